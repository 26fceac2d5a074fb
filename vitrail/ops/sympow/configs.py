"""What the sympow kernels support, their config spaces, and the index tables they read.

Support (checked by ``check_support``, refused with a clear error otherwise): power 1 to 4,
d (the expanded dimension's size) at most 256, d_tile in {1, 2, 4, 8, 16} dividing d, and
d_tile ** power at most 512 (p=2: d_tile <= 16; p=3: <= 8; p=4: <= 4). The bounds come from the
kernels: tile indices are packed as bytes (d <= 256), and the backward keeps a whole t^p block
of one tuple in registers.

The kernels walk the output in *groups*: a group is one tuple with its leading p-1 digits fixed,
so its t features differ only in the last factor's digit. A group's table entry packs the
indices of its p-1 leading input features (bytes 0-2) and the first index of its last tile
(byte 3), with its multiplicity coefficient beside it. The backward kernel walks whole tuples:
one entry per tuple with each factor's first tile index (bytes 0-3) and its coefficient.
"""
from __future__ import annotations

import math

import torch

from vitrail.device import gpu_limits, sm_count, vector
from vitrail.jit.errors import ArgumentError
from vitrail.ops.sympow.reference import multiplicity, sympow_dim, tuples
from vitrail.tune import Space, require

D_TILES = (1, 2, 4, 8, 16)
MAX_D = 256
MAX_BLOCK = 512          # d_tile ** power
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# The fused matmuls' CTA tile (BM x BN x BK) and threads; fixed for now (one config).
MMA_TILE = 64
MMA_THREADS = 256


def check_support(op: str, d: int, power: int, d_tile: int) -> int:
    """Refuse what the kernels do not implement; returns D."""
    if not isinstance(power, int) or isinstance(power, bool) or not 1 <= power <= 4:
        raise ArgumentError(f"{op}: power must be an int from 1 to 4, got {power!r}")
    if not isinstance(d_tile, int) or isinstance(d_tile, bool) or d_tile not in D_TILES:
        raise ArgumentError(f"{op}: d_tile must be one of {D_TILES}, got {d_tile!r}")
    if d < 1 or d > MAX_D:
        raise ArgumentError(f"{op}: the expanded dimension must have 1 to {MAX_D} features, "
                            f"got {d}")
    if d % d_tile:
        raise ArgumentError(f"{op}: d_tile={d_tile} must divide the expanded dimension's "
                            f"size d={d}")
    if power > 1 and d_tile ** power > MAX_BLOCK:
        best = max(t for t in D_TILES if t ** power <= MAX_BLOCK and d % t == 0)
        raise ArgumentError(f"{op}: d_tile**power = {d_tile}**{power} = {d_tile ** power} is "
                            f"over the kernels' limit of {MAX_BLOCK}; use d_tile <= {best}")
    return sympow_dim(d, power, d_tile)


_TABLES: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _pack(values) -> int:
    packed = 0
    for i, v in enumerate(values):
        packed |= int(v) << (8 * i)
    return packed - (1 << 32) if packed >= 1 << 31 else packed


