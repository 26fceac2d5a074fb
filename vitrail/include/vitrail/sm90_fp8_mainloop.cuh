// sm90_fp8_mainloop.cuh: the FP8 GEMM mainloop with exact accumulation whose promotions overlap
// the tensor cores' work (a CUTLASS 3 collective: the kernel schedules take it in place of the
// stock one).
//
// Hopper's FP8 wgmma adds its products into the accumulator at reduced precision, so exact mode
// (torch._scaled_mm's default, use_fast_accum=False) accumulates each k-tile (128 deep: 4 wgmma)
// into a temporary fragment started at zero and adds ("promotes") it into the fp32 accumulators
// on the CUDA cores; cuBLAS promotes at the same depth (its errors match ours to the bit).
// CUTLASS's collective waits for every wgmma in flight before each promotion (warpgroup_wait<0>),
// so the tensor cores idle while the warpgroup drains, adds and issues again (measured slower
// than torch's exact mode: docs/perf-notes.md, "The FP8 mainloop with exact accumulation").
//
// Here the warpgroup's N columns are cut into Parts slices. Unroll k-tiles form one sequence of
// Unroll x Parts wgmma groups (one slice of one k-tile each): each group is issued into a
// temporary, then the one before it is waited for (warpgroup_wait<1>) and promoted while it runs;
// the sequence's last group is waited for with warpgroup_wait<0>, so no wgmma is in flight across
// the loop's back edge (where one is, ptxas serializes every wgmma of the kernel: C7514). At most
// two groups are live, so two slice-sized temporaries rotate: a 64 x 256 warpgroup tile holds
// 128 + 2 x 32 accumulator registers, where CUTLASS's collective needs 2 x 128 and spills; that
// is what lets exact mode use the 128x256 tiles of fast mode. A k-tile's A is read from shared
// memory once per slice (64-column wgmmas run at the full rate, as 256-column ones do: measured,
// docs/perf-notes.md). The promotion depth (one k-tile) and order are CUTLASS's: the results
// are bit-identical.
//
// Its measurements against torch._scaled_mm's exact mode, and the variants that measured no
// better (staggered drains, other Unroll): docs/perf-notes.md.
//
// Constraints (static_asserts): operands from shared memory (SS wgmma), K-major; K-tile at most
// 4 wgmma deep (the promotion depth of exact mode); N per slice a multiple of 8 (a wgmma N).
// Everything is inlined (no lambdas): an outlined call puts the accumulators in local memory.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/sm90_mma_tma_gmma_ss_warpspecialized_fp8.hpp>

namespace vitrail::gemm {

// Collective: CUTLASS's FP8 collective (MainloopSm90TmaGmmaWarpSpecializedFP8, as the
// CollectiveBuilder makes it); everything but mma() is the stock one's (loads, pipeline,
// arguments, mma_tail, which releases the last k-tile's stage, as here).
template <class Collective, int Parts, int Unroll>
struct Sm90Fp8OverlappedPromotion : Collective {
  using typename Collective::TileShape;
  using typename Collective::TiledMma;
  using typename Collective::ElementA;
  using typename Collective::ElementB;
  using typename Collective::SmemLayoutA;
  using typename Collective::SmemLayoutB;
  using typename Collective::MainloopPipeline;
  using typename Collective::PipelineState;
  using typename Collective::TensorStorage;
  using typename Collective::Params;

