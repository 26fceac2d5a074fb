"""The sum of fp32 partials of a convolution's dw, rounded once to bf16 or fp16: one kernel for
the chunked implicit-GEMM wgrad (a partial dw a chunk of the batch) and the depthwise wgrad (a
partial dw a block column).

    sum_partials(partials, dw, blocks)
        dw (packed) = the sum of partials' `blocks` fp32 blocks of dw.numel() values (block b at
        b dw.numel()), rounded to nearest once

In one order, whatever the GPU: a block of THREADS threads computes OUTPUTS outputs, LANES
threads each; lane l adds partials l, l + LANES, ... and lane 0 adds the LANES lane sums in
order. Deterministic, no atomics. The kernel is an NVRTC RawKernel (vitrail.jit) launched on
the current stream, so a plan (vitrail.plan) records and replays it.
"""
from __future__ import annotations

import torch
from torch import Tensor

THREADS = 256
LANES = 8  # threads an output
OUTPUTS = THREADS // LANES  # a block's outputs

# an fp32 value rounded to nearest bf16 (kBf16) or fp16, as 16 bits: every conv kernel that
# writes 16-bit values from fp32 sums (this one, the depthwise ones) stores through it
ROUNDING = r"""
#ifndef CONV_ROUNDING
#define CONV_ROUNDING
namespace vitrail_conv {
template <int kBf16> __device__ __forceinline__ unsigned short store(float f) {
  unsigned short h;
  if (kBf16) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
}  // namespace vitrail_conv
#endif
"""

SOURCE = ROUNDING + r"""

// dw (n elements, packed; bf16 or fp16) = the sum of `blocks` fp32 partials of its size (block
// b at b n), in one order: a block's 32 outputs, 8 threads each adding every 8th partial, then
// those 8 in order; rounded once
template <int kBf16>
__global__ void __launch_bounds__(256) vitrail_conv_partials_sum(
    const float* __restrict__ partials, unsigned short* __restrict__ dw, long long n,
    long long blocks) {
  __shared__ float sums[8][32];
  const int o = threadIdx.x % 32, lane = threadIdx.x / 32;
  const long long i = blockIdx.x * 32LL + o;
  float sum = 0.f;
  for (long long b = lane; i < n && b < blocks; b += 8) sum += partials[b * n + i];
  sums[lane][o] = sum;
  __syncthreads();
  if (lane == 0 && i < n) {
    float total = 0.f;
#pragma unroll
    for (int l = 0; l < 8; ++l) total += sums[l][o];
    dw[i] = vitrail_conv::store<kBf16>(total);
  }
}
"""
SIGNATURE = "const float*, unsigned short*, long long, long long"
_KERNELS: dict[int, object] = {}


def _kernel(bf16: int):
    """The RawKernel vitrail_conv_partials_sum<bf16> (built on its first launch)."""
    kernel = _KERNELS.get(bf16)
    if kernel is None:
        from vitrail import jit
        kernel = _KERNELS.setdefault(bf16, jit.RawKernel(
            SOURCE, f"vitrail_conv_partials_sum<{bf16}>", signature=SIGNATURE))
    return kernel


def sum_partials(partials: Tensor, dw: Tensor, blocks: int) -> None:
    """dw (packed, bf16 or fp16) = the sum of partials' `blocks` fp32 blocks of dw's size (block
    b at b dw.numel()), in one order, rounded once: one launch on the current stream."""
    if dw.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"sum_partials: dw must be bf16 or fp16, got {dw.dtype}")
    if not dw.is_contiguous():
        raise ValueError(f"sum_partials: dw's elements must be packed (contiguous), got shape "
                         f"{tuple(dw.shape)} with strides {dw.stride()}")
    n = dw.numel()
    if (partials.dtype != torch.float32 or not partials.is_contiguous()
            or partials.numel() < blocks * n):
        raise ValueError(f"sum_partials: partials must be {blocks} packed fp32 blocks of "
                         f"{n} values, got {partials.dtype} of {partials.numel()} with strides "
                         f"{partials.stride()}")
    if n == 0:
        return
    _kernel(int(dw.dtype is torch.bfloat16))[-(-n // OUTPUTS), THREADS](partials, dw, n,
                                                                        blocks)
