"""vitrail.ops.copy: any strides to contiguous (or into ``out``), with dtype conversion.

Both sides contiguous in one order: one flat pass (the driver's device-to-device copy for equal
dtypes, as torch does; else a 16-byte vectorized conversion kernel). Anything else: dims merged
where both sides allow, then the first that applies of:
- the vector transpose: the input's and the output's fastest dims differ, both of stride 1, every
  other stride and both pointers 16-byte aligned; 16-byte accesses on both sides, blocks
  transposed in registers;
- the rows kernel: both sides' fastest dim is the same, of stride 1, rows apart (a slice, padded
  rows), at least ROWS_MIN_VECTORS vectors long; 16-byte vectors along each row where every row
  starts 16-byte aligned on both sides, else one element per access;
- the general tiled kernel: one element per access through shared memory, reading along the
  input's fastest dim and writing along the output's, so that any strides are coalesced.
Order: kernels and Ops, custom ops, autograd, the public function.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from vitrail.device import ctype, sm_count, vector
from vitrail.jit.errors import ArgumentError
from vitrail.op import Op
from vitrail.plan import GENERAL, Plans, signature
from vitrail.plan import native
from vitrail.plan.native import front
from vitrail.ops.common import (DISPATCH, EAGER, FLOATS, GRAD, autograd_apply, call_mode,
                                check_same_device, check_tensor)
from vitrail.ops.copy import configs
from vitrail.tune import bucket

HERE = Path(__file__).resolve().parent
KERNEL = (HERE / "sm90_copy.cuh").read_text()
MAX_DIMS = 6
ROWS_MIN_VECTORS = 16  # shorter rows would leave most lanes of the rows kernel idle: tiled kernel

_FLAT = r"""
extern "C" cudaError_t copy_flat(void* out, const void* in, long long n, int sms,
                                 cudaStream_t stream) {
  return vitrail::copy::launch_flat<TI, TO, V, U, THREADS>((TO*)out, (const TI*)in, n, sms, stream);
}"""


def _strided_entry(name: str, launcher: str, param: str = "", arg: str = "") -> str:
    """An extern "C" entry taking ndim and 6 sizes and strides per side (a Strided) and calling
    vitrail::copy::<launcher>(out, in, p, [arg,] stream); param declares arg."""
    return rf"""
