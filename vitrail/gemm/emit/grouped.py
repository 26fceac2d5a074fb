"""Mode 'grouped': G independent GEMMs (each its own M, N, K, pointers and leading strides) in
one launch, on CUTLASS 3's sm90 pointer-array collectives (TMA descriptors updated per group on
the device, the grouped persistent tile scheduler).

The problem sizes, pointers and leading strides are device arrays (int32 (G, 3); int64 (G,)),
so a MoE layer can build them from its group offsets on the GPU with no host sync (the torch op
grouped_mm does: vitrail.gemm.ops.grouped). Epilogue: D = alpha * acc (no C, bias or
activation yet); D row-major. Emitted on template.py's TEMPLATE with this mode's sections
(HOOKS); two ``extern "C"`` entry points: ``vitrail_grouped_gemm`` and
``vitrail_grouped_gemm_workspace`` (bytes of workspace for G groups: the TMA descriptors).
"""
from __future__ import annotations

from vitrail.gemm.descriptions import FP8, cpp_type
from vitrail.gemm.emit.template import Hooks, fill

ENTRY = "vitrail_grouped_gemm"
WORKSPACE_ENTRY = "vitrail_grouped_gemm_workspace"

# grouped's sections of TEMPLATE
HOOKS = Hooks(
    title='grouped GEMM', impl='grouped',
    head="""\
@PTR_ARRAY_INCLUDES@
""",
    types="""\
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using ElementA = @ELEMENT_A@;
using ElementB = @ELEMENT_B@;
using ElementD = @ELEMENT_D@;""",
    collectives="""\
using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    void, cutlass::layout::RowMajor*, @ALIGN_D@, ElementD, cutlass::layout::RowMajor*, @ALIGN_D@,
    @EPILOGUE_SCHEDULE@, cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>
    >::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementA, @LAYOUT_A@*, @ALIGN_A@, ElementB, @LAYOUT_B@*, @ALIGN_B@, float,
    TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    @KERNEL_SCHEDULE@>::CollectiveOp;""",
    kernel="""\
cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                        CollectiveEpilogue>""",
    arguments="""\
using StrideA = typename GemmKernel::InternalStrideA;
using StrideB = typename GemmKernel::InternalStrideB;
using StrideD = typename GemmKernel::InternalStrideD;
using Shape3 = typename ProblemShape::UnderlyingProblemShape;
// the Python side passes int64 leading strides and int32 (M, N, K) triples
static_assert(sizeof(StrideA) == 8 && sizeof(StrideB) == 8 && sizeof(StrideD) == 8);
static_assert(sizeof(Shape3) == 12);

typename GemmKernel::Arguments make_arguments(int groups, const void* sizes, const void* ptr_a,
    const void* ptr_b, void* ptr_d, const void* stride_a, const void* stride_b,
    const void* stride_d, float alpha, int sm_count) {
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sm_count;
  typename GemmKernel::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, const_cast<Shape3*>(static_cast<Shape3 const*>(sizes)), nullptr},
      {static_cast<ElementA const**>(const_cast<void*>(ptr_a)),
       static_cast<StrideA*>(const_cast<void*>(stride_a)),
       static_cast<ElementB const**>(const_cast<void*>(ptr_b)),
       static_cast<StrideB*>(const_cast<void*>(stride_b))},
      {{}, nullptr, nullptr, static_cast<ElementD**>(ptr_d),
       static_cast<StrideD*>(const_cast<void*>(stride_d))},
      hw};
  args.epilogue.thread.alpha = alpha;
  args.epilogue.thread.beta = 0.f;
  return args;
}""",
    entries="""\
extern "C" int64_t vitrail_grouped_gemm_workspace(int groups, int sm_count) {
  auto args = make_arguments(groups, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                             nullptr, 1.f, sm_count);
  return static_cast<int64_t>(GemmKernel::get_workspace_size(args));
}

extern "C" int vitrail_grouped_gemm(int groups, const void* sizes, const void* ptr_a,
    const void* ptr_b, void* ptr_d, const void* stride_a, const void* stride_b,
    const void* stride_d, float alpha, void* workspace, int64_t workspace_bytes, int sm_count,
    cudaStream_t stream) {
  if (groups <= 0) return -3;
  auto args = make_arguments(groups, sizes, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d,
                             alpha, sm_count);""",
)


def emit(op) -> str:
    """The translation unit of a GemmOperation of mode 'grouped'."""
    t = op.tile
    schedule = {"cooperative": "KernelPtrArrayTmaWarpSpecializedCooperative",
                "pingpong": "KernelPtrArrayTmaWarpSpecializedPingpong"}[t.kernel_schedule]
    if op.math.math_operation == "multiply_add_fast_accum":
        schedule += "FP8FastAccum"
    mainloops = ["sm90_mma_array_tma_gmma_ss_warpspecialized.hpp"]
    if op.math.element_a in FP8:
        mainloops.append("sm90_mma_array_tma_gmma_ss_warpspecialized_fp8.hpp")
    tm, tn, tk = t.tile_shape
    cm, cn, ck = t.cluster_shape
    subs = {
        "NAME": op.name,
        "MAINLOOP_INCLUDES": "\n".join(f"#include <cutlass/gemm/collective/{h}>"
                                       for h in mainloops),
        "KERNEL_HEADER": f"sm90_gemm_array_tma_warpspecialized_{t.kernel_schedule}.hpp",
        "ELEMENT_A": cpp_type(op.math.element_a), "ELEMENT_B": cpp_type(op.math.element_b),
        "ELEMENT_D": cpp_type(op.D.element),
        "LAYOUT_A": op.A.cpp_layout, "LAYOUT_B": op.B.cpp_layout,
        "ALIGN_A": str(op.A.alignment), "ALIGN_B": str(op.B.alignment),
        "ALIGN_D": str(op.D.alignment),
        "TILE": f"_{tm}, _{tn}, _{tk}", "CLUSTER": f"_{cm}, _{cn}, _{ck}",
        "KERNEL_SCHEDULE": f"cutlass::gemm::{schedule}",
        "EPILOGUE_SCHEDULE": {"cooperative": "cutlass::epilogue::"
                                             "PtrArrayTmaWarpSpecializedCooperative",
                              "pingpong": "cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong"
                              }[t.kernel_schedule],
    }
    return fill(HOOKS.template(), subs, op.wgmma_n)

