"""Mode 'split_k_parallel': K cut into S slices computed as one batched GEMM into an fp32
workspace [S, M, N], then a reduction kernel that sums the slices and applies the epilogue.

Why it exists next to 'split_k_serial' (the stream-K scheduler's split-K): the slices are plain
independent GEMMs (no tile-to-tile fixup, no semaphores), and the whole epilogue runs once, in
the reduction, on fp32 sums; for a small output (few tiles) and a long K this keeps every SM
busy with a cost of S * M * N * 4 bytes written and read once more.

The translation unit is the batched GEMM of mode gemm (plain.py) (D: fp32 in D's layout,
epilogue alpha * acc, its entry points renamed and made static) plus the reduction kernel
(plain CUDA C++; its activations are the epilogue's own ``vitrail_act::apply``) and the
usual two ``extern "C"`` entry points with the plain GEMM's signature, so the runtime side
(arguments.py) is shared:

- ``vitrail_gemm_workspace(M, N, K, L, splits, swizzle, raster, sm)``: the slices plus the
  GEMM's own workspace;
- ``vitrail_gemm(...)``: slice width ``ks`` = ceil(K / splits) rounded up to the tile's K;
  ``K // ks`` slices of width ks run as one batched launch (the batch stride of A and B is the
  offset of a slice), the remainder (if any) as one more launch, then the reduction.

Constraints (checked in ``can_implement``): L == 1 (a batched problem uses mode 'batched'),
splits >= 1, the TMA alignment of every operand (as the plain GEMM).
"""
from __future__ import annotations

import dataclasses

from vitrail.gemm.emit import plain
from vitrail.gemm.emit.template import fill
from vitrail.gemm.descriptions import TensorDescription, cpp_type
from vitrail.gemm.epilogue import ACTIVATION_FUNCTOR, LinearCombination, ACT_IDS

PARTIAL_ENTRY = "vitrail_partial_gemm"
PARTIAL_WORKSPACE_ENTRY = "vitrail_partial_gemm_workspace"

_REDUCE = r"""
namespace vitrail_split_k {
using ElementOut = @ELEMENT_D@;
using ElementSrc = @ELEMENT_SRC@;
using ElementBias = @ELEMENT_BIAS@;
constexpr bool IsRowMajor = @ROW_MAJOR@;  // D (and C, and the workspace) row-major
constexpr bool HasSource = @HAS_SOURCE@;
constexpr int BiasKind = @BIAS_KIND@;     // 0 none, 1 one per row (M), 2 one per column (N)
constexpr int ScaleA = @SCALE_A@;         // 0 none, 1 tensor, 2 one per row
constexpr int ScaleB = @SCALE_B@;         // 0 none, 1 tensor, 2 one per column
constexpr int Act = @ACT@;
constexpr bool Clamp = @CLAMP@;

// D[m, n] = clamp(act(alpha * sa * sb * sum_s ws[s, m, n] + beta * C[m, n] + bias));
// one thread per element, contiguous dimension fastest (coalesced on every layout).
__global__ void __launch_bounds__(256) reduce_slices(
    const float* __restrict__ ws, int64_t slice, int64_t ldw, int slices,
    const ElementSrc* __restrict__ C, int64_t ldc, ElementOut* __restrict__ D, int64_t ldd,
    const ElementBias* __restrict__ bias, const float* __restrict__ scale_a,
    const float* __restrict__ scale_b, int M, int N, float alpha, float beta, float slope,
    float lo, float hi) {
  const int64_t inner = IsRowMajor ? N : M, outer = IsRowMajor ? M : N;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < inner * outer;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t o = i / inner, c = i - o * inner;
    const int64_t m = IsRowMajor ? o : c, n = IsRowMajor ? c : o;
    const float* p = ws + o * ldw + c;
    float acc = 0.f;
    for (int s = 0; s < slices; ++s) acc += p[s * slice];
    float x = alpha * acc;
    if constexpr (ScaleA == 1) x *= scale_a[0];
    if constexpr (ScaleA == 2) x *= scale_a[m];
    if constexpr (ScaleB == 1) x *= scale_b[0];
    if constexpr (ScaleB == 2) x *= scale_b[n];
    if constexpr (HasSource) x += beta * float(C[o * ldc + c]);
    if constexpr (BiasKind == 1) x += float(bias[m]);
    if constexpr (BiasKind == 2) x += float(bias[n]);
@ACTIVATE@
    D[o * ldd + c] = ElementOut(x);
  }
}

int64_t slice_width(int K, int splits) {
  constexpr int64_t tk = cute::size<2>(TileShape{});
  int64_t ks = (K + splits - 1) / splits;
  return (ks + tk - 1) / tk * tk;
}
int64_t slice_elements(int M, int N) {  // one fp32 slice in D's layout, rows padded to 16 bytes
  int64_t ld = ((IsRowMajor ? N : M) + 3) / 4 * 4;
  return ld * (IsRowMajor ? M : N);
}
}  // namespace vitrail_split_k

extern "C" int64_t vitrail_gemm_workspace(int M, int N, int K, int L, int splits, int swizzle,
                                          int raster, int sm_count) {
  using namespace vitrail_split_k;
  if (splits < 1) splits = 1;
  int64_t ks = slice_width(K, splits);
  int64_t slices = (K + ks - 1) / ks;
  int64_t partial = @PARTIAL_WORKSPACE@(M, N, static_cast<int>(ks), static_cast<int>(slices),
                                        1, swizzle, raster, sm_count);
  return (slices * slice_elements(M, N) * 4 + 255) / 256 * 256 + partial;
}

extern "C" int vitrail_gemm(
@ENTRY_PARAMS@) {
  using namespace vitrail_split_k;
  (void)batch_a; (void)batch_b; (void)batch_c; (void)batch_d; (void)bias_batch_stride;
  if (M <= 0 || N <= 0 || K <= 0 || L != 1 || splits < 1) return -3;
  if (!aligned(D)@C_ALIGNED@) return -1;
  if (vitrail_gemm_workspace(M, N, K, L, splits, swizzle, raster, sm_count) > workspace_bytes)
    return -4;
  const int64_t ks = slice_width(K, splits), full = K / ks, rest = K - full * ks;
  const int64_t slice = slice_elements(M, N), ldw = ((IsRowMajor ? N : M) + 3) / 4 * 4;
  // a K slice of A (M x K) and of B (K x N): ks columns of A, ks rows of B, in elements
  const int64_t step_a = @A_K_MAJOR@ ? ks : ks * lda, step_b = @B_K_MAJOR@ ? ks : ks * ldb;
  float* ws = static_cast<float*>(workspace);
  const int64_t slices_bytes = ((full + (rest > 0)) * slice * 4 + 255) / 256 * 256;
  char* inner = static_cast<char*>(workspace) + slices_bytes;
  const int64_t inner_bytes = workspace_bytes - slices_bytes;
  int code = 0;
  if (full > 0)
    code = @PARTIAL_ENTRY@(A, B, nullptr, ws, nullptr, nullptr, nullptr, M, N,
        static_cast<int>(ks), static_cast<int>(full), lda, step_a, ldb, step_b, 0, 0, ldw, slice,
        0, 1.f, 0.f, 0.f, 0.f, 0.f, 1, swizzle, raster, inner, inner_bytes, sm_count, stream);
  if (code == 0 && rest > 0)
    code = @PARTIAL_ENTRY@(
        static_cast<const char*>(A) + full * step_a * int64_t(sizeof(ElementA)),
        static_cast<const char*>(B) + full * step_b * int64_t(sizeof(ElementB)), nullptr,
        ws + full * slice, nullptr, nullptr, nullptr, M, N, static_cast<int>(rest), 1, lda,
        step_a, ldb, step_b, 0, 0, ldw, slice, 0, 1.f, 0.f, 0.f, 0.f, 0.f, 1, swizzle, raster,
        inner, inner_bytes, sm_count, stream);
  if (code) return code;
  const int64_t total = int64_t(M) * N;
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 8LL * sm_count));
  reduce_slices<<<blocks, 256, 0, stream>>>(
      ws, slice, ldw, static_cast<int>(full + (rest > 0)), static_cast<const ElementSrc*>(C), ldc,
      static_cast<ElementOut*>(D), ldd, static_cast<const ElementBias*>(bias),
      static_cast<const float*>(scale_a), static_cast<const float*>(scale_b), M, N, alpha, beta,
      slope, lo, hi);
  return static_cast<int>(cudaGetLastError());
}
"""


