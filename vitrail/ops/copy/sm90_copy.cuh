// sm90_copy.cuh: copies between any strides, with dtype conversion.
//
// - flat_kernel: both sides contiguous in the same order: 16-byte vector loads, U vectors in
//   flight per thread, a grid-stride loop sized to the GPU, the ragged tail elementwise.
//   Constraint: both pointers aligned to V elements of their type (the caller picks V = 1 else).
// - tiled_kernel: any strides, up to 6 dims after the caller has merged what it can. Dim 0 is
//   the output's fastest dim, dim 1 the input's fastest (or any other dim when the input's fastest
//   is dim 0 too); a CTA moves a Tile x Tile tile through shared memory, reading coalesced along
//   the input's fastest dim and writing coalesced along the output's (the transposing case), and
//   loops over the rest (dims 2..5) as a batch. One element per access: the general fallback.
// - transpose_kernel: the transposing case in 16-byte vectors on both sides (the input's dim 1
//   and the output's dim 0 have stride 1; the other strides and both pointers 16-byte aligned).
//   A thread moves a B x B block (B: 16 bytes of the narrower type) with vector loads along
//   input rows, a transpose in registers and B vector stores along output rows; no shared memory.
// - rows_kernel: the input's and the output's fastest dim are the same (dim 0, stride 1 on both
//   sides) but rows are apart (a slice, padded rows): 16-byte vectors along each row, predicated
//   at its end; a CTA covers Threads / Lanes rows, Lanes * U vectors of each.
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

// The tile of CTA blockIdx.x: its corner (dims 0 and 1) and the offsets of its batch index
// (dims 2..) in the input and the output. The launchers keep the CTA count, the product of the
// tile counts and the batch extents, under 2^31, so each of them fits 32 bits: 32-bit divisions
// (a 64-bit one is a subroutine of about a hundred instructions, run by every thread).
struct TilePos {
  long long base0, base1, in_offset, out_offset;
};
template <int Tile0, int Tile1>
__device__ __forceinline__ TilePos tile_position(const Strided& p) {
  const unsigned tiles0 = (unsigned)((p.size[0] + Tile0 - 1) / Tile0);
  const unsigned tiles1 = (unsigned)((p.size[1] + Tile1 - 1) / Tile1);
  unsigned b = blockIdx.x;
  TilePos t{(long long)(b % tiles0) * Tile0, 0, 0, 0};
  b /= tiles0;
  t.base1 = (long long)(b % tiles1) * Tile1;
  b /= tiles1;
  for (int d = 2; d < p.ndim; ++d) {
    const unsigned n = (unsigned)p.size[d], idx = b % n;
    b /= n;
    t.in_offset += idx * p.si[d];
    t.out_offset += idx * p.so[d];
  }
  return t;
}
// The launchers' side of tile_position: the CTA count (tiles along dims 0 and 1 times the batch),
// refused unless 2 <= ndim <= 6 and the count is in 1 .. 2^31 - 1.
template <int Tile0, int Tile1>
inline cudaError_t tile_grid(const Strided& p, unsigned& ctas) {
  VITRAIL_TRY(require(p.ndim >= 2 && p.ndim <= 6));
  long long n = (p.size[0] + Tile0 - 1) / Tile0 * ((p.size[1] + Tile1 - 1) / Tile1);
  for (int d = 2; d < p.ndim; ++d) n *= p.size[d];
  VITRAIL_TRY(require(n > 0 && n < (1LL << 31)));
  ctas = (unsigned)n;
  return cudaSuccess;
}

