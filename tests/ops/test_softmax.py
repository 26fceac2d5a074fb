"""vitrail.ops.softmax / log_softmax: values against an fp64 reference, within a small factor of
torch's own error in the same dtype; odd sizes, every dtype, any dim, strided input, -inf and NaN,
long rows (clusters and the chunked path), autograd, opcheck, torch.compile. Plus compile-only
builds of representative configs for sm_90a (CI)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import requires_gpu, requires_nvcc

pytestmark = pytest.mark.warm_cache


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _err(a, ref):
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _check(ours, torch_same, ref):
    """ours within 4x (+ a floor) of torch's own error in the same dtype against ref."""
    assert not ours.isnan().any() or ref.isnan().any()
    e, t = _err(ours, ref), _err(torch_same, ref)
    assert e <= 4 * t + 1e-6, f"error {e:.3g} vs torch {t:.3g}"


@pytest.mark.slow
@requires_nvcc
def test_compile_representative_configs(monkeypatch):
    monkeypatch.setenv("VITRAIL_ARCH", "90a")
    from vitrail.ops.softmax import OPS
    from vitrail.tune import limits
    lim = limits(arch="90a")
    for key, n in [(("fwd", torch.bfloat16, 8, False), 4096),
                   (("bwd", torch.float32, 4, True), 1 << 17)]:  # the latter: a cluster of 4
        op = OPS[key]
        res = op.module(op.space.default(n, lim)).resources()
        assert res and not any(r.spills for r in res.values()), res


@pytest.fixture(params=[False, True], ids=["softmax", "log_softmax"])
def log(request):
    return request.param


def _fns(log):
    import vitrail.ops as ops
    return (ops.log_softmax if log else ops.softmax), \
        (torch.log_softmax if log else torch.softmax)


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (5, 7), (33, 100), (64, 1000), (7, 4096),
                                   (3, 5000), (2, 32768), (1, 70001)])
def test_forward_backward(shape, dtype, log):
    ours, theirs = _fns(log)
    x = (torch.randn(shape, device="cuda") * 3).to(dtype).requires_grad_()
    y = ours(x, -1)
    ref = theirs(x.detach().double(), -1)
    _check(y.detach(), theirs(x.detach(), -1), ref)
    dy = torch.randn(shape, device="cuda").to(dtype)
    (gx,) = torch.autograd.grad(y, x, dy)
    xd = x.detach().double().requires_grad_()
    (gref,) = torch.autograd.grad(theirs(xd, -1), xd, dy.double())
    xt = x.detach().clone().requires_grad_()
    (gt,) = torch.autograd.grad(theirs(xt, -1), xt, dy)
    _check(gx, gt, gref)


@requires_gpu
@pytest.mark.parametrize("n", [1 << 17, 300_000, 600_000])
def test_long_rows(n, log):
    """Clusters up to 8 CTAs, then the chunked path (rows longer than any config holds)."""
    ours, theirs = _fns(log)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(3, n, device="cuda") * 4).to(dtype)
        _check(ours(x), theirs(x, -1), theirs(x.double(), -1))
        from vitrail.ops.softmax import softmax_bwd
        y = theirs(x.float(), -1).to(dtype)
        dy = torch.randn_like(y)
        from vitrail.ops.softmax.reference import softmax_backward
        ref = softmax_backward(y, dy, -1, log)
        same = softmax_backward(y.float(), dy.float(), -1, log).to(dtype)
        _check(softmax_bwd(y, dy, 1, log), same, ref)


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_any_dim_and_strides(dtype, log):
    ours, theirs = _fns(log)
    x = torch.randn(6, 50, 36, device="cuda").to(dtype)
    for dim in (0, 1, -1):
        _check(ours(x, dim), theirs(x, dim), theirs(x.double(), dim))
    xs = torch.randn(40, 300, device="cuda").to(dtype)[:, 3:259]  # row stride 300, offset 3
    _check(ours(xs), theirs(xs, -1), theirs(xs.double(), -1))
    xt = torch.randn(256, 40, device="cuda").to(dtype).t()  # last dim strided
    _check(ours(xt), theirs(xt, -1), theirs(xt.double(), -1))
    x0 = torch.randn((), device="cuda").to(dtype)
    assert ours(x0, 0).item() == theirs(x0, 0).item()


@requires_gpu
@pytest.mark.parametrize("n", [100, 4096, 300_000])
def test_inf_nan_large(n, log):
    ours, theirs = _fns(log)
    x = torch.randn(5, n, device="cuda") * 1e4  # large magnitudes
    x[1, : n // 2] = float("-inf")  # partly masked
    x[2] = float("-inf")  # fully masked: NaN as torch
    x[3, n // 3] = float("nan")  # NaN propagates to the row
    y, ref = ours(x), theirs(x, -1)
    torch.testing.assert_close(y, ref, equal_nan=True, rtol=1e-5, atol=1e-5)
    assert y[2].isnan().all() and y[3].isnan().all()


@requires_gpu
def test_opcheck_compile_and_errors():
    import vitrail.ops as ops
    from vitrail.jit import ArgumentError
    from vitrail.ops.softmax import softmax_bwd, softmax_fwd
    x = torch.randn(8, 300, device="cuda", requires_grad=True)
    torch.library.opcheck(softmax_fwd, (x, 1, False))
    torch.library.opcheck(softmax_fwd, (x.detach().bfloat16(), 0, True))
    torch.library.opcheck(softmax_bwd, (torch.softmax(x.detach(), 1), torch.randn_like(x), 1, False))
    f = torch.compile(lambda t: ops.softmax(t * 2, -1).sum(), fullgraph=True)
    torch.testing.assert_close(f(x.detach()), (torch.softmax(x.detach() * 2, -1)).sum())
    with pytest.raises(ArgumentError, match="dim=2"):
        ops.softmax(x, 2)
    with pytest.raises(ArgumentError, match="dtype"):
        ops.softmax(x.detach().double())
    with pytest.raises(ArgumentError, match="CUDA"):
        ops.softmax(torch.randn(3))
