"""``vitrail doctor``: is this machine ready to compile and run vitrail kernels?

Reports the toolchain (nvcc, host compiler, NVRTC, CUTLASS, cuda-bindings, the driver) with a
warning for each version outside the tested set (toolchain.TESTED), the GPUs and target arch, the
cache;
builds a small CuTe kernel with nvcc and a kernel with NVRTC, runs both where a GPU exists and
checks their results; says plainly what is missing and how to fix it.
"""
from __future__ import annotations

import os
import platform
import re
import time
from dataclasses import dataclass
from typing import Callable

from vitrail import __version__, knobs

# A CuTe kernel (tiles of a global tensor, one element per thread) and, in a kernel that is never
# launched, a warpgroup fence: it only assembles for sm_90a, so the build proves the target.
CUTE_SOURCE = r"""
#include <cuda_runtime.h>
#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

template <int kBlock>
__global__ void scale_kernel(const float* x, float* y, int n, float a) {
  using namespace cute;
  Tensor gx = make_tensor(make_gmem_ptr(x), make_shape(n));
  Tensor gy = make_tensor(make_gmem_ptr(y), make_shape(n));
  Tensor tile_x = local_tile(gx, Shape<Int<kBlock>>{}, make_coord(blockIdx.x));
  Tensor tile_y = local_tile(gy, Shape<Int<kBlock>>{}, make_coord(blockIdx.x));
  if (int(blockIdx.x) * kBlock + int(threadIdx.x) < n) {
    tile_y(threadIdx.x) = a * tile_x(threadIdx.x);
  }
}

__global__ void sm90a_probe() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  cute::warpgroup_arrive();
#endif
}

extern "C" cudaError_t vitrail_doctor_scale(const float* x, float* y, int n, float a,
                                            cudaStream_t stream) {
  constexpr int kBlock = 128;
  scale_kernel<kBlock><<<(n + kBlock - 1) / kBlock, kBlock, 0, stream>>>(x, y, n, a);
  return cudaGetLastError();
}
"""

NVRTC_SOURCE = r"""
extern "C" __global__ void vitrail_doctor_saxpy(float a, const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
"""


@dataclass
class Check:
    what: str
    ok: bool | None  # None: not applicable here (e.g. no GPU to run on)
    detail: str
    fix: str = ""
    warning: str = ""  # works, but outside what vitrail was tested with


def _try(what: str, fn: Callable[[], str | tuple[str, str]], fix: str = "") -> Check:
    """fn returns its detail, or (detail, warning)."""
    try:
        got = fn()
    except Exception as e:  # doctor reports every failure instead of stopping at the first
        return Check(what, False, f"{type(e).__name__}: {e}".strip(), fix)
    detail, warning = got if isinstance(got, tuple) else (got, "")
    return Check(what, True, detail, warning=warning)


def torch_extensions(torch_cuda: str | None, nvcc: tuple[int, ...] | None, cxx: str, abi: int,
                     cuda_headers: bool) -> tuple[str, str]:
    """Whether torch's headers and the compilers agree for torch extensions (vitrail.jit's
    load_inline, load): (detail, warning), or ToolchainError saying what to fix. torch_cuda:
    the CUDA torch was built with (None: a CPU build); nvcc: its version (None: none); cxx:
    the host compiler's version line; abi: torch's _GLIBCXX_USE_CXX11_ABI; cuda_headers:
    whether torch ships c10/cuda's headers."""
    from vitrail.jit.toolchain import ToolchainError
    m = re.search(r"\b(\d+)\.(\d+)(?:\.\d+)?\b", cxx)
    if m and re.search(r"g\+\+|gcc|GCC", cxx) and int(m.group(1)) < 10:
        raise ToolchainError(f"{cxx.strip()}: torch extensions build with -std=c++20 (torch's "
                             f"default), which needs g++ 10 or newer; install it or set CXX")
    warning = ""
    if torch_cuda and nvcc:
        built = tuple(int(x) for x in torch_cuda.split(".")[:2])
        if built[0] != nvcc[0]:
            raise ToolchainError(
                f"torch was built with CUDA {torch_cuda} and nvcc is "
                f"{'.'.join(map(str, nvcc[:2]))}: a CUDA extension this nvcc builds does not "
                f"load into this torch (the major versions differ); install a CUDA "
                f"{built[0]} toolkit (or point VITRAIL_NVCC at one), or a torch built for CUDA "
                f"{nvcc[0]}")
        if built[1] != nvcc[1]:
            warning = (f"torch was built with CUDA {torch_cuda}, nvcc is "
                       f"{'.'.join(map(str, nvcc[:2]))}: extensions load (the same major "
                       f"version), but were not built by torch's own CUDA")
    detail = (f"{cxx.strip()}, C++11 ABI {abi}; torch's CUDA {torch_cuda or 'none (a CPU build)'}"
              + ("" if cuda_headers or not nvcc else "; torch has no c10/cuda headers: CUDA "
                 "sources may include torch/types.h and the CUDA runtime, not c10/cuda or "
                 "ATen/cuda"))
    return detail, warning


