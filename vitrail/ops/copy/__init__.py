"""vitrail.ops.copy: any strides to contiguous (or into ``out``), with dtype conversion.

Both sides contiguous in one order: one flat pass (the driver's device-to-device copy for equal
dtypes, as torch does; else a 16-byte vectorized conversion kernel). Anything else: dims merged
where both sides allow, then a shared-memory tiled kernel that reads along the input's fastest
dim and writes along the output's, so a transposing copy is coalesced on both sides.
Order: kernels and Ops, custom ops, autograd, the public function.
"""
from __future__ import annotations

from pathlib import Path

import torch

from vitrail.jit.errors import ArgumentError
from vitrail.op import Op
from vitrail.ops.common import FLOATS, check_same_device, check_tensor, plain_eager
from vitrail.ops.copy import configs
from vitrail.tune import bucket

HERE = Path(__file__).resolve().parent
KERNEL = (HERE / "sm90_copy.cuh").read_text()
CTYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
MAX_DIMS = 6

_FLAT = r"""
extern "C" cudaError_t copy_flat(void* out, const void* in, long long n, int sms,
                                 cudaStream_t stream) {
  return vitrail::copy::launch_flat<TI, TO, V, U, THREADS>((TO*)out, (const TI*)in, n, sms, stream);
}"""
_TILED = r"""
extern "C" cudaError_t copy_tiled(void* out, const void* in, int ndim, int load_along0,
    long long n0, long long n1, long long n2, long long n3, long long n4, long long n5,
    long long i0, long long i1, long long i2, long long i3, long long i4, long long i5,
    long long o0, long long o1, long long o2, long long o3, long long o4, long long o5,
    cudaStream_t stream) {
  vitrail::copy::Strided p = {{n0, n1, n2, n3, n4, n5}, {i0, i1, i2, i3, i4, i5},
                              {o0, o1, o2, o3, o4, o5}, ndim};
  return vitrail::copy::launch_tiled<TI, TO, TILE, THREADS>((TO*)out, (const TI*)in, p,
                                                            load_along0 != 0, stream);
}"""


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _render(entry: str, ti: torch.dtype, to: torch.dtype, v: int = 1):
    def render(config) -> dict:
        consts = "".join(f"constexpr int {k} = {val};\n" for k, val in config.items())
        source = (f'#include "sm90_copy.cuh"\nusing TI = {CTYPES[ti]};\nusing TO = {CTYPES[to]};\n'
                  f"constexpr int V = {v};\n{consts}{entry}")
        return dict(source=source, name="copy", include_dirs=[str(HERE)], flags=["-std=c++17"])
    return render


_SMS: dict[int, int] = {}


def _sms(device: torch.device) -> int:
    index = device.index or 0
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def _launch_flat(module, config, out, x):
    module.copy_flat(out.data_ptr(), x.data_ptr(), x.numel(), _sms(x.device))


def _launch_tiled(module, config, out, x, ndim, along0, sizes, si, so):
    module.copy_tiled(out.data_ptr(), x.data_ptr(), ndim, along0, *sizes, *si, *so)


FLAT_OPS: dict[tuple, Op] = {}
TILED_OPS: dict[tuple, Op] = {}
for _ti in CTYPES:
    for _to in CTYPES:
        _vmax = 16 // max(torch.empty((), dtype=d).element_size() for d in (_ti, _to))
        for _v in (_vmax, 1):
            FLAT_OPS[_ti, _to, _v] = Op(f"copy.flat.{_name(_ti)}.{_name(_to)}.v{_v}",
                                        space=configs.FLAT, kernel_source=KERNEL,
                                        render=_render(_FLAT, _ti, _to, _v), launch=_launch_flat)
        TILED_OPS[_ti, _to] = Op(f"copy.tiled.{_name(_ti)}.{_name(_to)}", space=configs.TILED,
                                 kernel_source=KERNEL, render=_render(_TILED, _ti, _to),
                                 launch=_launch_tiled)


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


def _run(out: torch.Tensor, x: torch.Tensor) -> None:
    if x.numel() == 0:
        return
    dims = _plan(x.shape, x.stride(), out.stride())
    if not dims or (len(dims) == 1 and dims[0][1] == 1 and dims[0][2] == 1):
        size = max(x.element_size(), out.element_size())
        v = 16 // size
        if x.data_ptr() % (v * x.element_size()) or out.data_ptr() % (v * out.element_size()):
            v = 1
        FLAT_OPS[x.dtype, out.dtype, v](f"n{bucket(x.numel())}", x.numel(), out, x)
        return
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
    dims += [[1, 0, 0]] * (MAX_DIMS - len(dims))
    sizes, si, so = zip(*dims)
    key = f"n0{bucket(sizes[0])};n1{bucket(sizes[1])};along0{along0}"
    TILED_OPS[x.dtype, out.dtype](key, None, out, x, len(dims), along0, sizes, si, so)


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


# ------------------------------------------------------------------ custom ops and autograd
@torch.library.custom_op("vitrail::copy", mutates_args=())
def copy_op(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    _run(out, x)
    return out


@copy_op.register_fake
def _(x, dtype):
    return torch.empty(x.shape, dtype=dtype, device=x.device)


@torch.library.custom_op("vitrail::copy_out", mutates_args=("out",))
def copy_out_op(x: torch.Tensor, out: torch.Tensor) -> None:
    _run(out, x)


@copy_out_op.register_fake
def _(x, out):
    return None


def _setup(ctx, inputs, output):
    ctx.dtype = inputs[0].dtype


def _grad(ctx, dy):
    return copy_op(dy, ctx.dtype), None


torch.library.register_autograd("vitrail::copy", _grad, setup_context=_setup)


# ------------------------------------------------------------------ public function
def copy(x: torch.Tensor, *, out: torch.Tensor | None = None,
         dtype: torch.dtype | None = None) -> torch.Tensor:
    """x copied into a new contiguous tensor (of ``dtype``, default x's) or into ``out``."""
    _check(x, out, dtype)
    if out is None:
        target = dtype or x.dtype
        if plain_eager(x):
            y = torch.empty(x.shape, dtype=target, device=x.device)
            _run(y, x)
            return y
        return copy_op(x, target)
    if plain_eager(x, out):
        _run(out, x)
    else:
        copy_out_op(x, out)
    return out


__all__ = ["copy", "copy_op", "copy_out_op", "FLAT_OPS", "TILED_OPS"]
