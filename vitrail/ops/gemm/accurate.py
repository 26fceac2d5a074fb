"""fp32 GEMMs at torch's 'highest' precision: the 3xTF32 kernel (vitrail.gemm.fast_f32).

``launch.run`` sends fp32 inputs here on Hopper when ``torch.get_float32_matmul_precision()``
is 'highest'. The kernel computes alpha * a @ b + beta * c in fp32 (error at fp32 level); the
rest of the epilogue (bias, activation, clamp, out_dtype) is applied by torch on its result,
in fp32. Layouts come from strides (row or column major, no copy); operands whose address or
leading stride is not 16-byte aligned, or that are broadcast over the batch, are copied
(launch.aligned). One kernel per (layout of a, layout of b), built on first use.
"""
from __future__ import annotations

from typing import Optional

import torch

from vitrail.gemm.fast_f32 import ENTRY, AccurateF32Operation
from vitrail.jit.errors import LaunchError

_MODULES: dict = {}


def operation(layout_a: str, layout_b: str) -> AccurateF32Operation:
    return AccurateF32Operation(layout_a, layout_b)


def _module(op: AccurateF32Operation):
    mod = _MODULES.get(op)
    if mod is None:
        mod = _MODULES[op] = op.compile()
    return mod


def product(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor], alpha: float,
            beta: float) -> torch.Tensor:
    """alpha * a @ b + beta * c in fp32 by the 3xTF32 kernel; a (M, K) or (L, M, K), b (K, N)
    or (L, K, N), c broadcastable to the output or None. A new contiguous fp32 tensor."""
    from vitrail.gemm.arguments import describe
    from vitrail.gemm.emitter import CODES
    from vitrail.ops.gemm.launch import aligned
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    batched = a.dim() == 3 or b.dim() == 3
    L = max(a.shape[0] if a.dim() == 3 else 1, b.shape[0] if b.dim() == 3 else 1)
    shape = (L, M, N) if batched else (M, N)
    if batched:
        a = a if a.dim() == 3 else a.expand(L, *a.shape)
        b = b if b.dim() == 3 else b.expand(L, *b.shape)
    a_t, la = aligned(a, None)
    b_t, lb = aligned(b, None)
    n_pad = (N + 3) // 4 * 4
    d_buf = torch.empty(*shape[:-1], n_pad, dtype=torch.float32, device=a.device)
    d = d_buf[..., :N]
    c_t = None
    if c is not None and beta != 0:
        c_t, _ = aligned(c.to(torch.float32).expand(shape), "row")
    ia, ib, idd = describe(a_t, "a", la), describe(b_t, "b", lb), describe(d, "d", "row")
    ic = describe(c_t, "c", "row") if c_t is not None else None
    op = operation(la, lb)
    stream = torch._C._cuda_getCurrentRawStream(a.device.index or 0)
    code = _module(op).function(ENTRY)(
        ia.ptr, ib.ptr, ic.ptr if ic else 0, idd.ptr, M, N, K, L, ia.ld, ia.batch_stride, ib.ld,
        ib.batch_stride, ic.ld if ic else 0, ic.batch_stride if ic else 0, idd.ld,
        idd.batch_stride, float(alpha), float(beta if ic else 0.0), stream=stream)
    if code:
        raise LaunchError(f"{op.name}: {CODES.get(code) or f'CUDA error {code}'}")
    return d if n_pad == N else d.contiguous()


def run(a, b, c, bias, alpha, beta, activation, slope, clamp_min, clamp_max,
        out_dtype) -> torch.Tensor:
    """launch.run's contract for fp32 a and b at 'highest' precision."""
    from vitrail.ops.gemm.reference import activation as act
    z = product(a, b, c, alpha, beta)
    if bias is not None:
        z = z + bias.to(torch.float32)
    if activation is not None:
        z = act(z, activation, slope)
    if clamp_min is not None or clamp_max is not None:
        z = torch.clamp(z, clamp_min, clamp_max)
    return z if out_dtype == torch.float32 else z.to(out_dtype)
