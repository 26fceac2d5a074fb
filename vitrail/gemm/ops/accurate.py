"""fp32 GEMMs at torch's 'highest' precision: the 3xTF32 kernel (vitrail.gemm.accurate).

``launch.run`` sends fp32 inputs here on Hopper when ``torch.get_float32_matmul_precision()``
is 'highest'. The kernel computes alpha * a @ b + beta * c in fp32 (error at fp32 level); the
rest of the epilogue (bias, activation, clamp, out_dtype) is applied by torch on its result,
in fp32. Layouts come from strides (row or column major, no copy); operands whose address or
leading stride is not 16-byte aligned, or that are broadcast over the batch, are copied
(operands.aligned); a problem whose contiguous extents are not multiples of 4 floats runs
zero-padded to multiples of 4 (a copy of the operands; zeros along K add nothing). One kernel per (layout of a, layout of b), built on first use.
"""
from __future__ import annotations

from typing import Optional

import torch

from vitrail.gemm.accurate import ENTRY, AccurateF32Operation
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
    from vitrail.gemm.accurate import CODES
    from vitrail.gemm.arguments import round_up
    from vitrail.gemm.ops.operands import aligned
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    batched = a.dim() == 3 or b.dim() == 3
    L = max(a.shape[0] if a.dim() == 3 else 1, b.shape[0] if b.dim() == 3 else 1)
    shape = (L, M, N) if batched else (M, N)
    if batched:
        a = a if a.dim() == 3 else a.expand(L, *a.shape)
        b = b if b.dim() == 3 else b.expand(L, *b.shape)
    la = describe(a, "a", None).layout or "row"  # read from the strides (None: no unit stride)
    lb = describe(b, "b", None).layout or "row"
    # CUTLASS 2's iterators read whole 16-byte vectors along each operand's contiguous extent:
    # that extent (and N, for C and D) must be a multiple of 4 floats. Otherwise the problem is
    # zero-padded to multiples of 4 (zeros along K add nothing) and the result sliced out.
    ragged = bool((K if la == "row" else M) % 4 or (N if lb == "row" else K) % 4 or N % 4)
    if ragged:
        Mp, Np, Kp = round_up(M, 4), round_up(N, 4), round_up(K, 4)
        a_t, b_t = _padded(a, Mp, Kp, la), _padded(b, Kp, Np, lb)
    else:
        Mp, Np, Kp = M, N, K
        (a_t, la), (b_t, lb) = aligned(a, la), aligned(b, lb)
    d = torch.empty(*shape[:-2], Mp, Np, dtype=torch.float32, device=a.device)
    c_t = None
    if c is not None and beta != 0:
        c32 = c.to(torch.float32).expand(shape)
        c_t = _padded(c32, Mp, Np, "row") if ragged else aligned(c32, "row")[0]
    ia, ib, idd = describe(a_t, "a", la), describe(b_t, "b", lb), describe(d, "d", "row")
    ic = describe(c_t, "c", "row") if c_t is not None else None
    op = operation(la, lb)
    stream = torch._C._cuda_getCurrentRawStream(a.device.index or 0)
    code = _module(op).function(ENTRY)(
        ia.ptr, ib.ptr, ic.ptr if ic else 0, idd.ptr, Mp, Np, Kp, L, ia.ld, ia.batch_stride, ib.ld,
        ib.batch_stride, ic.ld if ic else 0, ic.batch_stride if ic else 0, idd.ld,
        idd.batch_stride, float(alpha), float(beta if ic else 0.0), stream=stream)
    if code:
        raise LaunchError(f"{op.name}: {CODES.get(code) or f'CUDA error {code}'} (M={Mp}, "
                          f"N={Np}, K={Kp}, L={L}, lda={ia.ld}, ldb={ib.ld}, ldd={idd.ld})")
    return d[..., :M, :N].contiguous() if ragged else d


def _padded(t: torch.Tensor, rows: int, cols: int, layout: str) -> torch.Tensor:
    """t (..., r, c) at the top left of a zeroed (..., rows, cols) fp32 buffer in ``layout``."""
    lead = t.shape[:-2]
    if layout == "row":
        buf = torch.zeros(*lead, rows, cols, dtype=torch.float32, device=t.device)
    else:
        buf = torch.zeros(*lead, cols, rows, dtype=torch.float32, device=t.device).transpose(-1, -2)
    buf[..., :t.shape[-2], :t.shape[-1]].copy_(t)
    return buf


def run(a, b, c, bias, alpha, beta, activation, slope, clamp_min, clamp_max,
        out_dtype) -> torch.Tensor:
    """launch.run's contract for fp32 a and b at 'highest' precision."""
    from vitrail.gemm.ops.reference import activation as act
    z = product(a, b, c, alpha, beta)
    if bias is not None:
        z = z + bias.to(torch.float32)
    if activation is not None:
        z = act(z, activation, slope)
    if clamp_min is not None or clamp_max is not None:
        z = torch.clamp(z, clamp_min, clamp_max)
    return z if out_dtype == torch.float32 else z.to(out_dtype)
