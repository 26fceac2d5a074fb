"""vitrail.ops.softmax: softmax and log_softmax along any dim, forward and backward, at HBM speed.

Order (quack's): kernels and their Ops, the custom ops, autograd, the public functions. The
kernels (sm90_softmax.cuh) take rows with a contiguous last dim and any row stride; another
``dim`` or a strided last dim is moved into place first (an extra pass, correct but slower).
Rows of 8 KiB and more take the tile path where there are enough of them (each row held in
shared memory by one CTA or a cluster of them, loaded by TMA; sm_90+), shorter rows registers,
few very long rows the split path (one cooperative kernel, each row over G CTAs meeting at a
per-row barrier; see configs), whose barrier workspace is kept per (device, stream). Short rows
laid end to end (a contiguous tensor's rows of up to 1 KiB, configs.use_packed) take the packed
path: a CTA moves a run of rows with 16-byte vectors whatever n is (sm_90+).
An eager call goes straight to the kernels through their plans, under an autograd.Function where
gradients are recorded (vitrail.ops.common.call_mode); what compiles or traces goes through
``torch.ops.vitrail.softmax_fwd`` / ``softmax_bwd`` (fake impls registered, so
``torch.compile(fullgraph=True)`` traces them without a graph break).
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from vitrail.device import ctype, gpu_limits, sm_count, target_limits, vector
from vitrail.jit.errors import LaunchError
from vitrail.op import Op, OpFamily
from vitrail.plan import GENERAL, Plans, keep, scratch, signature
from vitrail.plan.native import ARG, GRAD, OUTPUT, VALUE, front
from vitrail.ops.common import (DISPATCH, EAGER, FLOATS, autograd_apply, call_mode, check_dim,
                                check_tensor, persistent)
from vitrail.ops.softmax import configs
from vitrail.ops.softmax.configs import Rows, Variant
from vitrail.tune import bucket

HERE = Path(__file__).resolve().parent
KERNEL = (HERE / "sm90_softmax.cuh").read_text()

_ENTRY = {
    "fwd": r"""
extern "C" cudaError_t softmax_fwd(void* y, const void* x, long long rows, int n, long long ldx,
                                   long long ldy, cudaStream_t stream) {
  return vitrail::softmax::launch_fwd<T, V, TPR, THREADS, ITERS, CLUSTER, IS_LOG, WINDOW>(
      (T*)y, (const T*)x, rows, n, ldx, ldy, stream);
}""",
    "bwd": r"""
extern "C" cudaError_t softmax_bwd(void* dx, const void* y, const void* dy, long long rows, int n,
                                   long long ldy, long long lddy, long long lddx,
                                   cudaStream_t stream) {
  return vitrail::softmax::launch_bwd<T, V, TPR, THREADS, ITERS, CLUSTER, IS_LOG, WINDOW>(
      (T*)dx, (const T*)y, (const T*)dy, rows, n, ldy, lddy, lddx, stream);
}""",
    "chunked": r"""
extern "C" cudaError_t softmax_chunked(void* out, void* stats, const void* a, const void* b,
                                       long long rows, int n, int chunk, long long lda,
                                       long long ldb, long long ldo, cudaStream_t stream) {
  return vitrail::softmax::launch_chunked<T, V, MODE, IS_LOG, THREADS, U, WINDOW>(
      (T*)out, stats, (const T*)a, (const T*)b, rows, n, chunk, lda, ldb, ldo, stream);
}""",
    "split": r"""
extern "C" cudaError_t softmax_split(void* out, void* ws, int slots, const void* a, const void* b,
                                     long long rows, int n, int slice, int groups, int smem_vecs,
                                     long long lda, long long ldb, long long ldo,
                                     cudaStream_t stream) {
  return vitrail::softmax::launch_split<T, V, MODE, IS_LOG, THREADS, ITERS, U, CTAS, WINDOW>(
      (T*)out, ws, slots, (const T*)a, (const T*)b, rows, n, slice, groups, smem_vecs, lda, ldb,
      ldo, stream);
}
extern "C" int softmax_split_ctas_per_sm(int smem_vecs) {
  return vitrail::softmax::split_ctas_per_sm<T, V, MODE, IS_LOG, THREADS, ITERS, U, CTAS,
                                             WINDOW>(smem_vecs);
}""",
    "packed": r"""
