"""The sympow family: power attention's tiled symmetric power and the matmuls fused with it.

    sympow(x, power, d_tile=1, dim=-1, duplicate_correction=True)          x -> sympow(x)
    sympow_mma(a, b, expand_dim, power, d_tile=1, scale_a=1.0, duplicate_correction=True)
        sympow(a along expand_dim) * scale_a @ b, the expansion never stored
        (a [*, M, d] with expand_dim=-1 expands K; a [*, d, K] with expand_dim=-2 expands M)
    mma_sympow_bwd(a, b, c, expand_dim, power, d_tile=1, scale_a=1.0, duplicate_correction=True)
        the gradient wrt c of <sympow(c along expand_dim) * scale_a, a @ b>, fused the same way

Interface and feature order follow vidrial 0.2.1's ``sympow`` (reference.py has the math).
What the kernels support is in configs.py. Order in this module: kernels and Ops, the
implementations, custom ops with fake implementations, autograd, public functions.
"""
from __future__ import annotations

import contextvars
from pathlib import Path

import torch

from vitrail.device import vector
from vitrail.jit.errors import ArgumentError
from vitrail.jit.tma import tensor_map
from vitrail.op import Op, OpFamily
from vitrail.plan import GENERAL, Plans, keep, setup, signature
from vitrail.plan import native
from vitrail.plan.native import front
from vitrail.ops.common import (EAGER, GRAD, autograd_apply, call_mode, check_dim,
                                check_same_device, check_tensor, plain_eager)
from vitrail.ops.sympow import configs
from vitrail.ops.sympow.configs import DTYPES
from vitrail.ops.sympow.configs import MMA_TILE as TILE
from vitrail.ops.sympow.reference import sympow_dim

__all__ = ["mma_sympow_bwd", "sympow", "sympow_dim", "sympow_mma"]

_HERE = Path(__file__).parent
_COMMON = (_HERE / "sympow_common.cuh").read_text()
SOURCES = {"elementwise": _COMMON + (_HERE / "sm90_sympow.cuh").read_text(),
           "mma": _COMMON + (_HERE / "sm80_sympow_mma.cuh").read_text(),
           "mma90": _COMMON + (_HERE / "sm90_sympow_mma.cuh").read_text()}
_DT_NAME = {0: "f32", 1: "f16", 2: "bf16"}

# ---------------------------------------------------------------- kernels and the family
def _variant(key: tuple) -> dict:
    """The Op of one kernel source for one (kind, dtype, power, d_tile): those are compile-time
    statics the problem fixes; the Op's space holds what may be tuned."""
    kind, dtype, power, d_tile = key
    tid = DTYPES[dtype]
    statics = {"T_ID": tid, "POW": power, "TILE": d_tile}
    name = f"sympow.{kind}.{_DT_NAME[tid]}.p{power}.t{d_tile}"
    source = SOURCES[kind]

    def render(config):
        defines = dict(statics)
        if kind == "elementwise":
            defines["VEC"] = config.VEC
        return dict(source=source, name=name.replace(".", "_"), backend="nvrtc",
                    defines=defines)

    space = {"elementwise": configs.ELEMENTWISE, "mma90": configs.MMA90}.get(kind, configs.MMA)
    return dict(name=name, space=space, kernel_source=source, render=render, launch=_launch,
                examples=[{"vec": 8}] if kind == "elementwise" else [None],
                shape="ROWSxD" if kind == "elementwise" else "MxNxD")  # make_problem: problems.py


_EXAMPLES = (("elementwise", torch.bfloat16, 2, 8), ("mma", torch.bfloat16, 2, 8),
             ("mma90", torch.bfloat16, 2, 8))
# variants (kind, dtype, power, d_tile), made on first use; the CLI knows the examples and those
# made so far (powers and tiles are open-ended)
FAMILY = OpFamily("sympow", _variant, listed=_EXAMPLES)


def variant_op(kind: str, dtype: torch.dtype, power: int, d_tile: int) -> Op:
    return FAMILY[kind, dtype, power, d_tile]


_THREADS = {"sympow_mma_m_wg3": 384, "sympow_mma_m_tma3": 384}  # kernels of other than 256 threads


def _launch(module, config, kernel, grid, smem: int, *args) -> None:
    """kernel: its name, or (the wgmma kernels) variant(config, *args) -> (kernel, grid, smem,
    args): the config's variant (configs.MMA90) of the launch."""
    if callable(kernel):
        kernel, grid, smem, args = kernel(config, *args)
    module.kernel(kernel)[grid, _THREADS.get(kernel, 256)](*args, shared_mem=smem)


# vitrail tune's arguments of a problem (problems.py): a list set in this context (another
# thread's calls launch as ever), to which _run adds (op, key, problem, args), launching nothing
CAPTURE: contextvars.ContextVar[list | None] = contextvars.ContextVar("vitrail_sympow_capture",
                                                                     default=None)


