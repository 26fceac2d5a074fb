// A Hopper GEMM from vitrail's blocks: C = A B^T, A (M x K) and B (N x K) row-major slabs of T,
// C (M x N) row-major, fp32 accumulation.
//
// Slab -> tile: one producer warpgroup, in which one thread moves each k-step's A and B tiles
// into a ring of Stages shared-memory stages by TMA (Tma on a Pipeline). Tile -> fragment: two
// consumer warpgroups multiply each stage into register accumulators by wgmma (TileMMA), one
// batch in flight, releasing a stage once the batch that read it retired. Fragment -> slab: the
// accumulators, converted to T, are stored where they land in C.
//
// Config (constexpr ints before the include): BM, BN, BK, STAGES.
#pragma once
#include <vitrail/pipeline.cuh>
#include <vitrail/tile_copy.cuh>
#include <vitrail/tile_mma.cuh>

namespace example {

using Mma = vitrail::TileMMA<T, BM, BN, BK, /*WarpGroups=*/2>;
constexpr int kThreads = 128 + Mma::kThreads;  // the producer warpgroup, then the consumers
constexpr int kStageBytes = Mma::kBytesA<> + Mma::kBytesB<>;
// Dynamic shared memory: the stages, 1024-byte aligned (the swizzle's period), then the barriers.
constexpr int kSmemBytes = 1024 + STAGES * kStageBytes + sizeof(vitrail::Pipeline<STAGES>::Storage);

__device__ void store_tile(T* C, int M, int N, int m0, int n0, const Mma& mma,
                           const decltype(Mma(0).accumulators())& acc) {
  auto where = mma.coordinates();  // (row, column) in the tile of each accumulator
  // Accumulators 2i and 2i + 1 are neighbours in a row: one 4-byte store each pair (N is a
  // multiple of 8, so a pair never straddles the edge).
  CUTE_UNROLL
  for (int i = 0; i < cute::size(acc); i += 2) {
    int m = m0 + cute::get<0>(where(i)), n = n0 + cute::get<1>(where(i));
    if (m < M && n < N) {
      using T2 = cute::conditional_t<cute::is_same_v<T, __half>, __half2, __nv_bfloat162>;
      *reinterpret_cast<T2*>(C + (long long)m * N + n) = T2(T(acc(i)), T(acc(i + 1)));
    }
  }
}

__device__ void gemm(T* C, const vitrail::TensorMap& mapA, const vitrail::TensorMap& mapB,
                     int M, int N, int K) {
  extern __shared__ char smem_raw[];
  unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  char* smem = smem_raw + ((1024 - raw % 1024) % 1024);
  auto sA = Mma::tile_a<STAGES>(smem);                         // (BM, BK, STAGES)
  auto sB = Mma::tile_b<STAGES>(smem + Mma::kBytesA<STAGES>);  // (BN, BK, STAGES)
  auto& bars = *reinterpret_cast<vitrail::Pipeline<STAGES>::Storage*>(smem + STAGES * kStageBytes);
  vitrail::Pipeline<STAGES> pipe(bars);
  const int warpgroup = threadIdx.x / 128, k_tiles = (K + BK - 1) / BK;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  if (threadIdx.x == 0) {
    vitrail::Tma::prefetch(mapA);
    vitrail::Tma::prefetch(mapB);
    pipe.init(/*producer arrivals=*/1, /*consumer arrivals: one per warp=*/Mma::kThreads / 32);
  }
  __syncthreads();

  if (warpgroup == 0) {  // producer: slab -> tile
    vitrail::warpgroup_registers_down<40>();
    if (threadIdx.x == 0) {
      auto w = vitrail::PipeState<STAGES>::producer();
      for (int k = 0; k < k_tiles; ++k, w.advance()) {
        pipe.acquire(w);
        pipe.expect(w, kStageBytes);
        vitrail::Tma::load(&sA(0, 0, w.index), mapA, pipe.full(w), k * BK, m0);
        vitrail::Tma::load(&sB(0, 0, w.index), mapB, pipe.full(w), k * BK, n0);
      }
    }
    return;
  }

  vitrail::warpgroup_registers_up<232>();  // consumers: tile -> fragment
  Mma mma(threadIdx.x - 128);
  auto acc = mma.accumulators();
  Mma::zero(acc);
  vitrail::PipeState<STAGES> r, previous;
  for (int k = 0; k < k_tiles; ++k, r.advance()) {
    pipe.wait(r);
    mma.mma(sA(cute::_, cute::_, r.index), sB(cute::_, cute::_, r.index), acc);
    Mma::wait<1>(acc);  // the previous batch retired: its stage is free
    if (k > 0 && threadIdx.x % 32 == 0) pipe.release(previous);
    previous = r;
  }
  Mma::wait<0>(acc);
  store_tile(C, M, N, m0, n0, mma, acc);  // fragment -> slab
}

}  // namespace example

extern "C" __global__ void __launch_bounds__(example::kThreads, 1)
tiled_gemm(T* C, const __grid_constant__ vitrail::TensorMap mapA,
           const __grid_constant__ vitrail::TensorMap mapB, int M, int N, int K) {
  example::gemm(C, mapA, mapB, M, N, K);
}
