// sm90_copy.cuh: copies between any strides, with dtype conversion.
//
// - flat_kernel: both sides contiguous in the same order: 16-byte vector loads, U vectors in
//   flight per thread, a grid-stride loop sized to the GPU, the ragged tail elementwise.
//   Constraint: both pointers aligned to V elements of their type (the caller picks V = 1 else).
// - tiled_kernel: any strides, up to 6 dims after the caller has merged what it can. Dim 0 is
//   the output's fastest dim, dim 1 the input's fastest (or any other dim when the input's fastest
//   is dim 0 too); a CTA moves a Tile x Tile tile through shared memory, reading coalesced along
//   the input's fastest dim and writing coalesced along the output's (the transposing case), and
//   loops over the rest (dims 2..5) as a batch.
#pragma once
#include <vitrail/launch.cuh>
#include <vitrail/tile_copy.cuh>

#include <algorithm>
#include <type_traits>

namespace vitrail::copy {

template <class TI, class TO, int V, int U, int Threads>
__global__ void __launch_bounds__(Threads)
flat_kernel(TO* __restrict__ out, const TI* __restrict__ in, long long n) {
  const long long vectors = n / V;
  const long long step = (long long)gridDim.x * Threads * U;
  for (long long base = (long long)blockIdx.x * Threads * U + threadIdx.x; base < vectors;
       base += step) {
    Frg<TI, V> f[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long i = base + (long long)u * Threads;
      load_frg_if(f[u], in + i * V, i < vectors);  // one predicated load: all U in flight
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long i = base + (long long)u * Threads;
      if (i < vectors) {
        Frg<TO, V> o;
#pragma unroll
        for (int k = 0; k < V; ++k) o[k] = convert<TO>(f[u][k]);
        store_frg<V>(out + i * V, o);
      }
    }
  }
  if (blockIdx.x == 0)
    for (long long i = vectors * V + threadIdx.x; i < n; i += Threads) out[i] = convert<TO>(in[i]);
}

struct Strided {
  long long size[6], si[6], so[6];  // per dim: extent, input stride, output stride (elements)
  int ndim;
};

template <class TI, class TO, int Tile, int Threads>
__global__ void __launch_bounds__(Threads)
tiled_kernel(TO* __restrict__ out, const TI* __restrict__ in, Strided p, bool load_along0) {
  constexpr int K = Tile * Tile / Threads;
  __shared__ TO tile[Tile][Tile + 1];  // [i1][i0]
  const long long tiles0 = (p.size[0] + Tile - 1) / Tile, tiles1 = (p.size[1] + Tile - 1) / Tile;
  long long b = blockIdx.x;
  const long long base0 = (b % tiles0) * Tile;
  b /= tiles0;
  const long long base1 = (b % tiles1) * Tile;
  b /= tiles1;
  long long oi = 0, oo = 0;
  for (int d = 2; d < p.ndim; ++d) {
    const long long idx = b % p.size[d];
    b /= p.size[d];
    oi += idx * p.si[d];
    oo += idx * p.so[d];
  }
  const int n0 = (int)(p.size[0] - base0 < Tile ? p.size[0] - base0 : Tile);
  const int n1 = (int)(p.size[1] - base1 < Tile ? p.size[1] - base1 : Tile);
  const TI* src = in + oi + base0 * p.si[0] + base1 * p.si[1];
  TI v[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int e = threadIdx.x + k * Threads;
    const int i0 = load_along0 ? e % Tile : e / Tile, i1 = load_along0 ? e / Tile : e % Tile;
    if (i0 < n0 && i1 < n1) v[k] = src[i0 * p.si[0] + i1 * p.si[1]];
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int e = threadIdx.x + k * Threads;
    const int i0 = load_along0 ? e % Tile : e / Tile, i1 = load_along0 ? e / Tile : e % Tile;
    if (i0 < n0 && i1 < n1) tile[i1][i0] = convert<TO>(v[k]);
  }
  __syncthreads();
  TO* dst = out + oo + base0 * p.so[0] + base1 * p.so[1];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int e = threadIdx.x + k * Threads;
    const int i0 = e % Tile, i1 = e / Tile;
    if (i0 < n0 && i1 < n1) dst[i0 * p.so[0] + i1 * p.so[1]] = tile[i1][i0];
  }
}

template <class TI, class TO, int V, int U, int Threads>
cudaError_t launch_flat(TO* out, const TI* in, long long n, int sms, cudaStream_t stream) {
  VITRAIL_TRY(require(n >= 0 && ((uintptr_t)in % (V * sizeof(TI))) == 0 &&
                      ((uintptr_t)out % (V * sizeof(TO))) == 0));
  if (n == 0) return cudaSuccess;
  if constexpr (sizeof(TI) == sizeof(TO) && std::is_same_v<TI, TO>) {
    // Same type, both contiguous: the driver's device-to-device copy (what torch's copy_ uses).
    return cudaMemcpyAsync(out, in, n * sizeof(TI), cudaMemcpyDeviceToDevice, stream);
  }
  const long long per_cta = (long long)Threads * U * V;
  const long long ctas = std::max(1LL, std::min((n + per_cta - 1) / per_cta, (long long)sms * 8));
  flat_kernel<TI, TO, V, U, Threads><<<(unsigned)ctas, Threads, 0, stream>>>(out, in, n);
  return cudaGetLastError();
}

template <class TI, class TO, int Tile, int Threads>
cudaError_t launch_tiled(TO* out, const TI* in, const Strided& p, bool load_along0,
                         cudaStream_t stream) {
  VITRAIL_TRY(require(p.ndim >= 2 && p.ndim <= 6));
  long long ctas = (p.size[0] + Tile - 1) / Tile * ((p.size[1] + Tile - 1) / Tile);
  for (int d = 2; d < p.ndim; ++d) ctas *= p.size[d];
  VITRAIL_TRY(require(ctas > 0 && ctas < (1LL << 31)));
  tiled_kernel<TI, TO, Tile, Threads><<<(unsigned)ctas, Threads, 0, stream>>>(out, in, p, load_along0);
  return cudaGetLastError();
}

}  // namespace vitrail::copy