def run_checks() -> list[Check]:
    import torch

    from vitrail import jit
    from vitrail.jit import housekeeping, toolchain

    checks = [Check("vitrail", True, f"{__version__} (python {platform.python_version()}, torch "
                    f"{torch.__version__}, CUDA {torch.version.cuda or 'none'})",
                    warning=toolchain.untested("torch", toolchain.major_minor(torch.__version__)))]

    def nvcc() -> tuple[str, str]:
        t = toolchain.nvcc()
        return (f"{t.version_text} at {t.path} (toolkit {t.cuda_home}; host {t.host_compiler})",
                toolchain.untested("nvcc", t.version))
    checks.append(_try("nvcc", nvcc, "install the CUDA toolkit or set VITRAIL_NVCC / CUDA_HOME"))

    def nvrtc() -> tuple[str, str]:
        t = toolchain.nvrtc()
        from importlib.metadata import version
        warning = toolchain.untested("NVRTC", t.version)
        try:  # the headers NVRTC compiles against are the toolkit's where there is one
            headers = toolchain.nvcc().version[:2]
            if headers != t.version and not warning:
                warning = (f"NVRTC {t.version_text} compiles against the CUDA "
                           f"{'.'.join(map(str, headers))} toolkit's headers; install "
                           f"nvidia-cuda-nvrtc=={headers[0]}.{headers[1]}.* or set VITRAIL_NVRTC")
        except toolchain.ToolchainError:
            pass
        bindings = version("cuda-bindings")
        warning = warning or toolchain.untested("cuda-bindings", toolchain.major_minor(bindings))
        return (f"{t.version_text} ({t.source}: {t.library}; cuda-bindings {bindings})", warning)
    checks.append(_try("NVRTC", nvrtc, "pip install nvidia-cuda-nvrtc cuda-bindings"))

    def cutlass() -> tuple[str, str]:
        t = toolchain.cutlass()
        return (f"{t.version_text} at {t.include_dir} ({t.source})",
                toolchain.untested("CUTLASS", t.version))
    checks.append(_try("CUTLASS/CuTe", cutlass, "pip install nvidia-cutlass, or set CUTLASS_PATH"))

    def extensions() -> tuple[str, str]:
        try:
            version = toolchain.nvcc().version
        except toolchain.ToolchainError:  # missing: its own check says so
            version = None
        include = os.path.join(os.path.dirname(torch.__file__), "include")
        cxx = os.environ.get("CXX") or toolchain.host_cxx()
        detail, warning = torch_extensions(
            torch.version.cuda, version, toolchain.version_line(cxx),
            int(torch._C._GLIBCXX_USE_CXX11_ABI),
            os.path.isfile(os.path.join(include, "c10", "cuda", "impl", "cuda_cmake_macros.h")))
        from vitrail.jit.extension import torch_pch_status
        try:
            status = torch_pch_status()
        except Exception as e:  # the check above holds without it
            status = f"precompiled header of torch/extension.h: unknown ({e})"
        return f"{detail}; {status}", warning
    checks.append(_try("torch extensions", extensions,
                       "install the compilers torch's headers need (see the message)"))

    def driver() -> str:
        have = toolchain.driver_version()
        if have is None:
            raise toolchain.ToolchainError("no NVIDIA driver (libcuda) on this machine")
        for compiler, tool in (("NVRTC", toolchain.nvrtc), ("nvcc", toolchain.nvcc)):
            try:
                built_by = tool().version_text
            except toolchain.ToolchainError:  # missing: its own check says so
                continue
            toolchain.check_driver_runs(compiler, built_by)
        return f"supports CUDA {have[0]}.{have[1]}: loads the cubins vitrail builds"
    driver_check = _try("driver", driver, "update the NVIDIA driver (CUDA 13 needs r580 or newer)")
    if toolchain.driver_version() is None:  # compiling needs no driver; running does
        driver_check = Check("driver", None, "none on this machine: kernels compile but cannot "
                             "run here")
    checks.append(driver_check)

    gpu = torch.cuda.is_available()
    if gpu:
        lines = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i} {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} "
                         f"SMs, {p.total_memory / 2**30:.0f} GiB")
        checks.append(Check("GPUs", True, "; ".join(lines)))
    else:
        checks.append(Check("GPUs", None, "none visible: kernels compile but cannot run here",
                            "run on a machine with an NVIDIA GPU and driver"))
    checks.append(_try("target arch", lambda: f"{toolchain.target_arch()} (from "
                       f"{toolchain.target_arch().source})",
                       "set VITRAIL_ARCH=90a (Hopper) to compile without a GPU"))

    def cache() -> str:
        i = housekeeping.info()
        return (f"{i.root}: {i.entries} kernels, {housekeeping.format_size(i.size)}"
                + (f", {i.failed} failed builds kept" if i.failed else ""))
    checks.append(_try("cache", cache, "set VITRAIL_CACHE_DIR to a writable directory"))

    n = 1000

    def build_cute() -> str:
        start = time.perf_counter()
        mod = jit.compile(CUTE_SOURCE, name="doctor_cute", backend="nvcc")
        regs = max((r.registers for r in mod.resources().values()), default=0)
        return (f"{mod.arch}, {mod.how} in {time.perf_counter() - start:.1f} s, {regs} registers"
                + ("" if "wgmma.fence" in mod.ptx else " (no sm_90a instructions)"))
    checks.append(_try("nvcc build (CuTe)", build_cute))

    def build_nvrtc() -> str:
        start = time.perf_counter()
        mod = jit.compile(NVRTC_SOURCE, name="doctor_nvrtc", backend="nvrtc")
        return f"{mod.arch}, {mod.how} in {time.perf_counter() - start:.2f} s"
    checks.append(_try("NVRTC build", build_nvrtc))

    if gpu:
        def run_cute() -> str:
            x = torch.randn(n, device="cuda")
            y = torch.full_like(x, float("nan"))
            jit.compile(CUTE_SOURCE, name="doctor_cute").vitrail_doctor_scale(x, y, n, 3.0)
            torch.testing.assert_close(y, 3.0 * x)
            return f"scale of {n} floats matches torch"
        checks.append(_try("nvcc kernel runs", run_cute))

        def run_nvrtc() -> str:
            x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
            expected = 2.0 * x + y
            jit.RawKernel(NVRTC_SOURCE, "vitrail_doctor_saxpy")[(n + 255) // 256, 256](2.0, x, y, n)
            torch.testing.assert_close(y, expected)
            return f"saxpy of {n} floats matches torch"
        checks.append(_try("NVRTC kernel runs", run_nvrtc))
    return checks


def main() -> int:
    checks = run_checks()
    width = max(len(c.what) for c in checks)
    for c in checks:
        mark = {True: "warn" if c.warning else "ok ", False: "FAIL", None: "-- "}[c.ok]
        print(f"[{mark:4}] {c.what:<{width}}  {c.detail}")
        if c.warning and c.ok:
            print(f"{'':7}{'':<{width}}  warning: {c.warning}")
        if c.fix and c.ok is not True:
            print(f"{'':7}{'':<{width}}  fix: {c.fix}")
    set_knobs = [k for k in knobs.ALL if k.is_set()]
    if set_knobs:
        print("knobs: " + ", ".join(f"{k.name}={k.get()}" for k in set_knobs))
    failed = [c for c in checks if c.ok is False]
    print(f"\n{len(checks) - len(failed)} ok, {len(failed)} failed"
          + ("" if failed else ": vitrail can compile" + (" and run" if any(
              c.what.endswith("runs") for c in checks) else "") + " kernels here"))
    return 1 if failed else 0
