"""Rows of memory-bound ops (softmax, copy): GB/s of each implementation beside the device's copy
bandwidth measured in the same run, the ceiling such an op can reach."""
from __future__ import annotations

from vitrail.bench.rows import Row


def copy_gbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth now (bytes read + written), the ceiling of this run."""
    import torch

    from vitrail.profile import measure
    a = torch.empty(nbytes // 4, device="cuda")
    b = torch.empty_like(a)
    t = measure(lambda: b.copy_(a), rep=30)
    return 2 * nbytes / t.median / 1e6


def rows_for(case: str, impls: dict, nbytes: float, ceiling: float, group: str = "") -> list[Row]:
    """A row per implementation of case (timed; one that fails is reported and left out): GB/s
    for nbytes moved, torch eager the baseline, and its percentage of the ceiling (copy GB/s)."""
    from vitrail.profile import measure
    out = []
    for impl, fn in impls.items():
        try:
            ms = measure(fn, rep=50).median
        except Exception as e:  # torch.compile may refuse a case: report, keep going
            print(f"  {case} {impl}: {type(e).__name__}: {str(e)[:120]}")
            continue
        gbps = nbytes / ms / 1e6
        out.append(Row(case, impl, gbps, "GB/s", lower_is_better=False,
                       baseline=impl == "torch eager", ms=ms, bytes=nbytes,
                       extra={"pct_of_copy": 100 * gbps / ceiling, "copy_gbps": ceiling},
                       group=group))
        print(f"  {case:<34}{impl:<16}{gbps:8.0f} GB/s  {100 * gbps / ceiling:5.1f}% of copy")
    return out


def build_configs(chosen, label: str) -> None:
    """Compile each (op, config) of chosen for the build target, in parallel (one pool); a
    failure is one line, the benchmark runs on."""
    from vitrail.tune import compile_all, limits
    arch = limits().arch.name
    jobs = {(op.name, config): dict(op.render(config), arch=arch) for op, config in chosen}
    for (name, config), error in compile_all(list(jobs.items()), label=label).items():
        print(f"  build failed: {name} {dict(config)}: {error[:2000]}")
