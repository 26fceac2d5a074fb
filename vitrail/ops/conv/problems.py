"""conv2d in ``vitrail tune`` and ``vitrail precompile``: a family with nothing to tune yet (one
kernel per kind, dtype and epilogue; its ConvOperations are not vitrail.op Ops), so both
commands say so in one line and name what does build the kernels ahead of time."""
from __future__ import annotations

from vitrail.op import family

family("conv2d", "", "", (), None,
       why_not="conv2d has no configs to choose yet (one 128x128x64 kernel per kind, dtype and "
               "epilogue); nothing to tune. Its kernels build at their first calls, or ahead of "
               "time: `vitrail bench conv --compile-only` builds the bf16 ones")
