"""Building torch extensions: vitrail.jit's load_inline and load beside torch's, in the same run.

    python -m vitrail.bench.extension_build [--cases small,large,small_cuda,large_cuda]
                                            [--impls torch,vitrail,vitrail+pch]
                                            [--warm N] [--no-killed] [--out FILE.json]

Two cpp-only extensions: ``small``, one function on ``torch::Tensor`` bound by ``functions=``
(``load_inline``); ``large``, five functions in one .cpp file and their bindings in another
(``load``). Two CUDA ones: ``small_cuda``, one kernel and its launcher (``load_inline``,
``cuda_sources=``, the declaration in ``cpp_sources=``); ``large_cuda``, five kernels in two .cu
files, the second with the bindings (``load``). The CUDA cases call their kernel, so they need a
GPU that torch sees; elsewhere they are refused. Each is built by torch, by vitrail without its
precompiled header of torch/extension.h (VITRAIL_TORCH_PCH=0) and by vitrail with it
(vitrail.jit.pch; .cu files get none), each measured in fresh processes with empty caches (a
fresh VITRAIL_CACHE_DIR and TORCH_EXTENSIONS_DIR, and a source no cache has seen):

- pch build: seconds of the PCH's one-time build (``build_torch_pch`` in a new process), before
  the PCH rows, which use it; "cold + pch" adds it to their cold build;
- cold: seconds of the first call (compile, link, load);
- warm: milliseconds of the call in a new process once it is built (the median of N processes;
  the import of the function is timed apart);
- killed: a build killed with SIGKILL half-way, then a load in a new process: its seconds, or
  that it was still waiting when the limit came (torch's lock file outlives its builder). The
  compilers the killed build left running are killed before the load is timed (gcc's cc1plus
  outlives its driver, which vitrail's builds take down with them).

These time builds, not kernels, so this is a script rather than an entry of ``vitrail bench``.
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

SMALL = """
// {salt}
at::Tensor scale_add(const at::Tensor& x, const at::Tensor& y, double alpha) {{
  return x * alpha + y;
}}
"""
LARGE_OPS = """#include <torch/extension.h>
// {salt}
at::Tensor scale_add(const at::Tensor& x, const at::Tensor& y, double alpha) {{
  return x * alpha + y;
}}
at::Tensor row_softmax(const at::Tensor& x) {{ return at::softmax(x, -1); }}
at::Tensor clamp_square(const at::Tensor& x, double hi) {{ return x.square().clamp_max(hi); }}
at::Tensor gelu_tanh(const at::Tensor& x) {{ return at::gelu(x, "tanh"); }}
std::vector<at::Tensor> split_norm(const at::Tensor& x) {{
  auto n = x.norm(2, -1, true);
  return {{x / n, n}};
}}
"""
LARGE_BIND = """#include <torch/extension.h>
// {salt}
at::Tensor scale_add(const at::Tensor& x, const at::Tensor& y, double alpha);
at::Tensor row_softmax(const at::Tensor& x);
at::Tensor clamp_square(const at::Tensor& x, double hi);
at::Tensor gelu_tanh(const at::Tensor& x);
std::vector<at::Tensor> split_norm(const at::Tensor& x);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{
  m.def("scale_add", &scale_add);
  m.def("row_softmax", &row_softmax);
  m.def("clamp_square", &clamp_square);
  m.def("gelu_tanh", &gelu_tanh);
  m.def("split_norm", &split_norm);
}}
"""
SMALL_CUDA_DECL = """
// {salt}
at::Tensor scale_add(const at::Tensor& x, const at::Tensor& y, double alpha);
"""
SCALE_ADD_CU = """
__global__ void scale_add_kernel(const float* x, const float* y, float* out, float alpha,
                                 int64_t n) {{
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = x[i] * alpha + y[i];
}}
at::Tensor scale_add(const at::Tensor& x, const at::Tensor& y, double alpha) {{
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat && x.is_contiguous() &&
              y.sizes() == x.sizes() && y.scalar_type() == at::kFloat && y.is_contiguous(),
              "scale_add: contiguous fp32 CUDA tensors of one shape");
  auto out = at::empty_like(x);
  const int64_t n = x.numel();
  scale_add_kernel<<<(n + 255) / 256, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), y.data_ptr<float>(), out.data_ptr<float>(), float(alpha), n);
  return out;
}}
"""
SMALL_CUDA = """#include <c10/cuda/CUDAStream.h>
// {salt}
""" + SCALE_ADD_CU
LARGE_CUDA_A = """#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
// {salt}
""" + SCALE_ADD_CU + """
__global__ void clamp_square_kernel(const float* x, float* out, float hi, int64_t n) {{
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) out[i] = fminf(x[i] * x[i], hi);
}}
at::Tensor clamp_square(const at::Tensor& x, double hi) {{
  auto out = at::empty_like(x);
  const int64_t n = x.numel();
  clamp_square_kernel<<<(n + 255) / 256, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), out.data_ptr<float>(), float(hi), n);
  return out;
}}
__global__ void row_sum_kernel(const float* x, float* out, int64_t cols) {{
  float s = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += x[blockIdx.x * cols + c];
  for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (threadIdx.x == 0) out[blockIdx.x] = s;
}}
at::Tensor row_sum(const at::Tensor& x) {{
  auto out = at::empty({{x.size(0)}}, x.options());
  row_sum_kernel<<<x.size(0), 32, 0, c10::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), out.data_ptr<float>(), x.size(1));
  return out;
}}
"""
LARGE_CUDA_B = """#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
// {salt}
__global__ void gelu_tanh_kernel(const float* x, float* out, int64_t n) {{
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) {{
    const float v = x[i];
    out[i] = 0.5f * v * (1.f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
  }}
}}
at::Tensor gelu_tanh(const at::Tensor& x) {{
  auto out = at::empty_like(x);
  const int64_t n = x.numel();
  gelu_tanh_kernel<<<(n + 255) / 256, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), out.data_ptr<float>(), n);
  return out;
}}
__global__ void axpy_kernel(float* y, const float* x, float a, int64_t n) {{
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}}
at::Tensor axpy_(at::Tensor y, const at::Tensor& x, double a) {{
  const int64_t n = y.numel();
  axpy_kernel<<<(n + 255) / 256, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      y.data_ptr<float>(), x.data_ptr<float>(), float(a), n);
  return y;
}}
at::Tensor scale_add(const at::Tensor& x, const at::Tensor& y, double alpha);
at::Tensor clamp_square(const at::Tensor& x, double hi);
at::Tensor row_sum(const at::Tensor& x);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{
  m.def("scale_add", &scale_add);
  m.def("clamp_square", &clamp_square);
  m.def("row_sum", &row_sum);
  m.def("gelu_tanh", &gelu_tanh);
  m.def("axpy_", &axpy_);
}}
"""
CHILD = r"""
import json, sys, time
impl, case, name, source = sys.argv[1:5]
import torch
t = time.perf_counter()
if impl == "torch":
    from torch.utils.cpp_extension import load_inline, load
