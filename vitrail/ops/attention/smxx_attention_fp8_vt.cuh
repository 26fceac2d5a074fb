// The FP8 forward's V^T: v (batch, keys, heads, DV) of 8-bit elements, written as (batch, heads,
// DV, padded) with the keys contiguous, zeros past the keys, and within each 32 keys in the order
// the forward's second product reads them (TileMMA::as_a for 8-bit A): position 16h + 4q + 2i + j
// holds key 16h + 8i + 2q + j (vitrail.ops.attention.fp8.key_order).
//
// A CTA per (64 keys, batch entry and head): the keys' rows read into shared memory in 4-byte
// words along DV (v's strides and start 4-byte multiples: the caller copies v otherwise), then
// each of the DV rows of V^T written as 4-byte words of 4 positions.
// Instantiated with: constexpr int DV = <v head dim, a multiple of 4 up to 256>;
#pragma once

#include <cuda/std/cstdint>

namespace fp8_vt {

using cuda::std::uint32_t;
using cuda::std::uint8_t;

constexpr int kKeys = 64;     // keys a CTA (two groups of 32)
constexpr int kThreads = 256;
constexpr int kPitch = DV + 4;  // a row of the tile in shared memory, bytes
static_assert(DV % 4 == 0 && DV <= 256, "DV: a multiple of 4 up to 256");

// The key at position p of a group of 32.
__device__ __forceinline__ int key_of(int p) {
  return 16 * (p / 16) + 8 * (p % 4 / 2) + 2 * (p % 16 / 4) + p % 2;
}

}  // namespace fp8_vt

extern "C" __global__ void __launch_bounds__(fp8_vt::kThreads)
attention_fp8_vt(cuda::std::uint8_t* vt, const cuda::std::uint8_t* v, int keys, int padded,
                 int heads, long long stride_b, long long stride_s, long long stride_h) {
  using namespace fp8_vt;
  __shared__ __align__(16) uint8_t tile[kKeys * kPitch];
  const int k0 = blockIdx.x * kKeys;
  const int bh = blockIdx.y;  // batch entry * heads + head
  const uint8_t* src = v + (bh / heads) * stride_b + (bh % heads) * stride_h;
  for (int i = threadIdx.x; i < kKeys * (DV / 4); i += kThreads) {
    const int r = i / (DV / 4), c = i % (DV / 4);
    const int key = k0 + r;
    const uint32_t word =
        key < keys ? *reinterpret_cast<const uint32_t*>(src + key * stride_s + 4 * c) : 0u;
    *reinterpret_cast<uint32_t*>(tile + r * kPitch + 4 * c) = word;
  }
  __syncthreads();
  uint8_t* dst = vt + (long long)bh * DV * padded + k0;
  for (int i = threadIdx.x; i < DV * (kKeys / 4); i += kThreads) {
    const int row = i / (kKeys / 4), w = i % (kKeys / 4);  // positions 4w .. 4w + 3 of row
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int p = 4 * w + j;
      word |= uint32_t(tile[(32 * (p / 32) + key_of(p % 32)) * kPitch + row]) << (8 * j);
    }
    *reinterpret_cast<uint32_t*>(dst + (long long)row * padded + 4 * w) = word;
  }
}
