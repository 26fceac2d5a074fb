"""What a benchmark is and returns, and how that reads: its rows, each row's speedup over the
baselines of its case, its place on the roofline, and the table ``vitrail bench`` prints of them
(the registry, vitrail.bench, runs benchmarks; vitrail.bench.report sums their rows up)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from vitrail.profile.timing import speedup_of


@dataclass
class Row:
    """One implementation on one case. ``ms`` with ``flops`` and/or ``bytes`` (the work's floor:
    each input read once, each output written once) puts the row on this GPU's roofline."""
    case: str
    impl: str
    value: float
    unit: str
    lower_is_better: bool = True
    baseline: bool = False
    extra: dict = field(default_factory=dict)
    ms: float | None = None
    flops: float = 0.0
    bytes: float = 0.0
    math: str = ""  # what the FLOPs run in (bf16, fp16, fp8, tf32): whose peak is the roof
    group: str = ""  # the cases a reader compares it with (a plot's panel): "fp8 scaled_mm"


@dataclass
class Benchmark:
    name: str
    description: str
    run: Callable[[], list[Row]]
    build: Callable[[], None]
    by_name: bool = False  # run only when named (a long sweep), not by a bare `vitrail bench`



# Each math's compute roof as a multiple of the measured bf16 matmul rate: Hopper's dense
# tensor cores do twice BF16/FP16's FLOPs per clock in FP8 and half in TF32 (derived, not
# measured; the bf16 rate is measured by vitrail.profile.peaks).
MATH_ROOFS = {"bf16": 1.0, "fp16": 1.0, "fp8": 2.0, "tf32": 0.5}


def math_of(row: Row) -> str:
    """A row's math: as it says, else from its case's name (results written before rows said
    it), else bf16."""
    if row.math:
        return row.math
    case = row.case.lower()
    return "fp8" if "fp8" in case or "e4m3" in case or "e5m2" in case else "bf16"


def speedup(row: Row, base: Row) -> float | None:
    """How many times faster row is than base (> 1: faster), whichever way the unit points."""
    return speedup_of(row.value, base.value, row.lower_is_better)


def ratios(rows: list[Row]) -> list[tuple[Row, dict[str, float | None]]]:
    """Each row with its speedup over every baseline of its case, by baseline implementation."""
    bases = [r for r in rows if r.baseline]
    return [(r, {b.impl: speedup(r, b) for b in bases if b.case == r.case}) for r in rows]


def roofline_of(row: Row, peaks) -> dict | None:
    """TFLOP/s, GB/s and % of the roofline of a row that says what work it did; the compute
    roof is its own math's (MATH_ROOFS), the memory roof the measured copy bandwidth."""
    if row.ms is None or not (row.flops or row.bytes) or row.ms <= 0:
        return None
    from vitrail.profile import roofline
    math = math_of(row)
    roof = None
    if peaks is not None:
        roof = {"tflops": _bf16(peaks) * MATH_ROOFS.get(math, 1.0), "gbps": _gbps(peaks)}
    r = roofline(flops=row.flops, bytes=row.bytes, ms=row.ms, peaks=roof)
    return {"tflops": r.tflops, "gbps": r.gbps, "math": math,
            "roof_tflops": roof["tflops"] if roof else None,
            "pct_roofline": r.pct_roofline if roof is not None else None}


def _bf16(peaks) -> float:
    return peaks["bf16_tflops"] if isinstance(peaks, dict) else peaks.bf16_tflops


def _gbps(peaks) -> float:
    return peaks["copy_gbps"] if isinstance(peaks, dict) else peaks.copy_gbps


def print_table(benchmark: Benchmark, rows: list[Row], peaks=None) -> None:
    """One line per row: its value, its place on the roofline (when it says what work it did),
    and its speedup over each baseline (one column per baseline implementation)."""
    print(f"\n{benchmark.name}: {benchmark.description}")
    roofs = [roofline_of(r, peaks) for r in rows]
    on_roof = any(roofs)
    baselines = list(dict.fromkeys(r.impl for r in rows if r.baseline))
    cw = max([len("case")] + [len(r.case) for r in rows]) + 2
    iw = max([len("implementation")] + [len(r.impl) for r in rows]) + 2
    head = f"  {'case':<{cw}}{'implementation':<{iw}}{'value':>12}  {'unit':<10}"
    if on_roof:
        head += f"{'TFLOP/s':>9}{'GB/s':>8}{'% roof*':>8}"
    widths = [max(len("vs " + b), len("baseline")) + 2 for b in baselines]  # whole names
    print(head + "".join(f"{'vs ' + b:>{w}}" for b, w in zip(baselines, widths)))
    for (r, vs), roof in zip(ratios(rows), roofs):
        marks = ["baseline" if r.baseline and b == r.impl else
                 f"{vs[b]:.2f}x" if vs.get(b) else "-" for b in baselines]
        line = f"  {r.case:<{cw}}{r.impl:<{iw}}{r.value:>12.2f}  {r.unit:<10}"
        if on_roof:
            if roof:
                pct = f"{roof['pct_roofline']:.0f}%" if roof["pct_roofline"] is not None else "-"
                tflops = f"{roof['tflops']:.1f}" if r.flops else "-"  # only the work counted
                gbps = f"{roof['gbps']:.0f}" if r.bytes else "-"
                line += f"{tflops:>9}{gbps:>8}{pct:>8}"
            else:
                line += f"{'-':>9}{'-':>8}{'-':>8}"
        print(line + "".join(f"{m:>{w}}" for m, w in zip(marks, widths)))
    if on_roof and peaks is not None:
        print("  * " + roof_legend([r for r, roof in zip(rows, roofs) if roof], peaks))


def roof_legend(rows: list[Row], peaks) -> str:
    """What '% roof' divides by: each math's compute peak among rows, and the memory peak."""
    maths = list(dict.fromkeys(math_of(r) for r in rows if r.flops))
    parts = [f"{m} {_bf16(peaks) * MATH_ROOFS.get(m, 1.0):.0f} TFLOP/s"
             + (" (measured)" if m == "bf16" else " (bf16's)" if MATH_ROOFS.get(m, 1.0) == 1.0
                else f" ({MATH_ROOFS[m]:g}x bf16's, derived)") for m in maths]
    memory = f"memory {_gbps(peaks):.0f} GB/s (copy, measured)"
    if not parts:  # memory-bound rows only (copy, softmax)
        return f"% of the memory roof: {memory}"
    return "% of the roof of the row's own math: " + ", ".join(parts) + f"; {memory}"
