"""The benchmark registry behind ``vitrail bench``.

A benchmark registers a ``run()`` returning rows (one per implementation and case) and a
``build()`` that compiles its kernels without running them (``--compile-only``, and what
``vitrail bench`` does on a machine with no GPU). Rows carry the measured value, its unit,
whether lower is better, and which row of the same case is the baseline; the runner prints the
ratio to the baseline and writes everything, with the device's description, to JSON; the run
ends in one summary (vitrail.bench.report), also the JSON's first key, and a PNG per benchmark.
"""
from __future__ import annotations

import importlib
import importlib.util
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

_MODULES = ["vitrail.bench.jit_overhead", "vitrail.bench.host"]


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


@dataclass
class Benchmark:
    name: str
    description: str
    run: Callable[[], list[Row]]
    build: Callable[[], None]
    by_name: bool = False  # run only when named (a long sweep), not by a bare `vitrail bench`


REGISTRY: dict[str, Benchmark] = {}


def register(name: str, description: str, build: Callable[[], None], *, by_name: bool = False):
    def wrap(run: Callable[[], list[Row]]) -> Callable[[], list[Row]]:
        REGISTRY[name] = Benchmark(name, description, run, build, by_name)
        return run
    return wrap


def load() -> dict[str, Benchmark]:
    """Import the registry's modules: vitrail's own, and each op family's ``bench.py``."""
    from vitrail import ops
    modules = list(_MODULES)
    for family in ops.families():
        if importlib.util.find_spec(f"vitrail.ops.{family}.bench") is not None:
            modules.append(f"vitrail.ops.{family}.bench")
    for m in modules:
        importlib.import_module(m)
    return REGISTRY


def speedup(row: Row, base: Row) -> float | None:
    """How many times faster row is than base (> 1: faster), whichever way the unit points."""
    if not row.value or not base.value:
        return None
    return base.value / row.value if row.lower_is_better else row.value / base.value


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


def print_table(bench: Benchmark, rows: list[Row], peaks=None) -> None:
    """One line per row: its value, its place on the roofline (when it says what work it did),
    and its speedup over each baseline (one column per baseline implementation)."""
    print(f"\n{bench.name}: {bench.description}")
    roofs = [roofline_of(r, peaks) for r in rows]
    on_roof = any(roofs)
    baselines = list(dict.fromkeys(r.impl for r in rows if r.baseline))
    cw = max([len("case")] + [len(r.case) for r in rows]) + 2
    iw = max([len("implementation")] + [len(r.impl) for r in rows]) + 2
    head = f"  {'case':<{cw}}{'implementation':<{iw}}{'value':>12}  {'unit':<10}"
    if on_roof:
        head += f"{'TFLOP/s':>9}{'GB/s':>8}{'% roof*':>8}"
    print(head + "".join(f"{'vs ' + b[:16]:>20}" for b in baselines))
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
        print(line + "".join(f"{m:>20}" for m in marks))
    if on_roof and peaks is not None:
        print("  * " + roof_legend([r for r, roof in zip(rows, roofs) if roof], peaks))


def roof_legend(rows: list[Row], peaks) -> str:
    """What '% roof' divides by: each math's compute peak among rows, and the memory peak."""
    maths = list(dict.fromkeys(math_of(r) for r in rows if r.flops))
    parts = [f"{m} {_bf16(peaks) * MATH_ROOFS.get(m, 1.0):.0f} TFLOP/s"
             + (" (measured)" if m == "bf16" else " (bf16's)" if MATH_ROOFS.get(m, 1.0) == 1.0
                else f" ({MATH_ROOFS[m]:g}x bf16's, derived)") for m in maths]
    return ("% of the roof of the row's own math: " + ", ".join(parts) + f"; memory "
            f"{_gbps(peaks):.0f} GB/s (copy, measured)")

DEFAULT_ARCH = "90a"  # what a machine with no GPU builds for: Hopper, the GPUs vitrail tunes for


def _build(selected: list[Benchmark]) -> int:
    """Compile the benchmarks' kernels (for the GPU here, else VITRAIL_ARCH, else Hopper) with
    a line per benchmark, and say at the end what was built, where, and what to run next."""
    from vitrail import knobs
    from vitrail.jit import ToolchainError, housekeeping, toolchain
    try:
        arch = toolchain.target_arch()
    except ToolchainError:  # no GPU, no VITRAIL_ARCH, no TORCH_CUDA_ARCH_LIST
        knobs.ARCH.set(DEFAULT_ARCH)
        arch = toolchain.target_arch()
        print(f"vitrail bench: building for {arch} (Hopper: H100, H200), the default with no "
              f"GPU; set VITRAIL_ARCH for another target")
    start, built = time.perf_counter(), []
    for i, b in enumerate(selected, 1):
        print(f"[{i}/{len(selected)}] building {b.name} ...", flush=True)
        t = time.perf_counter()
        try:
            b.build()
        except Exception as e:  # one family failing to build does not hide the others
            print(f"[{i}/{len(selected)}] {b.name} failed: {type(e).__name__}: {e}", flush=True)
            continue
        built.append(b.name)
        print(f"[{i}/{len(selected)}] built {b.name} in {time.perf_counter() - t:.1f} s",
              flush=True)
    info = housekeeping.info()
    print(f"\nbuilt {len(built)} of {len(selected)} benchmarks for {arch} in "
          f"{time.perf_counter() - start:.0f} s: {', '.join(built) or 'none'}")
    print(f"kernels cached in {info.root} ({info.entries} kernels, "
          f"{housekeeping.format_size(info.size)})")
    print("next: run `vitrail bench` on a machine with an NVIDIA GPU to time them (copy this "
          "cache there, or point VITRAIL_CACHE_DIR at it, to skip these builds)")
    return 0 if len(built) == len(selected) else 1


def select(registry: dict[str, Benchmark], names: list[str]) -> list[Benchmark]:
    """The benchmarks named, or, with no names, every one not marked by_name."""
    if names:
        return [registry[n] for n in names]
    return [b for b in registry.values() if not b.by_name]


def main(names: list[str], out_dir: str = "results", compile_only: bool = False,
         list_only: bool = False) -> int:
    registry = load()
    unknown = [n for n in names if n not in registry]
    if unknown:
        print(f"vitrail bench: unknown benchmark(s) {', '.join(unknown)}; known: "
              f"{', '.join(registry)}")
        return 2
    if list_only:
        for b in (registry[n] for n in (names or registry)):
            print(f"{b.name:<24}{b.description}" + (" (run when named)" if b.by_name else ""))
        return 0
    selected = select(registry, names)
    import torch
    if not compile_only and not torch.cuda.is_available():
        print("vitrail bench: no GPU is visible, so nothing can be timed here; building the "
              "benchmarks' kernels instead (--compile-only)")
        compile_only = True
    if compile_only:
        return _build(selected)
    from vitrail.profile import peaks as measure_peaks
    peaks = measure_peaks()  # measured once per machine, then read from the cache
    results = {}
    for b in selected:
        results[b.name] = b.run()
        print_table(b, results[b.name], peaks)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    from vitrail import __version__
    meta = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "vitrail": __version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    from vitrail.bench import report
    report.write(results, {b.name: b.description for b in selected}, peaks, meta,
                 Path(out_dir) / f"bench-{time.strftime('%Y%m%d-%H%M%S')}")
    return 0