template <class TI, class TO, int Tile, int Threads>
__global__ void __launch_bounds__(Threads)
tiled_kernel(TO* __restrict__ out, const TI* __restrict__ in, Strided p, bool load_along0) {
  constexpr int K = Tile * Tile / Threads;
  __shared__ TO tile[Tile][Tile + 1];  // [i1][i0]
  const TilePos t = tile_position<Tile, Tile>(p);
  const long long base0 = t.base0, base1 = t.base1, oi = t.in_offset, oo = t.out_offset;
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

// A thread's B x B block and a warp's lanes: the block's B indices along dim 0 are B / VO runs
// of VO (one output vector each), and along dim 1 B / VI runs of VI (one input vector each); the
// Lanes0 = 32 / Lanes1 lanes along dim 0 interleave their runs, as do the Lanes1 lanes along
// dim 1. So one load instruction reads Lanes1 adjacent 16-byte vectors of each of Lanes0 input
// rows, and one store writes Lanes0 adjacent 16-byte vectors of each of Lanes1 output rows: whole
// 32-byte sectors both ways, also when one type is wider (B / VI or B / VO runs > 1). Warps1
// warps side by side along dim 1, the others along dim 0.
template <class TI, class TO, int Lanes1, int Warps1, int Threads>
struct TransposeShape {
  static constexpr int VI = kVec<TI>, VO = kVec<TO>;
  static constexpr int B = VI > VO ? VI : VO;  // the block's side: 16 bytes of the narrower type
  static constexpr int Lanes0 = 32 / Lanes1, Warps0 = Threads / 32 / Warps1;
  static constexpr int Tile0 = B * Lanes0 * Warps0, Tile1 = B * Lanes1 * Warps1;
  static_assert(32 % Lanes1 == 0 && Threads % (32 * Warps1) == 0, "lanes and warps must tile");
};

template <class TI, class TO, int Lanes1, int Warps1, int Threads>
__global__ void __launch_bounds__(Threads)
transpose_kernel(TO* __restrict__ out, const TI* __restrict__ in, Strided p) {
  using S = TransposeShape<TI, TO, Lanes1, Warps1, Threads>;
  constexpr int B = S::B, VI = S::VI, VO = S::VO;
  const TilePos t = tile_position<S::Tile0, S::Tile1>(p);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const long long w0 = t.base0 + (long long)(warp / Warps1) * S::Lanes0 * B;  // the warp's corner
  const long long w1 = t.base1 + (long long)(warp % Warps1) * Lanes1 * B;
  const int lane0 = lane / Lanes1, lane1 = lane % Lanes1;
  // the block's r-th index along dim 0 and c-th along dim 1
  auto row = [&](int r) { return w0 + ((r / VO) * S::Lanes0 + lane0) * VO + r % VO; };
  auto col = [&](int c) { return w1 + ((c / VI) * Lanes1 + lane1) * VI + c % VI; };
  const TI* src = in + t.in_offset;    // element (i0, i1) at src[i0 * si[0] + i1]
  TO* dst = out + t.out_offset;        // element (i0, i1) at dst[i0 + i1 * so[1]]
  if (row(B - 1) >= p.size[0] || col(B - 1) >= p.size[1]) {  // at the edge: element by element
    for (int r = 0; r < B; ++r)
      for (int c = 0; c < B; ++c)
        if (row(r) < p.size[0] && col(c) < p.size[1])
          dst[row(r) + col(c) * p.so[1]] = convert<TO>(src[row(r) * p.si[0] + col(c)]);
    return;
  }
  Frg<TI, VI> a[B][B / VI];  // a[r][h]: input row row(r), elements col(h * VI) ..
#pragma unroll
  for (int r = 0; r < B; ++r)
#pragma unroll
    for (int h = 0; h < B / VI; ++h) a[r][h] = load_frg<VI>(src + row(r) * p.si[0] + col(h * VI));
  Frg<TO, VO> o[B][B / VO];  // o[c][h]: output row col(c), elements row(h * VO) ..
#pragma unroll
  for (int c = 0; c < B; ++c)
#pragma unroll
    for (int r = 0; r < B; ++r) o[c][r / VO][r % VO] = convert<TO>(a[r][c / VI][c % VI]);
#pragma unroll
  for (int c = 0; c < B; ++c)
#pragma unroll
    for (int h = 0; h < B / VO; ++h) store_frg_v4(dst + col(c) * p.so[1] + row(h * VO), o[c][h]);
}

// V: elements per vector (16 bytes of the wider type); rows are 16-byte aligned on both sides.
template <class TI, class TO, int V, int Lanes, int U, int Threads>
__global__ void __launch_bounds__(Threads)
rows_kernel(TO* __restrict__ out, const TI* __restrict__ in, Strided p) {
  constexpr int Rows = Threads / Lanes;
  static_assert(Threads % Lanes == 0, "Lanes must divide Threads");
  // chunk blockIdx.x of Lanes * U * V elements along dim 0, of Rows rows along dim 1
  const TilePos t = tile_position<Lanes * U * V, Rows>(p);
  const long long row = t.base1 + threadIdx.x / Lanes;
  if (row >= p.size[1]) return;
  const TI* src = in + t.in_offset + row * p.si[1];
  TO* dst = out + t.out_offset + row * p.so[1];
  const long long first = t.base0 + (long long)(threadIdx.x % Lanes) * V;
  const long long n = p.size[0];
  Frg<TI, V> f[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const long long i = first + (long long)u * Lanes * V;
    f[u] = load_frg<V>(src + i, (int)(n - i < V ? n - i : V), TI(0.0f));  // nothing past the end
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const long long i = first + (long long)u * Lanes * V;
    Frg<TO, V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) o[k] = convert<TO>(f[u][k]);
    if constexpr (V * sizeof(TO) == 16) {
      if (i + V <= n) {
        store_frg_v4(dst + i, o);  // the plain store splits here as in the transpose
        continue;
      }
    }
    if (i < n) store_frg<V>(dst + i, o, (int)(n - i));
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
  unsigned ctas;
  VITRAIL_TRY((tile_grid<Tile, Tile>(p, ctas)));
  tiled_kernel<TI, TO, Tile, Threads><<<ctas, Threads, 0, stream>>>(out, in, p, load_along0);
  return cudaGetLastError();
}

// The transposing case in vectors; the caller checks strides and alignment (require()s here).
template <class TI, class TO, int Lanes1, int Warps1, int Threads>
cudaError_t launch_transpose(TO* out, const TI* in, const Strided& p, cudaStream_t stream) {
  using S = TransposeShape<TI, TO, Lanes1, Warps1, Threads>;
  unsigned ctas;
  VITRAIL_TRY((tile_grid<S::Tile0, S::Tile1>(p, ctas)));  // checks ndim first
  VITRAIL_TRY(require(p.si[1] == 1 && p.so[0] == 1));
  bool aligned = (uintptr_t)in % 16 == 0 && (uintptr_t)out % 16 == 0 &&
                 p.si[0] % S::VI == 0 && p.so[1] % S::VO == 0;
  for (int d = 2; d < p.ndim; ++d) aligned = aligned && p.si[d] % S::VI == 0 && p.so[d] % S::VO == 0;
  VITRAIL_TRY(require(aligned));
  transpose_kernel<TI, TO, Lanes1, Warps1, Threads><<<ctas, Threads, 0, stream>>>(out, in, p);
  return cudaGetLastError();
}

// Rows apart along dim 1 (any strides for dims 1..); the caller checks alignment (require()s here).
template <class TI, class TO, int V, int Lanes, int U, int Threads>
cudaError_t launch_rows(TO* out, const TI* in, const Strided& p, cudaStream_t stream) {
  unsigned ctas;
  VITRAIL_TRY((tile_grid<Lanes * U * V, Threads / Lanes>(p, ctas)));  // checks ndim first
  VITRAIL_TRY(require(p.si[0] == 1 && p.so[0] == 1));
  bool aligned = (uintptr_t)in % (V * sizeof(TI)) == 0 && (uintptr_t)out % (V * sizeof(TO)) == 0;
  for (int d = 1; d < p.ndim; ++d) aligned = aligned && p.si[d] % V == 0 && p.so[d] % V == 0;
  VITRAIL_TRY(require(aligned));
  rows_kernel<TI, TO, V, Lanes, U, Threads><<<ctas, Threads, 0, stream>>>(out, in, p);
  return cudaGetLastError();
}

}  // namespace vitrail::copy
