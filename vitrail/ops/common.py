"""What every op's public function shares: argument checks with clear errors, and the lean path.

Checks raise ``ArgumentError`` (a TypeError) naming the op, the argument, what was expected and
what came. ``call_mode`` says how a public function runs a call: straight to the kernels through
their plans (EAGER), the same under the family's autograd.Function (GRAD: ``autograd_apply``), or
through the torch.library custom op, for what traces, compiles or transforms (DISPATCH): the
custom op's Python layers cost tens of µs a call.
"""
from __future__ import annotations

import threading
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


EAGER, GRAD, DISPATCH = 0, 1, 2  # call_mode's answers


def call_mode(*tensors: torch.Tensor | None) -> int:
    """How a public function runs a call on these tensors:

    - EAGER: straight to the kernels (vitrail.plan): nothing compiles, traces or transforms, and
      no gradient is recorded;
    - GRAD: plain tensors of which one requires grad, with grad mode on: the family's
      autograd.Function (``autograd_apply``), whose forward and backward call the kernels
      directly;
    - DISPATCH: the torch custom op (torch.compile, FakeTensor and other subclasses, functorch
      transforms such as vmap), which the dispatcher routes.
    """
    if torch.compiler.is_compiling() or _transforms_active():
        return DISPATCH
    grad = torch.is_grad_enabled()
    mode = EAGER
    for t in tensors:
        if t is None:
            continue
        if type(t) is not torch.Tensor:
            return DISPATCH
        if grad and t.requires_grad:
            mode = GRAD
    return mode


def persistent(make, device):
    """make()'s tensors on device, for a cache that outlives every call (tables per device):
    made by another thread, so that they come from torch's ordinary pool even where this
    thread allocates into a CUDA graph's pool (torch.compile's reduce-overhead warm-up routes a
    thread's allocations to its graphs' pool, which must hold only their own tensors), and
    complete before they are returned. During a stream capture: made here."""
    if torch.device(device).type != "cuda" or torch.cuda.is_current_stream_capturing():
        return make()
    made: list = []

    def run():
        with torch.cuda.device(device):
            try:
                made.append(make())
                torch.cuda.current_stream().synchronize()
            except BaseException as e:  # raised in the caller's thread
                made.append(e)
    worker = threading.Thread(target=run, name="vitrail-persistent")
    worker.start()
    worker.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def autograd_apply(function: type[torch.autograd.Function]):
    """``function.apply`` without torch.autograd.Function.apply's Python layer (binding default
    arguments for a setup_context, unwrapping functorch tensors: neither applies to a call that
    call_mode sends to GRAD), a little less host time a call
    (docs/perf-notes.md#autograd_apply); ``function.apply`` where torch lacks it."""
    raw = torch._C._FunctionBase.__dict__.get("apply")
    return raw.__get__(None, function) if raw is not None else function.apply


def plain_eager(*tensors: torch.Tensor | None) -> bool:
    """True when a call can go straight to the kernel: call_mode's EAGER."""
    return call_mode(*tensors) == EAGER
