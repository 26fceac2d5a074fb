"""Modes gemm, batched and split_k_serial: one kernel on ``Shape<M, N, K, L>`` whose batch
count L and strides are runtime arguments, the epilogue a visitor tree (epilogue.py), the tile
scheduler persistent or stream-K (which also runs split-K: 'split_k_serial'), FP8 with exact
accumulation on vitrail's overlapped-promotion mainloop where the tile allows it.

Two ``extern "C"`` entry points: ``vitrail_gemm`` (pointers, sizes, strides, scalars, workspace,
SM count, stream; returns 0, a negative check code of template.CODES, or a positive
cudaError_t) and ``vitrail_gemm_workspace`` (bytes of workspace a problem needs; stream-K uses
some).
"""
from __future__ import annotations

from vitrail.gemm.descriptions import FP8, cpp_type
from vitrail.gemm.emit.template import Hooks, fill

ENTRY = "vitrail_gemm"
WORKSPACE_ENTRY = "vitrail_gemm_workspace"
# k-tiles per sequence of the overlapped FP8 promotion (one wgmma drain per sequence).
FP8_PROMOTION_UNROLL = 4

# plain's sections of TEMPLATE
HOOKS = Hooks(
    title='GEMM', impl='gemm',
    head="""\
// @SUMMARY@
@EXTENDED_SHAPES@
#include <cuda_runtime.h>
#include <cstdint>
#include <cmath>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/functional.h>
#include <cute/tensor.hpp>
#include <cutlass/gemm/gemm.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/collective/collective_mma_decl.hpp>
@MAINLOOP_INCLUDES@
#include <cutlass/gemm/collective/builders/sm90_gmma_builder.inl>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>
#include <cutlass/gemm/kernel/@KERNEL_HEADER@>
#include <cutlass/device_kernel.h>
@PREAMBLE@@MAINLOOP_HEADER@""",
    types="""\

using ElementA = @ELEMENT_A@;
using ElementB = @ELEMENT_B@;
using ElementC = @ELEMENT_C@;
using ElementD = @ELEMENT_D@;
using LayoutA = @LAYOUT_A@;
using LayoutB = @LAYOUT_B@;
using LayoutC = @LAYOUT_C@;
using LayoutD = @LAYOUT_D@;
constexpr int AlignmentA = @ALIGN_A@;
constexpr int AlignmentB = @ALIGN_B@;
constexpr int AlignmentC = @ALIGN_C@;
constexpr int AlignmentD = @ALIGN_D@;""",
    collectives="""\
using Callbacks = @CALLBACKS@;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    ElementC, LayoutC, AlignmentC, ElementD, LayoutD, AlignmentD,
    @EPILOGUE_SCHEDULE@, Callbacks>::CollectiveOp;

using @MAINLOOP@ = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementA, LayoutA, AlignmentA, ElementB, LayoutB, AlignmentB, float,
    TileShape, ClusterShape, @STAGES@, @KERNEL_SCHEDULE@>::CollectiveOp;@MAINLOOP_WRAPPER@""",
    kernel="""\
cutlass::gemm::kernel::GemmUniversal<
    Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue, @TILE_SCHEDULER@>""",
    arguments="""\

template <class Stride>
Stride make_stride_of(int64_t ld, int64_t batch) {
  Stride s{};
  if constexpr (cute::is_static_v<decltype(cute::get<0>(s))>) cute::get<1>(s) = ld;
  else cute::get<0>(s) = ld;
  cute::get<2>(s) = batch;
  return s;
}

typename GemmKernel::Arguments make_arguments(
    const void* A, const void* B, const void* C, void* D, const void* bias,
    const void* scale_a, const void* scale_b, int M, int N, int K, int L,
    int64_t lda, int64_t batch_a, int64_t ldb, int64_t batch_b, int64_t ldc, int64_t batch_c,
    int64_t ldd, int64_t batch_d, int64_t bias_batch_stride, float alpha, float beta,
    float slope, float lo, float hi, int splits, int swizzle, int raster, int sm_count) {
  (void)bias; (void)scale_a; (void)scale_b; (void)bias_batch_stride; (void)beta;
  (void)slope; (void)lo; (void)hi; (void)splits;
  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideC = typename GemmKernel::StrideC;
  using StrideD = typename GemmKernel::StrideD;
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sm_count;
  typename GemmKernel::Arguments args{
      L > 1 ? cutlass::gemm::GemmUniversalMode::kBatched : cutlass::gemm::GemmUniversalMode::kGemm,
      {M, N, K, L},
      {static_cast<ElementA const*>(A), make_stride_of<StrideA>(lda, batch_a),
       static_cast<ElementB const*>(B), make_stride_of<StrideB>(ldb, batch_b)},
      {@CALLBACK_ARGS@,
       @C_POINTER@, make_stride_of<StrideC>(ldc, batch_c),
       static_cast<ElementD*>(D), make_stride_of<StrideD>(ldd, batch_d)},
      hw};
  // the tile scheduler's order of output tiles (runtime: arguments.scheduler_order())
  args.scheduler.max_swizzle_size = swizzle;
  using Raster = decltype(args.scheduler.raster_order);
  args.scheduler.raster_order =
      raster == 1 ? Raster::AlongM : raster == 2 ? Raster::AlongN : Raster::Heuristic;
@SCHEDULER_ARGS@
  return args;
}

bool aligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }""",
    entries="""\
@LINKAGE@ int64_t @WORKSPACE_ENTRY@(int M, int N, int K, int L, int splits, int swizzle,
                                   int raster, int sm_count) {
  auto args = make_arguments(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                             M, N, K, L, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1.f, 0.f, 0.f, 0.f, 0.f,
                             splits, swizzle, raster, sm_count);
  return static_cast<int64_t>(GemmKernel::get_workspace_size(args));
}

@LINKAGE@ int @ENTRY@(
@ENTRY_PARAMS@) {
  if (M <= 0 || N <= 0 || K <= 0 || L <= 0) return -3;
  if (!aligned(A) || !aligned(B) || !aligned(D)@C_ALIGNED@) return -1;
  constexpr int64_t ea = 128 / cutlass::sizeof_bits<ElementA>::value;
  constexpr int64_t eb = 128 / cutlass::sizeof_bits<ElementB>::value;
  constexpr int64_t ed = 128 / cutlass::sizeof_bits<ElementD>::value;
  if (lda % ea || batch_a % ea || ldb % eb || batch_b % eb || ldd % ed || batch_d % ed@C_STRIDES@)
    return -2;
  auto args = make_arguments(A, B, C, D, bias, scale_a, scale_b, M, N, K, L, lda, batch_a, ldb,
                             batch_b, ldc, batch_c, ldd, batch_d, bias_batch_stride, alpha, beta,
                             slope, lo, hi, splits, swizzle, raster, sm_count);""",
)


