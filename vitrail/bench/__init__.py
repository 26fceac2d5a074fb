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
    case: str
    impl: str
    value: float
    unit: str
    lower_is_better: bool = True
    baseline: bool = False
    extra: dict = field(default_factory=dict)


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


def print_table(bench: Benchmark, rows: list[Row]) -> None:
    print(f"\n{bench.name}: {bench.description}")
    print(f"  {'case':<22}{'implementation':<34}{'value':>12}  {'unit':<10}{'vs baseline':>12}")
    for r, ratio in ratios(rows):
        mark = "baseline" if r.baseline else (f"{ratio:.2f}x" if ratio else "-")
        print(f"  {r.case:<22}{r.impl:<34}{r.value:>12.2f}  {r.unit:<10}{mark:>12}")


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
    results = {}
    for b in selected:
        rows = b.run()
        print_table(b, rows)
        results[b.name] = [{**asdict(r), "ratio": ratio} for r, ratio in ratios(rows)]
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    report = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
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
            rows = [Row(**{k: v for k, v in r.items() if k != "ratio"}) for r in results[b.name]]
            plot_bench(rows, png, title=f"{b.name} on {props.name}: {b.description}")
            print(f"plot written to {png}")
        except ImportError as e:  # matplotlib is an optional extra
            print(f"no plot: {e}")
    return 0