def tables(d: int, power: int, d_tile: int, duplicate_correction: bool,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(group_index int32, group_coef float32, tuple_index int32, tuple_coef float32) on device,
    built once per (d, power, d_tile, duplicate_correction, device)."""
    key = (d, power, d_tile, bool(duplicate_correction), str(device))
    hit = _TABLES.get(key)
    if hit is not None:
        return hit
    n, t = d // d_tile, d_tile
    g_idx, g_coef, t_idx, t_coef = [], [], [], []
    for tup in tuples(n, power):
        coef = math.sqrt(multiplicity(tup)) if duplicate_correction else 1.0
        t_idx.append(_pack([i * t for i in tup]))
        t_coef.append(coef)
        for lead in range(t ** (power - 1)):
            digits = [(lead // t ** (power - 2 - l)) % t for l in range(power - 1)]
            leading = [tup[l] * t + digits[l] for l in range(power - 1)]
            leading += [0] * (3 - len(leading))
            g_idx.append(_pack(leading + [tup[-1] * t]))
            g_coef.append(coef)
    made = (torch.tensor(g_idx, dtype=torch.int32), torch.tensor(g_coef, dtype=torch.float32),
            torch.tensor(t_idx, dtype=torch.int32), torch.tensor(t_coef, dtype=torch.float32))
    from vitrail.ops.common import persistent
    made = persistent(lambda: tuple(m.to(device) for m in made), device)
    _TABLES[key] = made
    return made


def fwd_rows_at_once(rows: int, chunks: int, device: torch.device) -> int:
    """Rows sympow_fwd covers at once (R there): its chunks * R threads fill the GPU about
    twice over at 2048 threads per SM (each thread then loops over rows / R rows), at least 1,
    at most rows; chunks * R stays below 2**31."""
    return max(1, min(rows, 2 * sm_count(device.index) * 2048 // chunks, (1 << 31) // chunks - 1))


_SLOTS: dict[tuple, tuple[torch.Tensor, int]] = {}
GATHER_SMEM = 32 << 10   # shared memory a sympow_bwd_gather CTA takes first (6+ CTAs per SM)
GATHER_SMEM_MAX = 64 << 10  # ... and at most, where a row's partials need more


def part_ld(power: int, d_tile: int) -> int:
    """Floats between two items' partial gradients in sympow_bwd_gather (PART_LD there)."""
    part = power * d_tile
    return part + (4 if part % 8 == 0 else 0)


def gather_slots(d: int, power: int, d_tile: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(slots int32 [n, E], E) for sympow_bwd_gather: for each tile u, the offsets in a row's
    partial gradients (tuple j's factor l at j * part_ld + l * d_tile) of every (tuple, factor)
    whose tile is u; each tile has the same number E = tuples * power / n."""
    key = (d, power, d_tile, str(device))
    hit = _SLOTS.get(key)
    if hit is not None:
        return hit
    n, ld = d // d_tile, part_ld(power, d_tile)
    per_tile: list[list[int]] = [[] for _ in range(n)]
    for j, tup in enumerate(tuples(n, power)):
        for l, u in enumerate(tup):
            per_tile[u].append(j * ld + l * d_tile)
    entries = len(per_tile[0])
    assert all(len(p) == entries for p in per_tile)
    from vitrail.ops.common import persistent
    made = (persistent(lambda: torch.tensor(per_tile, dtype=torch.int32).to(device), device),
            entries)
    _SLOTS[key] = made
    return made


def gather_stage(dtype: torch.dtype, power: int, d_tile: int, vec: int) -> int:
    """Bytes one item takes in sympow_bwd_gather's dz stage (GSTAGE there: a tuple's block 32 to
    128 bytes, 16-byte vectors): the block padded by 16 bytes; else 0. A round stages at most
    256 items."""
    es = torch.empty((), dtype=dtype).element_size()
    block = d_tile ** power * es
    return block + 16 if 32 <= block <= 128 and vec * es == 16 else 0


def gather_smem(d: int, power: int, d_tile: int, n_tuples: int, rows: int, stage: int) -> int:
    """Shared memory of sympow_bwd_gather for `rows` rows a CTA: x's rows and the items'
    partial gradients in fp32, then the stage (`stage` bytes an item, the items of one round)."""
    parts = rows * n_tuples * part_ld(power, d_tile)
    return 4 * ((rows * d + 3) // 4 * 4 + (parts + 3) // 4 * 4) + \
        min(256, rows * n_tuples) * stage


def gather_rows(d: int, power: int, d_tile: int, n_tuples: int, stage: int = 0,
                budget: int | None = None) -> int:
    """Rows per CTA of sympow_bwd_gather (0: a row's partials do not fit; use sympow_bwd): as
    many as fit in `budget` bytes (GATHER_SMEM) with the items (rows x tuples) filling whole
    rounds of 256 threads best."""
    budget = GATHER_SMEM if budget is None else budget
    fits = [r for r in range(1, 65) if gather_smem(d, power, d_tile, n_tuples, r, stage) <= budget]
    if not fits:
        return 0
    fill = lambda r: r * n_tuples / (-(-r * n_tuples // 256) * 256)  # noqa: E731
    return max(fits, key=lambda r: (round(fill(r), 2), r))


PIPE_SMEM = 110 << 10  # sympow_bwd_pipe's shared memory at most (2 CTAs per SM)
SMEM_PER_SM = 228 << 10


def pipe_rows(d: int, power: int, d_tile: int, n_tuples: int, stage: int) -> int:
    """Rows per block of sympow_bwd_pipe (0: not applicable): staged blocks (stage > 0) whose
    items (rows x tuples) fit one stage of 256, with two stages in PIPE_SMEM; the most rows of
    the best fill of 256 threads."""
    if not stage:
        return 0
    fits = [r for r in range(1, 65) if r * n_tuples <= 256 and
            gather_smem(d, power, d_tile, n_tuples, r, 2 * stage) <= PIPE_SMEM]
    if not fits:
        return 0
    return max(fits, key=lambda r: (round(r * n_tuples / 256, 2), r))


PIPE_CTAS = {4: 3, 2: 4}  # element size -> sympow_bwd_pipe's __launch_bounds__ CTAs per SM


def pipe_grid(blocks: int, smem: int, device: torch.device, ctas: int = 8) -> int:
    """A persistent kernel's CTAs: as many as are resident at once (by shared memory, at most
    `ctas` of 256 threads per SM: what its registers allow), at most one per block."""
    per_sm = max(1, min(ctas, SMEM_PER_SM // (smem + 1024)))
    return max(1, min(blocks, per_sm * sm_count(device.index)))


def quarter_smem(dtype: torch.dtype, power: int, d_tile: int, vec: int, d: int,
                 n_tuples: int) -> int:
    """Shared memory of sympow_bwd_quarter (0: it does not apply): power 4, d_tile 4, 16-bit
    types, dz in 16-byte vectors; x's row and its partials in fp32, two stages of 64 items
    (each quarter padded by 16 bytes); within one CTA's limit."""
    es = torch.empty((), dtype=dtype).element_size()
    if (power, d_tile, es) != (4, 4, 2) or vec * es != 16:
        return 0
    smem = 4 * ((d + 3) // 4 * 4 + (n_tuples * part_ld(power, d_tile) + 3) // 4 * 4) + \
        2 * 64 * 4 * (64 * es + 16)
    return smem if smem <= SMEM_PER_CTA else 0


# Elementwise kernels: VEC is how many features one thread writes (forward) or loads at once
# (backward); 16 bytes at most. The problem fixes dtype, power and d_tile (module statics).
ELEMENTWISE = Space({"VEC": [1, 2, 4, 8]},
                    constraints=[require(lambda c, lim: c.VEC <= 8, "VEC over 8")],
                    heuristic=lambda problem, lim: {"VEC": problem["vec"]})

MMA = Space({"THREADS": [MMA_THREADS]}, heuristic=lambda problem, lim: {"THREADS": MMA_THREADS})

# sympow_mma on wgmma (sm90_sympow_mma.cuh): half/bfloat16 on sm_90a, and every 64-feature block
# of the expansion inside one tuple (d_tile ** power a multiple of 64: p=2 with d_tile 8 or 16,
# p=3 with 4 or 8, p=4 with 4); the rest, and float32, stay on the sm80 kernels.
WG_TILE = (128, 64)   # output rows (2 warpgroups x 64) x columns per CTA
WG_STAGES = 4
_WG_ARCH: dict[int, bool] = {}


def wgmma_supports(dtype: torch.dtype, power: int, d_tile: int) -> bool:
    """The problem is one sm90_sympow_mma.cuh implements (on any sm_90a device)."""
    return dtype in (torch.float16, torch.bfloat16) and power >= 2 and d_tile ** power % 64 == 0


def wgmma_applies(dtype: torch.dtype, power: int, d_tile: int, device: torch.device) -> bool:
    """wgmma_supports, and the device's target is sm_90a."""
    if not wgmma_supports(dtype, power, d_tile):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _WG_ARCH.get(index)
    if ok is None:
        arch = gpu_limits(index).arch
        ok = _WG_ARCH[index] = (arch.major, arch.suffix) == (9, "a")
    return ok


def wgmma_smem(kind: str, d: int) -> int:
    """Dynamic shared memory of a wgmma kernel (the carving in sm90_sympow_mma.cuh): 1 KiB of
    alignment slack, the stages of b's 64 x 64 tiles, then x's rows as fp32 (expand K) or the
    stages of a's d x 64 blocks (expand M; "m_tma": each stage 1 KiB aligned, then a full and
    an empty mbarrier a stage)."""
    base = 1024 + WG_STAGES * 64 * 64 * 2
    if kind in ("k", "k_tma"):  # ("k_tma": then a full and an empty mbarrier a stage)
        return base + WG_TILE[0] * ((d + 31) // 32 * 32 + 8) * 4 + 16 * WG_STAGES * (kind != "k")
    if kind == "m_tma":
        return base + WG_STAGES * (-(-d * 128 // 1024) * 1024 + 16)
    return base + WG_STAGES * d * 64 * 2


# The order CTAs are launched in (cta_tile in sympow_common.cuh): "tiles", one problem's tiles
# fastest (the CTAs resident at once share few problems' operands in L2), or "p", the problem
# index fastest (the sm80 kernels' order). The wgmma kernels take their config's (MMA90).
LAUNCH_ORDERS = ("tiles", "p")
MAX_GRID_X = (1 << 31) - 1
MAX_GRID_YZ = 65535


def launch_grid(P: int, tiles0: int, tiles1: int, order: str) -> tuple:
    """The grid of P problems of tiles0 x tiles1 tiles each in `order`: (P * tiles0 * tiles1,)
    for "tiles" (while it fits gridDim.x), else (P, tiles0, tiles1)."""
    if order not in LAUNCH_ORDERS:
        raise ArgumentError(f"launch order must be one of {LAUNCH_ORDERS}, got {order!r}")
    if order == "tiles" and P * tiles0 * tiles1 <= MAX_GRID_X:
        return (P * tiles0 * tiles1, 1, 1)
    if P > MAX_GRID_X or tiles0 > MAX_GRID_YZ or tiles1 > MAX_GRID_YZ:
        raise ArgumentError(f"sympow: {P} problems of {tiles0} x {tiles1} tiles is over the "
                            f"launch grid's limits; split the batch")
    return (P, tiles0, tiles1)


# sympow_mma_m_wg's warpgroups a CTA (expand M), by power: 2 (sympow_mma_m_wg, 128 features a
# CTA) or 3 (sympow_mma_m_wg3, 192 features: a third less L2 -> SM traffic per FLOP, 2 CTAs of
# 384 threads per SM at p 2, one at p > 2). Powers not listed take 2.
WG_STATE_WGS = {2: 3}
WG_STATE_VARIANTS = (2, 3)


def state_wgs(power: int, wgs: int | None = None) -> int:
    """Warpgroups a CTA of the expand-M wgmma kernel: wgs, else WG_STATE_WGS's."""
    wgs = WG_STATE_WGS.get(power, 2) if wgs is None else wgs
    if wgs not in WG_STATE_VARIANTS:
        raise ArgumentError(f"sympow_mma: warpgroups must be one of {WG_STATE_VARIANTS}, "
                            f"got {wgs!r}")
    return wgs


# The wgmma kernels' variants, a config's parameters so that PickBest times them (the
# heuristic's are those measured faster on the H100: docs/ops/power-attention.md):
#   ORDER  the CTAs' launch order (launch_grid)
#   TMA    the expand-K kernel's mainloop: b's k-blocks by TMA (sympow_mma_k_tma; D is a
#          multiple of 64, so every problem it serves can), else by cp.async (sympow_mma_k_wg)
#   DEFER  the query-side backward: mma_sympow_bwd_k_wg2 (factor 0's sums kept in registers over
#          runs of k-blocks), else mma_sympow_bwd_k_wg (each k-block's sums added into shared
#          memory)
MMA90 = Space({"THREADS": [MMA_THREADS], "ORDER": list(LAUNCH_ORDERS), "TMA": [True, False],
               "DEFER": [True, False]},
              heuristic=lambda problem, lim: {"THREADS": MMA_THREADS, "ORDER": "tiles",
                                              "TMA": True, "DEFER": True})


def state_tma(K: int, wgs: int) -> bool:
    """The expand-M kernel takes its TMA mainloop (sympow_mma_m_tma3, the faster one:
    docs/ops/power-attention.md) wherever it can: 3 warpgroups and K a multiple of 64 (b's
    5-d view steps 16 rows, and no k-block crosses into the next problem's rows)."""
    return wgs == 3 and K % 64 == 0


WG_BWD_STAGES = 2     # b's tiles in mma_sympow_bwd_k_wg (BW_STAGES there)
WG_BWD_MAX_N = 128    # a's (dY's) row length it keeps resident: 128 rows x n
SMEM_PER_CTA = 227 << 10


def wgmma_bwd_smem(d: int, lda: int) -> int:
    """Dynamic shared memory of mma_sympow_bwd_k_wg: 1 KiB of alignment slack, b's stages, a's
    128 rows (64-column tiles), then c's rows and dx's rows as fp32."""
    ldx = (d + 31) // 32 * 32 + 8
    return 1024 + WG_BWD_STAGES * 64 * 64 * 2 + -(-lda // 64) * 128 * 64 * 2 + 2 * 128 * ldx * 4


def wgmma_bwd_fits(d: int, lda: int) -> bool:
    """mma_sympow_bwd_k_wg takes the problem (beside wgmma_applies): dY's rows (lda elements,
    padded to 8) at most WG_BWD_MAX_N long, and its shared memory within one CTA's limit;
    the rest stays on the sm80 kernel."""
    return lda <= WG_BWD_MAX_N and wgmma_bwd_smem(d, lda) <= SMEM_PER_CTA


def vector_width(dtype: torch.dtype, block: int, *tensors: torch.Tensor) -> int:
    """The widest vector (elements, 16 bytes at most) that divides the t^p block and keeps every
    tensor's address aligned to the vector's size."""
    size, v = dtype.itemsize, vector(dtype)
    while v > 1 and (block % v or any(t.data_ptr() % (v * size) for t in tensors)):
        v //= 2
    return v
