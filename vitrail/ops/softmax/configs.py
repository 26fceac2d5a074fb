"""Configs of the softmax kernels: the space PickBest searches and the heuristic's choice.

A row of n elements is held by TPR threads x CLUSTER CTAs, ITERS vectors of V elements each
(V = 16 bytes / element size; 1 where rows are read element by element: rows off vector
boundaries that the windowed kernels do not take, ``use_window``). n is the row's window (n, or
n + V - 1 where rows may start off a vector boundary). The heuristic picks the fewest threads
that keep ITERS at its target (8 vectors per thread forward, 4 per array backward: enough loads
in flight without spilling), then clusters when one CTA of 512 threads is not enough (backward:
2 vectors per array then, so that two CTAs of 512 threads fit an SM's registers and one loads
while the other reduces or stores). Rows of at most 512 bytes (fp32 128) take CTAs of 128
threads and 4 vectors per thread: fp32 65536x128 forward then runs 4096 CTAs of 32 registers per
thread, 16 per SM (2048 threads x 64 bytes = 128 KB in flight, 1.9 waves), where CTAs of 256
threads x 8 vectors (48 registers) gave 1024 CTAs, 5 per SM: 1.55 waves, the second half
empty.

Rows that need a cluster in the forward (one CTA per SM: nothing overlaps its load, reduce and
store), and rows beyond the largest config, take the tile path where it fits and they are enough
(``use_tile``): each row over a cluster of CTAs that hold their slices in shared memory, several
CTAs per SM. Of those, the ones it would give clusters of 4 or more in problems of 16 MB or more
take the split path instead where its plan holds every slice on chip (``split_over_tile``). Of
the rest, rows beyond the largest config, and rows so few that the register path's clusters
would not give every SM two CTAs (rows x CLUSTER < 2 x SMs; a clustered forward CTA takes a
whole SM, so fewer means one wave or less of CTAs that load, reduce, then store with nothing to
overlap), leave the register path (``use_chunked``). Of those, few rows take the split path
(``use_split``): at most as many rows as SMs, so that every row gets G >= 2 of the 2-4 CTAs per
SM that are resident at once. One cooperative kernel of rows x G CTAs, all resident at
once; G = the CTAs the occupancy API says fit (ctas_per_sm x SMs) divided by rows, each CTA a slice
of about n / G elements (``split_plan``), which it reads once: THREADS x ITERS vectors per array
into registers, what is beyond into shared memory (up to the SM's shared memory shared among its
CTAs), and what is beyond that is read again after the barrier (from L2 where it is still there).
The CTAs of a row publish their statistics to a global workspace, meet at a per-row barrier, and
write. The rest (more rows) take the chunked path: each row cut into chunks, one CTA per chunk,
about CHUNK_CTAS_PER_SM CTAs per SM in all; one more read of the input, which the second kernel
takes in reverse order so that what the first read last is still in L2.

Before all of these, short rows laid end to end (a contiguous tensor's, up to 1 KiB) take the
packed path where ``use_packed`` says so (sm_90+): a CTA a run of rows, TPR lanes x ITEMS
elements a row, runs of KB KiB (``packed_heuristic``, ``packed_run``).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from vitrail.device import target_limits, vector, with_sm_count
from vitrail.tune import Space, bucket, max_threads, require
from vitrail.tune.space import Config

MAX_TPR, MAX_CLUSTER = 512, 8
# The tile and split paths' problem keys hold rows and row lengths to a quarter octave
# (vitrail.tune.bucket(x, KEY_STEPS): ..., 96, 112, 128, 160, ...): their choices turn on rows
# against the SM count and on slice bytes, which powers of two blur (150 rows as 256: the
# clusters of 256 rows). The register and chunked paths keep powers of two.
KEY_STEPS = 4
SHORT_ROW_BYTES = 512  # rows of at most this (aligned): CTAs of 128 threads, 4 vectors per thread
CHUNK_CTAS_PER_SM = 4
CLUSTER_CTAS_PER_SM = 2  # fewer clustered CTAs than this per SM: the chunked path instead


# Rows that start off a 16-byte boundary (odd n in 16-bit types, a view at an offset) take the
# windowed kernels (16-byte vectors over the aligned window holding each row, sm90_softmax.cuh)
# where the element-by-element ones (v = 1) are slow: rows of 16-bit elements of WINDOW_MIN_BYTES
# and more (2-byte loads), fp32 rows of WINDOW_MIN_BYTES_F32 and more; below, v = 1 keeps up
# (measured: docs/ops/softmax.md#windowed-rows).
WINDOW_MIN_BYTES = 2 << 10
WINDOW_MIN_BYTES_F32 = 32 << 10


def use_window(n: int, size: int) -> bool:
    """Whether rows of n elements of `size` bytes that start off a vector boundary take the
    windowed kernels (else element by element)."""
    return n * size >= (WINDOW_MIN_BYTES if size < 4 else WINDOW_MIN_BYTES_F32)


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def registers(c, v: int, arrays: int) -> int:
    """Estimated registers per thread: the row's fragments plus working registers."""
    return c.ITERS * (4 if v > 1 else 1) * arrays + 40