extern "C" cudaError_t {name}(void* out, const void* in, int ndim,{param}
    long long n0, long long n1, long long n2, long long n3, long long n4, long long n5,
    long long i0, long long i1, long long i2, long long i3, long long i4, long long i5,
    long long o0, long long o1, long long o2, long long o3, long long o4, long long o5,
    cudaStream_t stream) {{
  vitrail::copy::Strided p = {{{{n0, n1, n2, n3, n4, n5}}, {{i0, i1, i2, i3, i4, i5}},
                              {{o0, o1, o2, o3, o4, o5}}, ndim}};
  return vitrail::copy::{launcher}((TO*)out, (const TI*)in, p,{arg} stream);
}}"""


_TILED = _strided_entry("copy_tiled", "launch_tiled<TI, TO, TILE, THREADS>", " int load_along0,",
                        " load_along0 != 0,")
_ROWS = _strided_entry("copy_rows", "launch_rows<TI, TO, V, LANES, U, THREADS>")
_TRANSPOSE = _strided_entry("copy_transpose", "launch_transpose<TI, TO, LANES1, WARPS1, THREADS>")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _render(entry: str, ti: torch.dtype, to: torch.dtype, v: int | None = None):
    def render(config) -> dict:
        consts = dict(config.items(), **({"V": v} if v else {}))
        consts = "".join(f"constexpr int {k} = {val};\n" for k, val in consts.items())
        source = (f'#include "sm90_copy.cuh"\nusing TI = {ctype(ti)};\nusing TO = {ctype(to)};\n'
                  f"{consts}{entry}")
        return dict(source=source, name="copy", include_dirs=[str(HERE)], flags=["-std=c++17"])
    return render


def _launch_flat(module, config, out, x):
    module.copy_flat(out.data_ptr(), x.data_ptr(), x.numel(), sm_count(x.get_device()))


def _launch_tiled(module, config, out, x, ndim, along0, sizes, si, so):
    module.copy_tiled(out.data_ptr(), x.data_ptr(), ndim, along0, *sizes, *si, *so)


def _launch_transpose(module, config, out, x, ndim, sizes, si, so):
    module.copy_transpose(out.data_ptr(), x.data_ptr(), ndim, *sizes, *si, *so)


def _launch_rows(module, config, out, x, ndim, sizes, si, so):
    module.copy_rows(out.data_ptr(), x.data_ptr(), ndim, *sizes, *si, *so)


FLAT_OPS: dict[tuple, Op] = {}
TILED_OPS: dict[tuple, Op] = {}
TRANSPOSE_OPS: dict[tuple, Op] = {}
ROWS_OPS: dict[tuple, Op] = {}
for _ti in FLOATS:
    for _to in FLOATS:
        _vmax = min(vector(_ti), vector(_to))  # elements of a 16-byte vector on both sides
        for _v in (_vmax, 1):
            FLAT_OPS[_ti, _to, _v] = Op(f"copy.flat.{_name(_ti)}.{_name(_to)}.v{_v}",
                                        space=configs.FLAT, kernel_source=KERNEL,
                                        render=_render(_FLAT, _ti, _to, _v), launch=_launch_flat)
        TILED_OPS[_ti, _to] = Op(f"copy.tiled.{_name(_ti)}.{_name(_to)}", space=configs.TILED,
                                 kernel_source=KERNEL, render=_render(_TILED, _ti, _to),
                                 launch=_launch_tiled)
        TRANSPOSE_OPS[_ti, _to] = Op(f"copy.transpose.{_name(_ti)}.{_name(_to)}",
                                     space=configs.TRANSPOSE, kernel_source=KERNEL,
                                     render=_render(_TRANSPOSE, _ti, _to),
                                     launch=_launch_transpose)
        for _v in (_vmax, 1):
            ROWS_OPS[_ti, _to, _v] = Op(f"copy.rows.{_name(_ti)}.{_name(_to)}.v{_v}",
                                        space=configs.ROWS, kernel_source=KERNEL,
                                        render=_render(_ROWS, _ti, _to, _v), launch=_launch_rows)


def _plan(shape, si, so):
    """Dims (size > 1) in the output's order, slowest first, merged where both sides allow."""
    dims = sorted((d for d in range(len(shape)) if shape[d] > 1), key=lambda d: -abs(so[d]))
    merged: list[list[int]] = []
    for d in dims:
        n, a, b = shape[d], si[d], so[d]
        if merged:
            pn, pa, pb = merged[-1]
            if pa == a * n and pb == b * n:
                merged[-1] = [pn * n, a, b]
                continue
        merged.append([n, a, b])
    return merged