  static constexpr int kWarpGroups = cute::size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileN = cute::size<1>(TileShape{});
  static constexpr int kTileK = cute::size<2>(TileShape{});
  static constexpr int kSliceN = kTileN / Parts;
  static constexpr int kBlocks = kSliceN / 8;  // a slice's 8-column blocks
  static_assert(Parts >= 2 && kTileN % Parts == 0 && kSliceN % 8 == 0,
                "Parts (>= 2: one slice runs while another is promoted) must cut the tile's N "
                "into slices of a multiple of 8 columns");
  static_assert(Unroll >= 1, "Unroll: k-tiles per sequence, at least 1");
  // One slice's MMA: the same warpgroups along M as the collective's, N / Parts columns.
  using SliceMma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<
          ElementA, ElementB, float,
          cute::Shape<cute::Int<kTileM>, cute::Int<kSliceN>, cute::Int<kTileK>>,
          cute::GMMA::Major::K, cute::GMMA::Major::K>(),
      cute::Layout<cute::Shape<cute::Int<kWarpGroups>, cute::_1, cute::_1>>{}));
  static_assert(kTileK / cute::size<2>(typename SliceMma::AtomShape_MNK{}) <= 4,
                "exact FP8 accumulation promotes at most every 4 wgmma (128 deep)");
  using SliceFrg = decltype(cute::partition_fragment_C(
      SliceMma{}, cute::Shape<cute::Int<kTileM>, cute::Int<kSliceN>>{}));  // (MMA,MMA_M,MMA_N)
  // Temporaries: group G of a sequence goes into tmp[G % 2]; at most two groups are live (one
  // in flight, the one before it being promoted), so a 64 x 256 warpgroup tile needs 128 + 64
  // registers of accumulators, not 2 x 128.
  static constexpr int kTemps = 2;

  // The state of one mainloop: the pipeline positions and the operands' descriptors.
  template <class FrgA, class FrgB>
  struct Loop {
    MainloopPipeline& pipeline;
    PipelineState read, release;
    int k, k_tile_count;
    FrgA& tCrA;     // (MMA,MMA_M,MMA_K,PIPE)
    FrgB* tCrB;     // [Parts] (MMA,MMA_N,MMA_K,PIPE)
    SliceFrg* tmp;  // [kTemps]
  };

  // Slice P of k-tile `stage`: its wgmma into tmp[T], started at zero, committed as one group.
  template <int P, int T, class L>
  CUTLASS_DEVICE static void issue(L& loop, int stage) {
    using namespace cute;
    SliceMma mma;
    warpgroup_fence_operand(loop.tmp[T]);
    warpgroup_arrive();
    mma.accumulate_ = GMMA::ScaleOut::Zero;
    CUTLASS_PRAGMA_UNROLL
    for (int kb = 0; kb < size<2>(loop.tCrA); ++kb) {
      cute::gemm(mma, loop.tCrA(_, _, kb, stage), loop.tCrB[P](_, _, kb, stage), loop.tmp[T]);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(loop.tmp[T]);
  }

  // accum += tmp[P]. accum (V=(2,2,N/8), MMA_M, 1) holds slice P in its blocks [P * B, (P+1) * B).
  template <int P, class FrgC>
  CUTLASS_DEVICE static void promote(FrgC& accum, SliceFrg& tmp) {
    using namespace cute;
    warpgroup_fence_operand(tmp);
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < size<1>(accum); ++m)
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < kBlocks; ++b)
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < 4; ++v)
          accum(make_coord(make_coord(v % 2, v / 2, P * kBlocks + b), m, 0)) +=
              tmp(make_coord(make_coord(v % 2, v / 2, b), m, 0));
    warpgroup_fence_operand(accum);
  }

  // The stage of k-tile loop.k + u is free, but for the mainloop's last k-tile (mma_tail's).
  template <class L>
  CUTLASS_DEVICE static void release_unless_last(L& loop, int u) {
    if (loop.k + u + 1 < loop.k_tile_count) {
      loop.pipeline.consumer_release(loop.release);
      ++loop.release;
    }
  }

  // Group G of a sequence of U k-tiles (G = u * Parts + p), then the rest of the sequence.
  template <int U, int G, class L, class FrgC>
  CUTLASS_DEVICE static void group(L& loop, FrgC& accum, int stage) {
    constexpr int P = G % Parts;
    if constexpr (P == 0) {  // a new k-tile: wait for its stage
      auto token = loop.pipeline.consumer_try_wait(loop.read);
      loop.pipeline.consumer_wait(loop.read, token);
      stage = loop.read.index();
      ++loop.read;
    }
    issue<P, G % kTemps>(loop, stage);
    if constexpr (G > 0) {  // the group before this one: wait for it, promote it
      cute::warpgroup_wait<1>();
      promote<(G - 1) % Parts>(accum, loop.tmp[(G - 1) % kTemps]);
      if constexpr (P == 0) release_unless_last(loop, G / Parts - 1);
    }
    if constexpr (G + 1 < U * Parts) {
      group<U, G + 1>(loop, accum, stage);
    } else {
      cute::warpgroup_wait<0>();
      promote<Parts - 1>(accum, loop.tmp[G % kTemps]);
      release_unless_last(loop, U - 1);
      loop.k += U;
    }
  }

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          TensorStorage& shared_tensors, Params const& /*mainloop_params*/) {
    using namespace cute;
    static_assert(size<2>(FrgTensorC{}) == 1 && size<2>(SliceFrg{}) == 1 &&
                  size<0, 2>(FrgTensorC{}) == Parts * kBlocks &&
                  size<0, 2>(SliceFrg{}) == kBlocks &&
                  size<1>(FrgTensorC{}) == size<1>(SliceFrg{}),
                  "accumulator layouts: the full tile's is the slices' side by side along N");
    // (M,K,PIPE) and (N,K,PIPE)
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});
    const int warp_group = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    auto thr = SliceMma{}.get_slice(warp_group * cutlass::NumThreadsPerWarpGroup);
    Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
    // slice p of B: rows [p * kSliceN, (p + 1) * kSliceN) of every stage
    using Slice = Shape<Int<kSliceN>, Int<kTileK>, Int<size<2>(SmemLayoutB{})>>;
    using FrgB = decltype(thr.make_fragment_B(
        thr.partition_B(local_tile(sB, Slice{}, make_coord(0, 0, 0)))));
    FrgB tCrB[Parts];
    CUTLASS_PRAGMA_UNROLL
    for (int p = 0; p < Parts; ++p)
      tCrB[p] = thr.make_fragment_B(thr.partition_B(local_tile(sB, Slice{}, make_coord(p, 0, 0))));
    SliceFrg tmp[kTemps];
    clear(accum);

    Loop<decltype(tCrA), FrgB> loop{pipeline, smem_pipe_read, smem_pipe_read, 0, k_tile_count,
                                   tCrA, tCrB, tmp};
    warpgroup_fence_operand(accum);
    CUTLASS_PRAGMA_NO_UNROLL
    while (loop.k + Unroll <= k_tile_count) group<Unroll, 0>(loop, accum, 0);
    CUTLASS_PRAGMA_NO_UNROLL
    while (loop.k < k_tile_count) group<1, 0>(loop, accum, 0);
  }
};

}  // namespace vitrail::gemm
