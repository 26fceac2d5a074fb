"""The GEMM family's torch ops: mm, bmm, gemm (fused epilogues), scaled_mm (FP8), grouped_mm.

Each is a ``torch.library`` custom op in the ``vitrail`` namespace with a fake implementation
(torch.compile, meta tensors) and, for gemm/mm/bmm, autograd; an eager call skips the dispatcher
and goes to the kernels, under an autograd.Function where gradients are recorded
(vitrail.ops.common.call_mode). Kernels are CUTLASS 3 sm_90a GEMMs described and emitted by
vitrail.gemm (dense.py: mm, bmm, gemm; launch.py for layouts and fallbacks; operands.py for
aligned copies).

    gemm(a, b, c=None, *, alpha=1.0, beta=0.0, bias=None, activation=None, out_dtype=None,
         slope=0.01, clamp_min=None, clamp_max=None)
        = clamp(act(alpha * a @ b + beta * c + bias)); bias (N,) per column or (M, 1) per row.

``grouped_mm`` (grouped.py) runs CUTLASS's sm90 grouped (pointer-array) kernel in one launch
for bf16/fp16, else a loop of gemm launches; autograd for both forms.
"""
from __future__ import annotations

import importlib

from vitrail.gemm.ops.dense import bmm, gemm, mm
from vitrail.gemm.ops.fp8 import scaled_mm
from vitrail.gemm.ops.grouped import grouped_mm

__all__ = ["gemm", "mm", "bmm", "scaled_mm", "grouped_mm"]

importlib.import_module("vitrail.gemm.ops.problems")  # vitrail tune's shapes
