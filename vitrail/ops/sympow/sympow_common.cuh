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
}  // namespace sympow_detail

