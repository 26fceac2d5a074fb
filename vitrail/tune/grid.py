"""The shipped tuning grid: the problems ``vitrail tune grid`` tunes on a GPU (PickBest, into a
store of its own) and writes to ``vitrail/shipped/tuning.json``, the read-only layer every
lookup searches after the user's own store and the shared caches (vitrail.jit.shared.layers).

A record applies to the problems of its key (the shape's buckets, dtypes, alignment: see
vitrail.tune.problem_key) on the GPU model it was measured on, for the kernel source and the
vitrail version it was tuned with; any other problem takes its family's heuristic, as before.
GEMM is not in the grid: its selection is the measured table ``selection_h100.json``
(vitrail.gemm.ops.model), fitted on a sweep of its own, and a PickBest of its CUTLASS configs
builds each candidate for about a minute.

Writing the file keeps the records of other GPUs that still apply (same op, kernel source and
vitrail version) and drops the stale ones (``merge``): tune the grid once per GPU model and
release, then commit the file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from vitrail.tune.space import Config
from vitrail.tune.store import Record, RecordKey

SOFTMAX_SHAPES = ("32768x256", "8192x1024", "4096x4096", "1024x16384", "256x65536",
                  "64x262144", "16x1048576")
FLOAT_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class GridProblem:
    """One ``vitrail tune FAMILY --shape SHAPE --dtype DTYPE [--backward]``."""
    family: str
    shape: str
    dtype: str
    backward: bool = False

    @property
    def label(self) -> str:
        return (f"{self.family}{' backward' if self.backward else ''} {self.shape} "
                f"{self.dtype}")


def _softmax() -> list[GridProblem]:
    """Rows x columns from many short rows to a few of a million, forward and backward."""
    return [GridProblem(f, s, d, b) for f in ("softmax", "log_softmax") for b in (False, True)
            for d in FLOAT_DTYPES for s in SOFTMAX_SHAPES]


def _copy() -> list[GridProblem]:
    """Flat copies and conversions, transposes (square, wide, tall) and row slices."""
    flat = [GridProblem("copy", s, d) for s in ("1048576", "16777216", "268435456")
            for d in ("bfloat16", "float32", "bfloat16:float32", "float32:bfloat16")]
    transpose = [GridProblem("copy", s, d) for s in ("4096x4096", "8192x1024", "1024x8192",
                                                     "16384x16384")
                 for d in ("bfloat16", "float32")]
    rows = [GridProblem("copy", s, d) for s in ("4096x4096x8192", "65536x128x256")
            for d in ("bfloat16", "float32")]
    return flat + transpose + rows


def _sympow() -> list[GridProblem]:
    """The power-attention kernels at their default power and tile (2, 8); their configs are
    keyed per variant, so one shape each tunes every shape of it."""
    return ([GridProblem("sympow", "65536x64", d) for d in FLOAT_DTYPES] +
            [GridProblem(f, "4096x4096x64", d) for f in ("sympow_mma", "mma_sympow_bwd")
             for d in ("bfloat16", "float16")])


GRID: tuple[GridProblem, ...] = tuple(_softmax() + _copy() + _sympow())


def problems(family: str | None = None) -> list[GridProblem]:
    """The grid, or its problems of one family; ValueError for a family it does not hold."""
    if family is None:
        return list(GRID)
    chosen = [p for p in GRID if p.family == family]
    if not chosen:
        raise ValueError(f"the grid holds no {family!r} problems; its families: "
                         f"{', '.join(dict.fromkeys(p.family for p in GRID))}")
    return chosen


def merge(tuned: Iterable[Record], shipped: Iterable[Record],
          applies: Callable[[RecordKey], bool]) -> list[Record]:
    """The records to ship: those just tuned, then those already shipped that still apply
    (``applies(key)``: the op exists with that kernel source, the version is this one) and
    that the new ones do not replace; sorted by key, so that the file's diff shows what
    changed."""
    out = {r.key: r for r in tuned}
    for r in shipped:
        if r.key not in out and applies(r.key):
            out[r.key] = r
    return sorted(out.values(), key=lambda r: r.key.as_tuple())


def applies_here(registry: dict, version: str) -> Callable[[RecordKey], bool]:
    """``merge``'s test against the ops registered now (name -> Op) and vitrail's version."""
    def applies(key: RecordKey) -> bool:
        op = registry.get(key.op)
        return (op is not None and op.tunable.source_hash == key.source_hash
                and key.vitrail == version)
    return applies


def heuristic_slowdown(record: Record, heuristic: Config | None) -> float | None:
    """The heuristic's config's time over the best's in a PickBest record (None where the
    space has no heuristic or its config failed)."""
    times = {_label(t.get("config")): t.get("ms") for t in record.timings}
    best = min((ms for ms in times.values() if ms is not None), default=None)
    mine = None if heuristic is None else times.get(_label(dict(heuristic)))
    return None if mine is None or not best else mine / best


def shipped_form(record: Record, heuristic: Config | None) -> Record:
    """A record as it ships: the winner's timing and the heuristic's (the evidence of what
    tuning gained), not every candidate's."""
    keep = {_label(dict(c)) for c in (record.config, heuristic) if c is not None}
    return Record(record.key, record.config,
                  [t for t in record.timings if _label(t.get("config")) in keep], record.created)


def _label(config: dict | None) -> str:
    return "" if config is None else ",".join(f"{k}={v}" for k, v in sorted(config.items()))
