"""Host overhead of a cached call to a trivial kernel, on both JIT paths.

Measures the host time one call takes (the kernel itself does nothing) for a vitrail RawKernel
(NVRTC, driver launch), a vitrail nvcc entry point (ctypes into the shared library, which
launches with the runtime API), torch's ``Tensor.add_`` on a one-element tensor, and a CuPy
RawKernel launch, the baseline: vitrail's goal is to be no slower than CuPy.
"""
from __future__ import annotations

import statistics
import time

from vitrail.bench import Row, register

NOOP_KERNEL = r"""
extern "C" __global__ void vitrail_noop(float* p, int n) {
  if (n < 0 && threadIdx.x == 0) p[0] = 0.f;  // never true: the launch is all there is
}
"""
NOOP_ENTRY = r"""
#include <cuda_runtime.h>
__global__ void noop_kernel(float* p, int n) { if (n < 0 && threadIdx.x == 0) p[0] = 0.f; }
extern "C" cudaError_t vitrail_noop_launch(float* p, int n, cudaStream_t stream) {
  noop_kernel<<<1, 32, 0, stream>>>(p, n);
  return cudaGetLastError();
}
"""


def build() -> None:
    from vitrail import jit
    jit.compile(NOOP_KERNEL, name="vitrail_noop", backend="nvrtc")
    jit.compile(NOOP_ENTRY, name="vitrail_noop_launch", backend="nvcc")


def per_call_us(fns: dict, calls: int = 2000, rounds: int = 9) -> dict[str, float]:
    """Median over rounds of host microseconds per call, for each function.

    Rounds go round-robin over the functions, so a slower or faster spell of the machine
    (shared hosts drift by tens of percent) falls on all of them alike. The GPU is synchronized
    between rounds, never inside one.
    """
    import torch
    for fn in fns.values():
        for _ in range(200):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return {name: statistics.median(s) for name, s in samples.items()}


@register("jit.launch_overhead", "host µs per cached call of a trivial kernel", build)
def run() -> list[Row]:
    import torch

    from vitrail import jit
    x = torch.zeros(1, device="cuda")
    raw = jit.RawKernel(NOOP_KERNEL, "vitrail_noop")
    launch = raw[1, 32]
    entry = jit.compile(NOOP_ENTRY, name="vitrail_noop_launch").vitrail_noop_launch
    fns = {
        "vitrail RawKernel, k[g, b](...)": lambda: raw[1, 32](x, 1),
        "vitrail RawKernel, bound launcher": lambda: launch(x, 1),
        "vitrail nvcc entry point": lambda: entry(x, 1),
        "vitrail jit.compile (memo hit)":
            lambda: jit.compile(NOOP_ENTRY, name="vitrail_noop_launch"),
        "torch Tensor.add_": lambda: x.add_(1.0),
    }
    baseline = "CuPy RawKernel"
    try:
        import cupy
        import numpy as np
        ck = cupy.RawKernel(NOOP_KERNEL, "vitrail_noop")
        buf = cupy.zeros(1, dtype=cupy.float32)
        one = np.int32(1)
        fns[baseline] = lambda: ck((1,), (32,), (buf, one))
    except ImportError:
        baseline = "torch Tensor.add_"
    return [Row("trivial kernel", name, us, "µs/call", baseline=name == baseline)
            for name, us in per_call_us(fns).items()]
