"""The GEMM family's torch ops: mm, bmm, gemm (fused epilogues), scaled_mm (FP8), grouped_mm.

Each is a ``torch.library`` custom op in the ``vitrail`` namespace with a fake implementation
(torch.compile, meta tensors) and, for gemm/mm/bmm, autograd; the public functions skip the
dispatcher when nothing traces or records gradients (vitrail.ops.common.plain_eager). Kernels
are CUTLASS 3 sm_90a GEMMs described and emitted by vitrail.gemm (see launch.py for layouts,
aligned copies and fallbacks).

    gemm(a, b, c=None, *, alpha=1.0, beta=0.0, bias=None, activation=None, out_dtype=None,
         slope=0.01, clamp_min=None, clamp_max=None)
        = clamp(act(alpha * a @ b + beta * c + bias)); bias (N,) per column or (M, 1) per row.

``grouped_mm`` (grouped.py) runs CUTLASS's sm90 grouped (pointer-array) kernel in one launch
for bf16/fp16, else a loop of gemm launches; autograd for both forms.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from vitrail.ops.common import check_same_device, check_tensor, plain_eager
from vitrail.ops.gemm.launch import eager
from vitrail.ops.gemm.reference import activation_grad, activation as _act
from vitrail.gemm.epilogue import ACTIVATIONS
from vitrail.jit.errors import ArgumentError

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


# --------------------------------------------------------------------------------- checks
def _check(name: str, a, b, c, bias, activation, out_dtype, ndim: Optional[int]) -> torch.dtype:
    check_tensor(name, "a", a, dtypes=DTYPES)
    check_tensor(name, "b", b, dtypes=DTYPES)
    check_same_device(name, a=a, b=b, c=c, bias=bias)
    for n, t in (("a", a), ("b", b)):
        if ndim is not None and t.dim() != ndim:
            raise ArgumentError(f"{name}: {n} must have {ndim} dimensions, got shape "
                                f"{tuple(t.shape)}")
        if t.dim() not in (2, 3):
            raise ArgumentError(f"{name}: {n} must be 2-D or 3-D (batched), got shape "
                                f"{tuple(t.shape)}")
    if b.dtype != a.dtype:
        raise ArgumentError(f"{name}: a and b must have one dtype, got {a.dtype} and {b.dtype}")
    if a.shape[-1] != b.shape[-2]:
        raise ArgumentError(f"{name}: a {tuple(a.shape)} and b {tuple(b.shape)} cannot be "
                            f"multiplied: a's last dimension must equal b's second to last")
    if a.dim() == 3 and b.dim() == 3 and a.shape[0] != b.shape[0]:
        raise ArgumentError(f"{name}: batch sizes differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    out = a.dtype if out_dtype is None else out_dtype
    if out not in DTYPES:
        raise ArgumentError(f"{name}: out_dtype must be bfloat16, float16 or float32, got {out}")
    if activation is not None and activation not in ACTIVATIONS:
        raise ArgumentError(f"{name}: activation must be None or one of "
                            f"{', '.join(ACTIVATIONS)}, got {activation!r}")
    M, N = a.shape[-2], b.shape[-1]
    if bias is not None:
        check_tensor(name, "bias", bias, dtypes=DTYPES)
        if tuple(bias.shape) not in ((N,), (M, 1)):
            raise ArgumentError(f"{name}: bias must have shape ({N},) (one per column) or "
                                f"({M}, 1) (one per row), got {tuple(bias.shape)}")
    if c is not None:
        check_tensor(name, "c", c, dtypes=DTYPES)
        L = max(a.shape[0] if a.dim() == 3 else 1, b.shape[0] if b.dim() == 3 else 1)
        shape = (L, M, N) if max(a.dim(), b.dim()) == 3 else (M, N)
        try:
            torch.broadcast_shapes(tuple(c.shape), shape)
        except RuntimeError:
            raise ArgumentError(f"{name}: c of shape {tuple(c.shape)} does not broadcast to the "
                                f"output's {shape}") from None
    return out


def _out_shape(a: Tensor, b: Tensor) -> tuple[int, ...]:
    M, N = a.shape[-2], b.shape[-1]
    if a.dim() == 3 or b.dim() == 3:
        return (a.shape[0] if a.dim() == 3 else b.shape[0], M, N)
    return (M, N)


# ------------------------------------------------------------------------------ custom op
@torch.library.custom_op("vitrail::gemm", mutates_args=())
def _gemm(a: Tensor, b: Tensor, c: Optional[Tensor], bias: Optional[Tensor], alpha: float,
          beta: float, activation: Optional[str], slope: float, clamp_min: Optional[float],
          clamp_max: Optional[float], out_dtype: Optional[torch.dtype]) -> Tensor:
    return eager(a, b, c, bias, alpha, beta, activation, slope, clamp_min, clamp_max, out_dtype)


@_gemm.register_fake
def _gemm_fake(a, b, c, bias, alpha, beta, activation, slope, clamp_min, clamp_max, out_dtype):
    return a.new_empty(_out_shape(a, b), dtype=out_dtype or a.dtype)


def _gemm_setup(ctx, inputs, output):
    a, b, c, bias, alpha, beta, activation, slope, lo, hi, _ = inputs
    ctx.save_for_backward(a, b, c, bias)
    ctx.params = (alpha, beta, activation, slope, lo, hi)
    ctx.c_shape = None if c is None else tuple(c.shape)


def _sum_to(g: Tensor, shape: tuple) -> Tensor:
    """Sum a gradient over the dimensions that were broadcast to reach g's shape."""
    while g.dim() > len(shape):
        g = g.sum(0)
    for i, n in enumerate(shape):
        if n == 1 and g.shape[i] != 1:
            g = g.sum(i, keepdim=True)
    return g


