// sm90_conv_cooperative.cuh: CUTLASS 3's sm90 implicit-GEMM convolution mainloop under the
// GEMM's persistent cooperative kernel (two consumer warpgroups on each 128-row tile, one CTA
// per SM looping over tiles, the epilogue of one tile beside the next tile's loads).
//
// CUTLASS 4.2 runs its sm90 convolutions on the non-persistent warp-specialized kernel only: one
// consumer warpgroup a CTA, one CTA a tile (its dispatch policy refuses the persistent schedules
// for conv). The conv collective keeps the GEMM collectives' contract (load_init, load, mma,
// mma_tail, each taking the pipeline state of the tile it starts), so the GEMM's cooperative
// kernel can drive it; three things differ, and the adapters below bridge them:
//
// - the problem: a ConvProblemShape, where the GEMM kernel takes an (M, N, K, L) tuple. The
//   kernel's problem is the transformed (M, N, K, L) of cutlass::conv::detail (hierarchical: M
//   of fprop is (Q, P, N)), which is what the epilogue takes; the mainloop's arguments carry the
//   ConvProblemShape itself (its TMA im2col descriptors are built from it), and the mainloop and
//   the tile scheduler see the problem linearized as the im2col loads walk it (M of fprop and
//   dgrad as one mode of N*P*Q, wgrad's K likewise): `linearized`.
// - the batch mode: the GEMM kernel reads an L mode (mode 4) of the tiled B tensor, which a
//   convolution has not; load_init returns the tiled tensors with an L mode of one tile for the
//   kernel's reading, and the collective's own tensors, which `load` hands to it.
// - names the kernel asks of a mainloop and the conv collective has not: the number of producer
//   thread events of its pipeline (one: one thread issues the TMA loads), and rank-3 (M, K, L)
//   operand strides for a static_assert (the collective's own (M, K) strides are what it uses).
//
// The collective itself is CUTLASS's, built as its CollectiveBuilder builds the cooperative one
// (a 2x1x1 warpgroup layout of the tiled MMA) with the schedule tag KernelCooperative, which
// selects the GEMM's cooperative kernel (the builder's own cooperative tag is the one the
// dispatch policy refuses).
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/conv/collective/collective_builder.hpp>
#include <cutlass/conv/detail.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

namespace vitrail::conv {

// The schedule tag of the conv mainloop under the GEMM's persistent cooperative kernel
struct KernelCooperative : cutlass::gemm::KernelTmaWarpSpecializedCooperative {};

// The transformed (M, N, K, L) of a convolution as its im2col loads walk it: the im2col
// operand's pixels as one mode (cutlass::conv::detail::get_linearized_problem_shape_MNKL, from
// the transformed shape rather than the ConvProblemShape)
template <cutlass::conv::Operator Op, class ShapeMNKL>
CUTE_HOST_DEVICE constexpr auto linearized(ShapeMNKL const& shape) {
  auto [m, n, k, l] = shape;
  if constexpr (Op == cutlass::conv::Operator::kWgrad) {
    return cute::make_shape(m, n, cute::product(k), l);
  } else {
    return cute::make_shape(cute::product(m), n, k, cute::product(l));
  }
}

// The conv collective built as the builder builds the cooperative one, with KernelCooperative
template <cutlass::conv::Operator Op, class ElementA, class LayoutA, int AlignmentA,
          class ElementB, class LayoutB, int AlignmentB, class ElementAccumulator,
          class TileShape, class ClusterShape, class StageCount>
struct CooperativeCollective {
  using Built = cutlass::conv::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Op, ElementA, LayoutA, AlignmentA,
      ElementB, LayoutB, AlignmentB, ElementAccumulator, TileShape, ClusterShape, StageCount,
      cutlass::conv::KernelImplicitTmaWarpSpecializedSm90Cooperative>;
  using Policy = cutlass::conv::MainloopSm90TmaGmmaWarpSpecializedImplicitGemm<
      Op, Built::PipelineStages, Built::NumSpatialDimensions, ClusterShape, KernelCooperative>;
  using type = cutlass::conv::collective::CollectiveConv<
      Policy, TileShape, ElementA, ElementB, typename Built::TiledMma,
      cutlass::conv::collective::detail::Sm90ImplicitGemmTileTraits<
          typename Built::GmemTiledCopyA, typename Built::SmemLayoutA>,
      cutlass::conv::collective::detail::Sm90ImplicitGemmTileTraits<
          typename Built::GmemTiledCopyB, typename Built::SmemLayoutB>>;
};

// The mainloop the GEMM kernel drives: the conv collective, its problem in its arguments
template <class Collective>
struct Mainloop : Collective {
  using Base = Collective;
  static constexpr auto Op = Base::DispatchPolicy::ConvOp;
  using ConvShape = typename Base::ProblemShape;
  using Params = typename Base::Params;
  using StrideA = cute::Stride<int64_t, cute::_1, int64_t>;  // for the kernel's rank check only
  using StrideB = cute::Stride<int64_t, cute::_1, int64_t>;
  static constexpr int NumProducerThreadEvents = 1;

