// Device unit tests of tile_mma.cuh (NVRTC, sm_90a): each kernel is one CTA that stages its
// operands in shared memory in the block's layouts and writes its fp32 accumulators to out by
// their coordinates. Values are checked against torch in tests/blocks/test_tile_mma.py.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <vitrail/tile_mma.cuh>

using namespace cute;

// Stage an R x C operand (row-major in global memory, C contiguous) into a shared-memory tile.
template <class Tile, class T>
__device__ void stage(Tile& tile, const T* src, int rows, int cols, int threads) {
  using E = typename Tile::value_type;
  for (int i = threadIdx.x; i < rows * cols; i += threads) {
    tile(i / cols, i % cols) = reinterpret_cast<const E&>(src[i]);
  }
}

template <class Mma, class Acc>
__device__ void write(float* out, int ld, const Mma& mma, const Acc& acc) {
  auto where = mma.coordinates();
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) out[get<0>(where(i)) * ld + get<1>(where(i))] = acc(i);
}

// out (M x N) = sum over k-steps s of A_s B_s^T, A_s: (M x K), B_s: (N x K) slices of A (M x
// KSTEPS*K) and B (N x KSTEPS*K); B K-major, or N-major (then b is B^T: (KSTEPS*K) x N).
template <class T, int M, int N, int K, int WG, vitrail::Major MB, int KSTEPS>
__device__ void mma_ss(float* out, const T* a, const T* b) {
  using Mma = vitrail::TileMMA<T, M, N, K, WG, vitrail::Major::K, MB>;
  extern __shared__ __align__(1024) char smem[];
  auto sA = Mma::tile_a(smem);
  auto sB = Mma::tile_b(smem + Mma::template kBytesA<>);
  Mma mma(threadIdx.x);
  auto acc = mma.accumulators();
  Mma::zero(acc);
  for (int s = 0; s < KSTEPS; ++s) {
    for (int i = threadIdx.x; i < M * K; i += Mma::kThreads) {
      int m = i / K, k = i % K;
      sA(m, k, 0) = reinterpret_cast<const typename Mma::T&>(a[m * KSTEPS * K + s * K + k]);
    }
    for (int i = threadIdx.x; i < N * K; i += Mma::kThreads) {
      int n = i / K, k = i % K;
      const T& v = MB == vitrail::Major::K ? b[n * KSTEPS * K + s * K + k] : b[(s * K + k) * N + n];
      sB(n, k, 0) = reinterpret_cast<const typename Mma::T&>(v);
    }
    vitrail::fence_tile_writes();
    __syncthreads();
    mma.mma(sA(_, _, 0), sB(_, _, 0), acc, /*overwrite=*/false);
    Mma::wait<0>(acc);
    __syncthreads();  // the tiles are rewritten next step
  }
  write(out, N, mma, acc);
}

// Attention's two products: S = Q K^T (SS, 64 x 64 over D = 64), then O = S V with S converted
// to T in registers (RS; V: 64 keys x 64 features row-major, i.e. an N-major B). out: O (64 x
// 64); s_out: S.
template <class T>
__device__ void mma_rs(float* out, float* s_out, const T* q, const T* k, const T* v) {
  using QK = vitrail::TileMMA<T, 64, 64, 64, 1>;
  using PV = vitrail::TileMMA<T, 64, 64, 64, 1, vitrail::Major::K, vitrail::Major::MN>;
  extern __shared__ __align__(1024) char smem[];
  auto sQ = QK::tile_a(smem);
  auto sK = QK::tile_b(smem + QK::template kBytesA<>);
  auto sV = PV::tile_b(smem + QK::template kBytesA<> + QK::template kBytesB<>);
  for (int i = threadIdx.x; i < 64 * 64; i += 128) {
    int r = i / 64, c = i % 64;
    sQ(r, c, 0) = reinterpret_cast<const typename QK::T&>(q[i]);
    sK(r, c, 0) = reinterpret_cast<const typename QK::T&>(k[i]);
    sV(c, r, 0) = reinterpret_cast<const typename QK::T&>(v[i]);  // B(n = feature, k = key)
  }
  vitrail::fence_tile_writes();
  __syncthreads();
  QK qk(threadIdx.x);
  auto s = qk.accumulators();
  QK::zero(s);
  qk.mma(sQ(_, _, 0), sK(_, _, 0), s);
  QK::wait<0>(s);
  write(s_out, 64, qk, s);
  PV pv(threadIdx.x);
  auto o = pv.accumulators();
  PV::zero(o);
  auto p = PV::as_a(s);
  pv.mma_rs(p, sV(_, _, 0), o);
  PV::wait<0>(o, p);
  write(out, 64, pv, o);
}

// mma.sync: out (M x N) = A B^T, both K-major, 4 warps.
template <class T, int M, int N, int K>
__device__ void mma80(float* out, const T* a, const T* b) {
  using Mma = vitrail::TileMMA80<T, M, N, K, 4>;
  extern __shared__ __align__(1024) char smem[];
  using LA = vitrail::SmemTile<T, M, K>;
  using LB = vitrail::SmemTile<T, N, K>;
  auto sA = make_tensor(make_smem_ptr(reinterpret_cast<typename Mma::T*>(smem)), LA{});
  auto sB = make_tensor(make_smem_ptr(reinterpret_cast<typename Mma::T*>(smem) + M * K), LB{});
  for (int i = threadIdx.x; i < M * K; i += Mma::kThreads)
    sA(i / K, i % K, 0) = reinterpret_cast<const typename Mma::T&>(a[i]);
  for (int i = threadIdx.x; i < N * K; i += Mma::kThreads)
    sB(i / K, i % K, 0) = reinterpret_cast<const typename Mma::T&>(b[i]);
  __syncthreads();
  Mma mma(threadIdx.x);
  auto acc = mma.accumulators();
  mma.mma(sA(_, _, 0), sB(_, _, 0), acc, /*overwrite=*/true);
  write(out, N, mma, acc);
}

extern "C" __global__ void __launch_bounds__(256)
tile_mma_ss_bf16(float* out, const __nv_bfloat16* a, const __nv_bfloat16* b) {
  mma_ss<__nv_bfloat16, 128, 128, 64, 2, vitrail::Major::K, 3>(out, a, b);
}
extern "C" __global__ void __launch_bounds__(128)
tile_mma_ss_f16_mn(float* out, const __half* a, const __half* b) {
  mma_ss<__half, 64, 192, 32, 1, vitrail::Major::MN, 2>(out, a, b);
}
extern "C" __global__ void __launch_bounds__(128)
tile_mma_rs_bf16(float* out, float* s_out, const __nv_bfloat16* q, const __nv_bfloat16* k,
                 const __nv_bfloat16* v) {
  mma_rs<__nv_bfloat16>(out, s_out, q, k, v);
}
extern "C" __global__ void __launch_bounds__(128)
tile_mma80_f16(float* out, const __half* a, const __half* b) {
  mma80<__half, 64, 64, 64>(out, a, b);
}
