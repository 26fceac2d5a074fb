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


def per_call_us(fn, calls: int = 2000, rounds: int = 7) -> float:
    """Median over rounds of host microseconds per call (GPU synced between rounds only)."""
    import torch
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


@register("jit.launch_overhead", "host µs per cached call of a trivial kernel", build)
def run() -> list[Row]:
    import torch

    from vitrail import jit
    x = torch.zeros(1, device="cuda")
    raw = jit.RawKernel(NOOP_KERNEL, "vitrail_noop")
    launch = raw[1, 32]
    entry = jit.compile(NOOP_ENTRY, name="vitrail_noop_launch").vitrail_noop_launch
    case = "trivial kernel"
    rows = [
        Row(case, "vitrail RawKernel (NVRTC)", per_call_us(lambda: launch(x, 1)), "µs/call"),
        Row(case, "vitrail RawKernel, k[g, b](...)", per_call_us(lambda: raw[1, 32](x, 1)),
            "µs/call"),
        Row(case, "vitrail nvcc entry point", per_call_us(lambda: entry(x, 1)), "µs/call"),
        Row(case, "torch Tensor.add_", per_call_us(lambda: x.add_(1.0)), "µs/call"),
        Row(case, "vitrail jit.compile (memo hit)",
            per_call_us(lambda: jit.compile(NOOP_ENTRY, name="vitrail_noop_launch")), "µs/call"),
    ]
    try:
        import cupy
        import numpy as np
        ck = cupy.RawKernel(NOOP_KERNEL, "vitrail_noop")
        buf = cupy.zeros(1, dtype=cupy.float32)
        one = np.int32(1)
        rows.append(Row(case, "CuPy RawKernel", per_call_us(lambda: ck((1,), (32,), (buf, one))),
                        "µs/call", baseline=True))
    except ImportError:
        pass
    return rows