extern "C" cudaError_t softmax_packed(void* out, const void* a, const void* b, long long rows,
                                      int n, int run, cudaStream_t stream) {
  return vitrail::softmax::launch_packed<T, V, MODE, IS_LOG, THREADS, TPR, ITEMS>(
      (T*)out, (const T*)a, (const T*)b, rows, n, run, stream);
}""",
    "tile": r"""
extern "C" cudaError_t softmax_tile(void* out, const void* a, const void* b, long long rows, int n,
                                    int slice, long long lda, long long ldb, long long ldo,
                                    cudaStream_t stream) {
  return vitrail::softmax::launch_tile<T, V, MODE, IS_LOG, THREADS, CLUSTER, WINDOW>(
      (T*)out, (const T*)a, (const T*)b, rows, n, slice, lda, ldb, ldo, stream);
}""",
}


def _source(kind: str, dtype: torch.dtype, v: int, log: bool, mode: int, window: bool) -> str:
    head = (f'#include "sm90_softmax.cuh"\nusing T = {ctype(dtype)};\n'
            f"constexpr int V = {v};\nconstexpr bool IS_LOG = {str(log).lower()};\n"
            f"constexpr int MODE = {mode};\nconstexpr bool WINDOW = {str(window).lower()};\n"
            f"//CONSTS\n")
    return head + _ENTRY[kind]


_PARAMS = ("TPR", "THREADS", "ITERS", "CLUSTER", "U", "CTAS", "ITEMS")


def _render(kind: str, dtype: torch.dtype, v: int, log: bool, mode: int = 0,
            window: bool = False):
    def render(config) -> dict:
        consts = "".join(f"constexpr int {k} = {config[k]};\n" for k in _PARAMS if k in config)
        source = _source(kind, dtype, v, log, mode, window).replace("//CONSTS\n", consts)
        return dict(source=source,
                    name=f"softmax_{kind}", include_dirs=[str(HERE)], flags=["-std=c++17"])
    return render


def _ld(t: torch.Tensor) -> int:
    """The row stride the kernels see: a single row's stride is never used (and may not be a
    multiple of the vector width, e.g. 1 for a [1, n] tensor), so it is passed as 0."""
    return t.stride(0) if t.shape[0] > 1 else 0


def _launch_fwd(module, config, y, x, _x=None):  # (y, x) or, as the other paths, (y, x, x)
    rows, n = x.shape
    module.softmax_fwd(y.data_ptr(), x.data_ptr(), rows, n, _ld(x), _ld(y))


def _launch_bwd(module, config, dx, y, dy):
    rows, n = y.shape
    module.softmax_bwd(dx.data_ptr(), y.data_ptr(), dy.data_ptr(), rows, n, _ld(y), _ld(dy),
                       _ld(dx))


def _chunked_launcher(v: int):
    def launch(module, config, out, a, b):
        (rows, n), window = a.shape, _window(a, v)  # the chunks cut the rows' windows
        chunk = configs.chunk_length(window, rows, v, config, sm_count(a.get_device()))
        stats = scratch(rows * math.ceil(window / chunk) * 2, torch.float32,
                        a.device)  # (max, sum) per chunk
        module.softmax_chunked(out.data_ptr(), stats.data_ptr(), a.data_ptr(), b.data_ptr(),
                               rows, n, chunk, _ld(a), _ld(b), _ld(out))
    return launch


def _split_launcher(v: int, arrays: int, log: bool, windowed: bool):
    def launch(module, config, out, a, b, ctas_per_sm: int | None = None):
        """ctas_per_sm: use at most this many CTAs per SM (a variant to time; None: all that
        fit)."""
        (rows, n), window = a.shape, _window(a, v)  # the slices cut the rows' windows
        dev = a.device
        sms, lim = sm_count(dev.index), gpu_limits(dev.index)
        vec_bytes = v * a.element_size()

        def resident(smem_vecs: int) -> int:
            key = (module.key, smem_vecs, dev.index)
            if key not in _OCCUPANCY:
                _OCCUPANCY[key] = module.softmax_split_ctas_per_sm(smem_vecs)
            occ = _OCCUPANCY[key]
            return sms * (occ if ctas_per_sm is None else min(occ, ctas_per_sm))

        plan = configs.split_plan(window, rows, v, config, resident(0), 0, arrays, vec_bytes)
        if plan[1] > config.THREADS * config.ITERS * v:  # beyond the registers: shared memory
            budget = configs.split_smem_budget(config, lim)
            budget_vecs = budget // vec_bytes // arrays
            plan = configs.split_plan(window, rows, v, config, resident(budget_vecs), budget,
                                      arrays, vec_bytes)
        groups, slice_, smem_vecs = plan
        slots = _slots(dev)
        if rows * groups > min(slots, resident(smem_vecs)):  # cannot all be resident: chunked
            kind = "fwd" if arrays == 1 else "bwd"
            chunked = FAMILY[Variant("chunked", kind, a.dtype, v, log, windowed)]
            chunked(f"n{bucket(window)};rows{bucket(rows)}", window, out, a, b)
            return
        module.softmax_split(out.data_ptr(), _workspace(dev, slots).data_ptr(), slots,
                             a.data_ptr(), b.data_ptr(), rows, n, slice_, groups, smem_vecs,
                             _ld(a), _ld(b), _ld(out))
    return launch


def _tile_launcher(v: int, arrays: int):
    def launch(module, config, out, a, b):
        rows, n = a.shape
        slice_ = configs.tile_slice(_window(a, v), v, config.CLUSTER)
        smem = slice_ * a.element_size() * arrays
        limit = gpu_limits(a.get_device()).max_shared_per_block - 2048  # less the static scratch
        if smem > limit:
            raise LaunchError(f"softmax tile path: CLUSTER={config.CLUSTER} leaves a slice of "
                              f"{smem} bytes per CTA for rows of {n}; at most {limit} fit")
        module.softmax_tile(out.data_ptr(), a.data_ptr(), b.data_ptr(), rows, n, slice_, _ld(a),
                            _ld(b), _ld(out))
    return launch


def _packed_launcher(module, config, out, a, b):
    rows, n = a.shape
    run = configs.packed_run(n, rows, a.element_size(), config, sm_count(a.get_device()))
    module.softmax_packed(out.data_ptr(), a.data_ptr(), b.data_ptr(), rows, n, run)


# The split path's workspace: per (device, stream), `slots` barrier counters then `slots`
# partials (see sm90_softmax.cuh, launch_split). Guarantees: launches on one stream run one after
# another and reuse its workspace as it is (the barrier counters need no reset: group_barrier.cuh);
# launches on different streams have different workspaces, so they may run concurrently. Under
# CUDA graph capture each captured launch gets a workspace of its own, zeroed by a captured
# memset in the graph's memory pool, so replays are correct wherever they run (a graph does not
# run concurrently with itself). Not covered: a stream destroyed while its launches are pending
# whose handle CUDA hands to a new stream at once (the new stream then shares the workspace).
_WORKSPACES: dict[tuple[int, int], torch.Tensor] = {}
_OCCUPANCY: dict[tuple, int] = {}


def _slots(device: torch.device) -> int:
    """Workspace slots: more than the CTAs any split launch can hold (16 CTAs per SM)."""
    return 16 * sm_count(device.index)


def _workspace(device: torch.device, slots: int) -> torch.Tensor:
    """The split path's workspace on the current stream: counters that two grids must not use
    at once, so one per stream, zeroed once and kept (a plan passes it as a constant: plans hold
    on their own stream only); a new one in a stream capture (the graph's own)."""
    words = 3 * slots  # slots counters + slots 8-byte partials
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(words, dtype=torch.int32, device=device)
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.numel() < words:
        ws = _WORKSPACES[key] = persistent(
            lambda: torch.zeros(words, dtype=torch.int32, device=device), device)
    keep(ws)
    return ws


# The family's variants (configs.Variant): the kernel source instantiated per path, kind, dtype,
# vector width, log and window; made on first use.
_LAUNCHERS = {
    "registers": lambda v, arrays, log, window: _launch_fwd if arrays == 1 else _launch_bwd,
    "chunked": lambda v, arrays, log, window: _chunked_launcher(v),
    "packed": lambda v, arrays, log, window: _packed_launcher,
    "tile": lambda v, arrays, log, window: _tile_launcher(v, arrays),
    "split": lambda v, arrays, log, window: _split_launcher(v, arrays, log, window),
}
_SPACES = {
    "registers": lambda v, arrays, window: configs.space(v, arrays),
    "chunked": lambda v, arrays, window: configs.CHUNKED,
    "packed": lambda v, arrays, window: configs.packed_space(arrays),
    "tile": lambda v, arrays, window: configs.tile_space(arrays),
    "split": lambda v, arrays, window: configs.split_space(v, arrays, window),
}


def _variant(key: Variant) -> dict:
    """The Op of a variant: its space, source (the register path's entry is the kind's; the
    others' MODE: 0 forward, 1 softmax's backward, 2 log_softmax's), launch; precompile's
    examples for the register path's 16-byte variants."""
    path, kind, dtype, v, log, window = key
    registers = path == "registers"
    mode = 0 if kind == "fwd" or registers else 2 if log else 1
    return dict(name=key.name, space=_SPACES[path](v, key.arrays, window), kernel_source=KERNEL,
                render=_render(kind if registers else path, dtype, v, log, mode, window),
                launch=_LAUNCHERS[path](v, key.arrays, log, window),
                examples=[4096] if registers and v > 1 and not window else [],
                shape="ROWSxCOLS")  # make_problem: problems.py's (vitrail.ops.load_all)


FAMILY = OpFamily("softmax", _variant, keys=lambda: configs.variants(FLOATS))


def _aligned(v: int, *ts: torch.Tensor) -> bool:
    """Whether every row of ts starts on a 16-byte boundary (vectors of v elements)."""
    return all(t.data_ptr() % 16 == 0 and _ld(t) % v == 0 for t in ts)


def _coaligned(v: int, *ts: torch.Tensor) -> bool:
    """Whether the windowed kernels can read rows of ts in 16-byte vectors of v elements: every
    array's rows start at the same offset within a vector (base addresses equal modulo 16 bytes,
    row strides equal modulo v), so one window serves them all (sm90_softmax.cuh). Rows need not
    start on a vector boundary: odd n, a view at an offset."""
    a = ts[0]
    return a.element_size() * v == 16 and all(
        (t.data_ptr() - a.data_ptr()) % 16 == 0 and (_ld(t) - _ld(a)) % v == 0 for t in ts)


def _window(a: torch.Tensor, v: int) -> int:
    """The window columns a launch covers: n, plus v - 1 where a row may start off a vector
    boundary (the kernels' window_pad)."""
    n = a.shape[1]
    return n if v == 1 or _aligned(v, a) else n + v - 1


def _end_to_end(*ts: torch.Tensor) -> bool:
    """Whether every array's rows lie end to end (row stride n: a contiguous tensor's rows)."""
    return all(t.shape[0] == 1 or t.stride(0) == t.shape[1] for t in ts)


def route(kind: str, rows: int, n: int, dtype: torch.dtype, v: int, log: bool,
          device: torch.device | None, window: bool = False,
          packed: bool = False) -> tuple[Op, str, object]:
    """The variant that runs rows x n on `device` (None: the build target, vitrail.device's
    target_limits: its default SM count where no GPU gives one), as configs.route chooses it
    (configs.Rows says what the arguments mean): (op, problem key, problem); the op is called
    as op(key, problem, out, a, b). A GPU's routes are memoized (every call takes one)."""
    rows_ = Rows(kind, rows, n, dtype, v, log, window, packed)
    if device is None:
        variant, key, problem = configs.route(rows_, target_limits())
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
        variant, key, problem = _gpu_route(rows_, index)
    return FAMILY[variant], key, problem


@functools.lru_cache(maxsize=4096)
def _gpu_route(rows: Rows, index: int) -> configs.Recipe:
    return configs.route(rows, gpu_limits(index))


def route_contiguous(kind: str, rows: int, n: int, dtype: torch.dtype, log: bool,
                     device: torch.device | None) -> tuple[Op, str, object]:
    """``route`` of a contiguous rows x n tensor (16-byte-aligned base) as ``_run`` calls it."""
    v = vector(dtype)
    v, window = _vectors(n, dtype.itemsize, v, n % v == 0 or rows == 1, True)
    return route(kind, rows, n + (v - 1 if window else 0), dtype, v, log, device, window,
                 not window)


def _vectors(n: int, size: int, v: int, aligned: bool, coaligned: bool) -> tuple[int, bool]:
    """(vector width, windowed) for rows of n: 16-byte vectors where every row starts on a
    vector boundary (aligned); windows where rows start off one, all arrays' alike (coaligned),
    and configs.use_window says so; else element by element."""
    if aligned:
        return v, False
    if coaligned and configs.use_window(n, size):
        return v, True
    return 1, False


def _run(kind: str, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, log: bool) -> None:
    """Route rows x n to a path and launch it. kind "fwd": a = b = x; "bwd": a = y, b = dy."""
    op, key, problem = _resolve(kind, out, a, b, log)
    op(key, problem, out, a, b)


def _resolve(kind: str, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, log: bool):
    """``route`` of rows x n as these arrays lie: (op, problem key, problem)."""
    v = vector(a.dtype)
    coaligned = _coaligned(v, a, b, out)
    v, window = _vectors(a.shape[1], a.element_size(), v, _aligned(v, a, b, out), coaligned)
    cols = a.shape[1] + (v - 1 if window else 0)  # _window(a, v): a's rows are off if any are
    packed = not window and coaligned and _end_to_end(a, b, out)
    return route(kind, a.shape[0], cols, a.dtype, v, log, a.device, window, packed)


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t as (rows, n) with the softmax dim last and contiguous (a view where possible)."""
    t = t.movedim(dim, -1) if t.dim() else t.reshape(1)
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    n = t.shape[-1]
    try:
        return t.view(-1, n)
    except RuntimeError:
        return t.reshape(-1, n)


# Plans (vitrail.plan): a call's route, config and launch arguments, fixed at the first call of
# its signature; the paths with a per-stream workspace (split) take the general path each call.
PLANS = Plans("softmax")


def _like(*ts: torch.Tensor) -> tuple[torch.Tensor]:
    """A new contiguous tensor shaped as the first of ts (the forward's y, the backward's dx)."""
    t = ts[0]
    return (torch.empty_like(t) if t.is_contiguous() else
            torch.empty_like(t, memory_format=torch.contiguous_format),)


@front(PLANS)  # the GRAD path's forward and backward run from C++ too (grad mode is off there)
def _forward(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    """softmax of x along dim (checked, normalized) into a new contiguous tensor."""
    return PLANS.run((signature(x), dim, log), (x,), _like, _forward_into, (dim, log))[0]


def _forward_into(x: torch.Tensor, y: torch.Tensor, dim: int, log: bool) -> None:
    """y (contiguous, x's shape) = softmax of x along dim."""
    if x.numel() == 0:
        return
    x2 = _rows(x, dim)
    inplace = x.dim() == 0 or dim == x.dim() - 1
    y2 = y.view(-1, x2.shape[1]) if inplace else torch.empty_like(x2)
    _run("fwd", y2, x2, x2, log)
    if not inplace:
        y.copy_(y2.view(x.movedim(dim, -1).shape).movedim(-1, dim))


@front(PLANS)
def _backward(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    """The gradient of x from y = softmax(x) (or log_softmax) and dy, along dim (normalized)."""
    return PLANS.run((signature(y), signature(dy), dim, log), (y, dy), _like, _backward_into,
                     (dim, log))[0]


def _backward_into(y: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, dim: int,
                   log: bool) -> None:
    if y.numel() == 0:
        return
    y2, dy2 = _rows(y, dim), _rows(dy, dim)
    inplace = y.dim() == 0 or dim == y.dim() - 1
    dx2 = dx.view(-1, y2.shape[1]) if inplace else torch.empty_like(y2)
    _run("bwd", dx2, y2, dy2, log)
    if not inplace:
        dx.copy_(dx2.view(y.movedim(dim, -1).shape).movedim(-1, dim))


# ------------------------------------------------------------------ custom ops and autograd
@torch.library.custom_op("vitrail::softmax_fwd", mutates_args=())
def softmax_fwd(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    # dim normalized: -1 is the last dim (in place), not a transposed copy
    return _forward(x, check_dim("vitrail::softmax_fwd", dim, x.dim()), log)


@softmax_fwd.register_fake
def _(x, dim, log):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("vitrail::softmax_bwd", mutates_args=())
def softmax_bwd(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    return _backward(y, dy, check_dim("vitrail::softmax_bwd", dim, y.dim()), log)


@softmax_bwd.register_fake
def _(y, dy, dim, log):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    _, ctx.dim, ctx.log = inputs
    ctx.save_for_backward(output)


def _grad(ctx, dy):
    (y,) = ctx.saved_tensors
    return softmax_bwd(y, dy, ctx.dim, ctx.log), None, None


torch.library.register_autograd("vitrail::softmax_fwd", _grad, setup_context=_setup)


class _Softmax(torch.autograd.Function):
    """A GRAD call (vitrail.ops.common.call_mode): forward and backward straight to the kernels
    through their plans (from C++: ``_forward`` and ``_backward`` are front functions)."""

    @staticmethod
    def forward(ctx, x, dim, log):
        y = _forward(x, dim, log)
        ctx.save_for_backward(y)
        ctx.dim, ctx.log = dim, log
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return _gradient(y, dy, ctx.dim, ctx.log), None, None


def _gradient(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    """The gradient of x (the GRAD path's backward, the C++ plans' too: vitrail.plan.native)."""
    if torch.is_grad_enabled():  # create_graph: through the custom op, whose backward is
        return softmax_bwd(y, dy, dim, log)  # differentiable
    return _backward(y, dy, dim, log)


def _rule(name: str, log: bool):
    """The gradient rule of the public function's C++ plans: x's gradient from y, dy; its one
    step, the backward kernel's front call (_backward), which the C++ node makes itself."""
    def rule(x: torch.Tensor, dim: int = -1) -> tuple:
        d = check_dim(name, dim, x.dim())  # the call passed it: the dim normalized
        step = (_backward, ((ARG, 0), (ARG, 1), (ARG, 2), (ARG, 3)), 0)  # _gradient's args
        return (_gradient, ((OUTPUT, 0), (GRAD, 0), (VALUE, d), (VALUE, log)), (0,),
                f"vitrail::{'Log' if log else ''}SoftmaxBackward", (step,))
    return rule


_SOFTMAX = autograd_apply(_Softmax)


# ------------------------------------------------------------------ public functions
def _call(name: str, x: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    mode = call_mode(x)
    if mode == EAGER and type(dim) is int:
        d = dim + x.dim() if dim < 0 else dim  # as check_dim: an invalid dim stays invalid
        hit = PLANS.get((signature(x), d, log))
        if hit is not None and hit is not GENERAL:  # a signature that passed the checks
            return hit(x)[0]
    check_tensor(name, "x", x, dtypes=FLOATS)
    d = check_dim(name, dim, x.dim())
    if mode == DISPATCH:
        return softmax_fwd(x, d, log)
    run = _forward if mode == EAGER else _SOFTMAX
    if x.get_device() != torch.cuda.current_device():
        with torch.cuda.device(x.device):
            return run(x, d, log)
    return run(x, d, log)


@front(PLANS, grad=_rule("vitrail.ops.softmax", False))
def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """softmax(x) along ``dim``: fp32, fp16, bf16; any shape, strides and dim; autograd."""
    return _call("vitrail.ops.softmax", x, dim, False)


@front(PLANS, grad=_rule("vitrail.ops.log_softmax", True))
def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log_softmax(x) along ``dim``: fp32, fp16, bf16; any shape, strides and dim; autograd."""
    return _call("vitrail.ops.log_softmax", x, dim, True)


__all__ = ["softmax", "log_softmax", "softmax_fwd", "softmax_bwd", "FAMILY", "Variant",
           "LaunchError", "route", "route_contiguous"]
