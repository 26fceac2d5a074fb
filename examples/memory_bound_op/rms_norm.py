"""The Python side of the example: compile the kernel for a config, check, allocate, launch.

    from examples.memory_bound_op.rms_norm import rms_norm
    y = rms_norm(x)            # x: (..., n) bf16/fp16/fp32 CUDA tensor, n <= 32768 (bf16)
"""
from __future__ import annotations

from pathlib import Path

import torch

from vitrail import jit
from vitrail.device import ctype, vector
from vitrail.ops.common import FLOATS, check_tensor

HERE = Path(__file__).resolve().parent
ENTRY = r"""
extern "C" cudaError_t rms_norm(void* y, const void* x, long long rows, int n, long long ld,
                                float eps, cudaStream_t stream) {
  return example::rms_norm<T, TPR, THREADS, ITERS>((T*)y, (const T*)x, rows, n, ld, eps, stream);
}
"""


def config(n: int, dtype: torch.dtype) -> dict:
    """Threads per row so that each thread holds at most 8 fragments of 16 bytes."""
    v = vector(dtype)  # elements of a 16-byte vector
    vectors, tpr = -(-n // v), 1
    while tpr < 512 and -(-vectors // tpr) > 8:
        tpr *= 2
    iters = 1 << max(0, (-(-vectors // tpr) - 1).bit_length())
    return {"TPR": tpr, "THREADS": max(tpr, 256), "ITERS": iters}


def compile_kwargs(c: dict, dtype: torch.dtype) -> dict:
    """The arguments of jit.compile for config c: the entry point, with the config's values as
    constants, over the kernel template."""
    source = (f'#include "rms_norm.cuh"\nusing T = {ctype(dtype)};\n' +
              "".join(f"constexpr int {k} = {v};\n" for k, v in c.items()) + ENTRY)
    # rms_norm.cuh is found through include_dirs; its text is part of the cache key
    return dict(source=source, name="example_rms_norm", include_dirs=[HERE],
                flags=["-std=c++17"])


def module(n: int, dtype: torch.dtype):
    return jit.compile(**compile_kwargs(config(n, dtype), dtype))


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    check_tensor("rms_norm", "x", x, dtypes=FLOATS, min_ndim=1)
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    v = vector(x.dtype)
    if x2.stride(-1) != 1 or n % v or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    if n % v:
        raise ValueError(f"rms_norm: the last dim ({n}) must be a multiple of {v} for 16-byte rows")
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    module(n, x.dtype).rms_norm(y.data_ptr(), x2.data_ptr(), x2.shape[0], n, x2.stride(0), eps)
    return y.view(x.shape)
