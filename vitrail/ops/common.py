"""What every op's public function shares: argument checks with clear errors, and the lean path.

Checks raise ``ArgumentError`` (a TypeError) naming the op, the argument, what was expected and
what came. ``plain_eager`` says when a call may skip the torch.library dispatcher (tens of µs on
small inputs, see ANCHORS.md): nothing is tracing or compiling and no gradient is recorded.
"""
from __future__ import annotations

from typing import Iterable

import torch

from vitrail.jit.errors import ArgumentError

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(op: str, name: str, t, *, dtypes: Iterable[torch.dtype] | None = None,
                 ndim: int | None = None, min_ndim: int | None = None,
                 cuda: bool = True) -> torch.Tensor:
    """Refuse what ``op`` cannot take as argument ``name``; returns t unchanged."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if cuda and t.device.type != "cuda":
        raise ArgumentError(f"{op}: {name} must be on a CUDA device, got a tensor on {t.device}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise ArgumentError(f"{op}: {name} must have dtype {_names(dtypes)}, got "
                                f"{str(t.dtype).removeprefix('torch.')}")
    if ndim is not None and t.dim() != ndim:
        raise ArgumentError(f"{op}: {name} must have {ndim} dimensions, got shape "
                            f"{tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ArgumentError(f"{op}: {name} must have at least {min_ndim} dimension(s), got shape "
                            f"{tuple(t.shape)}")
    return t


def check_same_device(op: str, **tensors: torch.Tensor) -> None:
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ArgumentError(f"{op}: all tensors must be on one device, got {listed}")


def check_dim(op: str, dim: int, ndim: int, name: str = "dim") -> int:
    """``dim`` normalized to [0, ndim); a clear error when it is out of range."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise ArgumentError(f"{op}: {name} must be an int, got {type(dim).__name__}")
    lo, hi = -max(ndim, 1), max(ndim, 1) - 1
    if not lo <= dim <= hi:
        raise ArgumentError(f"{op}: {name}={dim} is out of range for a tensor with {ndim} "
                            f"dimension(s) (expected {lo} to {hi})")
    return dim % max(ndim, 1)


def plain_eager(*tensors: torch.Tensor | None) -> bool:
    """True when a call can go straight to the kernel: no tracing, compiling or autograd."""
    if torch.compiler.is_compiling():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) is not torch.Tensor or (grad and t.requires_grad):
            return False
    return True
