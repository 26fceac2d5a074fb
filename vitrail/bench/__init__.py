"""The benchmark registry behind ``vitrail bench``.

A benchmark registers a ``run()`` returning rows (one per implementation and case) and a
``build()`` that compiles its kernels without running them: before its run (so that a cold
cache's builds run side by side, not between timings), and alone with ``--compile-only`` (what
``vitrail bench`` does on a machine with no GPU). Rows carry the measured value, its unit,
whether lower is better, and which row of the same case is the baseline; the runner prints the
ratio to the baseline and writes everything, with the device's description, to JSON (after
each benchmark, so that a run cut short keeps what it measured); the run ends in one summary
(vitrail.bench.report), also the JSON's first key, and a PNG per benchmark.
Rows, their speedups and their table are vitrail.bench.rows' (re-exported here).
"""
from __future__ import annotations

import importlib
import platform
import time
from pathlib import Path
from typing import Callable

from vitrail.bench.rows import (MATH_ROOFS, Benchmark, Row, math_of, print_table, ratios,
                                roof_legend, roofline_of, speedup)

__all__ = ["Row", "Benchmark", "REGISTRY", "register", "load", "select", "main", "DEFAULT_ARCH",
           "MATH_ROOFS", "math_of", "speedup", "ratios", "roofline_of", "print_table",
           "roof_legend"]

_MODULES = ["vitrail.bench.jit_overhead"]


REGISTRY: dict[str, Benchmark] = {}


def register(name: str, description: str, build: Callable[[], None], *, by_name: bool = False):
    def wrap(run: Callable[[], list[Row]]) -> Callable[[], list[Row]]:
        REGISTRY[name] = Benchmark(name, description, run, build, by_name)
        return run
    return wrap


def load() -> dict[str, Benchmark]:
    """Import the registry's own benchmarks (the JIT's) and return the registry. The op
    library's benchmarks register themselves when imported, from above: ``vitrail bench`` (the
    CLI) imports them first (vitrail.ops.load_benchmarks), so the registry knows no op."""
    for m in _MODULES:
        importlib.import_module(m)
    return REGISTRY


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
    from vitrail.bench import report
    from vitrail.profile import peaks as measure_peaks
    peaks = measure_peaks()  # measured once per machine, then read from the cache
    meta = _meta()
    stem = Path(out_dir) / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    results: dict[str, list[Row]] = {}
    failed: dict[str, str] = {}
    for i, b in enumerate(selected):
        try:
            b.build()  # its kernels side by side before any timing (a cold cache's builds)
            results[b.name] = b.run()
        except Exception as e:  # one benchmark failing does not cost the others' figures
            failed[b.name] = f"{type(e).__name__}: {e}"
            print(f"vitrail bench: {b.name} failed: {failed[b.name]}", flush=True)
        else:
            print_table(b, results[b.name], peaks)
        report.write_json(results, peaks, {**meta, "failed": failed,
                                           "pending": [p.name for p in selected[i + 1:]]}, stem)
    report.write(results, {b.name: b.description for b in selected}, peaks,
                 {**meta, "failed": failed} if failed else meta, stem)
    for name, why in failed.items():
        print(f"vitrail bench: {name} failed: {why}")
    return 1 if failed else 0


def _meta() -> dict:
    """The run's GPU, versions and start time (every JSON of the run carries them)."""
    import torch

    from vitrail import __version__
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "vitrail": __version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
