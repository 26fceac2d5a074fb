"""Mode 'array': a batch of equal-shaped GEMMs whose matrices live anywhere (arrays of pointers),
D_i = alpha * A_i @ B_i (+ beta * C_i), on CUTLASS 3's pointer-array kernel
(``KernelPtrArrayTmaWarpSpecialized*`` with ``cutlass::gemm::ArrayProblemShape``: one M, N, K,
L for all, one leading stride per operand, the TMA descriptors re-pointed per batch on the
device).

Where 'batched' needs the batch at a fixed stride in one allocation, 'array' takes lists of
tensors (the layers of a model, the heads cut from different buffers) with no copy. The
pointer arrays are built on the host and copied to the device with each call.

    op = GemmOperation(A=TensorDescription("bf16", "row"), B=TensorDescription("bf16", "col"),
                       D=TensorDescription("bf16", "row"), math=MathInstruction("bf16", "bf16"),
                       mode="array")
    args = ArrayArguments.from_tensors(op, [a0, a1, a2], [b0, b1, b2])   # d: a new list
    op.run(args); d0, d1, d2 = args.sync()

Emitted on template.py's TEMPLATE with this mode's sections (HOOKS). Epilogue: alpha, and
beta * C with ``LinearCombination(element_source=...)``; bias, activation, clamp and FP8 scales
are not available in this mode (CUTLASS's pointer-array epilogue takes no per-batch broadcast
pointers here): ``operation.check_pointer_array_epilogue`` says so. The runtime side
(``ArrayArguments``) is in arguments.py.
Entry points: ``vitrail_array_gemm`` and ``vitrail_array_gemm_workspace``.
"""
from __future__ import annotations

from vitrail.gemm.descriptions import FP8, cpp_type
from vitrail.gemm.emit.template import Hooks, fill

ENTRY = "vitrail_array_gemm"
WORKSPACE_ENTRY = "vitrail_array_gemm_workspace"

# array's sections of TEMPLATE
HOOKS = Hooks(
    title='array-of-pointers GEMM', impl='array',
    head="""\
@PTR_ARRAY_INCLUDES@
""",
    types="""\
using ProblemShape = cutlass::gemm::ArrayProblemShape<Shape<int, int, int, int>>;
using ElementA = @ELEMENT_A@;
using ElementB = @ELEMENT_B@;
using ElementC = @ELEMENT_C@;
using ElementD = @ELEMENT_D@;""",
    collectives="""\
using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    ElementC, @LAYOUT_D@, @ALIGN_C@, ElementD, @LAYOUT_D@, @ALIGN_D@,
    @EPILOGUE_SCHEDULE@, cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC,
    float>>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementA, @LAYOUT_A@, @ALIGN_A@, ElementB, @LAYOUT_B@, @ALIGN_B@, float,
    TileShape, ClusterShape, @STAGES@, @KERNEL_SCHEDULE@>::CollectiveOp;""",
    kernel="""\
cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                        CollectiveEpilogue>""",
    arguments="""\
static_assert(!GemmKernel::IsGroupedGemmKernel, "one stride per operand (array, not grouped)");

template <class Stride>
Stride make_stride_of(int64_t ld, int64_t batch) {
  Stride s{};
  if constexpr (cute::is_static_v<decltype(cute::get<0>(s))>) cute::get<1>(s) = ld;
  else cute::get<0>(s) = ld;
  cute::get<2>(s) = batch;  // one pointer per batch: never used to address, kept aligned
  return s;
}

typename GemmKernel::Arguments make_arguments(const void* ptr_a, const void* ptr_b,
    const void* ptr_c, const void* ptr_d, int M, int N, int K, int L, int64_t lda, int64_t ldb,
    int64_t ldc, int64_t ldd, float alpha, float beta, int sm_count) {
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sm_count;
  typename GemmKernel::Arguments args{
      cutlass::gemm::GemmUniversalMode::kArray, {{M, N, K, L}},
      {static_cast<ElementA const**>(const_cast<void*>(ptr_a)),
       make_stride_of<typename GemmKernel::StrideA>(lda, lda * 16),
       static_cast<ElementB const**>(const_cast<void*>(ptr_b)),
       make_stride_of<typename GemmKernel::StrideB>(ldb, ldb * 16)},
      {{}, static_cast<ElementC const**>(const_cast<void*>(ptr_c)),
       make_stride_of<typename GemmKernel::StrideC>(ldc, ldc * 16),
       static_cast<ElementD**>(const_cast<void*>(ptr_d)),
       make_stride_of<typename GemmKernel::StrideD>(ldd, ldd * 16)},
      hw};
  args.epilogue.thread.alpha = alpha;
  args.epilogue.thread.beta = beta;
  return args;
}""",
    entries="""\
extern "C" int64_t vitrail_array_gemm_workspace(int M, int N, int K, int L, int sm_count) {
  auto args = make_arguments(nullptr, nullptr, nullptr, nullptr, M, N, K, L, 8, 8, 8, 8, 1.f,
                             0.f, sm_count);
  return static_cast<int64_t>(GemmKernel::get_workspace_size(args));
}

// ptr_a, ptr_b, ptr_c, ptr_d: device arrays of L pointers (ptr_c null without a source)
extern "C" int vitrail_array_gemm(const void* ptr_a, const void* ptr_b, const void* ptr_c,
    const void* ptr_d, int M, int N, int K, int L, int64_t lda, int64_t ldb, int64_t ldc,
    int64_t ldd, float alpha, float beta, void* workspace, int64_t workspace_bytes,
    int sm_count, cudaStream_t stream) {
  if (M <= 0 || N <= 0 || K <= 0 || L <= 0) return -3;
  constexpr int64_t ea = 128 / cutlass::sizeof_bits<ElementA>::value;
  constexpr int64_t eb = 128 / cutlass::sizeof_bits<ElementB>::value;
  constexpr int64_t ed = 128 / cutlass::sizeof_bits<ElementD>::value;
  if (lda % ea || ldb % eb || ldd % ed@C_STRIDES@) return -2;
  auto args = make_arguments(ptr_a, ptr_b, ptr_c, ptr_d, M, N, K, L, lda, ldb, ldc, ldd, alpha,
                             beta, sm_count);""",
)