else:
    from vitrail.jit import load_inline, load
imported = time.perf_counter() - t
t = time.perf_counter()
if case == "small":
    m = load_inline(name, cpp_sources=source, functions=["scale_add"])
elif case == "small_cuda":
    decl, cu = json.loads(source)
    m = load_inline(name, cpp_sources=decl, cuda_sources=cu, functions=["scale_add"])
else:
    m = load(name, json.loads(source))
call = time.perf_counter() - t
x = torch.randn(5, device="cuda" if case.endswith("_cuda") else "cpu")
assert torch.allclose(m.scale_add(x, x, 2.0), 3 * x)
print(json.dumps({"import_s": imported, "call_s": call}))
"""
PCH_CHILD = r"""
import time
t = time.perf_counter()
from vitrail.jit.extension import build_torch_pch
build_torch_pch()
print(time.perf_counter() - t)
"""
IMPLS = {"torch": {}, "vitrail": {"VITRAIL_TORCH_PCH": "0"},
         "vitrail+pch": {"VITRAIL_TORCH_PCH": "1"}}
CPP_CASES = ("small", "large")  # the default: they build and run on any machine
CASES = CPP_CASES + ("small_cuda", "large_cuda")


def _source(case: str, folder: Path) -> str:
    """A source (small), the JSON pair of sources (small_cuda: the declaration, the CUDA text)
    or the JSON list of source files (large, large_cuda) that no cache has seen."""
    salt = uuid.uuid4().hex
    if case == "small":
        return SMALL.format(salt=salt)
    if case == "small_cuda":
        return json.dumps([SMALL_CUDA_DECL.format(salt=salt), SMALL_CUDA.format(salt=salt)])
    folder = folder / salt
    folder.mkdir(parents=True)
    files = ({"ops.cpp": LARGE_OPS, "bind.cpp": LARGE_BIND} if case == "large" else
             {"kernels.cu": LARGE_CUDA_A, "more_kernels.cu": LARGE_CUDA_B})
    for file, text in files.items():
        (folder / file).write_text(text.format(salt=salt))
    return json.dumps([str(folder / file) for file in files])


def _run(impl: str, case: str, name: str, source: str, env: dict,
         timeout: float | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, impl, case, name, source],
                         env={**env, **IMPLS[impl]}, capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{impl}: the child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def _kill_left_in(folder: Path) -> None:
    """SIGKILL the processes whose working directory is under folder (a killed build's
    compilers)."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "cwd").startswith(str(folder)):
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            pass