def _run(kind, dtype, power, d_tile, vec, kernel, grid, smem, *args) -> None:
    op = variant_op(kind, dtype, power, d_tile)
    found = CAPTURE.get()
    if found is not None:
        found.append((op, f"vec={vec}", {"vec": vec}, (kernel, grid, smem, *args)))
        return
    op(f"vec={vec}", {"vec": vec}, kernel, grid, smem, *args)


# ---------------------------------------------------------------- implementations
# Plans (vitrail.plan) of the elementwise kernels: a signature's kernel, grid and arguments,
# fixed at its first call (the tables are kept alive by the plan).
PLANS = Plans("sympow")


def _new_z(x: torch.Tensor, power: int, d_tile: int, dc: bool, D: int) -> tuple[torch.Tensor]:
    return (x.new_empty(x.shape[:-1] + (D,)),)


def _new_dx(x: torch.Tensor, dz: torch.Tensor, *_) -> tuple[torch.Tensor]:
    return (torch.empty_like(x, memory_format=torch.contiguous_format),)


def _tables(d: int, power: int, d_tile: int, dc: bool, device: torch.device) -> tuple:
    """configs.tables, which a plan keeps alive and passes as constants."""
    with setup():  # built once per device and kept
        found = configs.tables(d, power, d_tile, dc, device)
    keep(*found)
    return found


