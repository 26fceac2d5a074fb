"""vitrail.ops.copy: any strides to contiguous (or into ``out``), with dtype conversion.

Both sides contiguous in one order: one flat pass (the driver's device-to-device copy for equal
dtypes, as torch does; else a 16-byte vectorized conversion kernel). Anything else: dims merged
where both sides allow, then the first that applies of:
- the vector transpose: the input's and the output's fastest dims differ, both of stride 1, every
  other stride and both pointers 16-byte aligned; 16-byte accesses on both sides, blocks
  transposed in registers;
- the rows kernel: both sides' fastest dim is the same, of stride 1, rows apart (a slice, padded
  rows), at least configs.ROWS_MIN_VECTORS vectors long; 16-byte vectors along each row where
  every row starts 16-byte aligned on both sides, else one element per access;
- the general tiled kernel: one element per access through shared memory, reading along the
  input's fastest dim and writing along the output's, so that any strides are coalesced.
The route (which variant, problem and launch arguments) is configs.route's, of the copy's layout.
Order: kernels and the family's variants, custom ops, autograd, the public function.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vitrail.device import ctype, sm_count
from vitrail.jit.errors import ArgumentError
from vitrail.op import Op, OpFamily
from vitrail.plan import GENERAL, Plans, signature
from vitrail.plan import native
from vitrail.plan.native import front
from vitrail.ops.common import (DISPATCH, EAGER, FLOATS, GRAD, autograd_apply, call_mode,
                                check_same_device, check_tensor)
from vitrail.ops.copy import configs
from vitrail.ops.copy.configs import Layout, Variant

HERE = Path(__file__).resolve().parent
KERNEL = (HERE / "sm90_copy.cuh").read_text()

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


# The family's variants (configs.Variant): the kernel source instantiated per path, dtypes and
# vector width; made on first use.
_KINDS = {  # path: (entry, space, launch)
    "flat": (_FLAT, configs.FLAT, _launch_flat),
    "tiled": (_TILED, configs.TILED, _launch_tiled),
    "transpose": (_TRANSPOSE, configs.TRANSPOSE, _launch_transpose),
    "rows": (_ROWS, configs.ROWS, _launch_rows),
}


def _variant(key: Variant) -> dict:
    entry, space, launch = _KINDS[key.path]
    return dict(name=key.name, space=space, kernel_source=KERNEL,
                render=_render(entry, key.src, key.dst, key.v or None), launch=launch,
                shape="ROWS[xCOLS[xLD]]")  # make_problem: problems.py's (vitrail.ops.load_all)


FAMILY = OpFamily("copy", _variant, keys=lambda: configs.variants(FLOATS))


def layout(x: torch.Tensor, out: torch.Tensor) -> Layout:
    """The copy of x into out as configs.route sees it."""
    return Layout(x.dtype, out.dtype, x.numel(), configs.merge(x.shape, x.stride(), out.stride()),
                  x.data_ptr() % 16, out.data_ptr() % 16)


def route(x: torch.Tensor, out: torch.Tensor) -> tuple[Op, str, Any, tuple] | None:
    """The kernel that copies x into out: (op, problem key, problem, launch arguments after
    out and x); None when there is nothing to copy."""
    try:
        recipe = configs.route(layout(x, out))
    except ArgumentError as e:
        raise ArgumentError(f"{e} (x's strides {tuple(x.stride())}, out's "
                            f"{tuple(out.stride())})") from None
    if recipe is None:
        return None
    return FAMILY[recipe.variant], recipe.key, recipe.problem, recipe.args


def _run(out: torch.Tensor, x: torch.Tensor) -> None:
    chosen = route(x, out)
    if chosen is not None:
        op, key, problem, args = chosen
        op(key, problem, out, x, *args)


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


@front(PLANS)  # the GRAD path's copies, and the C++ plans' backward step, run from C++ too
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
    """The gradient rule of copy's C++ plans (none into ``out``: autograd refuses that write);
    its one step, the copy back (_copy's front call), which the C++ node makes itself."""
    if out is not None:
        return None
    step = (_copy, ((native.ARG, 0), (native.ARG, 1)), 0)  # _gradient's arguments
    return (_gradient, ((native.GRAD, 0), (native.VALUE, x.dtype)), (0,),
            "vitrail::CopyBackward", (step,))


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


__all__ = ["copy", "copy_op", "copy_out_op", "route", "FAMILY", "Variant"]