def emit(op) -> str:
    """The translation unit of a GemmOperation of mode 'array'."""
    t, epi = op.tile, op.epilogue
    schedule = {"cooperative": "KernelPtrArrayTmaWarpSpecializedCooperative",
                "pingpong": "KernelPtrArrayTmaWarpSpecializedPingpong"}[t.kernel_schedule]
    if op.math.math_operation == "multiply_add_fast_accum":
        schedule += "FP8FastAccum"
    mainloops = ["sm90_mma_array_tma_gmma_ss_warpspecialized.hpp"]
    if op.math.element_a in FP8:
        mainloops.append("sm90_mma_array_tma_gmma_ss_warpspecialized_fp8.hpp")
    tm, tn, tk = t.tile_shape
    cm, cn, ck = t.cluster_shape
    has_c = epi.has_source
    c = op.C if has_c else op.D
    stages = (f"cutlass::gemm::collective::StageCount<{t.stages}>" if t.stages else
              "cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof("
              "typename CollectiveEpilogue::SharedStorage))>")
    subs = {
        "NAME": op.name,
        "MAINLOOP_INCLUDES": "\n".join(f"#include <cutlass/gemm/collective/{h}>"
                                       for h in mainloops),
        "KERNEL_HEADER": f"sm90_gemm_array_tma_warpspecialized_{t.kernel_schedule}.hpp",
        "ELEMENT_A": cpp_type(op.math.element_a), "ELEMENT_B": cpp_type(op.math.element_b),
        "ELEMENT_C": cpp_type(epi.element_source) if has_c else "void",
        "ELEMENT_D": cpp_type(op.D.element),
        "LAYOUT_A": op.A.cpp_layout, "LAYOUT_B": op.B.cpp_layout, "LAYOUT_D": op.D.cpp_layout,
        "ALIGN_A": str(op.A.alignment), "ALIGN_B": str(op.B.alignment),
        "ALIGN_C": str(c.alignment), "ALIGN_D": str(op.D.alignment),
        "TILE": f"_{tm}, _{tn}, _{tk}", "CLUSTER": f"_{cm}, _{cn}, _{ck}", "STAGES": stages,
        "KERNEL_SCHEDULE": f"cutlass::gemm::{schedule}",
        "EPILOGUE_SCHEDULE": {"cooperative": "cutlass::epilogue::"
                                             "PtrArrayTmaWarpSpecializedCooperative",
                              "pingpong": "cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong"
                              }[t.kernel_schedule],
        "C_STRIDES": " || ldc % (128 / cutlass::sizeof_bits<ElementC>::value)" if has_c else "",
    }
    return fill(HOOKS.template(), subs, op.wgmma_n)