def route(x: torch.Tensor, out: torch.Tensor) -> tuple[Op, str, Any, tuple] | None:
    """The kernel that copies x into out: (op, problem key, problem, launch arguments after
    out and x); None when there is nothing to copy."""
    if x.numel() == 0:
        return None
    dims = _plan(x.shape, x.stride(), out.stride())
    vmax = min(vector(x.dtype), vector(out.dtype))  # elements of a 16-byte vector on both sides
    if not dims or (len(dims) == 1 and dims[0][1] == 1 and dims[0][2] == 1):
        v = vmax
        if x.data_ptr() % (v * x.element_size()) or out.data_ptr() % (v * out.element_size()):
            v = 1
        return FLAT_OPS[x.dtype, out.dtype, v], f"n{bucket(x.numel())}", x.numel(), ()
    dims = dims[::-1]  # fastest output dim first
    if len(dims) > MAX_DIMS:
        raise ArgumentError(f"vitrail.ops.copy: the strides of x {tuple(x.stride())} and out "
                            f"{tuple(out.stride())} leave {len(dims)} dims that cannot be merged; "
                            f"at most {MAX_DIMS} are supported")
    # dim 1: the input's fastest dim, unless that is dim 0 (then any other one: the next)
    fastest_in = min(range(len(dims)), key=lambda i: abs(dims[i][1]))
    along0 = int(fastest_in == 0)
    if len(dims) == 1:
        dims.append([1, 0, 0])
    elif not along0:
        dims.insert(1, dims.pop(fastest_in))
    ndim = len(dims)
    dims += [[1, 0, 0]] * (MAX_DIMS - ndim)
    sizes, si, so = zip(*dims)
    key = f"n0{bucket(sizes[0])};n1{bucket(sizes[1])}"
    if not along0 and _vector_transpose(x, out, si[:ndim], so[:ndim]):
        return TRANSPOSE_OPS[x.dtype, out.dtype], key, None, (ndim, sizes, si, so)
    if along0 and si[0] == 1 and so[0] == 1:
        v = vmax if _aligned_rows(x, out, vmax, si[:ndim], so[:ndim]) else 1
        vectors = -(-sizes[0] // v)
        if vectors >= ROWS_MIN_VECTORS:
            return (ROWS_OPS[x.dtype, out.dtype, v], f"v{bucket(vectors)}",
                    (vectors, v * x.element_size()), (ndim, sizes, si, so))
    return (TILED_OPS[x.dtype, out.dtype], f"{key};along0{along0}", None,
            (ndim, along0, sizes, si, so))


def _run(out: torch.Tensor, x: torch.Tensor) -> None:
    chosen = route(x, out)
    if chosen is not None:
        op, key, problem, args = chosen
        op(key, problem, out, x, *args)


def _vector_transpose(x, out, si, so) -> bool:
    """Whether the transposing copy can move 16-byte vectors on both sides: the input's dim 1 and
    the output's dim 0 of stride 1, every other stride and both pointers 16-byte aligned."""
    if si[1] != 1 or so[0] != 1 or x.data_ptr() % 16 or out.data_ptr() % 16:
        return False
    vi, vo = vector(x.dtype), vector(out.dtype)
    return all(s % vi == 0 for i, s in enumerate(si) if i != 1) and \
        all(s % vo == 0 for i, s in enumerate(so) if i != 0)


def _aligned_rows(x, out, v, si, so) -> bool:
    """Whether every row starts on a vector of v elements on both sides."""
    return (x.data_ptr() % (v * x.element_size()) == 0
            and out.data_ptr() % (v * out.element_size()) == 0
            and all(s % v == 0 for s in si[1:]) and all(s % v == 0 for s in so[1:]))


def _check(x, out, dtype):
    name = "vitrail.ops.copy"
    check_tensor(name, "x", x, dtypes=FLOATS)
    if out is not None:
        check_tensor(name, "out", out, dtypes=FLOATS)
        check_same_device(name, x=x, out=out)
        if out.shape != x.shape:
            raise ArgumentError(f"{name}: out must have the shape of x {tuple(x.shape)}, got "
                                f"{tuple(out.shape)}")
        if dtype is not None and dtype != out.dtype:
            raise ArgumentError(f"{name}: dtype={dtype} differs from out.dtype={out.dtype}; "
                                f"give one or make them agree")
        if any(s == 0 and n > 1 for s, n in zip(out.stride(), out.shape)):
            raise ArgumentError(f"{name}: out has overlapping elements (stride 0 in "
                                f"{tuple(out.stride())}); it must be writable once per element")
    if dtype is not None and dtype not in FLOATS:
        raise ArgumentError(f"{name}: dtype must be one of float32, float16, bfloat16, got {dtype}")


# Plans (vitrail.plan): a signature's route and launch arguments, fixed at its first call.
PLANS = Plans("copy")


def _new(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor]:
    return (x.new_empty(x.shape, dtype=dtype),)


def _none(x: torch.Tensor, out: torch.Tensor) -> tuple:
    return ()


def _into(x: torch.Tensor, out: torch.Tensor, *_) -> None:
    _run(out, x)


# ------------------------------------------------------------------ custom ops and autograd
@torch.library.custom_op("vitrail::copy", mutates_args=())
def copy_op(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _copy(x, dtype)


@copy_op.register_fake
def _(x, dtype):
    return torch.empty(x.shape, dtype=dtype, device=x.device)


@torch.library.custom_op("vitrail::copy_out", mutates_args=("out",))
def copy_out_op(x: torch.Tensor, out: torch.Tensor) -> None:
    PLANS.run((signature(x), signature(out), None), (x, out), _none, _into)


@copy_out_op.register_fake
def _(x, out):
    return None


def _setup(ctx, inputs, output):
    ctx.dtype = inputs[0].dtype


def _grad(ctx, dy):
    return copy_op(dy, ctx.dtype), None


torch.library.register_autograd("vitrail::copy", _grad, setup_context=_setup)


def _copy(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x into a new contiguous tensor of dtype, through the signature's plan."""
    return PLANS.run((signature(x), dtype), (x,), _new, _into, (dtype,))[0]


class _Copy(torch.autograd.Function):
    """A GRAD call (vitrail.ops.common.call_mode): the copy and its gradient (the same copy back
    to x's dtype) straight to the kernels through their plans."""

    @staticmethod
    def forward(ctx, x, dtype, plan):
        ctx.dtype = x.dtype
        return plan(x)[0] if plan is not None else _copy(x, dtype)

    @staticmethod
    def backward(ctx, dy):
        return _gradient(dy, ctx.dtype), None, None


def _gradient(dy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x's gradient: dy copied back to x's dtype (the GRAD path's backward, the C++ plans'
    too: vitrail.plan.native)."""
    if torch.is_grad_enabled():  # create_graph: through the custom op (differentiable)
        return copy_op(dy, dtype)
    return _copy(dy, dtype)


def _rule(x: torch.Tensor, out: torch.Tensor | None = None,
          dtype: torch.dtype | None = None) -> tuple | None:
    """The gradient rule of copy's C++ plans (none into ``out``: autograd refuses that write)."""
    if out is not None:
        return None
    return (_gradient, ((native.GRAD, 0), (native.VALUE, x.dtype)), (0,),
            "vitrail::CopyBackward")


_COPY = autograd_apply(_Copy)


# ------------------------------------------------------------------ public function
@front(PLANS, grad=_rule)
def copy(x: torch.Tensor, *, out: torch.Tensor | None = None,
         dtype: torch.dtype | None = None) -> torch.Tensor:
    """x copied into a new contiguous tensor (of ``dtype``, default x's) or into ``out``."""
    mode = call_mode(x, out)
    if mode == GRAD and out is not None:
        mode = DISPATCH  # copy_out_op: an in-place write, which autograd refuses as torch does
    if mode != DISPATCH:  # a signature that passed the checks before: its plan
        key = (signature(x), dtype) if out is None else (signature(x), signature(out), dtype)
        hit = PLANS.get(key)
        if hit is not None and hit is not GENERAL:
            if out is not None:
                hit(x, out)
                return out
            return hit(x)[0] if mode == EAGER else _COPY(x, dtype, hit)
    _check(x, out, dtype)
    if out is None:
        target = dtype or x.dtype
        if mode == EAGER:
            return PLANS.run(key, (x,), _new, _into, (target,))[0]
        if mode == GRAD:
            return _COPY(x, target, None)
        return copy_op(x, target)
    if mode == EAGER:
        PLANS.run(key, (x, out), _none, _into)
    else:
        copy_out_op(x, out)
    return out


__all__ = ["copy", "copy_op", "copy_out_op", "route", "FLAT_OPS", "ROWS_OPS", "TILED_OPS",
           "TRANSPOSE_OPS"]
importlib.import_module("vitrail.ops.copy.problems")  # vitrail tune's shapes