def _sympow_impl(x: torch.Tensor, power: int, d_tile: int, dc: bool,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    key = (signature(x), power, d_tile, dc)
    if out is None:
        hit = PLANS.get(key)
        if hit is not None and hit is not GENERAL:
            return hit(x)[0]
    D = configs.check_support("sympow", x.shape[-1], power, d_tile)
    if out is not None:
        sympow_into(x, out, power, d_tile, dc, D)
        return out
    return PLANS.run(key, (x,), _new_z, sympow_into, (power, d_tile, dc, D))[0]


def sympow_into(x: torch.Tensor, z: torch.Tensor, power: int, d_tile: int, dc: bool,
                D: int) -> None:
    d = x.shape[-1]
    x = x.contiguous()
    rows = x.numel() // d if d else 0
    if rows == 0:
        return
    gidx, gcoef, _, _ = _tables(d, power, d_tile, dc, x.device)
    vec = configs.vector_width(x.dtype, d_tile ** power, z)
    chunks = D // vec
    at_once = configs.fwd_rows_at_once(rows, chunks, x.device)
    _run("elementwise", x.dtype, power, d_tile, vec, "sympow_fwd", -(-chunks * at_once // 256), 0,
         z, x, gidx, gcoef, rows, d, D, 1.0, at_once)


def _sympow_bwd_impl(x: torch.Tensor, dz: torch.Tensor, power: int, d_tile: int,
                     dc: bool, out: torch.Tensor | None = None, pipe: bool = True) -> torch.Tensor:
    """pipe=False: the one-block-per-CTA gather kernel even where a persistent one
    (sympow_bwd_pipe, sympow_bwd_quarter) applies (for comparisons)."""
    key = (signature(x), signature(dz), power, d_tile, dc)
    if out is None and pipe:
        hit = PLANS.get(key)
        if hit is not None and hit is not GENERAL:
            return hit(x, dz)[0]
    D = configs.check_support("sympow backward", x.shape[-1], power, d_tile)
    if out is not None or not pipe:
        dx = out if out is not None else _new_dx(x, dz)[0]
        _sympow_bwd_into(x, dz, dx, power, d_tile, dc, D, pipe)
        return dx
    return PLANS.run(key, (x, dz), _new_dx, _sympow_bwd_into, (power, d_tile, dc, D))[0]


def _sympow_bwd_into(x: torch.Tensor, dz: torch.Tensor, dx: torch.Tensor, power: int,
                     d_tile: int, dc: bool, D: int, pipe: bool = True) -> None:
    d = x.shape[-1]
    x, dz = x.contiguous(), dz.to(x.dtype).contiguous()
    rows = x.numel() // d if d else 0
    if rows == 0:
        return
    _, _, tidx, tcoef = _tables(d, power, d_tile, dc, x.device)
    tuples = tidx.numel()
    vec = configs.vector_width(x.dtype, d_tile ** power, dz)
    with setup():  # built once per device and kept
        slots, entries = configs.gather_slots(d, power, d_tile, x.device)
    keep(slots)
    smem = configs.quarter_smem(x.dtype, power, d_tile, vec, d, tuples) if pipe else 0
    if smem:  # 512-byte blocks: staged in quarters, 4 threads an item, persistent
        _run("elementwise", x.dtype, power, d_tile, vec, "sympow_bwd_quarter",
             configs.pipe_grid(rows, smem, x.device), smem,
             dx, x, dz, tidx, tcoef, slots, rows, d, D, tuples, entries, 1.0)
        return
    stage = configs.gather_stage(x.dtype, power, d_tile, vec)
    # no atomics: partial sums per (row, tuple), then one gather per dx element. Small CTAs
    # first (GATHER_SMEM: more of them per SM), then the persistent two-stage kernel, then
    # larger CTAs, in the order measured (docs/ops/power-attention.md#sympows-backward-ctas)
    per_block = configs.gather_rows(d, power, d_tile, tuples, stage)
    if not per_block and pipe:
        pipe_block = configs.pipe_rows(d, power, d_tile, tuples, stage)
        if pipe_block:  # the next block's dz in flight while one computes
            smem = configs.gather_smem(d, power, d_tile, tuples, pipe_block, 2 * stage)
            _run("elementwise", x.dtype, power, d_tile, vec, "sympow_bwd_pipe",
                 configs.pipe_grid(-(-rows // pipe_block), smem, x.device,
                                   configs.PIPE_CTAS[x.element_size()]), smem,
                 dx, x, dz, tidx, tcoef, slots, rows, d, D, tuples, entries, pipe_block, 1.0)
            return
    per_block = per_block or configs.gather_rows(d, power, d_tile, tuples, stage,
                                                 budget=configs.GATHER_SMEM_MAX)
    if per_block:
        _run("elementwise", x.dtype, power, d_tile, vec, "sympow_bwd_gather",
             -(-rows // per_block),
             configs.gather_smem(d, power, d_tile, tuples, per_block, stage),
             dx, x, dz, tidx, tcoef, slots, rows, d, D, tuples, entries, per_block, 1.0)
        return
    es, block = x.element_size(), d_tile ** power
    staged = 32 <= block * es <= 128  # as STAGE in sm90_sympow.cuh
    if staged:  # about one stage of 256 tuples per CTA
        per_block = max(1, min(64, 256 // tuples, 12288 // d))
    else:
        per_block = max(1, min(64, -(-1024 // tuples), 12288 // d))
    smem = (per_block * d + 3) // 4 * 16
    if staged:
        smem += 256 * (block * es + 16)
    grid = -(-rows // per_block)
    _run("elementwise", x.dtype, power, d_tile, vec, "sympow_bwd", grid, smem,
         dx, x, dz, tidx, tcoef, rows, d, D, tuples, per_block, 1.0)


def _vec_ok(t: torch.Tensor) -> int:
    """1 when t's rows can be read in 16-byte vectors (row bytes and address multiples of 16)."""
    return int(t.shape[-1] * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0)


def _smem(kind: str, dtype: torch.dtype, d: int) -> int:
    """Dynamic shared memory of a fused kernel (the carving in sm80_sympow_mma.cuh)."""
    es = torch.empty((), dtype=dtype).element_size()
    pad = 4 if dtype == torch.float32 else 8
    tile = TILE * (TILE + pad) * es  # one stage of sA or sB
    a16 = lambda b: (b + 15) // 16 * 16  # noqa: E731
    if kind == "mma_k":
        return a16(TILE * (d + 1) * 4) + 3 * tile
    if kind == "mma_m":
        return 2 * d * TILE * es + 3 * tile + TILE * 8
    g = TILE * (TILE + 1) * 4 + 32  # sG and alignment
    if kind == "bwd_k":
        return a16(2 * TILE * (d + 1) * 4) + g + 4 * tile
    return 2 * d * TILE * 4 + g + 4 * tile


def _new_mma(a, b, expand_dim, power, d_tile, scale, dc) -> tuple[torch.Tensor]:
    """sympow_mma's output [P, M', N] (M' = M, or D where a's d rows expand)."""
    rows = a.shape[1] if expand_dim == -1 else sympow_dim(a.shape[1], power, d_tile)
    return (a.new_empty((a.shape[0], rows, b.shape[-1])),)


def _mma_into(a, b, out, expand_dim, power, d_tile, scale, dc) -> None:
    mma_impl(a, b, expand_dim, power, d_tile, scale, dc, out=out)


def _mma_planned(a, b, expand_dim, power, d_tile, scale, dc) -> torch.Tensor:
    """sympow_mma of 3-D a and b through their signature's plan."""
    key = (signature(a), signature(b), expand_dim, power, d_tile, scale, dc)
    return PLANS.run(key, (a, b), _new_mma, _mma_into,
                     (expand_dim, power, d_tile, scale, dc))[0]


def _new_like_c(a, b, c, *_) -> tuple[torch.Tensor]:
    return (torch.empty_like(c, memory_format=torch.contiguous_format),)


def _mma_bwd_into(a, b, c, out, expand_dim, power, d_tile, scale, dc) -> None:
    mma_bwd_impl(a, b, c, expand_dim, power, d_tile, scale, dc, out=out)


def mma_impl(a: torch.Tensor, b: torch.Tensor, expand_dim: int, power: int, d_tile: int,
             scale: float, dc: bool, out: torch.Tensor | None = None,
             wgmma: bool | None = None, order: str | None = None,
             wgs: int | None = None, tma: bool | None = None) -> torch.Tensor:
    """a [P, M, d] (expand_dim -1) or [P, d, K] (-2), b [P, K', N] -> [P, M', N].
    wgmma: None picks sm90_sympow_mma.cuh where it applies (configs.wgmma_applies); False forces
    the sm80 kernels (for comparisons). order, tma: the wgmma kernels' launch order and the
    expand-K kernel's mainloop where not the config's (configs.MMA90; the sm80 kernels keep P
    fastest); wgs: the expand-M wgmma kernel's warpgroups (configs.state_wgs; all three for
    comparisons)."""
    a, b = a.contiguous(), b.contiguous()
    P, N = a.shape[0], b.shape[-1]
    d = a.shape[expand_dim]
    D = configs.check_support("sympow_mma", d, power, d_tile)
    if wgmma is not False and configs.wgmma_applies(a.dtype, power, d_tile, a.device):
        return _mma90_impl(a, b, expand_dim, power, d_tile, d, D, scale, dc, out, order, wgs,
                           tma)
    gidx, gcoef, _, _ = _tables(d, power, d_tile, dc, a.device)
    groups = gidx.numel()
    if expand_dim == -1:
        M = a.shape[1]
        c = out if out is not None else a.new_empty((P, M, N))
        grid = configs.launch_grid(P, -(-M // TILE), -(-N // TILE), "p")
        if c.numel():
            _run("mma", a.dtype, power, d_tile, 0, "sympow_mma_k", grid,
                 _smem("mma_k", a.dtype, d), c, a, b, gidx, gcoef, M, N, d, D, groups,
                 float(scale), _vec_ok(b))
    else:
        K = a.shape[2]
        c = out if out is not None else a.new_empty((P, D, N))
        grid = configs.launch_grid(P, -(-D // TILE), -(-N // TILE), "p")
        if c.numel():
            if K == 0:
                return c.zero_()
            _run("mma", a.dtype, power, d_tile, 0, "sympow_mma_m", grid,
                 _smem("mma_m", a.dtype, d), c, a, b, gidx, gcoef, K, N, d, D, groups,
                 float(scale), _vec_ok(a), _vec_ok(b))
    return c


def _pad16(t: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """t itself when its rows are 16-byte multiples at a 16-byte aligned address (and it has
    `rows` rows); else a zero-padded copy that is."""
    r, n = t.shape[-2], t.shape[-1]
    rows = r if rows is None else rows
    if rows == r and _vec_ok(t):
        return t
    e = vector(t.dtype)
    out = t.new_zeros(t.shape[:-2] + (rows, -(-n // e) * e))
    out[..., :r, :n] = t
    return out


def _mma90_impl(a, b, expand_dim, power, d_tile, d, D, scale, dc, out, order=None, wgs=None,
                tma=None):
    """The wgmma kernels (sm90_sympow_mma.cuh): 128 x 64 output tiles, tuple tables. Operands
    the kernels read by cp.async are zero-padded where their rows are not 16-byte vectors."""
    _, _, tidx, tcoef = _tables(d, power, d_tile, dc, a.device)
    P, N = a.shape[0], b.shape[-1]
    BM, BN = configs.WG_TILE
    rows = a.shape[1] if expand_dim == -1 else D
    c = out if out is not None else a.new_empty((P, rows, N))
    if not c.numel():
        return c
    if expand_dim == -2 and a.shape[2] == 0:
        return c.zero_()
    if expand_dim == -1:
        bp = _pad16(b)
        Np = bp.shape[-1]
        cp = c if Np == N else a.new_empty((P, rows, Np))
        tiles = (P, -(-rows // BM), -(-Np // BN))

        def query(config, cp, a, bp, *rest):
            grid = configs.launch_grid(*tiles, config.ORDER if order is None else order)
            if config.TMA if tma is None else tma:  # b's k-blocks: 64 x 64 boxes of [P, D, Np]
                map_b = tensor_map(bp, dims=(Np, D, P), strides=(Np, D * Np), box=(64, 64, 1))
                return ("sympow_mma_k_tma", grid, configs.wgmma_smem("k_tma", d),
                        (cp, a, map_b, *rest))
            return "sympow_mma_k_wg", grid, configs.wgmma_smem("k", d), (cp, a, bp, *rest)
        _run("mma90", a.dtype, power, d_tile, 0, query, None, 0, cp, a, bp, tidx, tcoef, rows,
             Np, d, D, float(scale), _vec_ok(a))
    else:
        ap = _pad16(a)
        K = ap.shape[-1]
        bp = _pad16(b, rows=K)
        Np = bp.shape[-1]
        cp = c if Np == N else a.new_empty((P, rows, Np))
        wgs = configs.state_wgs(power, wgs)
        tiles = (P, -(-rows // (64 * wgs)), -(-Np // BN))
        if configs.state_tma(K, wgs):
            # a's k-blocks as [d x 64] boxes; b's as one box of a 5-d view of its [P K, Np] rows
            # (16-row groups) that lands them in the kernel's permuted order (KPerm)
            map_a = tensor_map(ap, dims=(K, d, P), strides=(K, d * K), box=(64, d, 1))
            map_b = tensor_map(bp, dims=(Np, 2, P * K // 16, 2, 4),
                               strides=(Np, 16 * Np, 2 * Np, 4 * Np), box=(64, 2, 4, 2, 4))
            kernel, smem = "sympow_mma_m_tma3", configs.wgmma_smem("m_tma", d)
            ops = (map_a, map_b)
        else:
            kernel = "sympow_mma_m_wg" + ("3" if wgs == 3 else "")
            smem, ops = configs.wgmma_smem("m", d), (ap, bp)

        def state(config, *args):
            grid = configs.launch_grid(*tiles, config.ORDER if order is None else order)
            return kernel, grid, smem, args
        _run("mma90", a.dtype, power, d_tile, 0, state, None, 0, cp, *ops, tidx, tcoef, K, Np,
             d, D, float(scale))
    if cp is not c:
        c.copy_(cp[..., :N])
    return c


def mma_bwd_impl(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, expand_dim: int,
                 power: int, d_tile: int, scale: float, dc: bool,
                 out: torch.Tensor | None = None, wgmma: bool | None = None,
                 order: str | None = None, defer: bool | None = None) -> torch.Tensor:
    """c [P, M, d] (-1) or [P, d, K] (-2); a @ b has c's expanded shape. wgmma: None takes
    mma_sympow_bwd_k_wg for expand K where it applies (configs.wgmma_bwd_fits); False forces
    the sm80 kernels; order, defer: the wgmma kernel's launch order, and whether it keeps
    factor 0's sums in registers, where not the config's (configs.MMA90; the sm80 kernels keep
    P fastest; both for comparisons)."""
    c = c.contiguous()
    a, b = a.to(c.dtype).contiguous(), b.to(c.dtype).contiguous()
    P, n = c.shape[0], a.shape[-1]
    d = c.shape[expand_dim]
    D = configs.check_support("mma_sympow_bwd", d, power, d_tile)
    gidx, gcoef, _, _ = _tables(d, power, d_tile, dc, c.device)
    out = out if out is not None else torch.empty_like(c)
    if not out.numel():
        return out
    if n == 0:
        return out.zero_()
    if expand_dim == -1:
        M = c.shape[1]
        lda = -(-n // 8) * 8
        if wgmma is not False and configs.wgmma_bwd_fits(d, lda) and \
                configs.wgmma_applies(c.dtype, power, d_tile, c.device):
            _, _, tidx, tcoef = _tables(d, power, d_tile, dc, c.device)
            ap = _pad16(a)
            bp = b if _vec_ok(b) else b.clone()  # (D is a multiple of 64: only the address)
            tiles = (P, -(-M // configs.WG_TILE[0]), 1)

            def query_bwd(config, *args):
                grid = configs.launch_grid(*tiles, config.ORDER if order is None else order)
                deferred = config.DEFER if defer is None else defer
                return ("mma_sympow_bwd_k_wg2" if deferred else "mma_sympow_bwd_k_wg", grid,
                        configs.wgmma_bwd_smem(d, lda), args)
            _run("mma90", c.dtype, power, d_tile, 0, query_bwd, None, 0, out, c, ap, bp, tidx,
                 tcoef, M, ap.shape[-1], n, d, D, float(scale), _vec_ok(c))
            return out
        _run("mma", c.dtype, power, d_tile, 0, "mma_sympow_bwd_k",
             configs.launch_grid(P, -(-M // TILE), 1, "p"),
             _smem("bwd_k", c.dtype, d), out, c, a, b, gidx, gcoef, M, n, d, D, gidx.numel(),
             float(scale), _vec_ok(a), _vec_ok(b))
    else:
        K = c.shape[2]
        _run("mma", c.dtype, power, d_tile, 0, "mma_sympow_bwd_m",
             configs.launch_grid(P, -(-K // TILE), 1, "p"),
             _smem("bwd_m", c.dtype, d), out, c, a, b, gidx, gcoef, K, n, d, D, gidx.numel(),
             float(scale), _vec_ok(a), _vec_ok(b))
    return out


# ---------------------------------------------------------------- custom ops
@torch.library.custom_op("vitrail::sympow", mutates_args=())
def _sympow_op(x: torch.Tensor, power: int, d_tile: int,
               duplicate_correction: bool) -> torch.Tensor:
    return _sympow_impl(x, power, d_tile, duplicate_correction)


@_sympow_op.register_fake
def _(x, power, d_tile, duplicate_correction):
    return x.new_empty(x.shape[:-1] + (sympow_dim(x.shape[-1], power, d_tile),))


@torch.library.custom_op("vitrail::sympow_bwd", mutates_args=())
def _sympow_bwd_op(x: torch.Tensor, dz: torch.Tensor, power: int, d_tile: int,
                   duplicate_correction: bool) -> torch.Tensor:
    return _sympow_bwd_impl(x, dz, power, d_tile, duplicate_correction)


@_sympow_bwd_op.register_fake
def _(x, dz, power, d_tile, duplicate_correction):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("vitrail::sympow_mma", mutates_args=())
def _sympow_mma_op(a: torch.Tensor, b: torch.Tensor, expand_dim: int, power: int, d_tile: int,
                   scale_a: float, duplicate_correction: bool) -> torch.Tensor:
    return mma_impl(a, b, expand_dim, power, d_tile, scale_a, duplicate_correction)


@_sympow_mma_op.register_fake
def _(a, b, expand_dim, power, d_tile, scale_a, duplicate_correction):
    rows = a.shape[1] if expand_dim == -1 else sympow_dim(a.shape[1], power, d_tile)
    return a.new_empty((a.shape[0], rows, b.shape[-1]))


@torch.library.custom_op("vitrail::mma_sympow_bwd", mutates_args=())
def _mma_sympow_bwd_op(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, expand_dim: int,
                       power: int, d_tile: int, scale_a: float,
                       duplicate_correction: bool) -> torch.Tensor:
    return mma_bwd_impl(a, b, c, expand_dim, power, d_tile, scale_a, duplicate_correction)


@_mma_sympow_bwd_op.register_fake
def _(a, b, c, expand_dim, power, d_tile, scale_a, duplicate_correction):
    return torch.empty_like(c, memory_format=torch.contiguous_format)


# ---------------------------------------------------------------- autograd
def _sympow_setup(ctx, inputs, output):
    x, power, d_tile, dc = inputs
    ctx.save_for_backward(x)
    ctx.args = (power, d_tile, dc)


def _sympow_backward(ctx, dz):
    (x,) = ctx.saved_tensors
    return torch.ops.vitrail.sympow_bwd(x, dz, *ctx.args), None, None, None


torch.library.register_autograd("vitrail::sympow", _sympow_backward, setup_context=_sympow_setup)


def _mma_setup(ctx, inputs, output):
    a, b, expand_dim, power, d_tile, scale, dc = inputs
    ctx.save_for_backward(a, b)
    ctx.args = (expand_dim, power, d_tile, scale, dc)


def _mma_pair(a, b, dc_out, args, needs, mma, bwd) -> tuple:
    """The gradients of sympow_mma's a and b (where needs says): bwd = mma_sympow_bwd, mma =
    sympow_mma (the custom ops, or the implementations directly)."""
    expand_dim, power, d_tile, scale, dc = args
    da = db = None
    dc_out = dc_out.to(a.dtype)
    if needs[0]:  # dE = dC @ b^T, contracted through sympow's derivative
        da = bwd(dc_out, b.transpose(1, 2), a, expand_dim, power, d_tile, scale, dc)
    if needs[1]:  # db = E^T @ dC, and E^T is sympow of a^T along the other side
        db = mma(a.transpose(1, 2), dc_out, -3 - expand_dim, power, d_tile, scale, dc)
    return da, db


def _mma_backward(ctx, dc_out):
    a, b = ctx.saved_tensors
    return (*_mma_pair(a, b, dc_out, ctx.args, ctx.needs_input_grad[:2],
                       torch.ops.vitrail.sympow_mma, torch.ops.vitrail.mma_sympow_bwd),
            None, None, None, None, None)


torch.library.register_autograd("vitrail::sympow_mma", _mma_backward, setup_context=_mma_setup)


class _Sympow(torch.autograd.Function):
    """A GRAD call of sympow (vitrail.ops.common.call_mode): forward and backward straight to
    the kernels through their plans."""

    @staticmethod
    def forward(ctx, x, power, d_tile, dc):
        ctx.save_for_backward(x)
        ctx.args = (power, d_tile, dc)
        return _sympow_impl(x, power, d_tile, dc)

    @staticmethod
    def backward(ctx, dz):
        (x,) = ctx.saved_tensors
        return _sympow_gradient(x, dz, *ctx.args), None, None, None


@front(PLANS)  # the C++ plans' backward step runs from C++ too
def _sympow_bwd(x: torch.Tensor, dz: torch.Tensor, power: int, d_tile: int,
                dc: bool) -> torch.Tensor:
    """x's gradient from dz through the signature's plan (checked operands)."""
    return _sympow_bwd_impl(x, dz, power, d_tile, dc)


def _sympow_gradient(x: torch.Tensor, dz: torch.Tensor, power: int, d_tile: int,
                     dc: bool) -> torch.Tensor:
    """x's gradient (the GRAD path's backward, the C++ plans' too: vitrail.plan.native)."""
    if torch.is_grad_enabled():  # create_graph: the custom op refuses a second backward
        return torch.ops.vitrail.sympow_bwd(x, dz, power, d_tile, dc)
    return _sympow_bwd(x, dz, power, d_tile, dc)


def _sympow_rule(x: torch.Tensor, power: int, d_tile: int = 1, dim: int = -1,
                 duplicate_correction: bool = True) -> tuple | None:
    """The gradient rule of sympow's C++ plans, where the expansion is along the last dim (the
    result is then the plan's output); its one step, the backward kernel's front call
    (_sympow_bwd), which the C++ node makes itself."""
    if dim not in (-1, x.dim() - 1):
        return None
    step = (_sympow_bwd, tuple((native.ARG, j) for j in range(5)), 0)  # _sympow_gradient's
    return (_sympow_gradient, ((native.INPUT, 0), (native.GRAD, 0), (native.VALUE, power),
                               (native.VALUE, d_tile),
                               (native.VALUE, bool(duplicate_correction))), (0,),
            "vitrail::SympowBackward", (step,))


class _SympowMma(torch.autograd.Function):
    """A GRAD call of sympow_mma: forward and backward straight to the kernels."""

    @staticmethod
    def forward(ctx, a, b, expand_dim, power, d_tile, scale, dc):
        ctx.save_for_backward(a, b)
        ctx.args = (expand_dim, power, d_tile, scale, dc)
        return _mma_planned(a, b, expand_dim, power, d_tile, scale, dc)

    @staticmethod
    def backward(ctx, dc_out):
        a, b = ctx.saved_tensors
        return (*_mma_gradients(a, b, dc_out, *ctx.args, ctx.needs_input_grad[:2]),
                None, None, None, None, None)


def _mma_gradients(a, b, dc_out, expand_dim, power, d_tile, scale, dc, needs=(True, True)):
    """a's and b's gradients (the GRAD path's backward, the C++ plans' too)."""
    if torch.is_grad_enabled():  # create_graph: through the custom ops
        return _mma_pair(a, b, dc_out, (expand_dim, power, d_tile, scale, dc), needs,
                         torch.ops.vitrail.sympow_mma, torch.ops.vitrail.mma_sympow_bwd)
    return _mma_pair(a, b, dc_out, (expand_dim, power, d_tile, scale, dc), needs, mma_impl,
                     mma_bwd_impl)


def _mma_rule(a: torch.Tensor, b: torch.Tensor, expand_dim: int, power: int, d_tile: int = 1,
              scale_a: float = 1.0, duplicate_correction: bool = True) -> tuple | None:
    """The gradient rule of sympow_mma's C++ plans, for 3-D a and b (the result is then the
    plan's output)."""
    if a.dim() != 3 or b.dim() != 3:
        return None
    ed = _flatten("sympow_mma", a, b, expand_dim)[1]  # as the call normalized it
    values = (ed, power, d_tile, float(scale_a), bool(duplicate_correction))
    return (_mma_gradients, ((native.INPUT, 0), (native.INPUT, 1), (native.GRAD, 0),
                             *((native.VALUE, v) for v in values),
                             (native.VALUE, (a.requires_grad, b.requires_grad))), (0, 1),
            "vitrail::SympowMmaBackward")


_SYMPOW, _SYMPOW_MMA = autograd_apply(_Sympow), autograd_apply(_SympowMma)


# ---------------------------------------------------------------- public functions
def _check_float(op: str, name: str, t) -> None:
    check_tensor(op, name, t, dtypes=configs.DTYPES)


@front(PLANS, grad=_sympow_rule)
def sympow(x: torch.Tensor, power: int, d_tile: int = 1, dim: int = -1,
           duplicate_correction: bool = True) -> torch.Tensor:
    """The tiled symmetric power of x along dim: that dimension's d features become
    D = C(d/d_tile + power - 1, power) * d_tile**power (vidrial 0.2.1's order)."""
    dc = bool(duplicate_correction)
    mode = call_mode(x)
    if (mode == EAGER and type(power) is int and type(d_tile) is int and type(dim) is int
            and x.dim() and dim in (-1, x.dim() - 1)):  # a signature checked before: its plan
        hit = PLANS.get((signature(x), power, d_tile, dc))
        if hit is not None and hit is not GENERAL:
            return hit(x)[0]
    _check_float("sympow", "x", x)
    if x.dim() == 0:
        raise ArgumentError("sympow: x must have at least 1 dimension, got a scalar")
    dim = check_dim("sympow", dim, x.dim())
    configs.check_support("sympow", x.shape[dim], power, d_tile)
    last = dim == x.dim() - 1
    xl = x if last else x.movedim(dim, -1)
    if mode == EAGER:
        z = _sympow_impl(xl, power, d_tile, dc)
    elif mode == GRAD:
        z = _SYMPOW(xl, power, d_tile, dc)
    else:
        z = torch.ops.vitrail.sympow(xl, power, d_tile, dc)
    return z if last else z.movedim(-1, dim)


def _flatten(op: str, a: torch.Tensor, b: torch.Tensor, expand_dim: int):
    if a.dim() < 2 or b.dim() != a.dim():
        raise ArgumentError(f"{op}: a and b must have the same number (>= 2) of dimensions, "
                            f"got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[:-2] != b.shape[:-2]:
        raise ArgumentError(f"{op}: a and b must have the same batch dimensions, got "
                            f"{tuple(a.shape[:-2])} and {tuple(b.shape[:-2])}")
    if expand_dim not in (-1, -2, a.dim() - 1, a.dim() - 2):
        raise ArgumentError(f"{op}: expand_dim must be -1 (expand K) or -2 (expand M), got "
                            f"{expand_dim}")
    return _as3(a), (-1 if expand_dim in (-1, a.dim() - 1) else -2)


def _as3(t: torch.Tensor) -> torch.Tensor:
    """t as [P, rows, cols]: t itself where it is (a plan's inputs are the caller's tensors)."""
    return t if t.dim() == 3 else t.reshape((-1,) + t.shape[-2:])


@front(PLANS, grad=_mma_rule)
def sympow_mma(a: torch.Tensor, b: torch.Tensor, expand_dim: int, power: int, d_tile: int = 1,
               scale_a: float = 1.0, duplicate_correction: bool = True) -> torch.Tensor:
    """sympow(a along expand_dim) * scale_a @ b without storing the expansion.

    expand_dim=-1: a [*, M, d], b [*, D, N] -> [*, M, N] (the query side of power attention).
    expand_dim=-2: a [*, d, K], b [*, K, N] -> [*, D, N] (the state update side)."""
    op = "sympow_mma"
    _check_float(op, "a", a)
    check_tensor(op, "b", b, dtypes=[a.dtype])
    check_same_device(op, a=a, b=b)
    a3, ed = _flatten(op, a, b, expand_dim)
    d = a3.shape[ed]
    D = configs.check_support(op, d, power, d_tile)
    want = D if ed == -1 else a3.shape[2]
    if b.shape[-2] != want:
        why = "D = sympow_dim(d)" if ed == -1 else "K, as a has columns"
        raise ArgumentError(f"{op}: b must have {want} rows ({why}), got shape {tuple(b.shape)}")
    b3 = _as3(b)
    dc = bool(duplicate_correction)
    mode = call_mode(a, b)
    if mode == EAGER:
        c = _mma_planned(a3, b3, ed, power, d_tile, float(scale_a), dc)
    elif mode == GRAD:
        c = _SYMPOW_MMA(a3, b3, ed, power, d_tile, float(scale_a), dc)
    else:
        c = torch.ops.vitrail.sympow_mma(a3, b3, ed, power, d_tile, float(scale_a), dc)
    return c if a.dim() == 3 else c.reshape(a.shape[:-2] + c.shape[-2:])


@front(PLANS)
def mma_sympow_bwd(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, expand_dim: int,
                   power: int, d_tile: int = 1, scale_a: float = 1.0,
                   duplicate_correction: bool = True) -> torch.Tensor:
    """The gradient wrt c of <sympow(c along expand_dim) * scale_a, a @ b>, with a @ b (the size
    of the expansion) never stored. c [*, M, d] (expand_dim=-1): a [*, M, n], b [*, n, D];
    c [*, d, K] (expand_dim=-2): a [*, D, n], b [*, n, K]. Returns c's shape."""
    op = "mma_sympow_bwd"
    _check_float(op, "c", c)
    check_tensor(op, "a", a, dtypes=[c.dtype])
    check_tensor(op, "b", b, dtypes=[c.dtype])
    check_same_device(op, a=a, b=b, c=c)
    c3, ed = _flatten(op, c, a, expand_dim)
    if b.shape[:-2] != c.shape[:-2]:
        raise ArgumentError(f"{op}: b must have c's batch dimensions {tuple(c.shape[:-2])}, got "
                            f"{tuple(b.shape[:-2])}")
    d = c3.shape[ed]
    D = configs.check_support(op, d, power, d_tile)
    rows, cols = (c3.shape[1], D) if ed == -1 else (D, c3.shape[2])
    if a.shape[-2] != rows or b.shape[-1] != cols or a.shape[-1] != b.shape[-2]:
        raise ArgumentError(f"{op}: a @ b must have shape (..., {rows}, {cols}) (c expanded), "
                            f"got a {tuple(a.shape)} and b {tuple(b.shape)}")
    a3, b3 = _as3(a), _as3(b)
    dc = bool(duplicate_correction)
    if plain_eager(a, b, c):
        key = (signature(a3), signature(b3), signature(c3), ed, power, d_tile, float(scale_a),
               dc)
        out = PLANS.run(key, (a3, b3, c3), _new_like_c, _mma_bwd_into,
                        (ed, power, d_tile, float(scale_a), dc))[0]
    else:
        out = torch.ops.vitrail.mma_sympow_bwd(a3, b3, c3, ed, power, d_tile, float(scale_a),
                                               dc)
    return out if c.dim() == 3 else out.reshape(c.shape)
