// The FP8 forward's V^T: v (batch, keys, heads, DV) of 8-bit elements, written as (batch, heads,
// DV, padded) with the keys contiguous, zeros past the keys, and within each 32 keys in the order
// the forward's second product reads them (TileMMA::as_a for 8-bit A): position 16h + 4q + 2i + j
// holds key 16h + 8i + 2q + j (vitrail.ops.attention.fp8.key_order).
//
// No shared memory: a thread owns a 4-byte column of 32 keys. It loads the 32 words (a warp's
// load is whole rows of v, its lanes along DV), transposes them in registers four 4x4 bytes at a
// time (the four keys 16h + 2q + {0, 1, 8, 9} of each output word are one 4x4 block) and stores
// its four rows of V^T, 32 bytes each. v's strides and start are 4-byte multiples (the caller
// copies v otherwise).
// Instantiated with: constexpr int DV = <v head dim, a multiple of 4 up to 256>;
#pragma once

#include <cuda/std/cstdint>

namespace fp8_vt {

using cuda::std::uint32_t;
using cuda::std::uint8_t;

constexpr int kGroup = 32;     // keys a thread
constexpr int kThreads = 128;  // threads a CTA
constexpr int kWords = DV / 4;  // 4-byte columns of a row of v
static_assert(DV % 4 == 0 && DV <= 256, "DV: a multiple of 4 up to 256");

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

// Grid: (ceil(padded / 32 * DV / 4 / kThreads), batch * heads); kThreads threads.
extern "C" __global__ void __launch_bounds__(fp8_vt::kThreads)
attention_fp8_vt(cuda::std::uint8_t* vt, const cuda::std::uint8_t* v, int keys, int padded,
                 int heads, long long stride_b, long long stride_s, long long stride_h) {
  using namespace fp8_vt;
  const int t = blockIdx.x * kThreads + threadIdx.x;
  const int c = t % kWords, k0 = t / kWords * kGroup;  // the column and the group's first key
  if (k0 >= padded) return;
  const int bh = blockIdx.y;  // batch entry * heads + head
  const uint8_t* src = v + (bh / heads) * stride_b + (bh % heads) * stride_h + 4 * c;
  uint32_t w[kGroup];
#pragma unroll
  for (int r = 0; r < kGroup; ++r)
    w[r] = k0 + r < keys ? *reinterpret_cast<const uint32_t*>(src + (k0 + r) * stride_s) : 0u;
  uint32_t out[4][kGroup / 4];  // [byte of the column][positions 4m .. 4m + 3]
#pragma unroll
  for (int m = 0; m < kGroup / 4; ++m) {
    const int a = 16 * (m / 4) + 2 * (m % 4);  // positions 4m + j hold keys a + {0, 1, 8, 9}
    uint32_t y[4];
    transpose4x4(w[a], w[a + 1], w[a + 8], w[a + 9], y);
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e][m] = y[e];
  }
  uint8_t* dst = vt + ((long long)bh * DV + 4 * c) * padded + k0;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    uint4* row = reinterpret_cast<uint4*>(dst + (long long)e * padded);
    row[0] = make_uint4(out[e][0], out[e][1], out[e][2], out[e][3]);
    row[1] = make_uint4(out[e][4], out[e][5], out[e][6], out[e][7]);
  }
}
