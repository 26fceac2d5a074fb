"""The benchmark registry behind ``vitrail bench``.

A benchmark registers a ``run()`` returning rows (one per implementation and case) and a
``build()`` that compiles its kernels without running them (``--compile-only``, and what
``vitrail bench`` does on a machine with no GPU). Rows carry the measured value, its unit,
whether lower is better, and which row of the same case is the baseline; the runner prints the
ratio to the baseline and writes everything, with the device's description, to JSON.
"""
from __future__ import annotations

import importlib
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

_MODULES = ["vitrail.bench.jit_overhead"]


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


@dataclass
class Benchmark:
    name: str
    description: str
    run: Callable[[], list[Row]]
    build: Callable[[], None]


REGISTRY: dict[str, Benchmark] = {}


def register(name: str, description: str, build: Callable[[], None]):
    def wrap(run: Callable[[], list[Row]]) -> Callable[[], list[Row]]:
        REGISTRY[name] = Benchmark(name, description, run, build)
        return run
    return wrap


def load() -> dict[str, Benchmark]:
    for m in _MODULES:
        importlib.import_module(m)
    return REGISTRY


def ratios(rows: list[Row]) -> list[tuple[Row, float | None]]:
    """Each row with its speed ratio to its case's baseline (> 1: faster than the baseline)."""
    base = {r.case: r for r in rows if r.baseline}
    out = []
    for r in rows:
        b = base.get(r.case)
        if b is None or not r.value or not b.value:
            out.append((r, None))
        else:
            out.append((r, b.value / r.value if r.lower_is_better else r.value / b.value))
    return out


def roofline_of(row: Row, peaks) -> dict | None:
    """TFLOP/s, GB/s and % of the measured roofline of a row that says what work it did."""
    if row.ms is None or not (row.flops or row.bytes) or row.ms <= 0:
        return None
    from vitrail.profile import roofline
    r = roofline(flops=row.flops, bytes=row.bytes, ms=row.ms, peaks=peaks)
    return {"tflops": r.tflops, "gbps": r.gbps,
            "pct_roofline": r.pct_roofline if peaks is not None else None}


def print_table(bench: Benchmark, rows: list[Row], peaks=None) -> None:
    print(f"\n{bench.name}: {bench.description}")
    roofs = [roofline_of(r, peaks) for r in rows]
    on_roof = any(roofs)
    head = f"  {'case':<22}{'implementation':<34}{'value':>12}  {'unit':<10}"
    if on_roof:
        head += f"{'TFLOP/s':>9}{'GB/s':>8}{'% roof':>8}"
    print(head + f"{'vs baseline':>12}")
    for (r, ratio), roof in zip(ratios(rows), roofs):
        mark = "baseline" if r.baseline else (f"{ratio:.2f}x" if ratio else "-")
        line = f"  {r.case:<22}{r.impl:<34}{r.value:>12.2f}  {r.unit:<10}"
        if on_roof:
            if roof:
                pct = f"{roof['pct_roofline']:.0f}%" if roof["pct_roofline"] is not None else "-"
                line += f"{roof['tflops']:>9.1f}{roof['gbps']:>8.0f}{pct:>8}"
            else:
                line += f"{'-':>9}{'-':>8}{'-':>8}"
        print(line + f"{mark:>12}")


def main(names: list[str], out_dir: str = "results", compile_only: bool = False,
         list_only: bool = False) -> int:
    registry = load()
    unknown = [n for n in names if n not in registry]
    if unknown:
        print(f"vitrail bench: unknown benchmark(s) {', '.join(unknown)}; known: "
              f"{', '.join(registry)}")
        return 2
    selected = [registry[n] for n in (names or registry)]
    if list_only:
        for b in selected:
            print(f"{b.name:<24}{b.description}")
        return 0
    import torch
    if not compile_only and not torch.cuda.is_available():
        print("vitrail bench: no GPU is visible, so nothing can be timed here; building the "
              "benchmarks' kernels instead (--compile-only)")
        compile_only = True
    if compile_only:
        for b in selected:
            start = time.perf_counter()
            b.build()
            print(f"built {b.name} in {time.perf_counter() - start:.1f} s")
        return 0
    from vitrail.profile import peaks as measure_peaks
    peaks = measure_peaks()  # measured once per machine, then read from the cache
    results = {}
    for b in selected:
        rows = b.run()
        print_table(b, rows, peaks)
        results[b.name] = [{**asdict(r), "ratio": ratio, "roofline": roofline_of(r, peaks)}
                           for r, ratio in ratios(rows)]
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    report = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
              "peaks": {"copy_gbps": peaks.copy_gbps, "bf16_tflops": peaks.bf16_tflops},
              "python": platform.python_version(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "results": results}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    print(f"\nresults written to {stem.with_suffix('.json')}")
    for b in selected:
        png = stem.parent / f"{stem.name}-{b.name}.png"
        try:
            from vitrail.profile import plot_bench
            rows = [Row(**{k: v for k, v in r.items() if k not in ("ratio", "roofline")})
                    for r in results[b.name]]
            plot_bench(rows, png, title=f"{b.name} on {props.name}: {b.description}")
            print(f"plot written to {png}")
        except ImportError as e:  # matplotlib is an optional extra
            print(f"no plot: {e}")
    return 0