def emit(op, *, entry: str = ENTRY, workspace_entry: str = WORKSPACE_ENTRY,
         linkage: str = 'extern "C"') -> str:
    """The translation unit of GemmOperation ``op`` of mode gemm, batched or split_k_serial
    (``entry``, ``workspace_entry`` and ``linkage`` rename the entry points when another mode
    wraps this kernel: split_k.py)."""
    math, tile, epi = op.math, op.tile, op.epilogue
    fp8 = math.element_a in FP8
    schedule = {"cooperative": "KernelTmaWarpSpecializedCooperative",
                "pingpong": "KernelTmaWarpSpecializedPingpong"}[tile.kernel_schedule]
    if math.math_operation == "multiply_add_fast_accum":
        schedule += "FP8FastAccum"
    kernel_header = {"cooperative": "sm90_gemm_tma_warpspecialized_cooperative.hpp",
                     "pingpong": "sm90_gemm_tma_warpspecialized_pingpong.hpp"}[
        tile.kernel_schedule]
    epilogue_schedule = {"cooperative": "cutlass::epilogue::TmaWarpSpecializedCooperative",
                         "pingpong": "cutlass::epilogue::TmaWarpSpecialized"}[tile.kernel_schedule]
    mainloops = ["sm90_mma_tma_gmma_ss_warpspecialized.hpp"]
    if fp8:
        mainloops.append("sm90_mma_tma_gmma_ss_warpspecialized_fp8.hpp")
    mainloop, wrapper, mainloop_header = "CollectiveMainloop", "", ""
    if op.overlapped_promotion:  # FP8 exact: promotions overlap the wgmma (sm90_fp8_mainloop.cuh)
        mainloop = "StockMainloop"
        wrapper = (f"\nusing CollectiveMainloop = vitrail::gemm::Sm90Fp8OverlappedPromotion<"
                   f"StockMainloop, {tile.promotion_slices}, {FP8_PROMOTION_UNROLL}>;")
        mainloop_header = "\n#include <vitrail/sm90_fp8_mainloop.cuh>"
    tm, tn, tk = tile.tile_shape
    cm, cn, ck = tile.cluster_shape
    stages = (f"cutlass::gemm::collective::StageCount<{tile.stages}>" if tile.stages else
              "cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof("
              "typename CollectiveEpilogue::SharedStorage))>")
    scheduler = {"persistent": "cutlass::gemm::PersistentScheduler",
                 "stream_k": "cutlass::gemm::StreamKScheduler"}[tile.tile_scheduler]
    scheduler_args = ""
    if tile.tile_scheduler == "stream_k":
        scheduler_args = (
            "  using Decomposition = decltype(args.scheduler.decomposition_mode);\n"
            "  if (splits > 1) { args.scheduler.splits = splits;\n"
            "    args.scheduler.decomposition_mode = Decomposition::SplitK; }\n"
            "  else args.scheduler.decomposition_mode = Decomposition::Heuristic;")
    preamble, callbacks, callback_args = epi.emit("TileShape")
    has_c = epi.has_source
    d = op.D
    c = op.C if has_c else d
    summary = (f"A {math.element_a} {op.A.layout}, B {math.element_b} {op.B.layout}, "
               f"C {epi.element_source or 'none'}, D {epi.element_output} {d.layout}; tile "
               f"{tm}x{tn}x{tk}, cluster {cm}x{cn}, {tile.kernel_schedule}, "
               f"{tile.tile_scheduler}; epilogue {epi.tag}; {math.math_operation}")
    subs = {
        "NAME": op.name, "SUMMARY": summary, "LINKAGE": linkage, "ENTRY": entry,
        "WORKSPACE_ENTRY": workspace_entry,
        "MAINLOOP_INCLUDES": "\n".join(f"#include <cutlass/gemm/collective/{h}>"
                                       for h in mainloops),
        "KERNEL_HEADER": kernel_header, "PREAMBLE": preamble,
        "ELEMENT_A": cpp_type(math.element_a), "ELEMENT_B": cpp_type(math.element_b),
        "ELEMENT_C": cpp_type(epi.element_source) if has_c else "void",
        "ELEMENT_D": cpp_type(epi.element_output),
        "LAYOUT_A": op.A.cpp_layout, "LAYOUT_B": op.B.cpp_layout, "LAYOUT_C": c.cpp_layout,
        "LAYOUT_D": d.cpp_layout,
        "ALIGN_A": str(op.A.alignment), "ALIGN_B": str(op.B.alignment),
        "ALIGN_C": str(c.alignment), "ALIGN_D": str(d.alignment),
        "TILE": f"_{tm}, _{tn}, _{tk}", "CLUSTER": f"_{cm}, _{cn}, _{ck}",
        "CALLBACKS": callbacks, "CALLBACK_ARGS": callback_args,
        "EPILOGUE_SCHEDULE": epilogue_schedule, "STAGES": stages,
        "KERNEL_SCHEDULE": f"cutlass::gemm::{schedule}", "TILE_SCHEDULER": scheduler,
        "MAINLOOP": mainloop, "MAINLOOP_WRAPPER": wrapper, "MAINLOOP_HEADER": mainloop_header,
        "SCHEDULER_ARGS": scheduler_args,
        "C_POINTER": "static_cast<ElementC const*>(C)" if has_c else "nullptr",
        "C_ALIGNED": " || !aligned(C)" if has_c else "",
        "C_STRIDES": (" || ldc % (128 / cutlass::sizeof_bits<ElementC>::value) || batch_c % "
                      "(128 / cutlass::sizeof_bits<ElementC>::value)") if has_c else "",
    }
    return fill(HOOKS.template(), subs, op.wgmma_n)
