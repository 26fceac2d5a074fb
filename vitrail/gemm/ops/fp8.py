"""scaled_mm: FP8 GEMMs with per-tensor or row-wise scales.

scaled_mm: D = (scale_a * scale_b * (a @ b) + bias) in out_dtype, a (M, K) and b (K, N) of
float8_e4m3fn or float8_e5m2; scale_a () / (1,) or (M, 1), scale_b () / (1,) or (1, N), fp32 on
the device (read by the kernel's epilogue: no host sync). wgmma reads FP8 operands K-major, so
a should be row-major and b column-major (as torch._scaled_mm requires); other layouts are
copied. No autograd (as torch._scaled_mm).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from vitrail.jit.errors import ArgumentError
from vitrail.ops.common import check_same_device, check_tensor, plain_eager
from vitrail.gemm.ops.launch import PLANS, eager, native_ok
from vitrail.plan.native import front

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT = (torch.bfloat16, torch.float16, torch.float32)


def _check_scaled(a, b, scale_a, scale_b, bias, out_dtype) -> None:
    name = "vitrail.ops.scaled_mm"
    check_tensor(name, "a", a, dtypes=FP8, ndim=2)
    check_tensor(name, "b", b, dtypes=FP8, ndim=2)
    check_tensor(name, "scale_a", scale_a, dtypes=(torch.float32,))
    check_tensor(name, "scale_b", scale_b, dtypes=(torch.float32,))
    check_same_device(name, a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise ArgumentError(f"{name}: a and b cannot both be float8_e5m2 (as torch._scaled_mm)")
    M, K, N = a.shape[0], a.shape[1], b.shape[1]
    if b.shape[0] != K:
        raise ArgumentError(f"{name}: a {tuple(a.shape)} and b {tuple(b.shape)} cannot be "
                            f"multiplied")
    if scale_a.numel() != 1 and tuple(scale_a.shape) != (M, 1):
        raise ArgumentError(f"{name}: scale_a must have 1 element (per tensor) or shape "
                            f"({M}, 1) (row-wise), got {tuple(scale_a.shape)}")
    if scale_b.numel() != 1 and tuple(scale_b.shape) != (1, N):
        raise ArgumentError(f"{name}: scale_b must have 1 element (per tensor) or shape "
                            f"(1, {N}) (column-wise), got {tuple(scale_b.shape)}")
    if out_dtype not in OUT:
        raise ArgumentError(f"{name}: out_dtype must be bfloat16, float16 or float32, got "
                            f"{out_dtype}")
    if bias is not None:
        check_tensor(name, "bias", bias, dtypes=OUT)
        if tuple(bias.shape) != (N,):
            raise ArgumentError(f"{name}: bias must have shape ({N},), got {tuple(bias.shape)}")


@torch.library.custom_op("vitrail::scaled_mm", mutates_args=())
def _scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Optional[Tensor],
               out_dtype: torch.dtype, use_fast_accum: bool) -> Tensor:
    return eager(a, b, None, bias, 1.0, 0.0, None, 0.0, None, None, out_dtype, scale_a=scale_a,
                 scale_b=scale_b, fast_accum=use_fast_accum)


@_scaled_mm.register_fake
def _scaled_mm_fake(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@front(PLANS, when=native_ok)
def scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, *,
              bias: Optional[Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
              use_fast_accum: bool = False) -> Tensor:
    """FP8 a @ b with scales: scale_a * scale_b * (a @ b) + bias, in out_dtype."""
    if plain_eager(a, b, scale_a, scale_b, bias):  # through its plan; checked on a miss
        return eager(a, b, None, bias, 1.0, 0.0, None, 0.0, None, None, out_dtype,
                     scale_a=scale_a, scale_b=scale_b, fast_accum=use_fast_accum,
                     check=lambda: _check_scaled(a, b, scale_a, scale_b, bias, out_dtype))
    _check_scaled(a, b, scale_a, scale_b, bias, out_dtype)
    return _scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, use_fast_accum)