  struct Arguments {
    ConvShape problem;
    typename Base::Arguments operands;
  };

  template <class ShapeMNKL>
  static constexpr Params to_underlying_arguments(ShapeMNKL const&, Arguments const& args,
                                                  void* workspace) {
    return Base::to_underlying_arguments(args.problem, args.operands, workspace);
  }

  template <class ShapeMNKL>
  static bool can_implement(ShapeMNKL const&, Arguments const& args) {
    return Base::can_implement(args.problem, args.operands);
  }

  // (A and B tiled with an L mode of one tile, for the kernel; A and B as the collective's)
  template <class ShapeMNKL>
  CUTLASS_DEVICE auto load_init(ShapeMNKL const& shape, Params const& params) {
    auto tiled = Base::load_init(linearized<Op>(shape), params);
    auto with_l = [](auto const& t) {  // the kernel reads its shape only
      return cute::make_identity_tensor(cute::append(t.shape(), cute::_1{}));
    };
    return cute::make_tuple(with_l(cute::get<0>(tiled)), with_l(cute::get<1>(tiled)),
                            cute::get<0>(tiled), cute::get<1>(tiled));
  }

  template <class... Tensors, class BlockCoord, class KTileIterator>
  CUTLASS_DEVICE void load(Params const& params, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState state,
                           cute::tuple<Tensors...> const& inputs, BlockCoord const& blk_coord,
                           KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           uint32_t block_rank_in_cluster,
                           typename Base::TensorStorage& shared_tensors) {
    Base::load(params, pipeline, state,
               cute::make_tuple(cute::get<2>(inputs), cute::get<3>(inputs)), blk_coord,
               k_tile_iter, k_tile_count, thread_idx, block_rank_in_cluster, shared_tensors);
  }
};

// The persistent tile scheduler on the linearized problem (the tiles the mainloop walks)
template <cutlass::conv::Operator Op>
struct Scheduler : cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;
  using Base::Base;

  template <class ShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ShapeMNKL shape, TileShape tile, ClusterShape cluster,
                                        cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& arguments, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    return Base::to_underlying_arguments(linearized<Op>(shape), tile, cluster, hw_info,
                                         arguments, workspace, epilogue_subtile,
                                         ktile_start_alignment_count);
  }

  template <class ShapeMNKL, class TileShape, class ClusterShape>
  CUTLASS_HOST_DEVICE static dim3 get_grid_shape(Params const& params, ShapeMNKL shape,
                                                 TileShape tile, ClusterShape cluster,
                                                 cutlass::KernelHardwareInfo hw_info,
                                                 Arguments arguments = Arguments{},
                                                 bool truncate_by_problem_size = true) {
    return Base::get_grid_shape(params, linearized<Op>(shape), tile, cluster, hw_info,
                                arguments, truncate_by_problem_size);
  }

  template <class ShapeMNKL, class TileShape>
  CUTLASS_HOST_DEVICE static int get_work_k_tile_count(WorkTileInfo const& work, ShapeMNKL shape,
                                                       TileShape tile) {
    return Base::get_work_k_tile_count(work, linearized<Op>(shape), tile);
  }
};

template <cutlass::conv::Operator Op>
struct SchedulerTag {};

}  // namespace vitrail::conv

namespace cutlass::gemm::kernel::detail {
template <cutlass::conv::Operator Op, class ArchTag, class TileShape, class ClusterShape,
          uint32_t Stages>
struct TileSchedulerSelector<vitrail::conv::SchedulerTag<Op>, ArchTag, TileShape, ClusterShape,
                             Stages> {
  using Scheduler = vitrail::conv::Scheduler<Op>;
};
}  // namespace cutlass::gemm::kernel::detail

namespace vitrail::conv {

// The kernel: the GEMM's persistent cooperative kernel on the transformed problem
template <class ConvShape, class Collective, class CollectiveEpilogue>
using CooperativeKernel = cutlass::gemm::kernel::GemmUniversal<
    decltype(cutlass::conv::detail::get_transformed_problem_shape_MNKL(ConvShape{})),
    Mainloop<Collective>, CollectiveEpilogue, SchedulerTag<Collective::DispatchPolicy::ConvOp>>;

}  // namespace vitrail::conv
