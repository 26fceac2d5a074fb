// The FP8 forward's V^T: v (batch, keys, heads, DV) of 8-bit elements, written as (batch, heads,
// DV, padded) with the keys contiguous, zeros past the keys, and within each 32 keys in the order
// the forward's second product reads them (TileMMA::as_a for 8-bit A): position 16h + 4q + 2i + j
// holds key 16h + 8i + 2q + j (vitrail.ops.attention.fp8.key_order).
//
// No shared memory: a thread owns a 4-byte column of 16 keys (half a group). It loads the 16
// words, transposes them in registers a 4x4 block of bytes at a time (the keys 2q + {0, 1, 8, 9}
// of the half fill output word q) and stores its four rows of V^T, 16 bytes each. A warp is 8
// columns by 4 halves, so its loads are whole 32-byte sectors of 4 rows of v and its stores 64
// contiguous bytes of 8 rows of V^T. v's strides and start are 4-byte multiples (the caller
// copies v otherwise).
// Instantiated with: constexpr int DV = <v head dim, a multiple of 32 up to 256>;
#pragma once

#include <cuda/std/cstdint>

namespace fp8_vt {

using cuda::std::uint32_t;
using cuda::std::uint8_t;

constexpr int kHalf = 16;           // keys a thread
constexpr int kThreads = 128;       // threads a CTA
constexpr int kColBlocks = DV / 32;  // a warp's 8 columns of 4 bytes
static_assert(DV % 32 == 0 && DV <= 256, "DV: a multiple of 32 up to 256");

// Byte e of each of x0..x3, as one word (x0's byte lowest), for e = 0..3.
__device__ __forceinline__ void transpose4x4(uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3,
                                             uint32_t (&y)[4]) {
  const uint32_t lo01 = __byte_perm(x0, x1, 0x5140), hi01 = __byte_perm(x0, x1, 0x7362);
  const uint32_t lo23 = __byte_perm(x2, x3, 0x5140), hi23 = __byte_perm(x2, x3, 0x7362);
  y[0] = __byte_perm(lo01, lo23, 0x5410);
  y[1] = __byte_perm(lo01, lo23, 0x7632);
  y[2] = __byte_perm(hi01, hi23, 0x5410);
  y[3] = __byte_perm(hi01, hi23, 0x7632);
}

}  // namespace fp8_vt

// Grid: (ceil(ceil(padded / 64) * DV / 32 / 4), batch * heads); kThreads threads.
extern "C" __global__ void __launch_bounds__(fp8_vt::kThreads)
attention_fp8_vt(cuda::std::uint8_t* vt, const cuda::std::uint8_t* v, int keys, int padded,
                 int heads, long long stride_b, long long stride_s, long long stride_h) {
  using namespace fp8_vt;
  const int warp = blockIdx.x * (kThreads / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int c = 8 * (warp % kColBlocks) + lane / 4;           // the column of 4 bytes
  const int k0 = kHalf * (4 * (warp / kColBlocks) + lane % 4);  // the half's first key
  if (k0 >= padded) return;
  const int bh = blockIdx.y;  // batch entry * heads + head
  const uint8_t* src = v + (bh / heads) * stride_b + (bh % heads) * stride_h + 4 * c;
  uint32_t w[kHalf];
#pragma unroll
  for (int r = 0; r < kHalf; ++r)
    w[r] = k0 + r < keys ? *reinterpret_cast<const uint32_t*>(src + (k0 + r) * stride_s) : 0u;
  uint32_t out[4][4];  // [byte of the column][output word q: positions 4q .. 4q + 3]
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint32_t y[4];
    transpose4x4(w[2 * q], w[2 * q + 1], w[2 * q + 8], w[2 * q + 9], y);
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e][q] = y[e];
  }
  uint8_t* dst = vt + ((long long)bh * DV + 4 * c) * padded + k0;
#pragma unroll
  for (int e = 0; e < 4; ++e)
    *reinterpret_cast<uint4*>(dst + (long long)e * padded) =
        make_uint4(out[e][0], out[e][1], out[e][2], out[e][3]);
}
