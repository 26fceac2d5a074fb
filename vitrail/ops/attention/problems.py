"""attention, attention_varlen, attention_kvcache and attention_fp8 in ``vitrail tune`` and
``vitrail precompile``: families with nothing to tune yet (one kernel per dtype, head dim and
mask, the tile of query rows by the call; no vitrail.op Ops), so both commands say so in one
line."""
from __future__ import annotations

from vitrail.op import family

WHY_NOT = ("{} has no configs to choose yet (one kernel per dtype, head dim and mask; 128 query "
           "rows a CTA, 192 at head dims up to 64 on long sequences); nothing to tune. Each "
           "kernel builds with NVRTC in seconds at its first call")
for _name in ("attention", "attention_varlen", "attention_kvcache", "attention_fp8"):
    family(_name, "", "", (), None, why_not=WHY_NOT.format(_name))
