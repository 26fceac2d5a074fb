"""mm, bmm and gemm (fused epilogues): checks, the custom ops with their fake implementations and
autograd, the C++ hit path's gradient rules, and the public functions (vitrail.ops.gemm
re-exports them; grouped.py loops over gemm where its kernel does not apply).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from vitrail.ops.common import (DISPATCH, EAGER, autograd_apply, call_mode,
                                check_same_device, check_tensor)
from vitrail.gemm.ops.launch import PLANS, eager, native_ok
from vitrail.plan.native import GRAD, INPUT, OUTPUT, VALUE, front
from vitrail.gemm.ops.reference import activation as _act, activation_backward, grad_from_output
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
    _save(ctx, a, b, c, bias, output, (alpha, beta, activation, slope, lo, hi))


def _params(alpha, beta, activation, slope, clamp_min, clamp_max) -> tuple:
    """(alpha, beta, activation, slope, lo, hi) as the kernels and the backward take them."""
    lo = None if clamp_min is None else float(clamp_min)
    hi = None if clamp_max is None else float(clamp_max)
    return float(alpha), float(beta), activation, float(slope), lo, hi


def _from_y(params) -> bool:
    """Whether the backward takes the activation's derivative from the output y (no clamp:
    reference.grad_from_output); else z is recomputed in fp32 by one GEMM."""
    _, _, activation, slope, lo, hi = params
    return lo is None and hi is None and grad_from_output(activation, slope)


def _backward_mm():
    """The backward's GEMMs: the kernels, or under create_graph the custom op (differentiable)."""
    return _gemm if torch.is_grad_enabled() else _eager


def _save(ctx, a, b, c, bias, y, params) -> None:
    """What the backward needs: the operands, and the output y where the activation's
    derivative is a function of it (``_from_y``)."""
    activation = params[2]
    from_y = _from_y(params)
    ctx.save_for_backward(a, b, c, bias, y if from_y and activation is not None else None)
    ctx.params, ctx.from_y = params, from_y
    ctx.c_shape = None if c is None else tuple(c.shape)


def _sum_to(g: Tensor, shape: tuple) -> Tensor:
    """Sum a gradient over the dimensions that were broadcast to reach g's shape."""
    if g.shape == shape:  # nothing was broadcast (the common case: one comparison)
        return g
    while g.dim() > len(shape):
        g = g.sum(0)
    for i, n in enumerate(shape):
        if n == 1 and g.shape[i] != 1:
            g = g.sum(i, keepdim=True)
    return g


def _grads(ctx, grad: Tensor, mm) -> tuple:
    """The gradients of a, b, c and bias; mm(a, b, c, bias, alpha, beta, activation, slope,
    clamp_min, clamp_max, out_dtype) runs the GEMMs (the custom op, or the kernels directly)."""
    a, b, c, bias, y = ctx.saved_tensors
    alpha, beta, activation, slope, lo, hi = ctx.params
    needs = ctx.needs_input_grad
    g = grad
    if ctx.from_y:  # one aten kernel from the output (torch's own formulas: relu, tanh...)
        g = activation_backward(grad, y, activation, slope)
    else:  # z recomputed in fp32, the derivative's kernel from it, the clamps' mask
        z = mm(a, b, c, bias, alpha, beta, None, slope, None, None, torch.float32)
        g = activation_backward(grad.float(), z, activation, slope)
        if lo is not None or hi is not None:
            y = _act(z, activation, slope)
            inside = torch.ones_like(y, dtype=torch.bool)
            if lo is not None:
                inside &= y >= lo
            if hi is not None:
                inside &= y <= hi
            g = g * inside
    ga = gb = gc = gbias = None
    gm = g if g.dtype == a.dtype else g.to(a.dtype)
    if needs[0]:
        ga = _sum_to(mm(gm, b.mT, None, None, alpha, 0.0, None, 0.0, None, None, a.dtype),
                     a.shape)
    if needs[1]:
        gb = _sum_to(mm(a.mT, gm, None, None, alpha, 0.0, None, 0.0, None, None, b.dtype),
                     b.shape)
    if c is not None and needs[2]:
        gc = _sum_to(g * beta, ctx.c_shape).to(c.dtype)
    if bias is not None and needs[3]:  # summed in fp32
        if bias.dim() == 1:  # per column: over rows (and batch); a 16-bit g is summed in fp32
            # and rounded once: one kernel
            gbias = (g if g.dim() == 2 else g.reshape(-1, g.shape[-1])).sum(0)
        else:  # per row (M, 1): over columns and batch
            gbias = g.sum(-1, keepdim=True, dtype=torch.float32)
            while gbias.dim() > 2:
                gbias = gbias.sum(0)
        if gbias.dtype != bias.dtype:
            gbias = gbias.to(bias.dtype)
    return ga, gb, gc, gbias


def _gemm_backward(ctx, grad: Tensor):
    return *_grads(ctx, grad, _gemm), None, None, None, None, None, None, None


_gemm.register_autograd(_gemm_backward, setup_context=_gemm_setup)


