// Shared by the sympow kernels (prepended to each kernel's source by vitrail/ops/sympow):
// the element type T chosen by T_ID (0 float, 1 half, 2 bfloat16), conversions, vectors.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <vitrail/tprod.cuh>

#if T_ID == 0
typedef float T;
#elif T_ID == 1
typedef __half T;
#else
typedef __nv_bfloat16 T;
#endif

namespace sympow_detail {
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class U> __device__ __forceinline__ U from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <int N> struct alignas(sizeof(T) * N) Vec { T v[N]; };

// The problem p and the tile (t0, t1) this CTA computes, t1 the faster index. The host launches
// one of two orders (configs.launch_grid): grid (P * tiles0 * tiles1) with the tiles fastest, so
// that the CTAs resident at once work on few problems and share their operands in L2; or
// grid (P, tiles0, tiles1), P fastest (the first order, kept for comparisons). With one tile
// both decode alike. (blockIdx.x read by asm volatile: a kernel near its register limit may
// call it again in its epilogue rather than hold the results through the mainloop.)
__device__ __forceinline__ long long cta_tile(int tiles0, int tiles1, int& t0, int& t1) {
  unsigned x;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(x));
  if (gridDim.y == 1 && gridDim.z == 1) {
    const unsigned per = (unsigned)tiles0 * (unsigned)tiles1, b = x;
    const unsigned p = b / per, t = b - p * per;
    t0 = (int)(t / (unsigned)tiles1);
    t1 = (int)(t - (unsigned)t0 * (unsigned)tiles1);
    return p;
  }
  t0 = blockIdx.y;
  t1 = blockIdx.z;
  return x;
}
}  // namespace sympow_detail

