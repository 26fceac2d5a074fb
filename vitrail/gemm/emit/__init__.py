"""The C++ of a GemmOperation: one template (template.py), each mode's hooks into it.

    template.py   TEMPLATE, the sections a mode fills (Hooks), fill, the shared launch
    plain.py      modes gemm, batched, split_k_serial (stream-K): one GemmUniversal kernel
    split_k.py    mode split_k_parallel: plain's batched kernel over K slices + a reduction
    array.py      mode array: the pointer-array kernel (ArrayProblemShape)
    grouped.py    mode grouped: the pointer-array kernel on GroupProblemShape

``emit(op)`` is the translation unit of ``op`` by its mode's hook (EMITTERS).
"""
from __future__ import annotations

from vitrail.gemm.emit import array, grouped, plain, split_k
from vitrail.gemm.emit.template import CODES, LAUNCH, fill

EMITTERS = {"gemm": plain.emit, "batched": plain.emit, "split_k_serial": plain.emit,
            "split_k_parallel": split_k.emit, "array": array.emit, "grouped": grouped.emit}

__all__ = ["EMITTERS", "emit", "CODES", "LAUNCH", "fill"]


def emit(op) -> str:
    """The translation unit of GemmOperation ``op``, by its mode's hook."""
    return EMITTERS[op.mode](op)
