"""Accurate fp32 GEMM (3xTF32) for torch's 'highest' fp32 matmul precision.

Each fp32 operand is split into a TF32 big part and a TF32 small part (x = big + small, small
carrying the bits TF32 drops), and D = alpha * (a_big b_big + a_big b_small + a_small b_big) +
beta * C with fp32 accumulation: an error at fp32 level (within a small factor of an fp32 SIMT
GEMM) at three tensor-core MMAs per product.

sm_90's CUTLASS 3 collectives have no 3xTF32 mainloop (the installed CUTLASS 4.2 headers offer
it only as the sm80 warp-level ``OpMultiplyAddFastF32`` and as sm100 emulation), so this is a
CUTLASS 2 ``device::GemmUniversal`` on the sm80 path (``mma.sync``: HMMA in SASS, cp.async
multistage, no TMA or wgmma), which runs on sm_90; its prediction and measurement:
docs/ops/gemm.md#fp32-as-3xtf32.

One emitted translation unit, entry points ``vitrail_gemm_f32x3`` (batched: L and batch
strides; any row/col layout of A and B as given by the description; C and D row-major) and
nothing else: no workspace (serial batches, no split-K).
"""
from __future__ import annotations

from dataclasses import dataclass

from vitrail.gemm.descriptions import LAYOUTS
from vitrail.gemm.emit.template import CODES as GEMM_CODES, fill
from vitrail.gemm.operation import Buildable

ENTRY = "vitrail_gemm_f32x3"
CODES = {**GEMM_CODES,
         -6: "CUTLASS's can_implement refused the problem (an address not 16-byte aligned, or a "
             "leading stride or contiguous extent not a multiple of 4 floats)"}

_TEMPLATE = r"""// vitrail accurate fp32 GEMM (3xTF32, sm80 mma.sync path): @NAME@
#include <cuda_runtime.h>
#include <cstdint>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal.h>
#include <cutlass/epilogue/thread/linear_combination.h>

namespace vitrail_f32x3_impl {
using Gemm = cutlass::gemm::device::GemmUniversal<
    float, @LAYOUT_A@, float, @LAYOUT_B@, float, cutlass::layout::RowMajor, float,
    cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
    cutlass::gemm::GemmShape<@TILE@>, cutlass::gemm::GemmShape<@WARP@>,
    cutlass::gemm::GemmShape<16, 8, 8>,
    cutlass::epilogue::thread::LinearCombination<float, 4, float, float>,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<8>, @STAGES@, 4, 4,
    cutlass::arch::OpMultiplyAddFastF32>;
}  // namespace vitrail_f32x3_impl
using namespace vitrail_f32x3_impl;

// D = alpha * A @ B + beta * C per batch (C may be null when beta == 0); returns 0, a negative
// vitrail check code or a positive cudaError_t.
extern "C" int vitrail_gemm_f32x3(const void* A, const void* B, const void* C, void* D, int M,
    int N, int K, int L, int64_t lda, int64_t batch_a, int64_t ldb, int64_t batch_b,
    int64_t ldc, int64_t batch_c, int64_t ldd, int64_t batch_d, float alpha, float beta,
    cudaStream_t stream) {
  if (M <= 0 || N <= 0 || K <= 0 || L <= 0) return -3;
  if (C == nullptr) { C = D; ldc = ldd; batch_c = batch_d; beta = 0.f; }
  typename Gemm::Arguments args(
      L > 1 ? cutlass::gemm::GemmUniversalMode::kBatched : cutlass::gemm::GemmUniversalMode::kGemm,
      {M, N, K}, L, {alpha, beta}, A, B, C, D, batch_a, batch_b, batch_c, batch_d,
      lda, ldb, ldc, ldd);
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return -6;
  Gemm gemm;
  if (gemm.initialize(args, nullptr, stream) != cutlass::Status::kSuccess) return -5;
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    cudaError_t e = cudaGetLastError();
    return e ? static_cast<int>(e) : -5;
  }
  return 0;
}
"""


@dataclass(frozen=True)
class AccurateF32Operation(Buildable):
    """A 3xTF32 GEMM on fp32 operands: A and B 'row' or 'col', C and D row-major, D = alpha *
    A @ B + beta * C. Tiles: CTA 128 x 128 x 32, warps 64 x 32 x 32 (8 warps), 3 stages (the
    64 x 64 warp tile of 1xTF32 spills here: 255 registers, 1560 bytes of spill stores; this
    one uses 254 and spills nothing, sm_90a with nvcc 13.0); operands need
    16-byte aligned addresses, and leading strides and contiguous extents (K of a row-major A,
    N of a row-major B and of D) that are multiples of 4 elements."""
    layout_a: str = "row"
    layout_b: str = "row"
    tile_shape: tuple = (128, 128, 32)
    warp_shape: tuple = (64, 32, 32)
    stages: int = 3

    def __post_init__(self):
        for name in ("layout_a", "layout_b"):
            if getattr(self, name) not in LAYOUTS:
                raise ValueError(f"AccurateF32Operation.{name}={getattr(self, name)!r}: expected "
                                 f"'row' or 'col'")
        tm, tn, tk = self.tile_shape
        wm, wn, wk = self.warp_shape
        if tm % wm or tn % wn or wk != tk or (tm // wm) * (tn // wn) not in (1, 2, 4, 8):
            raise ValueError(f"AccurateF32Operation: tile {self.tile_shape} and warp tile "
                             f"{self.warp_shape} do not fit (the warp tile must divide the CTA "
                             f"tile into 1-8 warps, with the same K)")
        if self.stages < 2 or self.stages * (tm + tn) * tk * 4 > 227 * 1024:
            raise ValueError(f"AccurateF32Operation.stages={self.stages}: expected >= 2 stages "
                             f"that fit in 227 KiB of shared memory")

    @property
    def name(self) -> str:
        tm, tn, tk = self.tile_shape
        wm, wn, _ = self.warp_shape
        return (f"gemm_f32x3_{self.layout_a[0]}{self.layout_b[0]}r_{tm}x{tn}x{tk}_w{wm}x{wn}_"
                f"s{self.stages}_sm80")

    def emit(self) -> str:
        lay = {"row": "cutlass::layout::RowMajor", "col": "cutlass::layout::ColumnMajor"}
        return fill(_TEMPLATE, {
            "NAME": self.name, "LAYOUT_A": lay[self.layout_a], "LAYOUT_B": lay[self.layout_b],
            "TILE": ", ".join(map(str, self.tile_shape)),
            "WARP": ", ".join(map(str, self.warp_shape)), "STAGES": str(self.stages)})
