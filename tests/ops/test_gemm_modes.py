"""The torch ops' new paths: fp32 at 'highest' precision on the 3xTF32 kernel (error at fp32
level) and grouped_mm's autograd (lists and the packed MoE form) against torch autograd through
the reference. GPU only."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import requires_gpu

pytestmark = pytest.mark.warm_cache


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device="cuda").to(dtype)


@requires_gpu
@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (7, 7, 7), (1000, 7, 4097), (7, 1000, 1000),
                                   (257, 300, 4097)])
@pytest.mark.parametrize("lb", ["row", "col"])
def test_fp32_highest_is_accurate(M, N, K, lb):
    import vitrail.ops as ops
    assert torch.get_float32_matmul_precision() == "highest"
    a = rand(M, K)
    b = rand(K, N) if lb == "row" else rand(N, K).t()
    bias = rand(N)
    out = ops.gemm(a, b, bias=bias, activation="silu")
    ref = torch.nn.functional.silu(a.double() @ b.double() + bias.double())
    tout = torch.nn.functional.silu(a @ b + bias).double()  # torch's fp32 (no TF32)
    assert_fp32_level(out, ref, tout, a.abs().double() @ b.abs().double())
    a3, c = rand(3, M, K), rand(3, M, N)
    out = ops.gemm(a3, b, c, beta=0.5)  # batched, broadcast b, C
    ref = a3.double() @ b.double() + 0.5 * c.double()
    assert_fp32_level(out, ref, (a3 @ b + 0.5 * c).double(), a3.abs().double() @ b.abs().double())


def assert_fp32_level(out, ref, torch_out, abs_products):
    """Within 4x torch's own fp32 error, plus 2^-18 of sum |a||b|: 3xTF32's split of each fp32
    operand into two TF32 parts truncates (CUTLASS's FastF32), leaving up to ~3 * 2^-20 of each
    product (measured 2.1e-6 relative at M=N=K=1, about 16 fp32 ulps; 1xTF32 leaves 2^-10)."""
    assert out.shape == ref.shape and not torch.isnan(out).any()
    err = (out.double() - ref).abs().max().item()
    terr = (torch_out - ref).abs().max().item()
    bound = 4 * terr + 2.0 ** -18 * abs_products.max().item()
    assert err <= bound, (err, terr, bound)


def _packed_reference(a, b, offsets):
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64, device=a.device)
    start = 0
    for g, end in enumerate(offsets.tolist()):
        out[start:end] = a[start:end].double() @ b[g].double()
        start = end
    return out


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_mm_packed_autograd(dtype):
    import vitrail.ops as ops
    G, K, N = 4, 64, 40
    a = rand(300, K, dtype=dtype).requires_grad_()
    b = rand(G, K, N, dtype=dtype).requires_grad_()
    offsets = torch.tensor([50, 50, 180, 290], device="cuda", dtype=torch.int32)  # empty group
    out = ops.grouped_mm(a, b, offsets)
    g = rand(300, N, dtype=dtype)
    out.backward(g)
    a64 = a.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    _packed_reference(a64, b64, offsets).backward(g.double())
    tol = {torch.bfloat16: 2.0 ** -6, torch.float32: 2.0 ** -9}[dtype]
    for got, want in ((out, _packed_reference(a, b, offsets)), (a.grad, a64.grad),
                      (b.grad, b64.grad)):
        scale = want.abs().max().item() + 1e-6
        assert (got.double() - want).abs().max().item() <= tol * scale
    assert torch.equal(b.grad[1], torch.zeros_like(b.grad[1]))  # the empty group
    assert torch.equal(a.grad[290:], torch.zeros_like(a.grad[290:]))  # rows after the last end


@requires_gpu
def test_grouped_mm_list_autograd():
    import vitrail.ops as ops
    shapes = [(7, 64, 16), (1, 64, 32), (130, 64, 8)]
    a = [rand(m, k, dtype=torch.bfloat16).requires_grad_() for m, k, _ in shapes]
    b = [rand(k, n, dtype=torch.bfloat16).requires_grad_() for _, k, n in shapes]
    outs = ops.grouped_mm(a, b)
    gs = [rand(*o.shape, dtype=torch.bfloat16) for o in outs]
    torch.autograd.backward(outs, gs)
    for x, y, o, g in zip(a, b, outs, gs):
        x64 = x.detach().double().requires_grad_()
        y64 = y.detach().double().requires_grad_()
        ref = x64 @ y64
        ref.backward(g.double())
        for got, want in ((o, ref), (x.grad, x64.grad), (y.grad, y64.grad)):
            scale = want.abs().max().item() + 1e-6
            assert (got.double() - want).abs().max().item() <= 2.0 ** -6 * scale