class _Gemm(torch.autograd.Function):
    """A GRAD call (vitrail.ops.common.call_mode): the forward and the backward's GEMMs straight
    to the kernels through their plans; check: the public function's checks (run on a miss)."""

    @staticmethod
    def forward(ctx, a, b, c, bias, alpha, beta, activation, slope, lo, hi, out_dtype, name,
                ndim):
        y = _eager(a, b, c, bias, alpha, beta, activation, slope, lo, hi, out_dtype, name, ndim)
        _save(ctx, a, b, c, bias, y, (alpha, beta, activation, slope, lo, hi))
        return y

    @staticmethod
    def backward(ctx, grad):
        return (*_grads(ctx, grad, _backward_mm()), None, None, None, None, None, None, None, None,
                None)


_GEMM = autograd_apply(_Gemm)


class _Saved:
    """What ``_grads`` reads of an autograd ctx, for the C++ plans' backward (``_rule``)."""
    __slots__ = ("saved_tensors", "params", "needs_input_grad", "from_y", "c_shape")

    def __init__(self, saved, params, needs, from_y, c_shape):
        self.saved_tensors, self.params, self.needs_input_grad = saved, params, needs
        self.from_y, self.c_shape = from_y, c_shape


def _plan_grads(a, b, c, bias, y, grad, params, needs, from_y, c_shape) -> tuple:
    """The gradients of the tensors among a, b, c, bias (those not None, in that order): the
    backward of a call that records gradients run as a C++ plan (vitrail.plan.native)."""
    got = _grads(_Saved((a, b, c, bias, y), params, needs, from_y, c_shape), grad,
                 _backward_mm())
    return tuple(g for g, t in zip(got, (a, b, c, bias)) if t is not None)


def _rule(a, b, c, bias, alpha, beta, activation, slope, clamp_min, clamp_max, positions):
    """The gradient rule of a call's C++ plan (front(grad=)): what ``_save`` keeps, as the
    rule's arguments; positions: the front arguments' positions of a, b, c, bias."""
    params = _params(alpha, beta, activation, slope, clamp_min, clamp_max)
    from_y = _from_y(params)
    tensors = (a, b, c, bias)
    args = tuple((INPUT, p) if t is not None else (VALUE, None)
                 for t, p in zip(tensors, positions))
    args += ((OUTPUT, 0) if from_y and activation is not None else (VALUE, None), (GRAD, 0),
             (VALUE, params), (VALUE, tuple(t is not None and t.requires_grad for t in tensors)),
             (VALUE, from_y), (VALUE, None if c is None else tuple(c.shape)))
    inputs = tuple(p for t, p in zip(tensors, positions) if t is not None)
    return _plan_grads, args, inputs, "vitrail::GemmBackward"


def _gemm_rule(a, b, c=None, alpha=1.0, beta=0.0, bias=None, activation=None, out_dtype=None,
               slope=0.01, clamp_min=None, clamp_max=None):
    return _rule(a, b, c, bias, alpha, beta, activation, slope, clamp_min, clamp_max,
                 (0, 1, 2, 5))


def _mm_rule(a, b, out_dtype=None):
    return _rule(a, b, None, None, 1.0, 0.0, None, 0.0, None, None, (0, 1, None, None))


@front(PLANS, when=native_ok)  # the GRAD path's GEMMs run from C++ (grad mode is off there)
def _eager(a, b, c, bias, alpha, beta, activation, slope, lo, hi, out_dtype, name=None,
           ndim=None) -> Tensor:
    """``eager``, checked on a plan miss as the public function ``name`` (None: unchecked, the
    backward's GEMMs of checked operands)."""
    check = None if name is None else \
        (lambda: _check(name, a, b, c, bias, activation, out_dtype, ndim))
    return eager(a, b, c, bias, alpha, beta, activation, slope, lo, hi, out_dtype, check=check)


def _call(name: str, a, b, c, bias, alpha, beta, activation, slope, clamp_min, clamp_max,
          out_dtype, ndim: Optional[int]) -> Tensor:
    """A public function's call: straight to the kernels (checked on a plan miss), under
    autograd, or through the custom op (vitrail.ops.common.call_mode)."""
    args = (*_params(alpha, beta, activation, slope, clamp_min, clamp_max), out_dtype)
    mode = call_mode(a, b, c, bias)
    if mode == DISPATCH:
        _check(name, a, b, c, bias, activation, out_dtype, ndim)
        return _gemm(a, b, c, bias, *args)
    check = lambda: _check(name, a, b, c, bias, activation, out_dtype, ndim)  # noqa: E731
    if mode == EAGER:
        return eager(a, b, c, bias, *args, check=check)
    return _GEMM(a, b, c, bias, *args, name, ndim)


# ------------------------------------------------------------------------- public functions
@front(PLANS, when=native_ok, grad=_gemm_rule)
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
    return _call("vitrail.ops.gemm", a, b, c, bias, alpha, beta, activation, slope, clamp_min,
                 clamp_max, out_dtype, None)


@front(PLANS, when=native_ok, grad=_mm_rule)
def mm(a: Tensor, b: Tensor, *, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """a @ b for 2-D a (M, K) and b (K, N); transposed views are read without a copy."""
    return _call("vitrail.ops.mm", a, b, None, None, 1.0, 0.0, None, 0.0, None, None, out_dtype,
                 2)


@front(PLANS, when=native_ok, grad=_mm_rule)
def bmm(a: Tensor, b: Tensor, *, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """Batched a @ b for 3-D a (L, M, K) and b (L, K, N)."""
    return _call("vitrail.ops.bmm", a, b, None, None, 1.0, 0.0, None, 0.0, None, None, out_dtype,
                 3)
