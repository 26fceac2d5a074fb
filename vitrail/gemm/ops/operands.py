"""GEMM operands as TMA reads them: a tensor as it is where its strides and address allow, else
an aligned copy (launch.run, and accurate.py's 3xTF32 path); warnings given once a process."""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from vitrail.device import vector
from vitrail.gemm import arguments as gargs
from vitrail.gemm.arguments import round_up

_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def aligned(t: torch.Tensor, want: Optional[str]) -> tuple[torch.Tensor, str]:
    """(t, its layout) when TMA can read t as is (in layout ``want`` if given), else an aligned
    copy in layout ``want`` (default row) and that layout."""
    info = gargs.describe(t, "operand", want)
    align = vector(t.dtype)  # elements of 16 bytes
    L = t.shape[0] if t.dim() == 3 else 1
    ok = (info.layout is not None and (want is None or info.layout == want)
          and info.ptr % 16 == 0 and info.ld % align == 0
          and (L == 1 or (info.batch_stride != 0 and info.batch_stride % align == 0)))
    if ok:
        return t, info.layout
    layout = want or "row"
    if want is None or info.layout is None or info.layout == want:
        warn_once("copy", "vitrail.ops.gemm: an operand whose strides or address are not "
                          "16-byte aligned (or that is broadcast over the batch) is copied into "
                          "an aligned buffer before the TMA kernel reads it")
    rows, cols = t.shape[-2], t.shape[-1]
    lead = t.shape[:-2]
    if layout == "row":
        buf = torch.empty(*lead, rows, round_up(max(cols, 1), align), dtype=t.dtype,
                          device=t.device)
        view = buf[..., :cols]
    else:
        buf = torch.empty(*lead, cols, round_up(max(rows, 1), align), dtype=t.dtype,
                          device=t.device)
        view = buf[..., :rows].transpose(-1, -2)
    view.copy_(t)
    return view, layout
