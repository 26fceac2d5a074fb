"""vitrail.gemm: the GEMM family, described in Python and emitted on CUTLASS 3 (sm_90a).

One package, read top to bottom as a GEMM goes from description to torch op:

    descriptions.py    MathInstruction, TileDescription, TensorDescription; the modes
                       (MODES, and MODE_RULES: what each asks of an operation)
    epilogue.py        LinearCombination: the epilogue as a CUTLASS 3 visitor tree
    emit/              the C++: one template (template.py) with a hook per mode: plain.py
                       (gemm, batched, split_k_serial: stream-K), split_k.py
                       (split_k_parallel), array.py (array), grouped.py (grouped)
    operation.py       GemmOperation (validates, names, emits by its mode) and compile
                       (Buildable: through vitrail.jit, cached on disk; compile_many)
    arguments.py       the runtime side: GemmArguments, ArrayArguments, checks, launch
    accurate.py        AccurateF32Operation: the 3xTF32 fp32 GEMM (CUTLASS 2, sm80 path)
    conv.py            ConvOperation: 2-D convolutions (fprop, dgrad, wgrad) on CUTLASS 3's
                       sm90 implicit GEMM, on the same descriptions; conv_arguments.py: their
                       Conv2dProblem and ConvArguments
    ops/               the torch ops: mm, bmm, gemm (dense.py), scaled_mm (fp8.py), grouped_mm
                       (grouped.py), their configs, model, launch and benchmarks; exported as
                       vitrail.ops.mm etc. (vitrail/ops/gemm names them to the op library)

A ``GemmOperation`` (operands as ``TensorDescription``, a ``MathInstruction``, a
``TileDescription``, an epilogue such as ``LinearCombination``, a mode) emits the C++ of one
kernel (TMA, wgmma, warp specialization, persistent or stream-K scheduler), compiles it through
vitrail.jit, and runs it on ``GemmArguments`` built from torch tensors, NumPy, CuPy or DLPack
arrays (mode 'array': ``ArrayArguments``, lists of tensors; mode 'grouped': device arrays built
by the grouped_mm op). The torch ops on top: vitrail.gemm.ops, and vitrail.ops.conv for conv2d.
"""
from vitrail.gemm.descriptions import (DTYPES, KERNEL_SCHEDULES, TILE_SCHEDULERS,
                                       MathInstruction, TensorDescription, TileDescription)
from vitrail.gemm.epilogue import ACTIVATIONS, LinearCombination
from vitrail.gemm.operation import GemmOperation, compile_many
from vitrail.gemm.arguments import GemmArguments
from vitrail.gemm.arguments import ArrayArguments
from vitrail.gemm.accurate import AccurateF32Operation
from vitrail.gemm.conv import ConvOperation
from vitrail.gemm.conv_arguments import Conv2dProblem, ConvArguments

__all__ = ["DTYPES", "KERNEL_SCHEDULES", "TILE_SCHEDULERS", "MathInstruction",
           "TensorDescription", "TileDescription", "ACTIVATIONS", "LinearCombination",
           "GemmOperation", "compile_many", "GemmArguments", "ArrayArguments",
           "AccurateF32Operation", "ConvOperation", "Conv2dProblem", "ConvArguments"]
