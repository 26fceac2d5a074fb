// rms_norm.cuh: an example memory-bound op written with vitrail's blocks (copy this file).
//
//   y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps)
//
// One row per group of TPR threads, held in registers as Iters 16-byte fragments (TileCopy's
// load_frg/store_frg, predicated at the row's end), one SmartReduce for the sum of squares,
// launched through vitrail::launch (errors come back to Python as vitrail.jit.LaunchError).
// Constraints: the last dim contiguous, rows 16-byte aligned (ld % V == 0), n <= TPR * Iters * V.
#pragma once
#include <vitrail/launch.cuh>
#include <vitrail/smart_reduce.cuh>
#include <vitrail/tile_copy.cuh>

namespace example {
using namespace vitrail;

template <class T, int TPR, int Threads, int Iters>
__global__ void __launch_bounds__(Threads)
rms_norm_kernel(T* __restrict__ y, const T* __restrict__ x, long long rows, int n, long long ld,
                float eps) {
  constexpr int V = kVec<T>;  // elements per 16-byte fragment
  __shared__ float scratch[Threads / 32 + 1];
  const int t = threadIdx.x % TPR;
  const long long row = (long long)blockIdx.x * (Threads / TPR) + threadIdx.x / TPR;
  const bool live = row < rows;  // dead rows still take part in the reduction
  const T* xr = x + (live ? row : 0) * ld;

  Frg<T, V> frg[Iters];  // the row's slice, in registers: read from HBM once
#pragma unroll
  for (int i = 0; i < Iters; ++i) {
    const int col = (i * TPR + t) * V;  // neighbouring threads read neighbouring vectors
    frg[i] = load_frg<V>(xr + col, live ? n - col : 0, from_float<T>(0.f));
  }
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < Iters; ++i)
#pragma unroll
    for (int k = 0; k < V; ++k) ss += to_float(frg[i][k]) * to_float(frg[i][k]);
  ss = SmartReduce<TPR>::reduce(ss, Sum{}, scratch);  // every thread of the row gets the sum
  const float scale = rsqrtf(ss / n + eps);
  if (!live) return;
#pragma unroll
  for (int i = 0; i < Iters; ++i) {
    const int col = (i * TPR + t) * V;
    Frg<T, V> out;
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = from_float<T>(to_float(frg[i][k]) * scale);
    store_frg<V>(y + row * ld + col, out, n - col);
  }
}

template <class T, int TPR, int Threads, int Iters>
cudaError_t rms_norm(T* y, const T* x, long long rows, int n, long long ld, float eps,
                     cudaStream_t stream) {
  constexpr int V = kVec<T>;
  VITRAIL_TRY(require(n >= 1 && n <= TPR * Iters * V && ld % V == 0));  // can_implement
  return launch(rms_norm_kernel<T, TPR, Threads, Iters>, dim3(ceil_div(rows, Threads / TPR)),
                dim3(Threads), 0, stream, /*cluster=*/1, y, x, rows, n, ld, eps);
}
}  // namespace example