def partial_operation(op):
    """The batched GEMM of op's slices: D fp32 in D's layout, epilogue alpha * acc."""
    return dataclasses.replace(op, mode="batched", D=TensorDescription("f32", op.D.layout),
                               C=None, epilogue=LinearCombination("f32"))


def emit(op) -> str:
    """The translation unit of a GemmOperation of mode 'split_k_parallel'."""
    from vitrail.gemm.descriptions import k_major
    epi = op.epilogue
    inner = plain.emit(partial_operation(op), entry=PARTIAL_ENTRY,
                         workspace_entry=PARTIAL_WORKSPACE_ENTRY, linkage="static")
    act = epi.activation is not None or epi.clamp
    activate = ""
    if act:
        act_id = ACT_IDS.get(epi.activation, 0) if epi.activation else 0
        activate = "    x = vitrail_act::apply<Act>(x, slope);\n" if act_id else ""
        if epi.clamp:
            activate += "    x = vitrail_act::clamp(x, lo, hi);\n"
    subs = {
        "ELEMENT_D": cpp_type(epi.element_output),
        "ELEMENT_SRC": cpp_type(epi.element_source) if epi.has_source else "float",
        "ELEMENT_BIAS": cpp_type(epi.element_bias) if epi.bias else "float",
        "ROW_MAJOR": "true" if op.D.layout == "row" else "false",
        "HAS_SOURCE": "true" if epi.has_source else "false",
        "BIAS_KIND": {None: "0", "row": "1", "col": "2"}[epi.bias],
        "SCALE_A": {None: "0", "tensor": "1", "row": "2"}[epi.scale_a],
        "SCALE_B": {None: "0", "tensor": "1", "col": "2"}[epi.scale_b],
        "ACT": str(ACT_IDS.get(epi.activation, 0) if epi.activation else 0),
        "CLAMP": "true" if epi.clamp else "false",
        "ACTIVATE": activate.rstrip("\n"),
        "C_ALIGNED": "",
        "A_K_MAJOR": "true" if k_major("a", op.A) else "false",
        "B_K_MAJOR": "true" if k_major("b", op.B) else "false",
        "PARTIAL_ENTRY": PARTIAL_ENTRY, "PARTIAL_WORKSPACE": PARTIAL_WORKSPACE_ENTRY,
    }
    reduce = fill(_REDUCE, subs)
    header = (f"// vitrail split-K (parallel) GEMM: {op.name}\n// epilogue {epi.tag}, applied "
              f"by the reduction; the slices' batched GEMM follows\n#include <algorithm>\n")
    return header + inner + (ACTIVATION_FUNCTOR if act else "") + reduce