def _killed(impl: str, case: str, name: str, source: str, env: dict, after: float,
            limit: float, tmp: Path) -> str:
    """Kill a build after ``after`` seconds, then load in a new process for at most limit s."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, impl, case, name, source],
                            env={**env, **IMPLS[impl]}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(after)
    os.killpg(proc.pid, signal.SIGKILL)  # the build's compilers too: a machine that reboots
    proc.wait()
    time.sleep(0.5)
    _kill_left_in(tmp)
    start = time.perf_counter()
    try:
        _run(impl, case, name, source, env, timeout=limit)
    except subprocess.TimeoutExpired:
        return f"still waiting after {limit:.0f} s"
    return f"{time.perf_counter() - start:.1f} s"


def measure(warm: int = 5, killed: bool = True, kill_after: float = 5.0, limit: float = 60.0,
            cases=CPP_CASES, impls=tuple(IMPLS), on_row=None) -> dict:
    """The report of the cases built by impls (some of IMPLS, in IMPLS' order);
    on_row(case, impl, row, report) after each row, the report so far (its rows yet to come
    under "pending"): a run cut short keeps the rows it measured."""
    import torch
    cuda = [c for c in cases if c.endswith("_cuda")]
    if cuda and not torch.cuda.is_available():
        raise RuntimeError(f"extension_build: the cases {', '.join(cuda)} call a kernel: they "
                           f"need a GPU, and torch {torch.__version__} sees none")
    results: dict[str, dict] = {}
    pch_s = None
    todo = [(impl, case) for impl in IMPLS if impl in impls for case in cases]

    def report() -> dict:
        return {"results": results, "pch_build_s": pch_s, "torch": torch.__version__,
                "cpus": os.cpu_count(), "python": sys.version.split()[0],
                "time": time.strftime("%Y-%m-%d %H:%M"), "pending": [list(t) for t in todo]}
    with tempfile.TemporaryDirectory(prefix="vitrail-ext-bench-") as name:
        tmp = Path(name)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VITRAIL_")}
        env.update(VITRAIL_CACHE_DIR=f"{tmp}/vitrail", TORCH_EXTENSIONS_DIR=f"{tmp}/torch",
                   PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                               env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        for impl in (i for i in IMPLS if i in impls):
            if impl == "vitrail+pch":
                out = subprocess.run([sys.executable, "-c", PCH_CHILD], env=env, text=True,
                                     capture_output=True, check=True)
                pch_s = round(float(out.stdout.split()[-1]), 2)
            for case in cases:
                label = f"bench_{case}_{uuid.uuid4().hex[:8]}"
                source = _source(case, tmp / "src")
                cold = _run(impl, case, label, source, env)
                runs = [_run(impl, case, label, source, env) for _ in range(warm)]
                row = results.setdefault(case, {})[impl] = {
                    "cold_s": round(cold["call_s"], 2),
                    "warm_ms": round(statistics.median(r["call_s"] for r in runs) * 1e3, 2),
                    "import_ms": round(statistics.median(r["import_s"] for r in runs) * 1e3, 1)}
                if impl == "vitrail+pch":
                    row["cold_with_pch_build_s"] = round(row["cold_s"] + pch_s, 2)
                if killed:
                    label = f"bench_killed_{case}_{uuid.uuid4().hex[:8]}"
                    row["after_sigkill"] = _killed(impl, case, label, _source(case, tmp / "src"),
                                                   env, kill_after, limit, tmp)
                todo.remove((impl, case))
                if on_row is not None:
                    on_row(case, impl, row, report())
    return report()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CPP_CASES),
                        help=f"some of {', '.join(CASES)} (default: {', '.join(CPP_CASES)})")
    parser.add_argument("--warm", type=int, default=5, help="new processes timed warm")
    parser.add_argument("--no-killed", action="store_true", help="skip the SIGKILL case")
    parser.add_argument("--limit", type=float, default=60.0,
                        help="seconds a load after a killed build may take")
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help=f"some of {', '.join(IMPLS)} (default: all; torch's rows are the "
                             "baseline of the ratios)")
    parser.add_argument("--out", help="write the results as JSON here (after every row)")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    if not cases or set(cases) - set(CASES):
        parser.error(f"--cases: expected some of {', '.join(CASES)}")
    impls = [i for i in args.impls.split(",") if i]
    if not impls or set(impls) - set(IMPLS):
        parser.error(f"--impls: expected some of {', '.join(IMPLS)}")

    def on_row(case: str, impl: str, row: dict, report: dict) -> None:
        print(f"{case} {impl}: " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
    report = measure(args.warm, not args.no_killed, limit=args.limit, cases=cases, impls=impls,
                     on_row=on_row)
    print(f"torch {report['torch']}, Python {report['python']}, {report['cpus']} CPUs; "
          f"the PCH's one-time build: {report['pch_build_s']} s")
    for case, rows in report["results"].items():
        base = rows.get("torch")
        print(f"\n{case}\n{'':<13}{'cold s':>8}{'cold+pch s':>12}{'x torch':>9}{'warm ms':>9}"
              f"{'x torch':>9}{'import ms':>11}  after SIGKILL")
        for impl, r in rows.items():
            with_pch = r.get("cold_with_pch_build_s")
            ratio = (lambda k: f"{r[k] / base[k]:>9.2f}") if base else (lambda k: f"{'-':>9}")
            print(f"{impl:<13}{r['cold_s']:>8.2f}"
                  f"{with_pch if with_pch is not None else '-':>12}"
                  f"{ratio('cold_s')}{r['warm_ms']:>9.2f}"
                  f"{ratio('warm_ms')}{r['import_ms']:>11.1f}  "
                  f"{r.get('after_sigkill', '-')}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
