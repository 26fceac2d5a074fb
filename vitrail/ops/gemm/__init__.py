"""The GEMM family's entry in the op library: the names vitrail.ops exports (mm, bmm, gemm,
scaled_mm, grouped_mm). The ops themselves live with their kernels in vitrail.gemm.ops (the
last stage of the vitrail.gemm package: descriptions -> emit -> compile -> arguments -> torch
ops); this folder holds no code of its own, so that vitrail.ops finds the family as it finds
every other one (a subpackage, its ``benchmarks`` module)."""
from __future__ import annotations

from vitrail.gemm.ops import bmm, gemm, grouped_mm, mm, scaled_mm

__all__ = ["gemm", "mm", "bmm", "scaled_mm", "grouped_mm"]
