"""Plain-torch reference of vitrail.ops.copy."""
from __future__ import annotations

import torch


def copy(x: torch.Tensor, *, out: torch.Tensor | None = None,
         dtype: torch.dtype | None = None) -> torch.Tensor:
    if out is None:
        return x.to(dtype or x.dtype, memory_format=torch.contiguous_format, copy=True)
    return out.copy_(x)