def space(v: int, arrays: int) -> Space:
    return Space(
        {"TPR": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], "THREADS": [128, 256, 512],
         "ITERS": [1, 2, 4, 8, 16], "CLUSTER": [1, 2, 4, 8]},
        constraints=[
            max_threads(lambda c: c.THREADS),
            require(lambda c, lim: c.THREADS >= c.TPR, "THREADS={THREADS} < TPR={TPR}"),
            require(lambda c, lim: c.CLUSTER == 1 or (c.TPR == c.THREADS and c.TPR >= 128),
                    "a cluster (CLUSTER={CLUSTER}) takes one row per CTA of >= 128 threads"),
            require(lambda c, lim: c.CLUSTER <= lim.max_cluster_size,
                    "CLUSTER={CLUSTER} > the target's cluster limit"),
            require(lambda c, lim: registers(c, v, arrays) <= 255 and
                    registers(c, v, arrays) * c.THREADS <= lim.registers_per_sm,
                    "ITERS={ITERS} x THREADS={THREADS}: too many registers"),
        ],
        heuristic=lambda problem, lim: heuristic(problem, v, arrays, lim))


def heuristic(n: int | None, v: int, arrays: int, lim=None) -> dict:
    """The config for rows of n elements (n a power of two: the problem key's bucket)."""
    n = n or 4096
    vectors = math.ceil(n / v)
    short = v > 1 and n * (16 // v) <= SHORT_ROW_BYTES
    target = ((4 if short else 8) if arrays == 1 else 4) if v > 1 else 16
    tpr = 1
    while tpr < MAX_TPR and math.ceil(vectors / tpr) > target:
        tpr *= 2
    iters, cluster = _pow2(math.ceil(vectors / tpr)), 1
    if iters > target:
        if arrays == 2 and v > 1:
            target = 2
        cluster = min(MAX_CLUSTER, _pow2(math.ceil(vectors / (MAX_TPR * target))))
        iters = min(_max_iters(v, arrays), _pow2(math.ceil(vectors / (MAX_TPR * cluster))))
    return {"TPR": tpr, "THREADS": max(tpr, 128 if short else 256), "ITERS": iters,
            "CLUSTER": cluster}


def capacity(config, v: int) -> int:
    return config.TPR * config.ITERS * v * config.CLUSTER


def _max_iters(v: int, arrays: int) -> int:
    """The most vectors per thread and array that ptxas holds without spilling at 512 threads."""
    return 16 if v == 1 else (8 if arrays == 1 else 4)


def max_register_row(v: int, arrays: int) -> int:
    """The longest row the register path takes; longer rows go chunked."""
    return MAX_TPR * _max_iters(v, arrays) * v * MAX_CLUSTER


@functools.lru_cache(maxsize=4096)
def use_chunked(n: int, rows: int, v: int, arrays: int, sms: int) -> bool:
    """Whether rows x n goes to the chunked path: longer rows than any config holds, or a
    register path of clusters that would not give every SM two CTAs."""
    if n > max_register_row(v, arrays):
        return True
    cluster = heuristic(bucket(n), v, arrays)["CLUSTER"]
    return cluster > 1 and rows * cluster < CLUSTER_CTAS_PER_SM * sms


# ------------------------------------------------------------------ packed path (short rows)
# Rows of at most PACKED_MAX_BYTES that lie end to end (row stride n: a contiguous tensor's rows)
# take the packed path (sm90_softmax.cuh, packed_kernel): a CTA moves a run of rows with 16-byte
# vectors and TMA bulk copies, lanes reduce the rows from shared memory.
PACKED_MAX_BYTES = 1 << 10
PACKED_MAX_ROW = 1024  # elements: 32 lanes x 32 items, a row within a warp
PACKED_MIN_BYTES = 32  # rows on vector boundaries: shorter ones stay in registers
PACKED_MAX_ALIGNED_BWD_BYTES = 256  # ... and longer ones backward
PACKED_CTAS_PER_SM = 4  # runs are cut shorter where the rows would not give every SM this many


def use_packed(n: int, size: int, v: int, arrays: int) -> bool:
    """Whether rows of n elements of `size` bytes that lie end to end take the packed path; v:
    the register path's vector width (1: element by element, rows off vector boundaries). Rows
    off vector boundaries always; rows on them (whole 16-byte vectors a thread in registers)
    from PACKED_MIN_BYTES, and backward to PACKED_MAX_ALIGNED_BWD_BYTES: where packed beat the
    register path (docs/ops/softmax.md#the-packed-path)."""
    row = n * size
    if n > PACKED_MAX_ROW or row > PACKED_MAX_BYTES:
        return False
    if v == 1:
        return True
    return row >= PACKED_MIN_BYTES and (arrays == 1 or row <= PACKED_MAX_ALIGNED_BWD_BYTES)


def packed_space(arrays: int) -> Space:
    return Space(
        {"THREADS": [128, 256, 512], "TPR": [1, 2, 4, 8, 16, 32], "ITEMS": [1, 2, 4, 8, 16, 32],
         "KB": [4, 8, 16, 32]},
        constraints=[
            max_threads(lambda c: c.THREADS),
            require(lambda c, lim: c.KB * 1024 * arrays + 64 <= lim.max_shared_per_block,
                    "runs of KB={KB} per array do not fit a CTA's shared memory"),
        ],
        heuristic=lambda problem, lim: packed_heuristic(problem))


def packed_heuristic(n: int | None) -> dict:
    """The config for rows of n elements (the key's power of two): TPR lanes a row, the fewest
    that leave each at most 4 elements (rows of up to 32) or 8 (longer rows: fewer shuffles);
    CTAs of 256 threads, 128 where a lane holds 16 or more. TPR > 1 for rows of 8 or more keeps
    the lanes of a warp on neighbouring elements of few rows in shared memory (a lane a row of
    32 fp32 elements would meet 32-way bank conflicts); 128 threads where a lane holds 16
    (more CTAs, more bytes in flight per SM). Measured: docs/ops/softmax.md#packed-configs."""
    n = n or 8
    target = 4 if n <= 32 else 8
    tpr = 1
    while tpr < 32 and math.ceil(n / tpr) > target:
        tpr *= 2
    items = _pow2(math.ceil(n / tpr))
    return {"THREADS": 128 if items >= 16 else 256, "TPR": tpr, "ITEMS": items, "KB": 16}


def packed_run(n: int, rows: int, size: int, config, sms: int) -> int:
    """Rows per CTA: as many as KB KiB hold, fewer where the rows would not give every SM
    PACKED_CTAS_PER_SM CTAs, but no fewer than a CTA's groups of TPR lanes take in one pass
    (shorter runs were slower: docs/ops/softmax.md#packed-runs)."""
    return _packed_run(n, rows, size, config.KB, config.THREADS // config.TPR, sms)


@functools.lru_cache(maxsize=4096)
def _packed_run(n: int, rows: int, size: int, kb: int, groups: int, sms: int) -> int:
    fit = max(1, kb * 1024 // (n * size))
    return max(1, min(fit, max(groups, math.ceil(rows / (sms * PACKED_CTAS_PER_SM)))))


CHUNKED = Space({"THREADS": [128, 256, 512], "U": [2, 4, 8]},
                constraints=[max_threads(lambda c: c.THREADS)],
                heuristic=lambda problem, lim: {"THREADS": 256, "U": 4})


def chunk_length(n: int, rows: int, v: int, config, sms: int,
                 ctas_per_sm: int = CHUNK_CTAS_PER_SM) -> int:
    """Elements per chunk: a multiple of one step (THREADS x U vectors), cut so that rows x
    chunks is about ctas_per_sm CTAs per SM (more where rows alone give that many). At 256
    threads x U=4 a step is 16 KB, all of it in flight: 4 CTAs per SM keep 64 KB in flight."""
    step = config.THREADS * config.U * v
    chunks = max(1, math.ceil(sms * ctas_per_sm / rows))
    return max(step, math.ceil(math.ceil(n / chunks) / step) * step)


# ------------------------------------------------------------------ split path
def split_space(v: int, arrays: int, window: bool = False) -> Space:
    return Space(
        {"THREADS": [128, 256, 512, 1024], "ITERS": [1, 2, 4, 8, 16], "U": [1, 2, 4],
         "CTAS": [1, 2, 3, 4]},
        constraints=[
            max_threads(lambda c: c.THREADS),
            require(lambda c, lim: split_registers(c, v, arrays) <= 255 and
                    split_registers(c, v, arrays) * c.THREADS * c.CTAS <= lim.registers_per_sm,
                    "ITERS={ITERS}, U={U} x THREADS={THREADS} x CTAS={CTAS}: too many registers"),
        ],
        heuristic=lambda problem, lim: split_heuristic(v, arrays, problem, lim, window))


def split_registers(c, v: int, arrays: int) -> int:
    """Estimated registers per thread: the held fragments, one step's, and working registers."""
    words = 4 if v > 1 else 1
    return (c.ITERS + c.U) * words * arrays + 24


def split_heuristic(v: int, arrays: int, problem=None, lim=None, window: bool = False) -> dict:
    """problem: (n, rows) as the key buckets them, or None. 64 registers per thread (ptxas, sm_90a,
    no spills): forward 8 fp32 vectors per thread, 4 of 16-bit types (8 spill: their fp32 copies),
    16 elements where v is 1; backward 4 vectors (8 elements) per array.
    Forward: CTAs of 256 threads, four per SM. Backward: CTAs of 512 threads, two per SM, where
    that plan holds the slices on chip with 4 or more CTAs a row; else 256 x 4 where that holds
    them. Each the faster where measured: docs/ops/softmax.md#split-path-configs.
    window: the windowed kernels (rows off vector boundaries); their 16-bit backward holds 2
    vectors per array in registers (at 4, ptxas spilled 28-44 bytes under the 64-register
    bound), the rest of the slice in shared memory."""
    iters = (16 if arrays == 1 else 8) if v == 1 else (8 if v == 4 else 4) if arrays == 1 else 4
    if window and arrays == 2 and v == 8:
        iters = 2
    u = 4 if v == 1 else (2 if arrays == 1 else 1)
    wide = {"THREADS": 512, "ITERS": iters, "U": u, "CTAS": 2}
    narrow = dict(wide, THREADS=256, CTAS=4)
    if arrays == 1 or problem is None or v == 1:
        return narrow if arrays == 1 else wide
    n, rows = problem
    lim = with_sm_count(lim or target_limits("90a"))  # none given: sm_90a's
    sms = lim.sm_count
    if not split_fits(n, rows, v, Config(wide), sms, lim, arrays, 4) and split_fits(
            n, rows, v, Config(narrow), sms, lim, arrays):
        return narrow
    return wide


def split_fits(n: int, rows: int, v: int, config, sms: int, lim, arrays: int,
               min_groups: int = 2) -> bool:
    """Whether config's split plan for rows x n (16-byte vectors: v > 1) gives every row
    min_groups CTAs or more and holds every slice on chip (registers, then shared memory:
    nothing read twice)."""
    groups, slice_, smem_vecs = split_plan(n, rows, v, config, config.CTAS * sms,
                                           split_smem_budget(config, lim), arrays)
    return groups >= min_groups and slice_ <= (config.THREADS * config.ITERS + smem_vecs) * v


@functools.lru_cache(maxsize=4096)
def use_split(n: int, rows: int, v: int, arrays: int, sms: int) -> bool:
    """Whether rows x n goes to the split path when the tile path does not take it: it leaves
    the register path (use_chunked) and there are at most as many rows as SMs (every row gets at
    least two of the 2-4 CTAs per SM that are resident at once)."""
    return use_chunked(n, rows, v, arrays, sms) and rows <= sms


# Rows that the tile path takes in clusters of 4 or more CTAs go to the split path instead where
# its plan holds every slice on chip with 2 or more CTAs a row, in problems of at least
# SPLIT_OVER_TILE_BYTES of input: one wave of CTAs that meet at a barrier in global memory, where
# the tile path's cluster barriers and its wave tail cost more; in smaller problems the
# barrier's latency weighs more (measured: docs/ops/softmax.md#split-over-tile).
SPLIT_OVER_TILE_BYTES = 16 << 20


@functools.lru_cache(maxsize=4096)
def split_over_tile(n: int, rows: int, v: int, size: int, arrays: int, lim) -> bool:
    """Whether rows x n, which the tile path takes (use_tile), goes to the split path instead
    (lim: with its SM count, ``vitrail.device.with_sm_count``)."""
    sms = lim.sm_count
    problem = (bucket(n, KEY_STEPS), bucket(rows, KEY_STEPS))
    c = tile_cluster(*problem, size, arrays, sms, lim.shared_per_sm)
    if c is None or c < 4 or rows * n * size * arrays < SPLIT_OVER_TILE_BYTES:
        return False
    config = Config(split_heuristic(v, arrays, problem, lim))  # the op's, from its key
    return split_fits(n, rows, v, config, sms, lim, arrays)


def split_smem_budget(config, lim) -> int:
    """Dynamic shared memory bytes per CTA: the SM's shared memory shared among its CTAS CTAs,
    less 1 KiB each that the driver reserves and the static scratch, in whole KiB."""
    per_cta = lim.shared_per_sm // config.CTAS - 2048
    return max(0, min(per_cta, lim.max_shared_per_block - 1024)) // 1024 * 1024


def split_plan(n: int, rows: int, v: int, config, resident: int, smem_budget: int,
               arrays: int, vec_bytes: int = 16) -> tuple[int, int, int]:
    """(groups, slice, smem_vecs) for rows x n on `resident` CTAs at once: groups = CTAs per
    row (at most resident // rows, and no more than give every thread one vector), slice =
    elements per CTA (a multiple of v; the last CTA of a row takes the remainder), smem_vecs =
    vectors per array beyond the registers' share that shared memory keeps (the rest is read
    twice)."""
    groups = max(1, min(resident // rows, math.ceil(n / (config.THREADS * v))))
    slice_ = math.ceil(math.ceil(n / groups) / v) * v
    groups = math.ceil(n / slice_)
    rest = max(0, slice_ - config.THREADS * config.ITERS * v)
    smem_vecs = min(math.ceil(rest / v), smem_budget // vec_bytes // arrays)
    return groups, slice_, smem_vecs


# ------------------------------------------------------------------ tile path
# Rows of TILE_MIN_ROW_BYTES and more (per array) take the tile path where rows x CTAs fill the
# GPU, where a sweep found it faster than the register path (docs/ops/softmax.md#the-tile-path).
TILE_MIN_ROW_BYTES = 8 << 10  # shorter rows (per array) stay in registers
TILE_BYTES = 64 << 10  # the most a CTA's slice (all arrays) holds, below MAX_CLUSTER CTAs a row
MAX_TILE_BYTES = 192 << 10  # the most it holds at MAX_CLUSTER CTAs (then one CTA per SM)
MIN_TILE_BYTES = 16 << 10  # no smaller slices to spread rows over more CTAs
TILE_WIDE_BYTES = 48 << 10  # slices of this and more take CTAs of 256 threads, smaller 128
TILE_CTAS_PER_SM = 7  # CTAs the heuristic aims at (rows x CLUSTER), per SM: ~1000 on 132 SMs
TILE_MIN_CTAS_PER_SM = 1.5  # fewer rows x CLUSTER per SM: the split path spreads them wider


def tile_space(arrays: int) -> Space:
    return Space(
        {"THREADS": [128, 256, 512], "CLUSTER": [1, 2, 4, 8]},
        constraints=[
            max_threads(lambda c: c.THREADS),
            require(lambda c, lim: c.CLUSTER <= lim.max_cluster_size,
                    "CLUSTER={CLUSTER} > the target's cluster limit"),
        ],
        heuristic=lambda problem, lim: tile_heuristic(problem, arrays, lim))


def tile_cluster(n: int, rows: int, size: int, arrays: int, sms: int,
                 smem_per_sm: int = 228 << 10) -> int | None:
    """CTAs per row on the tile path (None: a row does not fit MAX_CLUSTER CTAs' shared memory).
    One where the rows alone spread evenly over the SMs in one wave (``one_cta_a_row``); else
    the fewest that keep a slice within TILE_BYTES, then more, while slices stay at least
    MIN_TILE_BYTES, until rows x CTAs reach TILE_CTAS_PER_SM per SM. A cluster costs its
    barriers and smaller slices, so it only pays where rows alone leave the SMs short of CTAs
    (measured: docs/ops/softmax.md#tile-clusters)."""
    row_bytes = n * size * arrays
    if one_cta_a_row(rows, row_bytes, sms, smem_per_sm):
        return 1
    c = 1
    while c < MAX_CLUSTER and row_bytes > c * TILE_BYTES:
        c *= 2
    if row_bytes > c * MAX_TILE_BYTES:
        return None
    while (c < MAX_CLUSTER and rows * c < TILE_CTAS_PER_SM * sms
           and row_bytes >= 2 * c * MIN_TILE_BYTES):
        c *= 2
    return c


def one_cta_a_row(rows: int, row_bytes: int, sms: int, smem_per_sm: int) -> bool:
    """Whether the tile path takes one CTA a row, with no cluster: a row (all arrays) fits
    MAX_TILE_BYTES, the rows fill 90% of the SMs or more and are all resident at once, and the
    busiest SM holds at most 4/3 of the average. No cluster barrier then, and slices of up to
    MAX_TILE_BYTES at one or two CTAs per SM still keep enough bytes in flight. Fewer rows, or
    rows beyond one wave, or uneven ones keep clusters (measured:
    docs/ops/softmax.md#one-cta-a-row)."""
    if row_bytes > MAX_TILE_BYTES or rows < 0.9 * sms:
        return False
    busiest = -(-rows // sms)
    return busiest <= smem_per_sm // (row_bytes + 1024) and rows >= 0.75 * busiest * sms


def tile_heuristic(problem, arrays: int, lim=None) -> dict:
    """problem: (n, rows, element size) as the key buckets them. CTAs of 256 threads for slices
    of TILE_WIDE_BYTES and more, 128 below (docs/ops/softmax.md#tile-cta-size)."""
    n, rows, size = problem or (65536, 256, 2)
    lim = with_sm_count(lim or target_limits("90a"))  # none given: sm_90a's
    sms = lim.sm_count
    c = tile_cluster(n, rows, size, arrays, sms, lim.shared_per_sm) or MAX_CLUSTER
    return {"THREADS": 256 if n * size * arrays // c >= TILE_WIDE_BYTES else 128, "CLUSTER": c}


@functools.lru_cache(maxsize=4096)
def use_tile(n: int, rows: int, v: int, size: int, arrays: int, sms: int,
             smem_per_sm: int = 228 << 10) -> bool:
    """Whether rows x n goes to the tile path: 16-byte vectors; rows of at least
    TILE_MIN_ROW_BYTES that fit MAX_CLUSTER CTAs' shared memory; and at least
    TILE_MIN_CTAS_PER_SM CTAs per SM (below, split wins:
    docs/ops/softmax.md#tile-against-split); or one CTA a row (``one_cta_a_row``). Of those,
    ``split_over_tile`` sends some to the split path."""
    if v == 1 or n * size < TILE_MIN_ROW_BYTES:
        return False
    n, rows = bucket(n, KEY_STEPS), bucket(rows, KEY_STEPS)
    c = tile_cluster(n, rows, size, arrays, sms, smem_per_sm)
    return c is not None and (rows * c >= TILE_MIN_CTAS_PER_SM * sms
                              or one_cta_a_row(rows, n * size * arrays, sms, smem_per_sm))


def tile_slice(n: int, v: int, cluster: int) -> int:
    """Elements per CTA: n over the cluster, a multiple of v."""
    return math.ceil(math.ceil(n / cluster) / v) * v


# ------------------------------------------------------------------------------------ routing
class Rows(NamedTuple):
    """What a call asks of the family: rows x n of dtype (n: the columns of the rows' windows, n
    or n + v - 1 where rows may start off a vector boundary), kind "fwd" (y of x) or "bwd" (dx of
    y, dy), log_softmax or softmax; v: the vector width (16 bytes / element size, or 1: element
    by element); window: rows may start off a vector boundary (the windowed kernels); packed: the
    rows lie end to end in coaligned arrays (not windowed), so short ones may take the packed
    path whatever v is."""
    kind: str
    rows: int
    n: int
    dtype: torch.dtype
    v: int
    log: bool
    window: bool = False
    packed: bool = False

    @property
    def arrays(self) -> int:
        """Arrays a row reads: x forward, y and dy backward."""
        return 1 if self.kind == "fwd" else 2


class Variant(NamedTuple):
    """One instantiation of the kernel source, an Op of the family (its name, its compile and
    tuning key): the path (registers, chunked, packed, tile, split), kind, dtype, vector width,
    log, window (the windowed kernels: rows off a vector boundary; a separate instantiation so
    that the others keep their registers: sm90_softmax.cuh, load_row)."""
    path: str
    kind: str
    dtype: torch.dtype
    v: int
    log: bool
    window: bool = False

    @property
    def arrays(self) -> int:
        """Arrays a row reads: x forward, y and dy backward."""
        return 1 if self.kind == "fwd" else 2

    @property
    def name(self) -> str:
        """softmax.fwd.bfloat16.v8, log_softmax.bwd_split.float32.v4w, ..."""
        path = "" if self.path == "registers" else f"_{self.path}"
        return (f"{'log_softmax' if self.log else 'softmax'}.{self.kind}{path}."
                f"{str(self.dtype).removeprefix('torch.')}.v{self.v}{'w' if self.window else ''}")


def variants(dtypes) -> list[Variant]:
    """Every variant of the family for dtypes: each vector width (16 bytes, windowed, element by
    element) and path that takes it (packed: 16-byte vectors, never windowed; tile: vectors)."""
    out = []
    for dtype in dtypes:
        for v, window in ((vector(dtype), False), (vector(dtype), True), (1, False)):
            for log in (False, True):
                for kind in ("fwd", "bwd"):
                    for path in PATH_NAMES:
                        if (path != "packed" or (v > 1 and not window)) and (
                                path != "tile" or v > 1):
                            out.append(Variant(path, kind, dtype, v, log, window))
    return out


class Recipe(NamedTuple):
    """A route's answer: the variant that runs the rows, and the problem key and problem its
    heuristic and tuner take."""
    variant: Variant
    key: str
    problem: object


def _tiles(p: Rows, lim) -> bool:
    return lim.arch.major >= 9 and use_tile(p.n, p.rows, p.v, p.dtype.itemsize, p.arrays,
                                            lim.sm_count, lim.shared_per_sm)


# The paths, in the order they are tried: the first whose test holds runs the rows (the module's
# docstring says why each test is what it is); the registers take the rest.
PATHS = (
    ("packed", lambda p, lim: p.packed and lim.arch.major >= 9
        and use_packed(p.n, p.dtype.itemsize, p.v, p.arrays)),
    ("split", lambda p, lim: _tiles(p, lim)
        and split_over_tile(p.n, p.rows, p.v, p.dtype.itemsize, p.arrays, lim)),
    ("tile", _tiles),
    ("split", lambda p, lim: use_split(p.n, p.rows, p.v, p.arrays, lim.sm_count)),
    ("chunked", lambda p, lim: use_chunked(p.n, p.rows, p.v, p.arrays, lim.sm_count)),
    ("registers", lambda p, lim: True),
)
PATH_NAMES = ("registers", "chunked", "packed", "tile", "split")


def route(p: Rows, lim) -> Recipe:
    """The variant that runs rows p on lim's GPU, and its problem key and problem."""
    path = next(name for name, holds in PATHS if holds(p, lim))
    if path == "packed":  # 16-byte vectors whatever p.v: the rows lie end to end
        variant = Variant(path, p.kind, p.dtype, vector(p.dtype), p.log)
    else:
        variant = Variant(path, p.kind, p.dtype, p.v, p.log, p.window)
    return Recipe(variant, *problem_of(path, p.rows, p.n, p.dtype.itemsize))


def problem_of(path: str, rows: int, n: int, size: int) -> tuple[str, object]:
    """(problem key, problem) of rows x n (the windows' columns) of size-byte elements on a
    path: what its heuristic and tuner take."""
    if path in ("tile", "split"):
        fine = (bucket(n, KEY_STEPS), bucket(rows, KEY_STEPS))
        return f"n{fine[0]};rows{fine[1]}", (*fine, size) if path == "tile" else fine
    key = f"n{bucket(n)};rows{bucket(rows)}"  # registers, chunked, packed
    return key, n if path == "chunked" else bucket(n)