def _gemm_backward(ctx, grad: Tensor):
    a, b, c, bias = ctx.saved_tensors
    alpha, beta, activation, slope, lo, hi = ctx.params
    g = grad
    if activation is not None or lo is not None or hi is not None:
        z = _gemm(a, b, c, bias, alpha, beta, None, slope, None, None, torch.float32)
        gz = grad.float() * activation_grad(z, activation, slope)
        if lo is not None or hi is not None:
            y = _act(z, activation, slope)
            inside = torch.ones_like(y, dtype=torch.bool)
            if lo is not None:
                inside &= y >= lo
            if hi is not None:
                inside &= y <= hi
            gz = gz * inside
        g = gz
    ga = gb = gc = gbias = None
    gm = g.to(a.dtype)
    if ctx.needs_input_grad[0]:
        ga = _sum_to(_gemm(gm, b.transpose(-1, -2), None, None, alpha, 0.0, None, 0.0, None, None,
                           a.dtype), tuple(a.shape))
    if ctx.needs_input_grad[1]:
        gb = _sum_to(_gemm(a.transpose(-1, -2), gm, None, None, alpha, 0.0, None, 0.0, None, None,
                           b.dtype), tuple(b.shape))
    if c is not None and ctx.needs_input_grad[2]:
        gc = _sum_to(g * beta, ctx.c_shape).to(c.dtype)
    if bias is not None and ctx.needs_input_grad[3]:
        gf = g.float()
        if bias.dim() == 1:  # per column: sum over rows (and batch)
            gbias = gf.reshape(-1, gf.shape[-1]).sum(0)
        else:  # per row (M, 1): sum over columns and batch
            gbias = gf.sum(-1, keepdim=True)
            while gbias.dim() > 2:
                gbias = gbias.sum(0)
        gbias = gbias.to(bias.dtype)
    return ga, gb, gc, gbias, None, None, None, None, None, None, None


_gemm.register_autograd(_gemm_backward, setup_context=_gemm_setup)


# ------------------------------------------------------------------------- public functions
def gemm(a: Tensor, b: Tensor, c: Optional[Tensor] = None, *, alpha: float = 1.0,
         beta: float = 0.0, bias: Optional[Tensor] = None, activation: Optional[str] = None,
         out_dtype: Optional[torch.dtype] = None, slope: float = 0.01,
         clamp_min: Optional[float] = None, clamp_max: Optional[float] = None) -> Tensor:
    """clamp(act(alpha * a @ b + beta * c + bias)), in one kernel.

    a (M, K) or (L, M, K); b (K, N) or (L, K, N); c broadcastable to the output (read only when
    beta != 0, as torch.addmm); bias (N,) added to every row or (M, 1) to every column;
    activation: None or relu, leaky_relu (``slope``), gelu, gelu_tanh, silu, sigmoid, tanh,
    hardswish; clamp_min/clamp_max clamp the result. dtypes: bf16, fp16, fp32 (TF32 math);
    out_dtype defaults to a's.
    """
    if plain_eager(a, b, c, bias):  # through its plan; checked on a miss
        return eager(a, b, c, bias, float(alpha), float(beta), activation, float(slope),
                     None if clamp_min is None else float(clamp_min),
                     None if clamp_max is None else float(clamp_max), out_dtype,
                     check=lambda: _check("vitrail.ops.gemm", a, b, c, bias, activation,
                                          out_dtype, None))
    _check("vitrail.ops.gemm", a, b, c, bias, activation, out_dtype, None)
    return _gemm(a, b, c, bias, float(alpha), float(beta), activation, float(slope),
                 None if clamp_min is None else float(clamp_min),
                 None if clamp_max is None else float(clamp_max), out_dtype)


def mm(a: Tensor, b: Tensor, *, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """a @ b for 2-D a (M, K) and b (K, N); transposed views are read without a copy."""
    if plain_eager(a, b):
        return eager(a, b, None, None, 1.0, 0.0, None, 0.0, None, None, out_dtype,
                     check=lambda: _check("vitrail.ops.mm", a, b, None, None, None, out_dtype, 2))
    _check("vitrail.ops.mm", a, b, None, None, None, out_dtype, 2)
    return _gemm(a, b, None, None, 1.0, 0.0, None, 0.0, None, None, out_dtype)


def bmm(a: Tensor, b: Tensor, *, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """Batched a @ b for 3-D a (L, M, K) and b (L, K, N)."""
    if plain_eager(a, b):
        return eager(a, b, None, None, 1.0, 0.0, None, 0.0, None, None, out_dtype,
                     check=lambda: _check("vitrail.ops.bmm", a, b, None, None, None, out_dtype,
                                          3))
    _check("vitrail.ops.bmm", a, b, None, None, None, out_dtype, 3)
    return _gemm(a, b, None, None, 1.0, 0.0, None, 0.0, None, None, out_dtype)


from vitrail.ops.gemm.fp8 import scaled_mm  # noqa: E402
from vitrail.ops.gemm.grouped import grouped_mm  # noqa: E402

__all__ = ["gemm", "mm", "bmm", "scaled_mm", "grouped_mm"]
