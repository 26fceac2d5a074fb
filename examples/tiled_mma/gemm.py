"""The Python side of the example: compile the kernel for a config (NVRTC, seconds), describe A
and B to TMA, launch.

    from examples.tiled_mma.gemm import gemm
    c = gemm(a, b)      # a: (M, K), b: (N, K) bf16/fp16 CUDA tensors -> a @ b.T, (M, N)
"""
from __future__ import annotations

from pathlib import Path

import torch

from vitrail import jit
from vitrail.device import ctype
from vitrail.jit.tma import tensor_map
from vitrail.ops.common import check_tensor

HERE = Path(__file__).resolve().parent
CONFIG = {"BM": 128, "BN": 256, "BK": 64, "STAGES": 4}
THREADS = 384  # a producer warpgroup and two consumer warpgroups


def source(dtype: torch.dtype, config: dict = CONFIG) -> str:
    return ("#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"
            f"using T = {ctype(dtype)};\n" +
            "".join(f"constexpr int {k} = {v};\n" for k, v in config.items()) +
            '#include "gemm.cuh"\n')


def kernel(dtype: torch.dtype, config: dict = CONFIG) -> jit.Kernel:
    # CuTe's constexpr helpers carry no __device__: NVRTC needs -default-device
    module = jit.compile(source(dtype, config), name="example_tiled_gemm", backend="nvrtc",
                         include_dirs=[HERE], flags=["-default-device"])
    # the kernel is declared in gemm.cuh, not in the source text: say its parameters
    return module.kernel("tiled_gemm", "void* C, const vitrail::TensorMap mapA, "
                                       "const vitrail::TensorMap mapB, int M, int N, int K")


def smem_bytes(dtype: torch.dtype, config: dict = CONFIG) -> int:
    """The kernel's dynamic shared memory: the stages, 1024 bytes of alignment, the barriers."""
    stage = (config["BM"] + config["BN"]) * config["BK"] * torch.finfo(dtype).bits // 8
    return 1024 + config["STAGES"] * stage + 16 * config["STAGES"]


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t itself where TMA can read it (contiguous rows 16 bytes apart and 16-byte aligned), else
    a contiguous copy."""
    ok = t.stride(1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0
    return t if ok or t.shape[0] <= 1 and t.stride(1) == 1 else t.contiguous()


def gemm(a: torch.Tensor, b: torch.Tensor, config: dict = CONFIG) -> torch.Tensor:
    check_tensor("gemm", "a", a, dtypes=(torch.bfloat16, torch.float16), ndim=2)
    check_tensor("gemm", "b", b, dtypes=(a.dtype,), ndim=2)
    if b.device != a.device:
        raise ValueError(f"gemm: a is on {a.device} but b on {b.device}")
    (M, K), (N, Kb) = a.shape, b.shape
    if K != Kb:
        raise ValueError(f"gemm: a is {M} x {K} but b is {N} x {Kb}; b must be N x K (a @ b.T)")
    if K % 8 or N % 8:
        raise ValueError(f"gemm: K ({K}) and N ({N}) must be multiples of 8 (16-byte rows)")
    a, b = _tma_ready(a), _tma_ready(b)
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if not c.numel() or K == 0:
        return c.zero_()
    bm, bn, bk = config["BM"], config["BN"], config["BK"]
    map_a = tensor_map(a, dims=(K, M), strides=(a.stride(0),), box=(bk, bm))
    map_b = tensor_map(b, dims=(K, N), strides=(b.stride(0),), box=(bk, bn))
    grid = (-(-N // bn), -(-M // bm))
    kernel(a.dtype, config)[grid, THREADS](c, map_a, map_b, M, N, K,
                                           shared_mem=smem_bytes(a.dtype, config))
    return c
