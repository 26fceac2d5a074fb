"""The GEMM selection: which of the candidate configs, or torch's own matmul, runs a problem.

The choice is empirical, from a sweep measured on the H100 (vitrail.gemm.ops.sweep: 315 shapes,
every candidate and torch replayed from CUDA graphs side by side, operands from DRAM): each problem
takes the option with the least total slowdown over its ``NEIGHBOURS`` nearest measured shapes in
log2 (M, N, K, batch) of its size class (N and K multiples of 8, or not); one farther than ``FAR``
octaves from all of them runs torch's matmul where it may.

An unaligned problem (N or K not a multiple of 8), of a class with few measured shapes, takes
its kernel from the nearest shapes of either class (the kernels run on aligned copies: the class
changes torch's speed, not theirs). Torch runs it, where it may, when the unaligned shapes near
it say torch is faster, or when torch's time there (``torch_unaligned_s``: its kernels cannot use
TMA) is too short for the kernel to win back the host time of its aligned copies, which no plan
skips (``UNALIGNED_KERNEL_FROM``): docs/ops/gemm.md#unaligned-n-or-k. The table ships as
``selection_h100.json``; ``python -m vitrail.gemm.ops.sweep table SWEEP.json... >
selection_h100.json`` rebuilds it and ``... check SWEEP.json...`` reports the choice on the sweep's
held-out quarter when fitted on the rest.

Why neighbours and not an analytic model: a wave-quantization and roofline model (per config
a launch cost, a per-wave cost and a per-k-block cost; DRAM, per-SM and L2 bandwidth floors)
fitted on the same sweep chose slower configs on held-out shapes than the neighbours do,
because neighbouring configs differ by less than its error and by effects it does not model
(cluster multicast, stream-K's fixup): docs/ops/gemm.md#the-selection-neighbours-not-a-model.

``torch`` is an option only where torch's ops compute the kernel's result (configs.Kind.
torch_passes: 16-bit inputs, output in the same dtype, no scales). A fused epilogue adds passes
over D to torch's matmul (the activation, the clamp, C), so torch runs a fused kind only where
the table says its matmul beats the kernel by more than those passes take (``pass_s``, against
the ratios' scale ``best_s``): where cuBLAS is much the faster (few rows against a long K).
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

from vitrail.tune.space import Config

TORCH = "torch"
NEIGHBOURS = 3
FAR = 1.5  # octaves: a problem this far from every measured shape runs torch where it may
# torch's matmul on unaligned 16-bit operands, at about its best rates measured on the H200
TORCH_UNALIGNED_FLOPS, TORCH_UNALIGNED_BYTES = 130e12, 0.9e12
# s of torch's time below which it runs an unaligned problem: the host time the kernel's route
# adds there, eagerly (no plan skips its copies), measured: 0.2-0.3 ms where N is unaligned (the
# output through a padded buffer), tens of us where only K is (copies of A or B)
UNALIGNED_KERNEL_FROM = {"n": 250e-6, "k": 40e-6}
# a fused kind on torch's ops: each pass over D (an elementwise kernel) costs about a launch's
# gap in a stream, and D read and written at about the copy bandwidth
PASS_S, PASS_BYTES = 2e-6, 2.6e12
# the scale of the table's ratios: about the best rates and the least time of a GEMM
BEST_FLOPS, BEST_BYTES, BEST_FLOOR_S = 700e12, 3.0e12, 4e-6
TABLE = Path(__file__).with_name("selection_h100.json")
torch_allowed = True  # False: always a vitrail kernel (only inside testing.kernels_only)


def make_config(tile: str, cluster: str, schedule: str, scheduler: str,
                backend: str = "vitrail") -> Config:
    # the parameters in the space's order (configs.space), so equal configs hash alike
    return Config([("tile", tile), ("cluster", cluster), ("schedule", schedule),
                   ("scheduler", scheduler), ("backend", backend)])


# the configs the selection chooses among for 16-bit inputs (K tile 64)
CANDIDATES = [
    make_config("128x256x64", "2x1", "cooperative", "persistent"),
    make_config("128x256x64", "1x1", "cooperative", "persistent"),
    make_config("256x128x64", "1x2", "cooperative", "persistent"),
    make_config("128x128x64", "2x1", "cooperative", "persistent"),
    make_config("128x128x64", "1x1", "cooperative", "persistent"),
    make_config("128x128x64", "2x1", "pingpong", "persistent"),
    make_config("128x128x64", "1x1", "pingpong", "persistent"),
    make_config("128x128x64", "1x1", "cooperative", "stream_k"),
    make_config("128x128x64", "2x1", "cooperative", "stream_k"),
    make_config("128x256x64", "1x1", "cooperative", "stream_k"),
    make_config("128x64x64", "1x1", "cooperative", "persistent"),
    make_config("128x64x64", "1x1", "cooperative", "stream_k"),
    make_config("64x64x64", "1x1", "pingpong", "persistent"),
    make_config("64x128x64", "1x1", "pingpong", "persistent"),
    make_config("64x256x64", "1x1", "pingpong", "persistent"),
]
# torch's matmul as a config of the space: the other parameters at their first values
TORCH_CONFIG = make_config("128x256x64", "1x1", "cooperative", "persistent", TORCH)


def label(config: Config) -> str:
    """128x256x64 2x1 coop persistent; torch."""
    if config["backend"] == TORCH:
        return TORCH
    return (f"{config['tile']} {config['cluster']} {config['schedule'][:4]} "
            f"{config['scheduler']}")


BY_LABEL = {label(c): c for c in CANDIDATES + [TORCH_CONFIG]}


# -------------------------------------------------------------------------------- choosing
def _point(m: int, n: int, k: int, batch: int) -> tuple[float, ...]:
    """Where a problem lies in the table: log2 of its sizes (a batch is its own axis: tiles do
    not span batches, so 32 products of 128 x 128 are not one of 4096 x 128), and its size class
    far from the other: N or K not a multiple of 8 puts torch on kernels that do not use TMA
    (much slower: docs/ops/gemm.md#unaligned-n-or-k) and vitrail.ops on aligned copies."""
    odd = n % 8 or k % 8
    return (*(math.log2(max(1, x)) for x in (m, n, k, batch)), 64.0 if odd else 0.0)


@lru_cache(maxsize=1)
def table() -> list[tuple[tuple[float, ...], dict[str, float]]]:
    """The shipped sweep: (point, {option: time / the shape's best time})."""
    return table_rows(json.loads(TABLE.read_text()))


def choose(m: int, n: int, k: int, batch: int = 1, *, torch_ok: bool, passes: int = 0,
           rows=None) -> Config:
    """The config for an (M, N, K, batch) problem: the option with the least total log
    slowdown over the nearest measured shapes (torch among them when torch_ok). passes: those
    over D that torch's ops add to its matmul for the kind's epilogue (configs.Kind.torch_passes);
    torch runs a fused kind only where its matmul is faster than the kernel by more than they
    cost."""
    rows = table() if rows is None else rows
    chosen = _choose(m, n, k, batch, torch_ok, rows)
    if not passes or chosen != TORCH_CONFIG:
        return chosen
    p = _point(m, n, k, batch)
    near = [] if p[-1] else _nearest(p, rows, within=FAR ** 2)
    if not near:  # unaligned (the kernel's copies), or nothing measured near: as the matmul
        return TORCH_CONFIG
    kernel = _choose(m, n, k, batch, False, rows)
    ratio = {o: geomean(s.get(o, 1e3) for _, s in near) for o in (label(kernel), TORCH)}
    gain = (ratio[label(kernel)] - ratio[TORCH]) * best_s(m, n, k, batch)
    return TORCH_CONFIG if gain > passes * pass_s(m, n, batch) else kernel


def best_s(m: int, n: int, k: int, batch: int = 1) -> float:
    """About the best option's time on a 16-bit problem (the scale of the table's ratios):
    its FLOPs and bytes at the H100's best rates, or a short kernel's least time."""
    flops = 2.0 * m * n * k * batch
    moved = 2.0 * (m * k + k * n + m * n) * batch
    return max(flops / BEST_FLOPS, moved / BEST_BYTES, BEST_FLOOR_S)


def pass_s(m: int, n: int, batch: int = 1) -> float:
    """The time of one elementwise pass of torch's over a 16-bit D, in place."""
    return PASS_S + 4.0 * m * n * batch / PASS_BYTES


def _choose(m: int, n: int, k: int, batch: int, torch_ok: bool, rows) -> Config:
    """``choose`` for a kind whose result torch's matmul gives alone (no passes)."""
    p = _point(m, n, k, batch)
    options = [o for o in BY_LABEL if torch_ok or o != TORCH]
    if not p[-1]:
        near = _nearest(p, rows)
        if torch_ok and _distance(near[0][0], p) > FAR ** 2:  # nothing measured near it
            return TORCH_CONFIG
        return BY_LABEL[_least_slow(near, options)]
    near = _nearest(p[:-1] + (0.0,), [(r[:-1] + (0.0,), s) for r, s in rows])
    kernel = _least_slow(near, [o for o in options if o != TORCH])
    if torch_ok:
        if torch_unaligned_s(m, n, k, batch) < UNALIGNED_KERNEL_FROM["n" if n % 8 else "k"]:
            return TORCH_CONFIG
        near = _nearest(p, [row for row in rows if row[0][-1]], within=FAR ** 2)
        if near and _least_slow(near, [kernel, TORCH]) == TORCH:
            return TORCH_CONFIG
    return BY_LABEL[kernel]


def torch_unaligned_s(m: int, n: int, k: int, batch: int = 1) -> float:
    """A floor of torch's matmul's time on an unaligned 16-bit problem: its FLOPs and bytes
    at the rates TORCH_UNALIGNED_* (its measured best there)."""
    flops = 2.0 * m * n * k * batch
    moved = 2.0 * (m * k + k * n + m * n) * batch
    return max(flops / TORCH_UNALIGNED_FLOPS, moved / TORCH_UNALIGNED_BYTES)


def _distance(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return sum((x - y) ** 2 for x, y in zip(a, b))


def _nearest(p: tuple[float, ...], rows, within: float = math.inf) -> list:
    """The NEIGHBOURS rows nearest to p, but those farther than `within` (squared)."""
    ranked = sorted((_distance(r[0], p), i) for i, r in enumerate(rows))[:NEIGHBOURS]
    return [rows[i] for d, i in ranked if d <= within]


def _least_slow(near: list, options: list[str]) -> str:
    """The option of least total log slowdown over the rows (ties: the first by name)."""
    score = {o: sum(math.log(slowdown.get(o, 1e3)) for _, slowdown in near) for o in options}
    return min(score, key=lambda o: (score[o], o))


# ------------------------------------------------------------ the table, from sweep records
def _times(record: dict) -> dict[str, float]:
    times = {k: v for k, v in record["configs"].items() if v}
    times[TORCH] = record["torch"]
    return times


def make_table(records: list[dict]) -> dict:
    options = list(BY_LABEL)
    shapes = []
    for r in records:
        times = _times(r)
        best = min(times.values())
        shapes.append([r["M"], r["N"], r["K"], r["L"]]
                      + [round(times[o] / best, 3) if o in times else None for o in options])
    return {"about": "vitrail.gemm.ops.model: per measured shape (M, N, K, batch), each option's "
                     "time over the best option's (bf16, CUDA-graph replay, H100 SXM); null: "
                     "the option cannot run the shape", "options": options, "shapes": shapes}


def check(records: list[dict]) -> str:
    """The choice on the held-out records, from a table of the others: its slowdown against
    the best option, and torch's time over the chosen option's."""
    rows = table_rows(make_table([r for r in records if not r["held_out"]]))
    lines = []
    for torch_ok in (True, False):
        regret, speedup = [], []
        for r in (r for r in records if r["held_out"]):
            times = _times(r)
            if not torch_ok:
                times.pop(TORCH)
            chosen = label(choose(r["M"], r["N"], r["K"], r["L"], torch_ok=torch_ok, rows=rows))
            regret.append(times[chosen] / min(times.values()))
            speedup.append(r["torch"] / times[chosen])
        option = "an option" if torch_ok else "not an option"
        lines.append(f"held out, {len(regret)} shapes, torch {option}: "
                     f"slowdown against the best option geomean {geomean(regret):.3f}, max "
                     f"{max(regret):.2f}; torch time / chosen geomean {geomean(speedup):.3f}, min "
                     f"{min(speedup):.3f}, {sum(s < 0.97 for s in speedup)} below 0.97")
    return "\n".join(lines)


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def table_rows(data: dict) -> list[tuple[tuple[float, ...], dict[str, float]]]:
    options = data["options"]
    return [(_point(*row[:4]), {o: v for o, v in zip(options, row[4:]) if v is not None})
            for row in data["shapes"]]
