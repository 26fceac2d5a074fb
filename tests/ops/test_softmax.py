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
                   (("bwd", torch.float32, 4, True), 1 << 14),  # a cluster of 4
                   (("chunked", "bwd", torch.bfloat16, 8, False), 1 << 20)]:
        op = OPS[key]
        res = op.module(op.space.default(n, lim)).resources()
        assert res and not any(r.spills for r in res.values()), res


def test_routing_and_chunks():
    """CPU: which path a shape takes, and chunked launches sized to the GPU (132 SMs)."""
    from vitrail.ops.softmax import configs
    from vitrail.tune import Space
    c = Space({"THREADS": [256], "U": [4]}).config(THREADS=256, U=4)
    assert configs.use_chunked(262144, 16, 8, 1, 132)  # 16 rows x cluster 8 < 2 x 132
    assert configs.use_chunked(1 << 20, 8, 4, 1, 132)  # longer than any config holds
    assert not configs.use_chunked(32768, 4096, 8, 2, 132)
    assert not configs.use_chunked(4096, 1, 8, 1, 132)  # one CTA per row: no cluster
    for n, rows, v in [(262144, 16, 8), (1 << 20, 8, 4), (5, 1, 1), (5000, 600, 4),
                       (70001, 3, 1), (1 << 20, 100000, 8)]:
        chunk = configs.chunk_length(n, rows, v, c, 132)
        assert chunk % (256 * 4 * v) == 0 and chunk >= 256 * 4 * v
        ctas = rows * -(-n // chunk)
        assert ctas >= min(rows * -(-n // (256 * 4 * v)), 132 * configs.CHUNK_CTAS_PER_SM) // 2
        assert ctas <= max(rows, 2 * 132 * configs.CHUNK_CTAS_PER_SM)
    assert configs.heuristic(32768, 8, 2) == {"TPR": 512, "THREADS": 512, "ITERS": 2,
                                              "CLUSTER": 4}
    assert configs.heuristic(128, 4, 1) == {"TPR": 8, "THREADS": 128, "ITERS": 4, "CLUSTER": 1}


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


def _sms():
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


@requires_gpu
@pytest.mark.parametrize("n", [1 << 16, 1 << 17, 40_001])
def test_cluster_rows(n, log):
    """Enough rows that the register path takes clusters (2 to 8 CTAs per row, 16-byte vectors
    and, at n = 40001, elementwise ones), forward and backward."""
    from vitrail.ops.softmax import configs, softmax_bwd
    from vitrail.ops.softmax.reference import softmax_backward
    ours, theirs = _fns(log)
    for dtype in (torch.float32, torch.bfloat16):
        v = configs.vec(dtype) if n % configs.vec(dtype) == 0 else 1
        rows = 2 * _sms()
        for arrays in (1, 2):  # the register path with clusters, where a config holds n
            if n <= configs.max_register_row(v, arrays):
                assert not configs.use_chunked(n, rows, v, arrays, _sms())
                assert configs.heuristic(1 << (n - 1).bit_length(), v, arrays)["CLUSTER"] > 1
        x = (torch.randn(rows, n, device="cuda") * 4).to(dtype)
        _check(ours(x), theirs(x, -1), theirs(x.double(), -1))
        y = theirs(x.float(), -1).to(dtype)
        dy = torch.randn_like(y)
        same = softmax_backward(y.float(), dy.float(), -1, log).to(dtype)
        _check(softmax_bwd(y, dy, 1, log), same, softmax_backward(y, dy, -1, log))


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 5), (3, 70_001), (600, 5000), (7, 50_000), (2, 1 << 20)])
def test_chunked_direct(shape, dtype, log):
    """The chunked path on any shape (one chunk per row, ragged last chunks, elementwise vectors
    where a row is not 16-byte aligned), with -inf and NaN rows, called directly."""
    from vitrail.ops.softmax import OPS, configs
    from vitrail.ops.softmax.reference import softmax, softmax_backward
    rows, n = shape
    v = configs.vec(dtype) if n % configs.vec(dtype) == 0 else 1
    x = (torch.randn(rows, n, device="cuda") * 3).to(dtype)
    if rows >= 3:
        x[1, : n // 2] = float("-inf")
        x[2, n // 3] = float("nan")
    y = torch.full_like(x, float("nan"))
    OPS["chunked", "fwd", dtype, v, log]("test", n, y, x, x)
    ref = softmax(x, -1, log)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), ref, equal_nan=True, rtol=tol, atol=tol)
    x = (torch.randn(rows, n, device="cuda") * 3).to(dtype)
    y = softmax(x, -1, log).to(dtype)
    dy = torch.randn_like(y)
    dx = torch.full_like(y, float("nan"))
    OPS["chunked", "bwd", dtype, v, log]("test", n, dx, y, dy)
    same = softmax_backward(y.float(), dy.float(), -1, log).to(dtype)
    _check(dx, same, softmax_backward(y, dy, -1, log))
