"""Building torch extensions: vitrail.jit.load_inline beside torch's, in the same run, on the CPU.

    python -m vitrail.bench.extension_build [--warm N] [--no-killed] [--out FILE.json]

For one cpp-only extension (one function on ``torch::Tensor``, bound by ``functions=``), each
measured in fresh processes with empty caches (a fresh VITRAIL_CACHE_DIR and
TORCH_EXTENSIONS_DIR, and a source no cache has seen):

- cold: seconds of the first ``load_inline`` call (compile, link, load);
- warm: milliseconds of the ``load_inline`` call in a new process once it is built (the
  median of N processes; the import of the function is timed apart);
- killed: a build killed with SIGKILL half-way, then a load in a new process: its seconds, or
  that it was still waiting when the limit came (torch's lock file outlives its builder).

These are not GPU kernels, so this is a script rather than an entry of ``vitrail bench``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

SOURCE = """
// {salt}
at::Tensor scale_add(const at::Tensor& x, const at::Tensor& y, double alpha) {{
  return x * alpha + y;
}}
"""
CHILD = r"""
import json, sys, time
impl, name, source = sys.argv[1:4]
import torch
t = time.perf_counter()
if impl == "torch":
    from torch.utils.cpp_extension import load_inline
else:
    from vitrail.jit import load_inline
imported = time.perf_counter() - t
t = time.perf_counter()
m = load_inline(name, cpp_sources=source, functions=["scale_add"])
call = time.perf_counter() - t
x = torch.randn(5)
assert torch.allclose(m.scale_add(x, x, 2.0), 3 * x)
print(json.dumps({"import_s": imported, "call_s": call}))
"""
IMPLS = ("torch", "vitrail")


def _run(impl: str, name: str, source: str, env: dict, timeout: float | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, impl, name, source], env=env,
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{impl}: the child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def _killed(impl: str, name: str, source: str, env: dict, after: float, limit: float) -> str:
    """Kill a build after ``after`` seconds, then load in a new process for at most limit s."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, impl, name, source], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    time.sleep(after)
    os.killpg(proc.pid, signal.SIGKILL)  # the build's compilers too: a machine that reboots
    proc.wait()
    start = time.perf_counter()
    try:
        _run(impl, name, source, env, timeout=limit)
    except subprocess.TimeoutExpired:
        return f"still waiting after {limit:.0f} s"
    return f"{time.perf_counter() - start:.1f} s"


def measure(warm: int = 5, killed: bool = True, kill_after: float = 5.0,
            limit: float = 60.0) -> dict:
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="vitrail-ext-bench-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VITRAIL_")}
        env.update(VITRAIL_CACHE_DIR=f"{tmp}/vitrail", TORCH_EXTENSIONS_DIR=f"{tmp}/torch",
                   PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                               env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        for impl in IMPLS:
            name = f"bench_{impl}_{uuid.uuid4().hex[:8]}"
            source = SOURCE.format(salt=uuid.uuid4().hex)
            cold = _run(impl, name, source, env)
            runs = [_run(impl, name, source, env) for _ in range(warm)]
            results[impl] = {
                "cold_s": round(cold["call_s"], 2),
                "warm_ms": round(statistics.median(r["call_s"] for r in runs) * 1e3, 2),
                "import_ms": round(statistics.median(r["import_s"] for r in runs) * 1e3, 1)}
            if killed:
                name = f"bench_killed_{impl}_{uuid.uuid4().hex[:8]}"
                results[impl]["after_sigkill"] = _killed(
                    impl, name, SOURCE.format(salt=uuid.uuid4().hex), env, kill_after, limit)
    import torch
    return {"results": results, "torch": torch.__version__, "cpus": os.cpu_count(),
            "python": sys.version.split()[0], "time": time.strftime("%Y-%m-%d %H:%M")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", type=int, default=5, help="new processes timed warm")
    parser.add_argument("--no-killed", action="store_true", help="skip the SIGKILL case")
    parser.add_argument("--limit", type=float, default=60.0,
                        help="seconds a load after a killed build may take")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    report = measure(args.warm, not args.no_killed, limit=args.limit)
    base = report["results"]["torch"]
    print(f"torch {report['torch']}, Python {report['python']}, {report['cpus']} CPUs")
    print(f"{'':<10}{'cold s':>9}{'warm ms':>10}{'import ms':>11}  after SIGKILL")
    for impl, r in report["results"].items():
        print(f"{impl:<10}{r['cold_s']:>9.2f}{r['warm_ms']:>10.2f}{r['import_ms']:>11.1f}  "
              f"{r.get('after_sigkill', '-')}")
    v = report["results"]["vitrail"]
    print(f"vitrail/torch: cold {v['cold_s'] / base['cold_s']:.2f}x, warm "
          f"{v['warm_ms'] / base['warm_ms']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
