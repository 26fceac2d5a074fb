"""Convolutions described in Python and emitted on CUTLASS 3's sm90 implicit GEMM.

A ``ConvOperation`` is a GEMM description (``MathInstruction``, ``TileDescription``,
``TensorDescription``, the ``LinearCombination`` epilogue) with a kind, fprop, dgrad or wgrad,
that maps the tensors of a 2-D convolution onto the GEMM operands (CUTLASS's table):

    kind    A (M x K)            B                   D (M x N)          M        N        K
    fprop   x   NHWC (im2col)    w  KRSC             y  NPQK            N*P*Q    K        R*S*C
    dgrad   dy  NPQK (im2col)    w  KRSC             dx NHWC            N*H*W    C        R*S*K
    wgrad   dy  NPQK             x  NHWC (im2col)    dw KRSC            K        R*S*C    N*P*Q

Every tensor is channels-last (its last index contiguous), which TensorDescription states as
layout 'row' (NHWC read as an (N*H*W) x C row-major matrix). Static: the kind, the element
types, the tile, the cluster, the epilogue. Runtime: every size, padding, stride, dilation and
tensor stride (``Conv2dProblem`` and the tensors' strides): CUTLASS builds the TMA im2col
descriptors on the host from the problem shape at each launch (the mainloop collective's
``to_underlying_arguments``), so one compiled kernel serves every problem of its kind.

What CUTLASS's sm90 kernels take, and so ``ConvOperation`` emits: the non-persistent
warp-specialized schedule (one producer warpgroup, one consumer warpgroup, one CTA per output
tile: ``TileDescription(kernel_schedule='warpspecialized')``), or the same mainloop under the
GEMM's persistent cooperative kernel (``kernel_schedule='cooperative'``: two consumer
warpgroups on a tile of 128 or 256 rows, one CTA an SM; CUTLASS refuses its own persistent
schedules for conv, include/vitrail/sm90_conv_cooperative.cuh bridges them); bf16/fp16
operands with fp32 accumulation, and fp32 operands as TF32 for fprop (TF32's wgmma reads both
operands K-major: fprop's x and w are, dgrad's w and wgrad's operands are not; FP8 and int8
exist in CUTLASS and are not emitted here yet), no groups, 2-D only. The runtime checks
(``can_implement``) follow the collective's own: 16-byte aligned channels and strides, padding
and filter extents within the TMA im2col limits, dgrad at unit stride (CUTLASS's tests run its
sm90 dgrad at stride 1 only), wgrad on packed dy and dw.

The translation unit reuses the GEMM template's pieces: the epilogue visitor tree of
``LinearCombination.emit``, the launch code (``emit.template.LAUNCH``: workspace, parameters,
``cudaLaunchKernelEx`` with the cluster) and ``fill``; it is compiled and cached by
vitrail.jit like a GemmOperation (``Buildable``), and run by conv_arguments.py.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional

from vitrail.gemm.descriptions import (MathInstruction, TensorDescription,
                                       TileDescription, bits, check_stages, check_tile_k,
                                       cpp_type)
from vitrail.gemm.conv_arguments import ENTRY, MAX_CHUNKS, launch, reasons
from vitrail.gemm.emit.template import cluster_launch, fill
from vitrail.gemm.epilogue import LinearCombination
from vitrail.gemm.operation import Buildable

CONV_KINDS = ("fprop", "dgrad", "wgrad")
CONV_ELEMENTS = ("bf16", "f16", "tf32")  # tf32: fprop only (both operands K-major)


def default_tile() -> TileDescription:
    return TileDescription((128, 128, 64), kernel_schedule="warpspecialized")


@dataclass(frozen=True)
class ConvOperation(Buildable):
    """A 2-D convolution kernel of one kind (fprop, dgrad or wgrad): operands, math, tile,
    epilogue (all static). A, B, D (and C) are the GEMM operands of the module docstring's
    table, each channels-last (layout 'row'); C, when the epilogue reads a source, has D's
    shape. The epilogue's bias is one value per column of D (``bias='col'``): per output
    channel of fprop (K values), per input channel of dgrad (C values); wgrad takes none."""
    kind: str
    A: TensorDescription
    B: TensorDescription
    D: TensorDescription
    math: MathInstruction
    tile: TileDescription = field(default_factory=default_tile)
    epilogue: Optional[LinearCombination] = None
    C: Optional[TensorDescription] = None
    spatial_dims: int = 2
    chunked: bool = False
    phased: bool = False

    def __post_init__(self):
        if self.epilogue is None:
            object.__setattr__(self, "epilogue", LinearCombination(self.D.element))
        epi, t = self.epilogue, self.tile
        if self.kind not in CONV_KINDS:
            raise ValueError(f"ConvOperation.kind={self.kind!r}: expected one of "
                             f"{', '.join(CONV_KINDS)}")
        if self.spatial_dims != 2:
            raise ValueError(f"ConvOperation.spatial_dims={self.spatial_dims}: only 2-D "
                             f"convolutions are emitted (conv1d and conv3d are not implemented "
                             f"yet)")
        a, b = self.math.element_a, self.math.element_b
        if a not in CONV_ELEMENTS or b != a:
            raise ValueError(f"ConvOperation: math elements {a}/{b}: the convolutions are "
                             f"emitted for bf16 or fp16 operands (one type for both), or tf32 "
                             f"(fp32 in memory) for fprop, with fp32 accumulation; FP8 and "
                             f"int8 are not implemented yet")
        if a == "tf32" and self.kind != "fprop":
            raise ValueError(f"ConvOperation: {self.kind} with tf32: TF32's wgmma reads both "
                             f"operands K-major, and {self.kind}'s "
                             f"{'filter is' if self.kind == 'dgrad' else 'operands are'} not "
                             f"(CUTLASS's table: fprop only); run {self.kind} in bf16 or fp16")
        for name, desc, elem in (("A", self.A, a), ("B", self.B, b)):
            if desc.element != elem:
                raise ValueError(f"ConvOperation: {name}.element={desc.element} does not match "
                                 f"math.element_{name.lower()}={elem}")
        if self.D.element != epi.element_output:
            raise ValueError(f"ConvOperation: D.element={self.D.element} does not match "
                             f"epilogue.element_output={epi.element_output}")
        if epi.has_source:
            if self.C is None:
                object.__setattr__(self, "C", TensorDescription(epi.element_source))
            if self.C.element != epi.element_source:
                raise ValueError(f"ConvOperation: C.element={self.C.element} does not match "
                                 f"epilogue.element_source={epi.element_source}")
        elif self.C is not None:
            raise ValueError("ConvOperation: C is described but the epilogue reads no source; "
                             "give LinearCombination(element_source=...)")
        for name, desc in (("A", self.A), ("B", self.B), ("D", self.D), ("C", self.C)):
            if desc is not None and desc.layout != "row":
                raise ValueError(f"ConvOperation: {name}.layout={desc.layout!r}: every "
                                 f"convolution tensor is channels-last (NHWC, KRSC), layout "
                                 f"'row'; make NCHW tensors channels-last first")
        if epi.scale_a or epi.scale_b:
            raise ValueError("ConvOperation: scale_a/scale_b are for FP8 operands, which the "
                             "convolutions do not take yet")
        if epi.bias == "row":
            raise ValueError("ConvOperation: bias='row' would add one value per output pixel; "
                             "a convolution's bias is one per output channel: bias='col'")
        if epi.bias and self.kind == "wgrad":
            raise ValueError("ConvOperation: wgrad takes no bias (D is a weight gradient)")
        if self.chunked and (self.kind != "wgrad" or epi.has_source):
            raise ValueError("ConvOperation: chunked is wgrad's batch in chunks, each writing its "
                             "own partial dw: wgrad only, without a source C")
        if self.phased and (self.kind != "dgrad" or epi.has_source or
                            tuple(t.cluster_shape) != (1, 1, 1)):
            raise ValueError("ConvOperation: phased is a strided dx's stride phases in one "
                             "launch: dgrad only, without a source C, cluster 1x1x1 (a CTA "
                             "outside its phase's tiles returns at once)")
        if t.kernel_schedule not in ("warpspecialized", "cooperative"):
            raise ValueError(f"ConvOperation: kernel_schedule={t.kernel_schedule!r}: expected "
                             f"'warpspecialized' (CUTLASS's sm90 implicit-GEMM kernel: one "
                             f"consumer warpgroup, one CTA a tile) or 'cooperative' (the "
                             f"GEMM's persistent cooperative kernel on the same mainloop)")
        if t.kernel_schedule == "cooperative":
            if t.tile_shape[0] % 128:
                raise ValueError(f"ConvOperation: a cooperative tile splits its rows between "
                                 f"two warpgroups of 64-row wgmmas: tile M {t.tile_shape[0]} "
                                 f"must be a multiple of 128")
            if self.chunked or self.phased:
                raise ValueError("ConvOperation: chunked and phased launches pick their "
                                 "problem by blockIdx.z and return CTAs outside it, which a "
                                 "persistent kernel cannot: use kernel_schedule="
                                 "'warpspecialized' with them")
        if t.tile_scheduler != "persistent":
            raise ValueError("ConvOperation: the convolution kernels have no stream-K "
                             "scheduler; leave TileDescription.tile_scheduler='persistent'; "
                             "split-K wgrad is not implemented yet")
        check_tile_k(t, a)
        check_stages(t, self.smem_bytes)

    # ------------------------------------------------------------------------------ static
    def smem_bytes(self, stages: int) -> int:
        """An estimate of shared memory: the mainloop's stages, and the epilogue's buffers
        beside them (StageCountAutoCarveout sets them aside)."""
        tm, tn, tk = self.tile.tile_shape
        per_stage = (tm + tn) * tk * bits(self.math.element_a) // 8
        epi_tile = min(tm, 64) * min(tn, 64)
        epi = 2 * epi_tile * bits(self.D.element) // 8
        if self.epilogue.has_source:
            epi += 2 * epi_tile * bits(self.epilogue.element_source) // 8
        if self.epilogue.bias:
            epi += tn * 4
        return stages * (per_stage + 16) + epi + 1024

    @property
    def wgmma_n(self) -> tuple[int, ...]:
        return (self.tile.tile_shape[1],)

    @property
    def name(self) -> str:
        tm, tn, tk = self.tile.tile_shape
        cm, cn, _ = self.tile.cluster_shape
        return (f"conv2d_{self.kind}_{self.math.element_a}_{self.D.element}_{tm}x{tn}x{tk}_"
                f"c{cm}x{cn}" + (f"_s{self.tile.stages}" if self.tile.stages else "")
                + ("_coop" if self.tile.kernel_schedule == "cooperative" else "")
                + f"_{self.epilogue.tag}" + ("_chunked" if self.chunked else "")
                + ("_phased" if self.phased else ""))

    def emit(self) -> str:
        """The C++ translation unit of this operation."""
        return emit(self)

    def key(self) -> str:
        return hashlib.sha256(self.emit().encode()).hexdigest()[:16]

    # ----------------------------------------------------------------------------- runtime
    def can_implement(self, args) -> list[str]:
        """Why this operation cannot run ``args`` (a ConvArguments); empty when it can."""
        return reasons(self, args)

    def run(self, args, *, stream=None, module=None) -> None:
        """Run on ``args`` (a ConvArguments) on ``stream`` (default: torch's current one)."""
        why = self.can_implement(args)
        if why:
            from vitrail.jit.errors import ArgumentError
            raise ArgumentError(f"{self.name} cannot implement this problem: "
                                + "; ".join(why))
        launch(self, module or self.compile(), args, stream)


# ------------------------------------------------------------------------------------ emit
_TEMPLATE = r"""// vitrail conv: @NAME@
// @SUMMARY@
@EXTENDED_SHAPES@
#include <cuda_runtime.h>
#include <cstdint>
#include <cmath>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/functional.h>
#include <cute/tensor.hpp>
#include <cutlass/kernel_hardware_info.hpp>
#include <cutlass/conv/convolution.h>
#include <cutlass/conv/convnd_problem_shape.hpp>
#include <cutlass/conv/dispatch_policy.hpp>
#include <cutlass/conv/collective/collective_builder.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/conv/kernel/conv_universal.hpp>
#include <cutlass/device_kernel.h>
@PREAMBLE@
namespace vitrail_conv_impl {
using namespace cute;

using ElementA = @ELEMENT@;
using ElementB = @ELEMENT@;
using ElementC = @ELEMENT_C@;
using ElementD = @ELEMENT_D@;
using LayoutAct = cutlass::layout::TensorNHWC;
using LayoutOut = @LAYOUT_OUT@;
constexpr int Alignment = 128 / cutlass::sizeof_bits<ElementA>::value;
constexpr int AlignmentC = 128 / cutlass::sizeof_bits<@ELEMENT_C_OR_D@>::value;
constexpr int AlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;
constexpr auto Op = cutlass::conv::Operator::@OPERATOR@;
// wgrad's N (C,S,R) and every kind's K are multi-mode in the implicit GEMM: one-mode shapes
using TileShape = Shape<_@TM@, @TILE_N@, Shape<_@TK@>>;
using ClusterShape = Shape<@CLUSTER@>;

using Callbacks = @CALLBACKS@;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    ElementC, LayoutOut, AlignmentC, ElementD, LayoutOut, AlignmentD,
    @EPILOGUE_SCHEDULE@, Callbacks>::CollectiveOp;

@KERNEL@
// act: x (fprop, wgrad) or dx (dgrad), N x H x W x C; flt: w or dw, K x R x S x C;
// out: y (fprop) or dy (dgrad, wgrad), N x P x Q x K. Strides in elements, channels' is 1.
ProblemShape make_problem(int n, int h, int w, int c, int k, int r, int s, int pad_h, int pad_w,
                          int pad_h_hi, int pad_w_hi, int stride_h, int stride_w,
                          int dilation_h, int dilation_w, const int64_t* act,
                          const int64_t* flt, const int64_t* out) {
  typename ProblemShape::TensorExtent shape_act{}, shape_flt{};
  typename ProblemShape::TensorStride stride_act{}, stride_flt{}, stride_out{};
  shape_act[0] = n; shape_act[1] = h; shape_act[2] = w; shape_act[3] = c;
  shape_flt[0] = k; shape_flt[1] = r; shape_flt[2] = s; shape_flt[3] = c;
  for (int i = 0; i < 3; ++i) {
    stride_act[i] = act[i]; stride_flt[i] = flt[i]; stride_out[i] = out[i];
  }
  stride_act[3] = stride_flt[3] = stride_out[3] = 1;
  typename ProblemShape::ShapePadding lower{}, upper{};
  typename ProblemShape::TraversalStride traversal{};
  typename ProblemShape::ShapeDilation dilation{};
  lower[0] = pad_h; lower[1] = pad_w; upper[0] = pad_h_hi; upper[1] = pad_w_hi;
  traversal[0] = stride_h; traversal[1] = stride_w;
  dilation[0] = dilation_h; dilation[1] = dilation_w;
  return ProblemShape(cutlass::conv::Mode::kCrossCorrelation, shape_act, stride_act, shape_flt,
                      stride_flt, stride_out, lower, upper, traversal, dilation, 1);
}

// The epilogue's strides of an output-shaped tensor whose strides are t[0..2] (n, h, w of an
// NHWC tensor: ((w, h, n), _1, _0); k, r, s of wgrad's KRSC: (k, (_1, s, r), _0)).
template <class Stride>
Stride output_stride(const int64_t* t) {
  Stride d{};
@OUTPUT_STRIDE@
  return d;
}

typename GemmKernel::Arguments make_arguments(
    const void* A, const void* B, const void* C, void* D, const void* bias,
    const ProblemShape& problem, const int64_t* d_strides, const int64_t* c_strides,
    float alpha, float beta, float slope, float lo, float hi, int sm_count) {
  (void)bias; (void)beta; (void)slope; (void)lo; (void)hi; (void)c_strides;
  const int64_t bias_batch_stride = 0;
  (void)bias_batch_stride;
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sm_count;
  using StrideC = typename GemmKernel::StrideC;
  using StrideD = typename GemmKernel::StrideD;
  typename GemmKernel::Arguments args{
@ARGUMENTS_HEAD@
      {@CALLBACK_ARGS@,
       @C_POINTER@, output_stride<StrideC>(@C_STRIDES@),
       static_cast<ElementD*>(D), output_stride<StrideD>(d_strides)},
      hw};
  return args;
}

bool aligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
bool aligned_strides(const int64_t* t, int64_t e) { return !(t[0] % e || t[1] % e || t[2] % e); }
@CHUNKS@}  // namespace vitrail_conv_impl
using namespace vitrail_conv_impl;

extern "C" int @ENTRY@(
    const void* A, const void* B, const void* C, void* D, const void* bias,
    int n, int h, int w, int c, int k, int r, int s, int pad_h, int pad_w, int pad_h_hi,
    int pad_w_hi, int stride_h, int stride_w, int dilation_h, int dilation_w,
    int64_t act_n, int64_t act_h, int64_t act_w, int64_t flt_k, int64_t flt_r, int64_t flt_s,
    int64_t out_n, int64_t out_p, int64_t out_q, int64_t c_0, int64_t c_1, int64_t c_2,
    float alpha, float beta, float slope, float lo, float hi, int splits,
    const long long* phases, void* workspace,
    int64_t workspace_bytes, int sm_count, cudaStream_t stream) {
  if (n <= 0 || h <= 0 || w <= 0 || c <= 0 || k <= 0 || r <= 0 || s <= 0 || stride_h <= 0 ||
      stride_w <= 0 || dilation_h <= 0 || dilation_w <= 0 || pad_h < 0 || pad_w < 0 ||
      pad_h_hi < 0 || pad_w_hi < 0)
    return -3;
  if (!aligned(A) || !aligned(B) || !aligned(D)@C_ALIGNED@) return -1;
  constexpr int64_t e = 128 / cutlass::sizeof_bits<ElementA>::value;
  constexpr int64_t ed = 128 / cutlass::sizeof_bits<ElementD>::value;
  if (c % e || k % e || c % ed || k % ed) return -8;
  const int64_t act[3] = {act_n, act_h, act_w}, flt[3] = {flt_k, flt_r, flt_s};
  const int64_t out[3] = {out_n, out_p, out_q}, cs[3] = {c_0, c_1, c_2};
  if (!aligned_strides(act, e) || !aligned_strides(flt, e) ||
      !aligned_strides(out, e)@C_STRIDES_ALIGNED@)
    return -2;
@KIND_CHECKS@
@RUN@
}
"""

_WARPSPECIALIZED = r"""
using CollectiveMainloop = typename cutlass::conv::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Op,
    ElementA, LayoutAct, Alignment, ElementB, LayoutAct, Alignment, float,
    TileShape, ClusterShape, @STAGES@,
    cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;

using ProblemShape = cutlass::conv::ConvProblemShape<Op, 2>;
// GemmKernel: the name the launch code shared with the GEMMs uses (emitter.LAUNCH)
using GemmKernel = cutlass::conv::kernel::ConvUniversal<
    ProblemShape, CollectiveMainloop, CollectiveEpilogue, cutlass::gemm::PersistentScheduler>;
"""[1:]
_COOPERATIVE = r"""
using CollectiveMainloop = typename vitrail::conv::CooperativeCollective<
    Op, ElementA, LayoutAct, Alignment, ElementB, LayoutAct, Alignment, float,
    TileShape, ClusterShape, @STAGES@>::type;

using ProblemShape = cutlass::conv::ConvProblemShape<Op, 2>;
// GemmKernel: the name the launch code shared with the GEMMs uses (emitter.LAUNCH)
using GemmKernel = vitrail::conv::CooperativeKernel<ProblemShape, CollectiveMainloop,
                                                    CollectiveEpilogue>;
"""[1:]
# Each schedule's epilogue, kernel and the head of its arguments: 'warpspecialized' CUTLASS's
# own (non-persistent, one consumer warpgroup), 'cooperative' the GEMM's persistent cooperative
# kernel (include/vitrail/sm90_conv_cooperative.cuh)
_KERNELS = {
    "warpspecialized": ("cutlass::epilogue::TmaWarpSpecialized", _WARPSPECIALIZED,
                        "      problem,\n"
                        "      {static_cast<ElementA const*>(A), "
                        "static_cast<ElementB const*>(B)},"),
    "cooperative": ("cutlass::epilogue::TmaWarpSpecializedCooperative", _COOPERATIVE,
                    "      cutlass::gemm::GemmUniversalMode::kGemm,\n"
                    "      cutlass::conv::detail::get_transformed_problem_shape_MNKL(problem),\n"
                    "      {problem, {static_cast<ElementA const*>(A), "
                    "static_cast<ElementB const*>(B)}},"),
}

# fprop and dgrad: one problem, one launch (the GEMMs' LAUNCH)
_RUN = r"""  if (splits != 1 || phases != nullptr) return -9;
  ProblemShape problem = make_problem(n, h, w, c, k, r, s, pad_h, pad_w, pad_h_hi, pad_w_hi,
                                      stride_h, stride_w, dilation_h, dilation_w, act, flt, out);
  auto args = make_arguments(A, B, C, D, bias, problem, @D_STRIDES@, cs, alpha, beta, slope, lo,
                             hi, sm_count);
  if (!GemmKernel::can_implement(args)) return -6;
@LAUNCH@"""

# A chunked wgrad (ConvOperation.chunked). wgrad's GEMM K is the batch's pixels, so a small dw
# (K x RSC: a few tiles) leaves most of the GPU idle. The batch runs in `splits` chunks of whole
# images in one launch: the kernel below takes every chunk's parameters (its own TMA descriptors
# and sizes; about 1.5 KB each, so MAX_CHUNKS of them stay under the 32 KB kernel parameter limit)
# and blockIdx.z picks one (CUTLASS's conv kernel reads no blockIdx.z: a convolution has no batch
# mode L); chunk i writes its partial dw to D's rows [i K, (i + 1) K), which the caller sums.
_CHUNKS = r"""
constexpr int kMaxChunks = @MAX_CHUNKS@;  // conv_arguments.MAX_CHUNKS
struct ChunkParams {
  typename GemmKernel::Params chunk[kMaxChunks];
};
static_assert(sizeof(ChunkParams) <= 32764, "a kernel's parameters take at most 32764 bytes");

__global__ void __launch_bounds__(GemmKernel::MaxThreadsPerBlock,
                                  GemmKernel::MinBlocksPerMultiprocessor)
vitrail_conv_chunks(const __grid_constant__ ChunkParams params) {
  extern __shared__ char smem[];
  GemmKernel op;
  op(params.chunk[blockIdx.z], smem);
}

// A chunk of chunk 0's sizes has chunk 0's parameters but for the global addresses of its three
// TMA descriptors (A: dy, B: x, D: dw; each encoded from its tensor's first element): a copy and
// three cuTensorMapReplaceAddress calls instead of three descriptor encodings. False where the
// driver lacks the call or refuses an address (the caller then builds the chunk's parameters).
using ReplaceAddress = CUresult (*)(CUtensorMap*, void*);

ReplaceAddress replace_address() {
  static const ReplaceAddress fn = [] {
    void* pfn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapReplaceAddress", &pfn, 12000,
                                         cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return static_cast<ReplaceAddress>(nullptr);
    return reinterpret_cast<ReplaceAddress>(pfn);
  }();
  return fn;
}

template <class Copy>
CUtensorMap* descriptor(Copy& copy) {
  return reinterpret_cast<CUtensorMap*>(const_cast<void*>(
      static_cast<const void*>(copy.get_tma_descriptor())));
}

long long readdressed_chunks = 0;  // since the library loaded (atomic builtins; tests read it)

bool readdressed(typename GemmKernel::Params& p, const void* a, const void* b, void* d) {
  const ReplaceAddress replace = replace_address();
  const bool done =
      replace != nullptr &&
      replace(descriptor(p.mainloop.tma_load_a), const_cast<void*>(a)) == CUDA_SUCCESS &&
      replace(descriptor(p.mainloop.tma_load_b), const_cast<void*>(b)) == CUDA_SUCCESS &&
      replace(descriptor(p.epilogue.tma_store_d), d) == CUDA_SUCCESS;
  if (done) __atomic_fetch_add(&readdressed_chunks, 1, __ATOMIC_RELAXED);
  return done;
}

// The chunks that took chunk 0's parameters with their addresses replaced, since the library
// loaded: what says that the driver's call was found and took them (tests).
extern "C" long long vitrail_conv_readdressed() {
  return __atomic_load_n(&readdressed_chunks, __ATOMIC_RELAXED);
}
"""
_RUN_CHUNKS = r"""  // chunks of ceil(n / splits) images, none empty
  if (splits < 1 || splits > kMaxChunks || phases != nullptr) return -9;
  const int chunk = (n + splits - 1) / splits;
  if ((splits - 1) * chunk >= n) return -9;
@BIND@
  ChunkParams params;
  for (int i = 0; i < splits; ++i) {
    const int images_i = i + 1 < splits ? chunk : n - i * chunk;
    const int64_t images = static_cast<int64_t>(i) * chunk;
    const ElementA* a = static_cast<const ElementA*>(A) + images * out_n;
    const ElementB* b = static_cast<const ElementB*>(B) + images * act_n;
    ElementD* d = static_cast<ElementD*>(D) + i * k * flt_k;
    if (i > 0 && images_i == chunk) {  // chunk 0's sizes: its parameters, other addresses
      params.chunk[i] = params.chunk[0];
      if (readdressed(params.chunk[i], a, b, d)) continue;
    }
    ProblemShape problem = make_problem(images_i, h, w, c, k, r, s, pad_h, pad_w, pad_h_hi,
                                        pad_w_hi, stride_h, stride_w, dilation_h, dilation_w,
                                        act, flt, out);
    auto args = make_arguments(a, b, C, d, bias, problem, flt, cs, alpha, beta, slope, lo, hi,
                               sm_count);
    if (!GemmKernel::can_implement(args)) return -6;
    if (static_cast<int64_t>(GemmKernel::get_workspace_size(args)) > workspace_bytes) return -4;
    params.chunk[i] = GemmKernel::to_underlying_arguments(args, workspace);
  }
""" + cluster_launch("vitrail_conv_chunks", "params",
                      "config.gridDim = GemmKernel::get_grid_shape(params.chunk[0]);\n"
                      "  config.gridDim.z = splits;")

# A strided dgrad's stride phases in one launch (ConvOperation.phased). CUTLASS's sm90 dgrad runs
# at unit stride, so a strided dx is stride_h * stride_w unit-stride dgrads, one a phase (the
# pixels at (i, j) + stride * (a, b)), each with the filter taps that reach them: problems of
# their own sizes on views of dy, w and dx that share their strides. One launch takes every
# phase's parameters; blockIdx.z picks one, and a CTA past that phase's own tiles returns before
# it does anything (so the cluster is 1x1x1: no CTA waits on another). `phases` (host memory)
# holds kPhaseValues int64 a phase: the filter's and dx's element offsets from B and D, dx's
# rows and columns of the phase, its taps (r, s), and its padding (h, w, h_hi, w_hi).
_PHASES = r"""
constexpr int kMaxPhases = @MAX_CHUNKS@;  // conv_arguments.MAX_CHUNKS
constexpr int kPhaseValues = 10;
struct PhaseParams {
  typename GemmKernel::Params phase[kMaxPhases];
  unsigned tiles[kMaxPhases][2];  // the phase's own grid (x, y)
};
static_assert(sizeof(PhaseParams) <= 32764, "a kernel's parameters take at most 32764 bytes");
static_assert(cute::size(ClusterShape{}) == 1, "phases return early: no cluster");

__global__ void __launch_bounds__(GemmKernel::MaxThreadsPerBlock,
                                  GemmKernel::MinBlocksPerMultiprocessor)
vitrail_conv_phases(const __grid_constant__ PhaseParams params) {
  if (blockIdx.x >= params.tiles[blockIdx.z][0] || blockIdx.y >= params.tiles[blockIdx.z][1])
    return;
  extern __shared__ char smem[];
  GemmKernel op;
  op(params.phase[blockIdx.z], smem);
}
"""
_RUN_PHASES = r"""  if (splits < 1 || splits > kMaxPhases || phases == nullptr) return -9;
@BIND@
  PhaseParams params;
  dim3 grid(1, 1, splits);
  for (int i = 0; i < splits; ++i) {
    const long long* v = phases + kPhaseValues * i;
    ProblemShape problem = make_problem(n, v[2], v[3], c, k, v[4], v[5], v[6], v[7], v[8], v[9],
                                        1, 1, dilation_h, dilation_w, act, flt, out);
    auto args = make_arguments(A, static_cast<const ElementB*>(B) + v[0], C,
                               static_cast<ElementD*>(D) + v[1], bias, problem, @D_STRIDES@, cs,
                               alpha, beta, slope, lo, hi, sm_count);
    if (!GemmKernel::can_implement(args)) return -6;
    if (static_cast<int64_t>(GemmKernel::get_workspace_size(args)) > workspace_bytes) return -4;
    params.phase[i] = GemmKernel::to_underlying_arguments(args, workspace);
    const dim3 tiles = GemmKernel::get_grid_shape(params.phase[i]);
    params.tiles[i][0] = tiles.x;
    params.tiles[i][1] = tiles.y;
    grid.x = tiles.x > grid.x ? tiles.x : grid.x;
    grid.y = tiles.y > grid.y ? tiles.y : grid.y;
  }
""" + cluster_launch("vitrail_conv_phases", "params", "config.gridDim = grid;")

# the template's text, all its parts: what keys the tuning records of conv2d's kernels
KERNEL_SOURCE = (_TEMPLATE + "".join("".join(k) for k in _KERNELS.values()) + _RUN + _CHUNKS
                 + _RUN_CHUNKS + _PHASES + _RUN_PHASES)
_OPERATORS = {"fprop": "kFprop", "dgrad": "kDgrad", "wgrad": "kWgrad"}
# the strides of D's tensor among the entry's: y (fprop), dx (dgrad), dw (wgrad)
_D_STRIDES = {"fprop": "out", "dgrad": "act", "wgrad": "flt"}
_NHWC_STRIDE = ("  cute::get<0, 0>(d) = t[2];  // w\n"
                "  cute::get<0, 1>(d) = t[1];  // h\n"
                "  cute::get<0, 2>(d) = t[0];  // n")
_KRSC_STRIDE = ("  cute::get<0>(d) = t[0];     // k\n"
                "  cute::get<1, 1>(d) = t[2];  // s\n"
                "  cute::get<1, 2>(d) = t[1];  // r")


def emit(op: ConvOperation) -> str:
    """The translation unit of ConvOperation ``op``: its ``extern "C"`` entry point
    ``vitrail_conv`` (pointers, sizes, padding, traversal stride, dilation, the strides of the
    activation, filter and output tensors and of C, the epilogue's scalars, workspace, SM count,
    stream; returns 0, a negative check code of CONV_CODES, or a positive cudaError_t)."""
    math, tile, epi = op.math, op.tile, op.epilogue
    tm, tn, tk = tile.tile_shape
    cm, cn, ck = tile.cluster_shape
    preamble, callbacks, callback_args = epi.emit("TileShape")
    has_c = epi.has_source
    wgrad = op.kind == "wgrad"
    stages = (f"cutlass::conv::collective::StageCount<{tile.stages}>" if tile.stages else
              "cutlass::conv::collective::StageCountAutoCarveout<static_cast<int>(sizeof("
              "typename CollectiveEpilogue::SharedStorage))>")
    kind_checks = ""
    if op.kind == "dgrad":
        kind_checks = "  if (stride_h != 1 || stride_w != 1) return -7;"
    summary = (f"{op.kind}: A {math.element_a}, B {math.element_b}, C "
               f"{epi.element_source or 'none'}, D {epi.element_output}; tile {tm}x{tn}x{tk}, "
               f"cluster {cm}x{cn}, warp-specialized; epilogue {epi.tag}")
    subs = {
        "NAME": op.name, "SUMMARY": summary, "ENTRY": ENTRY, "PREAMBLE": preamble,
        "ELEMENT": cpp_type(math.element_a),
        "ELEMENT_C": cpp_type(epi.element_source) if has_c else "void",
        "ELEMENT_C_OR_D": cpp_type(epi.element_source) if has_c else "ElementD",
        "ELEMENT_D": cpp_type(epi.element_output),
        "LAYOUT_OUT": "cutlass::layout::TensorKCSR" if wgrad else "cutlass::layout::TensorNHWC",
        "OPERATOR": _OPERATORS[op.kind],
        "TM": str(tm), "TK": str(tk), "TILE_N": f"Shape<_{tn}>" if wgrad else f"_{tn}",
        "CLUSTER": f"_{cm}, _{cn}, _{ck}", "CALLBACKS": callbacks,
        "CALLBACK_ARGS": callback_args, "STAGES": stages,
        "OUTPUT_STRIDE": _KRSC_STRIDE if wgrad else _NHWC_STRIDE,
        "C_POINTER": "static_cast<ElementC const*>(C)" if has_c else "nullptr",
        "C_STRIDES": "c_strides" if has_c else "d_strides",
        "C_ALIGNED": " || !aligned(C)" if has_c else "",
        "C_STRIDES_ALIGNED": (" ||\n      !aligned_strides(cs, 128 / cutlass::sizeof_bits<"
                              "ElementC>::value)") if has_c else "",
        "D_STRIDES": _D_STRIDES[op.kind], "KIND_CHECKS": kind_checks,
        "MAX_CHUNKS": str(MAX_CHUNKS),
    }
    epilogue_schedule, kernel, arguments_head = _KERNELS[tile.kernel_schedule]
    subs.update(EPILOGUE_SCHEDULE=epilogue_schedule, ARGUMENTS_HEAD=arguments_head)
    if tile.kernel_schedule == "cooperative":
        subs["PREAMBLE"] = "#include <vitrail/sm90_conv_cooperative.cuh>\n" + subs["PREAMBLE"]
    run, extra = ((_RUN_CHUNKS, _CHUNKS) if op.chunked else
                  (_RUN_PHASES, _PHASES) if op.phased else (_RUN, ""))
    template = (_TEMPLATE.replace("@KERNEL@", kernel).replace("@RUN@", run)
                .replace("@CHUNKS@", extra))
    return fill(template, subs, op.wgmma_n)
