"""vitrail.gemm: GEMM kernels described in Python and emitted on CUTLASS 3 (sm_90a).

A ``GemmOperation`` (operands as ``TensorDescription``, a ``MathInstruction``, a
``TileDescription``, an epilogue functor such as ``LinearCombination``) emits the C++ of one
CUTLASS 3 kernel (TMA, wgmma, warp specialization, persistent or stream-K scheduler), compiles it
through vitrail.jit, and runs it on ``GemmArguments`` built from torch tensors, NumPy, CuPy or
DLPack arrays. Modes: gemm, batched, split_k_serial (stream-K), split_k_parallel (split_k.py),
array (array.py, lists of tensors: ``ArrayArguments``); ``AccurateF32Operation`` is the 3xTF32
fp32 GEMM (accurate.py). ``ConvOperation`` (conv.py) is a 2-D convolution (fprop, dgrad, wgrad)
on the same descriptions, emitted on CUTLASS 3's sm90 implicit GEMM and run on ``ConvArguments``
(conv_arguments.py). The torch ops on top live in ``vitrail.ops.gemm`` and ``vitrail.ops.conv``.
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
