"""attention in ``vitrail tune`` and ``vitrail precompile``: a family with nothing to tune yet (one
kernel per dtype, head dim and causal flag; no vitrail.op Ops), so both commands say so in one
line."""
from __future__ import annotations

from vitrail.op import family

family("attention", "", "", (), None,
       why_not="attention has no configs to choose yet (one kernel per dtype, head dim and "
               "causal flag, 128 query rows a CTA); nothing to tune. Each kernel builds with "
               "NVRTC in seconds at its first call")
