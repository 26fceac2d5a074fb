"""GEMM problems from a shape (``vitrail tune``): the kind that mm, bmm, gemm and scaled_mm give
contiguous operands of a dtype (as ``launch.run_into`` reads them), and that kind's problem."""
from __future__ import annotations

import torch

from vitrail.gemm import LinearCombination
from vitrail.op import Shaped, family
from vitrail.gemm.ops.configs import Kind
from vitrail.gemm.ops.launch import ELEMENTS, OUT_ELEMENTS, SHAPE, make_problem


def plain_kind(a: torch.dtype, b: torch.dtype | None = None, out: torch.dtype | None = None,
               scaled: bool = False) -> Kind:
    """The kind of row-major (contiguous) a @ b: wgmma reads TF32 and FP8 operands K-major, so
    run_into copies b to column-major for those; scaled: scaled_mm's per-tensor scales."""
    b = b or a
    element = ELEMENTS[a]
    k_major = element in ("tf32", "e4m3", "e5m2")
    out_el = OUT_ELEMENTS[out or a]
    epi = (LinearCombination(out_el, scale_a="tensor", scale_b="tensor") if scaled
           else LinearCombination(out_el))
    return Kind(element, ELEMENTS[b], "row", "col" if k_major else "row", epi)


def _plain(shape: tuple[int, ...], dtype: str, *, backward: bool = False,
           device: torch.device | None = None) -> Shaped:
    return make_problem(plain_kind(getattr(torch, dtype)), shape)


def _scaled(shape: tuple[int, ...], dtype: str, *, backward: bool = False,
            device: torch.device | None = None) -> Shaped:
    a = getattr(torch, dtype)
    b = torch.float8_e4m3fn  # e5m2 x e5m2 is refused (as torch._scaled_mm)
    return make_problem(plain_kind(a, b, torch.bfloat16, scaled=True), shape)


_DOC = ("a (M x K) @ b (K x N), contiguous, {}; L: a batch of L products (bmm); float32 runs the "
        "TF32 kernel (what torch.set_float32_matmul_precision('high') asks; 'highest' runs "
        "3xTF32, one config)")
for _name, _what in (("gemm", "plain (no C, bias or activation)"), ("mm", "out in a's dtype"),
                     ("bmm", "out in a's dtype")):
    family(_name, SHAPE, _DOC.format(_what), ("bfloat16", "float16", "float32"), _plain,
           variants=("gemm.",))
family("scaled_mm", "MxNxK", "FP8 a (M x K, row-major) @ b (K x N, column-major) with "
       "per-tensor scales, out bfloat16; --dtype is a's (b is float8_e4m3fn)",
       ("float8_e4m3fn", "float8_e5m2"), _scaled, variants=("gemm.e4m3", "gemm.e5m2"))
family("grouped_mm", "", "", (), None,
       why_not="grouped_mm has no configs to choose (one CUTLASS grouped kernel per dtype and "
               "layout); nothing to tune")
