"""vitrail.ops.softmax / log_softmax: values against an fp64 reference, within a small factor of
torch's own error in the same dtype; odd sizes, every dtype, any dim, strided input, -inf and NaN,
long rows (clusters and the chunked path), autograd, opcheck, torch.compile. Plus compile-only
builds of representative configs for sm_90a (CI)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import requires_gpu, requires_nvcc
from vitrail.device import sm_count, target_limits, vector

pytestmark = pytest.mark.warm_cache


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _err(a, ref):
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _check_backward(dx, y, dy, log):
    """Our dx (last dim) against fp64 within 4x of the error of torch's own backward kernel
    (fp32, rounded to y's dtype), or within the error bound of fp32 arithmetic on rows whose
    gradient cancels: y * (dy - s) loses what s = sum(y * dy) carries beyond |dy - s| (fp32
    backward of a row of 5 drew |dx| = 1.8e-4 against sum |y dy| = 0.69: 5e-4 relative in any
    fp32 kernel)."""
    from vitrail.ops.softmax.reference import softmax_backward
    f = torch._log_softmax_backward_data if log else torch._softmax_backward_data
    same = f(dy.float(), y.float(), -1, torch.float32).to(y.dtype)
    ref = softmax_backward(y, dy, -1, log)
    yd, gd = y.double(), dy.double()
    p = yd.exp() if log else yd
    carried = (gd.abs() if log else (gd * yd).abs()).sum(-1, keepdim=True)
    bound = 4 * 2.0 ** -24 * (p.abs() * carried).norm().item() / max(ref.norm().item(), 1e-30)
    _check(dx, same, ref, floor=max(1e-6, bound))


def _check(ours, torch_same, ref, floor=1e-6):
    """ours within 4x (+ a floor) of torch's own error in the same dtype against ref."""
    assert not ours.isnan().any() or ref.isnan().any()
    e, t = _err(ours, ref), _err(torch_same, ref)
    assert e <= 4 * t + floor, f"error {e:.3g} vs torch {t:.3g} (floor {floor:.3g})"


@pytest.mark.slow
@requires_nvcc
def test_compile_representative_configs(monkeypatch):
    monkeypatch.setenv("VITRAIL_ARCH", "90a")
    from vitrail.ops.softmax import FAMILY, Variant
    from vitrail.tune import limits
    lim = limits(arch="90a")
    for key, n in [(Variant("registers", "fwd", torch.bfloat16, 8, False), 4096),
                   (Variant("registers", "bwd", torch.float32, 4, True), 1 << 14),  # cluster of 4
                   (Variant("chunked", "bwd", torch.bfloat16, 8, False), 1 << 20),
                   (Variant("split", "fwd", torch.bfloat16, 8, False), (1 << 18, 16)),
                   (Variant("tile", "bwd", torch.float32, 4, True), (1 << 17, 128, 4)),
                   (Variant("packed", "fwd", torch.bfloat16, 8, False), 8)]:
        op = FAMILY[key]
        mod = op.module(op.space.default(n, lim))
        res = mod.resources()
        assert res and not any(r.spills for r in res.values()), res
        if key[0] == "split":  # its barrier: a release add and an acquire load at GPU scope
            assert "atom.release.gpu" in mod.ptx or "atom.add.release.gpu" in mod.ptx
            assert "ld.acquire.gpu" in mod.ptx
        if key[0] == "tile":  # TMA bulk copies on mbarriers, its peers' statistics via DSMEM
            assert "cp.async.bulk.shared::cluster.global.mbarrier" in mod.ptx
            assert "mapa" in mod.ptx and "barrier.cluster" in mod.ptx
    # the packed kernel: bulk copies in (on an mbarrier) and out, shuffles within a row's lanes
    assert "cp.async.bulk.shared::cluster.global.mbarrier" in mod.ptx
    assert "cp.async.bulk.global.shared::cta" in mod.ptx and "shfl.sync.bfly" in mod.ptx


def test_split_routing_and_plan():
    """CPU: few long rows take the split path where there are at most as many rows as SMs (132);
    the plan covers every row with slices that fit the GPU at once."""
    from vitrail.ops.softmax import configs
    sms, lim = 132, target_limits("90a")
    for n, rows, v, arrays in [(262144, 16, 8, 1), (262144, 16, 8, 2), (1 << 20, 8, 4, 1),
                               (1 << 20, 8, 4, 2), (131072, 32, 8, 1), (1 << 20, 4, 8, 2),
                               (70001, 1, 1, 1), (300_000, 3, 4, 1), (1 << 20, 132, 8, 1)]:
        assert configs.use_split(n, rows, v, arrays, sms), (n, rows, v, arrays)
    for n, rows, v, arrays in [(4096, 32768, 8, 1), (65536, 256, 8, 1), (65536, 256, 8, 2),
                               (4096, 1, 8, 1), (1 << 20, 133, 8, 1), (1 << 20, 1000, 4, 2)]:
        assert not configs.use_split(n, rows, v, arrays, sms), (n, rows, v, arrays)
    assert configs.use_chunked(1 << 20, 1000, 4, 2, sms)  # too many rows: still chunked
    # forward: CTAs of 256 threads, 4 per SM; bf16 16 x 262144 all in registers (33 CTAs a row)
    c = configs.split_space(8, 1).config(**configs.split_heuristic(8, 1))
    assert (c.THREADS, c.CTAS) == (256, 4)
    assert configs.split_plan(262144, 16, 8, c, 4 * sms, 0, 1) == (33, 7944, 0)
    c4 = configs.split_space(4, 1).config(**configs.split_heuristic(4, 1))
    g, sl, sv = configs.split_plan(1 << 20, 8, 4, c4, 4 * sms, configs.split_smem_budget(c4, lim),
                                   1)
    assert (g, sl) == (66, 15888) and sv * 4 == sl - 256 * 8 * 4  # the rest in shared memory
    assert configs.split_fits(1 << 20, 8, 4, c4, sms, lim, 1)
    # backward: 512 x 2 where it holds the slices with 4 or more CTAs a row, else 256 x 4
    for problem, threads in [((262144, 32), 512), ((65536, 64), 512), ((65536, 160), 256),
                             ((32768, 128), 256), (None, 512)]:
        assert configs.split_heuristic(8, 2, problem, lim)["THREADS"] == threads, problem
    for n, rows, v, arrays, smem in [(70001, 1, 1, 1, 0), (300_000, 3, 4, 2, 112 << 10),
                                     (1 << 20, 8, 4, 2, 112 << 10), (5, 1, 8, 1, 0)]:
        cfg = configs.split_space(v, arrays).config(
            **configs.split_heuristic(v, arrays, (n, rows), lim))
        g, sl, sv = configs.split_plan(n, rows, v, cfg, cfg.CTAS * sms, smem, arrays)
        assert sl % v == 0 and (g - 1) * sl < n <= g * sl and rows * g <= cfg.CTAS * sms
        assert sv * 16 * arrays <= smem and sv >= 0
    for v in (1, 4, 8):
        for arrays in (1, 2):  # the heuristic's configs are in their space
            for problem in (None, (1 << 20, 8), (65536, 160)):
                configs.split_space(v, arrays).config(
                    **configs.split_heuristic(v, arrays, problem, lim))


def test_route_tile_or_split():
    """CPU (132 SMs): rows that fill the SMs evenly in one wave take the tile path with one CTA
    a row; rows it would give clusters of 4 or more take the split path in problems of 16 MB or
    more where the split plan holds them on chip."""
    from vitrail.ops.softmax import configs, route
    from vitrail.tune import bucket
    bf, f32 = torch.bfloat16, torch.float32
    sizes = (1, 16, 17, 100, 128, 129, 150, 200, 300, 50000)
    assert [bucket(x, configs.KEY_STEPS) for x in sizes] == [1, 16, 20, 112, 128, 160, 160, 224,
                                                             320, 57344]
    cases = [  # (kind, rows, n, dtype, path, CTAs a row on the tile path / THREADS on split)
        ("fwd", 256, 32768, bf, "tile", 1), ("fwd", 128, 65536, bf, "tile", 1),
        ("bwd", 256, 16384, bf, "tile", 1), ("bwd", 128, 16384, f32, "tile", 1),
        ("fwd", 200, 16384, bf, "tile", 1),
        ("fwd", 150, 50000, bf, "tile", 4),  # uneven: 18 SMs would hold two rows
        ("fwd", 100, 30000, bf, "tile", 4),  # too few rows for one CTA a row
        ("fwd", 256, 131072, bf, "tile", 4),  # 2 CTAs a row: the split plan would read some twice
        ("fwd", 32, 131072, bf, "tile", 8),  # 8 MB: the barrier's latency weighs more
        ("bwd", 64, 262144, bf, "tile", 8),  # 64 MB: the split plan would read some twice
        ("fwd", 64, 262144, bf, "split", 256), ("fwd", 132, 131072, bf, "split", 256),
        ("fwd", 256, 65536, bf, "split", 256), ("fwd", 64, 131072, f32, "split", 256),
        ("bwd", 32, 262144, bf, "split", 512), ("bwd", 150, 50000, bf, "split", 256),
        ("bwd", 64, 65536, f32, "split", 512),
        ("fwd", 16, 262144, bf, "split", 256), ("bwd", 16, 262144, bf, "split", 512)]
    for kind, rows, n, dtype, path, value in cases:
        op, key, problem = route(kind, rows, n, dtype, 16 // dtype.itemsize, False, None)
        config = op.space.default(problem, target_limits("90a"))
        got = (op.name.split(".")[1].split("_")[-1],
               config.CLUSTER if "tile" in op.name else config.THREADS)
        assert got == (path, value), (kind, rows, n, dtype, got)


def test_tile_routing_and_heuristic():
    """CPU: which rows take the tile path (132 SMs) and with how many CTAs each; slices cover
    the row in 16-byte vectors and fit shared memory."""
    from vitrail.ops.softmax import configs
    from vitrail.tune import bucket
    sms = 132
    # (n, rows, v, size, arrays, CTAs a row): clusters only where rows leave SMs short of CTAs
    tile = [(65536, 256, 8, 2, 1, 4), (65536, 1024, 8, 2, 1, 2), (65536, 64, 8, 2, 1, 8),
            (131072, 128, 4, 4, 1, 8), (131072, 128, 4, 4, 2, 8), (65536, 256, 4, 4, 1, 4),
            (100_000, 512, 8, 2, 1, 4), (1 << 18, 2000, 8, 2, 2, 8), (65536, 256, 8, 2, 2, 4),
            (4096, 32768, 8, 2, 1, 1), (4096, 32768, 8, 2, 2, 1), (2048, 65536, 4, 4, 2, 1),
            (4096, 4096, 8, 2, 1, 1), (16384, 2048, 8, 2, 2, 1), (8192, 1024, 8, 2, 2, 1),
            (131072, 32, 8, 2, 1, 8), (12288, 8192, 8, 2, 2, 1)]
    for n, rows, v, size, arrays, cluster in tile:
        assert configs.use_tile(n, rows, v, size, arrays, sms), (n, rows, arrays)
        h = configs.tile_heuristic((bucket(n, configs.KEY_STEPS), bucket(rows, configs.KEY_STEPS),
                                    size), arrays)
        assert h["CLUSTER"] == cluster, (n, rows, arrays, h)
        configs.tile_space(arrays).config(**h)  # in its space
        sl = configs.tile_slice(n, v, cluster)
        assert sl % v == 0 and sl * cluster >= n > (sl - v) * cluster
        assert sl * size * arrays <= configs.MAX_TILE_BYTES
    not_tile = [(262144, 16, 8, 2, 1),  # too few rows: the split path spreads them wider
                (131072, 24, 8, 2, 1),  # 192 CTAs: under 1.5 per SM
                (2048, 32768, 8, 2, 1), (1024, 65536, 4, 4, 2),  # rows under 8 KiB: registers
                (4096, 8, 8, 2, 1),  # 8 CTAs: registers
                (65536, 256, 1, 2, 1),  # not 16-byte aligned
                (1 << 20, 8, 4, 4, 1), (1 << 20, 300, 8, 2, 2)]  # too long for 8 CTAs
    for n, rows, v, size, arrays in not_tile:
        assert not configs.use_tile(n, rows, v, size, arrays, sms), (n, rows, arrays)
    assert configs.tile_cluster(1 << 20, 300, 2, 2, sms) is None


def test_routing_and_chunks():
    """CPU: which path a shape takes, and chunked launches sized to the GPU (132 SMs)."""
    from vitrail.ops.softmax import configs
    from vitrail.tune import Space
    c = Space({"THREADS": [256], "U": [4]}).config(THREADS=256, U=4)
    assert configs.use_chunked(262144, 16, 8, 1, 132)  # 16 rows x cluster 8 < 2 x 132
    assert configs.use_chunked(1 << 20, 8, 4, 1, 132)  # longer than any config holds
    assert not configs.use_chunked(32768, 4096, 8, 2, 132)
    assert not configs.use_chunked(4096, 1, 8, 1, 132)  # one CTA per row: no cluster
    # rows off vector boundaries: windowed kernels where element-by-element ones are slow
    assert configs.use_window(1025, 2) and not configs.use_window(1023, 2)
    assert configs.use_window(8193, 4) and not configs.use_window(8191, 4)
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


def test_packed_routing():
    """CPU: which short rows take the packed path (rows end to end, on sm_90's 132 SMs), its
    configs hold the rows they are picked for, and runs cover the rows."""
    from vitrail.ops.softmax import configs, route
    from vitrail.tune import Space, bucket
    for kind, n, dtype, v, packed, expect in [
            ("fwd", 7, torch.bfloat16, 1, True, True),  # off vector boundaries: any length
            ("bwd", 1, torch.float32, 1, True, True),
            ("bwd", 512, torch.bfloat16, 1, True, True),
            ("fwd", 513, torch.bfloat16, 1, True, False),  # over PACKED_MAX_BYTES
            ("fwd", 7, torch.bfloat16, 1, False, False),  # rows not end to end
            ("fwd", 8, torch.bfloat16, 8, True, False),  # 16-byte rows stay in registers
            ("fwd", 16, torch.bfloat16, 8, True, True),
            ("fwd", 256, torch.float32, 4, True, True),
            ("bwd", 128, torch.bfloat16, 8, True, True),
            ("bwd", 256, torch.bfloat16, 8, True, False)]:  # aligned backward over 256 bytes
        op = route(kind, 100_000, n, dtype, v, False, None, False, packed)[0]
        assert ("_packed." in op.name) == expect, (kind, n, dtype, v, packed, op.name)
        if expect:
            assert op.name.endswith(f".v{vector(dtype)}")
    from vitrail.ops.softmax import route_contiguous  # what a contiguous tensor's rows take
    for rows, n, dtype, name in [(4096, 7, torch.bfloat16, "fwd_packed.bfloat16.v8"),
                                 (1, 7, torch.bfloat16, "fwd.bfloat16.v8"),  # 14-byte row
                                 (4096, 1, torch.float32, "fwd_packed.float32.v4"),
                                 (4096, 2049, torch.bfloat16, "fwd.bfloat16.v8w"),
                                 (4096, 1023, torch.bfloat16, "fwd.bfloat16.v1"),
                                 (4096, 512, torch.bfloat16, "fwd_packed.bfloat16.v8")]:
        op = route_contiguous("fwd", rows, n, dtype, False, None)[0]
        assert op.name == f"softmax.{name}", (rows, n, op.name)
    space = configs.packed_space(2)
    for n in range(1, configs.PACKED_MAX_ROW + 1):
        h = configs.packed_heuristic(bucket(n))
        assert h["TPR"] * h["ITEMS"] >= n and space.config(**h) is not None
    assert configs.packed_heuristic(7) == {"THREADS": 256, "TPR": 2, "ITEMS": 4, "KB": 16}
    assert configs.packed_heuristic(512) == {"THREADS": 128, "TPR": 32, "ITEMS": 16, "KB": 16}
    c = Space({"THREADS": [256], "TPR": [2], "ITEMS": [4], "KB": [16]}).config(
        THREADS=256, TPR=2, ITEMS=4, KB=16)
    for n, rows, size in [(7, 4096, 2), (7, 4_793_490, 2), (1, 1, 4), (1000, 3, 1), (5, 10**9, 4)]:
        run = configs.packed_run(n, rows, size, c, 132)
        assert 1 <= run and (run * n * size <= 16 << 10 or run == 1)
        assert run >= min(128, max(1, (16 << 10) // (n * size)))  # a pass of the CTA's groups
        assert -(-rows // run) >= min(rows // 128, 132 * configs.PACKED_CTAS_PER_SM) // 2


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_the_gradient_rules_step_is_the_python_backwards_call(monkeypatch, log, dim):
    """softmax's and log_softmax's C++ gradient rule: its one step (what the C++ autograd node
    calls without Python) is the backward kernel's front call that the rule's Python backward
    makes where no graph of the gradients is asked for, with the same arguments (the dim
    normalized), its result x's gradient."""
    import importlib
    from vitrail.plan.native import ARG, GRAD, OUTPUT, VALUE
    S = importlib.import_module("vitrail.ops.softmax")
    calls = []
    monkeypatch.setattr(S, "_backward", lambda *a: calls.append(a) or torch.zeros(()))
    x, y, dy = (torch.randn(3, 5) for _ in range(3))
    rule = S._rule("vitrail.ops.log_softmax" if log else "vitrail.ops.softmax", log)(x, dim)
    backward, spec, inputs, name, steps = rule
    assert name == f"vitrail::{'Log' if log else ''}SoftmaxBackward" and inputs == (0,)
    given = {OUTPUT: lambda k: y, GRAD: lambda k: dy}
    args = [v if kind == VALUE else given[kind](v) for kind, v in spec]
    with torch.no_grad():
        backward(*args)
    (fn, fn_args, gradient), = steps
    assert gradient == 0 and fn is S._backward
    fn(*(args[v] if kind == ARG else v for kind, v in fn_args))
    assert len(calls) == 2 and calls[0] == calls[1] and calls[0][2] == dim % 2
    assert calls[0][0] is y and calls[0][1] is dy and calls[0][3] is log


def test_custom_ops_normalize_dim(monkeypatch):
    """CPU: torch.ops.vitrail.softmax_fwd/_bwd with dim=-1 write their result in place, as with
    the last dim's index (once a transposed copy, 1.16-1.22x slower); a dim out of range is an
    ArgumentError that names it."""
    import importlib
    S = importlib.import_module("vitrail.ops.softmax")
    written = []

    def fake_run(kind, out, a, b, log):  # the kernel's result, in torch, into the rows given
        written.append(out.data_ptr())
        if kind == "fwd":
            out.copy_(torch.log_softmax(a, -1) if log else torch.softmax(a, -1))
        else:
            out.copy_(b - a.exp() * b.sum(-1, keepdim=True) if log
                      else a * (b - (a * b).sum(-1, keepdim=True)))
    monkeypatch.setattr(S, "_run", fake_run)
    x = torch.randn(3, 4, 5)
    for dim in (-1, 2):
        written.clear()
        y = torch.ops.vitrail.softmax_fwd(x, dim, False)
        assert written == [y.data_ptr()]
        torch.testing.assert_close(y, torch.softmax(x, -1))
        written.clear()
        dy = torch.randn_like(x)
        dx = torch.ops.vitrail.softmax_bwd(y, dy, dim, False)
        assert written == [dx.data_ptr()]
        torch.testing.assert_close(dx, y * (dy - (y * dy).sum(-1, keepdim=True)))
    from vitrail.jit.errors import ArgumentError
    with pytest.raises(ArgumentError, match="dim=3 is out of range"):
        torch.ops.vitrail.softmax_fwd(x, 3, False)


@pytest.fixture(params=[False, True], ids=["softmax", "log_softmax"])
def log(request):
    return request.param


def _fns(log):
    import vitrail.ops as ops
    return (ops.log_softmax if log else ops.softmax), \
        (torch.log_softmax if log else torch.softmax)


def _check_rows(rows, n, dtype, log):
    """Forward against torch (fp64 reference) and backward (_check_backward), on fresh rows x n
    data."""
    from vitrail.ops.softmax import softmax_bwd
    ours, theirs = _fns(log)
    x = (torch.randn(rows, n, device="cuda") * 4).to(dtype)
    _check(ours(x), theirs(x, -1), theirs(x.double(), -1))
    y = theirs(x.float(), -1).to(dtype)
    dy = torch.randn_like(y)
    _check_backward(softmax_bwd(y, dy, 1, log), y, dy, log)


def _check_autograd(x, dy, log):
    """Our gradient through autograd (dim -1) within 4x of torch's own error against fp64."""
    ours, theirs = _fns(log)
    xg = x.detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(ours(xg, -1), xg, dy)
    xd = x.detach().double().requires_grad_()
    (gref,) = torch.autograd.grad(theirs(xd, -1), xd, dy.double())
    xt = x.detach().clone().requires_grad_()
    (gt,) = torch.autograd.grad(theirs(xt, -1), xt, dy)
    _check(g, gt, gref)


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 1), (5, 7), (33, 100), (64, 1000), (7, 4096),
                                   (3, 5000), (2, 32768), (1, 70001)])
def test_forward_backward(shape, dtype, log):
    ours, theirs = _fns(log)
    x = (torch.randn(shape, device="cuda") * 3).to(dtype)
    _check(ours(x, -1), theirs(x, -1), theirs(x.double(), -1))
    _check_autograd(x, torch.randn(shape, device="cuda").to(dtype), log)


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
        _check_backward(softmax_bwd(y, dy, 1, log), y, dy, log)


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


def _op(path, kind, dtype, v, log, *ts):
    """The variant of the family on path, or its windowed kernels where a row of ts starts off a
    vector boundary."""
    import importlib
    S = importlib.import_module("vitrail.ops.softmax")
    window = v > 1 and not S._aligned(v, *ts)
    return S.FAMILY[S.Variant(path, kind, dtype, v, log, window)]


@requires_gpu
@pytest.mark.parametrize("n", [1 << 16, 1 << 17, 40_001])
def test_cluster_rows(n, log):
    """Enough rows for the register path's clusters (2 to 8 CTAs per row): through the public
    path (on Hopper the tile or split path takes them), and the register kernels called directly
    (they serve such rows where the GPU has no tile path; element by element where a row is not
    16-byte aligned, as at n = 40001), forward and backward."""
    from vitrail.ops.softmax import FAMILY, Variant, configs
    from vitrail.ops.softmax.reference import softmax
    from vitrail.tune import bucket
    for dtype in (torch.float32, torch.bfloat16):
        v = vector(dtype) if n % vector(dtype) == 0 else 1
        rows = 2 * sm_count()
        _check_rows(rows, n, dtype, log)
        x = (torch.randn(rows, n, device="cuda") * 4).to(dtype)
        y = softmax(x, -1, log).to(dtype)
        dy = torch.randn_like(y)
        for kind, arrays in (("fwd", 1), ("bwd", 2)):
            if n > configs.max_register_row(v, arrays):
                continue
            assert configs.heuristic(bucket(n), v, arrays)["CLUSTER"] > 1
            out = torch.full_like(x, float("nan"))
            op = FAMILY[Variant("registers", kind, dtype, v, log)]
            key = f"n{bucket(n)}"  # an Op keeps a config per key
            if kind == "fwd":
                op(key, bucket(n), out, x)
                _check(out, softmax(x, -1, log).to(dtype), softmax(x, -1, log))
            else:
                op(key, bucket(n), out, y, dy)
                _check_backward(out, y, dy, log)


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 5), (3, 70_001), (600, 5000), (7, 50_000), (2, 1 << 20)])
def test_chunked_direct(shape, dtype, log):
    """The chunked path on any shape (one chunk per row, ragged last chunks, rows that start off
    a vector boundary: windows), with -inf and NaN rows, called directly, in 16-byte vectors and
    element by element (v = 1)."""
    from vitrail.ops.softmax import _window
    from vitrail.ops.softmax.reference import softmax
    rows, n = shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for v in (vector(dtype), 1):
        x = (torch.randn(rows, n, device="cuda") * 3).to(dtype)
        if rows >= 3:
            x[1, : n // 2] = float("-inf")
            x[2, n // 3] = float("nan")
        y = torch.full_like(x, float("nan"))
        _op("chunked", "fwd", dtype, v, log, x)("test", _window(x, v), y, x, x)
        ref = softmax(x, -1, log)
        torch.testing.assert_close(y.double(), ref, equal_nan=True, rtol=tol, atol=tol)
        x = (torch.randn(rows, n, device="cuda") * 3).to(dtype)
        y = softmax(x, -1, log).to(dtype)
        dy = torch.randn_like(y)
        dx = torch.full_like(y, float("nan"))
        _op("chunked", "bwd", dtype, v, log, y)("test", _window(y, v), dx, y, dy)
        _check_backward(dx, y, dy, log)


# ------------------------------------------------------------------ tile path (rows in shared memory)
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(400, 65536), (600, 100_000), (160, 131072), (128, 16384),
                                   (1000, 4096), (300, 12_000), (2000, 24_576)])
def test_tile_rows(shape, dtype, log):
    """The public path on rows that take the tile path, forward and backward (one CTA a row, or
    a cluster of 2-8), against fp64, within 4x of torch's own error."""
    from vitrail.ops.softmax import route
    rows, n = shape
    v = vector(dtype)
    for kind in ("fwd", "bwd"):
        assert "tile" in route(kind, rows, n, dtype, v, log, torch.device("cuda"))[0].name
    _check_rows(rows, n, dtype, log)


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_tile_rows_strided_dim_and_autograd(dtype, log):
    """Tile-path rows through the public API: padded rows (a row stride beyond n, 16-byte
    aligned), the softmax dim first (moved into place), and autograd."""
    ours, theirs = _fns(log)
    base = (torch.randn(600, 8192 + 64, device="cuda") * 3).to(dtype)
    x = base[:, 32:32 + 8192]
    _check(ours(x, -1), theirs(x, -1), theirs(x.double(), -1))
    xt = x.t()  # rows of 8192 along dim 0
    _check(ours(xt, 0), theirs(xt, 0), theirs(xt.double(), 0))
    _check_autograd(x, torch.randn(x.shape, device="cuda").to(dtype), log)


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_tile_direct_every_cluster(dtype, log):
    """The tile kernel called directly with every cluster size and 128 to 512 threads, into
    NaN-poisoned outputs (nothing outside the rows written): rows with a partial last vector (a
    row stride beyond n), rows that start 3 elements into a vector (edge vectors at both ends:
    the rows' windows), CTAs past a short row's end, -inf and NaN rows."""
    from vitrail.jit.errors import LaunchError
    from vitrail.ops.softmax import FAMILY, Variant
    from vitrail.ops.softmax.reference import softmax
    v = vector(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # 24576 and 12288 at one CTA: 48 KiB of dynamic shared memory for some dtype and direction,
    # beside the kernel's static shared memory (over the default 48 KiB in all)
    for n, cluster, threads, off in [(70_001, 8, 128, 8), (20_001, 1, 512, 8), (200, 8, 128, 8),
                                     (33_333, 2, 512, 8), (8, 4, 128, 8), (50_000, 4, 128, 8),
                                     (24_576, 1, 128, 8), (12_288, 1, 256, 8),
                                     (70_001, 8, 128, 3), (20_001, 1, 512, 3), (5, 4, 128, 3),
                                     (33_333, 2, 256, 3), (24_573, 1, 128, 3)]:
        rows, width = 7, -(-n // 8) * 8 + 16  # row strides of whole 16-byte vectors
        base = (torch.randn(rows, width, device="cuda") * 3).to(dtype)
        x = base[:, off:off + n]  # rows start on a vector at off 8, 3 elements into one at 3
        x[1, : n // 2] = float("-inf")
        x[2] = float("-inf")
        x[3, n - 1] = float("nan")
        for kind in ("fwd", "bwd"):
            op = _op("tile", kind, dtype, v, log, x)
            c = op.space.config(THREADS=threads, CLUSTER=cluster)
            poisoned = torch.full((rows, width), float("nan"), device="cuda", dtype=dtype)
            out = poisoned[:, off:off + n]
            if kind == "fwd":
                plain = FAMILY[Variant("tile", kind, dtype, v, log)]
                if op is not plain:  # unwindowed kernels refuse them
                    with pytest.raises(LaunchError):
                        plain.launch(plain.module(c), c, out, x, x)
                op.launch(op.module(c), c, out, x, x)
                torch.testing.assert_close(out.double(), softmax(x, -1, log), equal_nan=True,
                                           rtol=tol, atol=tol)
            else:
                y = torch.empty(rows - 4, width, device="cuda", dtype=dtype)[:, off:off + n]
                y.copy_(softmax(x[4:], -1, log))
                dy = (torch.randn(rows - 4, width, device="cuda")).to(dtype)[:, off:off + n]
                out = out[4:]
                op.launch(op.module(c), c, out, y, dy)
                _check_backward(out, y, dy, log)
            assert poisoned[:, :off].isnan().all() and poisoned[:, off + n:].isnan().all()


# ------------------------------------------------------------------ rows off vector boundaries
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, path", [
    ((33, 4097), "fwd"), ((1000, 999), None), ((2, 7), None), ((200, 4097), "tile"),
    ((300, 12_001), "tile"), ((150, 50_001), "tile"), ((5, 300_001), "split"),
    ((16, 262_145), "split")])
def test_window_rows(shape, path, dtype, log, monkeypatch):
    """Contiguous rows of n % v != 0 (every row after the first starts off a 16-byte boundary):
    where configs.use_window says so (16-bit rows of 2 KiB and more, fp32 of 32 KiB and more)
    they take the windowed 16-byte-vector kernels over the rows' windows (n + v - 1 columns),
    else the element-by-element ones (v = 1): the vector width, window and kernels the public
    calls route with, the path (bf16 forward, on an H100's 132 SMs: registers, tile or split),
    and the values, forward and backward, against fp64."""
    import importlib
    S = importlib.import_module("vitrail.ops.softmax")  # the module (vitrail.ops.softmax is the op)
    rows, n = shape
    window = S.configs.use_window(n, dtype.itemsize)
    v = vector(dtype) if window else 1
    seen, real = [], S.route

    def spy(*args):
        op, key, problem = real(*args)
        seen.append((args[0], args[4], args[2], op.name))  # kind, v, window columns, op
        return op, key, problem
    monkeypatch.setattr(S, "route", spy)
    _check_rows(rows, n, dtype, log)
    cols = n + v - 1
    assert [s[:3] for s in seen] == [("fwd", v, cols), ("bwd", v, cols)], seen
    if S.configs.use_packed(n, dtype.itemsize, v, 2):  # short rows end to end: packed
        assert all("_packed." in s[3] for s in seen), seen
    else:
        assert all(s[3].endswith(f".v{v}w" if window else ".v1") for s in seen), seen
    if dtype == torch.bfloat16 and sm_count() == 132:
        assert window == (path is not None), seen
        if window:
            assert seen[0][3].split(".")[1] == ("fwd" if path == "fwd" else f"fwd_{path}"), seen


# ------------------------------------------------------------------ packed path (short rows)
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (4097, 1), (3, 2), (100_003, 7), (4096, 7), (9, 31),
                                   (5000, 33), (777, 100), (129, 255), (20_000, 128),
                                   (1000, 256), (301, 512)])
def test_packed_rows(shape, dtype, log, monkeypatch):
    """Short contiguous rows (a run of rows a CTA, starting anywhere in a 16-byte vector) take
    the packed path where configs.use_packed says so, forward and backward, through the public
    functions; values against fp64 with -inf, NaN and large rows among them."""
    import importlib
    S = importlib.import_module("vitrail.ops.softmax")
    rows, n = shape
    v = vector(dtype)
    seen, real = [], S.route

    def spy(*args):
        routed = real(*args)
        seen.append((args[0], routed[0].name))
        return routed
    monkeypatch.setattr(S, "route", spy)
    _check_rows(rows, n, dtype, log)
    assert [kind for kind, _ in seen] == ["fwd", "bwd"], seen
    for kind, name in seen:
        arrays = 1 if kind == "fwd" else 2
        want = S.configs.use_packed(n, dtype.itemsize, v if n % v == 0 or rows == 1 else 1,
                                    arrays)
        assert ("_packed." in name) == want, (kind, name)
    ours, theirs = _fns(log)
    x = (torch.randn(rows, n, device="cuda") * 3).to(dtype)
    x[rows // 2] = float("-inf")
    x[rows // 3, n // 2] = float("nan")
    x[rows - 1] = x[rows - 1] * 1e4 if dtype != torch.float16 else x[rows - 1] * 1e3
    torch.testing.assert_close(ours(x).double(), theirs(x.double(), -1), equal_nan=True,
                               rtol=1e-5 if dtype == torch.float32 else 2e-2,
                               atol=1e-5 if dtype == torch.float32 else 2e-2 * (8 if log else 1))


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_direct(dtype, log):
    """The packed kernel called directly with every array at the same odd base (every run's
    window edges), into NaN-poisoned buffers (nothing outside the rows written), with runs of
    one row to many and every lane count; it refuses rows longer than its lanes hold and arrays
    whose rows sit at different offsets within their vectors."""
    from vitrail.jit.errors import LaunchError
    from vitrail.ops.softmax import FAMILY, Variant
    from vitrail.ops.softmax.reference import softmax
    v = vector(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for n, rows, off, tpr, items, threads, kb in [
            (1, 5000, 3, 1, 1, 256, 16), (7, 3001, 1, 2, 4, 128, 4), (7, 3001, 5, 1, 8, 512, 32),
            (31, 999, 3, 8, 4, 256, 16), (100, 257, 2, 32, 4, 256, 8), (3, 1, 1, 4, 1, 128, 4),
            (256, 33, 7, 32, 8, 256, 16), (60, 1000, 1, 16, 4, 256, 4)]:
        if n * dtype.itemsize > 1024:
            continue
        c = FAMILY[Variant("packed", "fwd", dtype, v, log)].space.config(
            THREADS=threads, TPR=tpr, ITEMS=items, KB=kb)

        def buf(fill=None):
            t = (torch.randn(rows * n + off + 16, device="cuda") * 3).to(dtype)
            if fill is not None:
                t.fill_(fill)
            return t, t[off:off + rows * n].view(rows, n)
        _, x = buf()
        x[rows // 2] = float("-inf")
        for kind in ("fwd", "bwd"):
            op = FAMILY[Variant("packed", kind, dtype, v, log)]
            poisoned, out = buf(float("nan"))
            if kind == "fwd":
                op.launch(op.module(c), c, out, x, x)
                torch.testing.assert_close(out.double(), softmax(x, -1, log), equal_nan=True,
                                           rtol=tol, atol=tol * (8 if log else 1))
            else:
                _, y = buf()
                y.copy_(softmax(x.double().nan_to_num(0.0), -1, log).nan_to_num(0.0))
                _, dy = buf()
                op.launch(op.module(c), c, out, y, dy)
                _check_backward(out, y, dy, log)
            assert poisoned[:off].isnan().all() and poisoned[off + rows * n:].isnan().all()
        fwd = FAMILY[Variant("packed", "fwd", dtype, v, log)]
        longer = torch.randn(2, tpr * items + 1, device="cuda").to(dtype)
        with pytest.raises(LaunchError):  # rows beyond TPR x ITEMS
            fwd.launch(fwd.module(c), c, torch.empty_like(longer), longer, longer)
        assert off % v
        with pytest.raises(LaunchError):  # out's rows at another offset within a vector
            fwd.launch(fwd.module(c), c, torch.empty_like(x), x, x)


# ------------------------------------------------------------------ split path (few long rows)
SPLIT_SHAPES = [(16, 262144), (8, 1 << 20), (3, 300_000), (5, 70_001), (1, 1 << 20)]


def _takes_split(rows, n, dtype, arrays=1):
    """Whether contiguous rows x n take the split path (as the public path routes them: 16-byte
    vectors over the rows' windows, n + v - 1 columns where rows start off a vector boundary and
    configs.use_window says so, else element by element)."""
    from vitrail.ops.softmax import configs
    v = vector(dtype)
    if n % v and rows > 1 and not configs.use_window(n, dtype.itemsize):
        v = 1  # element by element
    return configs.use_split(_window_of(rows, n, v), rows, v, arrays, sm_count())


def _window_of(rows, n, v):
    """The window columns of contiguous rows x n (vitrail.ops.softmax._window)."""
    return n if n % v == 0 or rows == 1 else n + v - 1


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SPLIT_SHAPES)
def test_split_rows(shape, dtype, log):
    """The split path, forward and backward, against fp64, within 4x of torch's own error."""
    if dtype == torch.float16 and shape[1] > 300_000:
        pytest.skip("covered by fp32/bf16")
    rows, n = shape
    assert _takes_split(rows, n, dtype) and _takes_split(rows, n, dtype, 2)
    _check_rows(rows, n, dtype, log)


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 131072), (150, 50_000)])
def test_split_over_tile_rows(shape, dtype, log):
    """Rows the tile path could take that go to the split path (configs.split_over_tile:
    forward in every dtype at 64 x 131072; the backward's 256 x 4 CTAs at 150 x 50000, 16-bit
    types), forward and backward against fp64."""
    from vitrail.ops.softmax import route
    rows, n = shape
    paths = [route(kind, rows, n, dtype, vector(dtype), log, torch.device("cuda"))[0].name
             for kind in ("fwd", "bwd")]
    assert any("split" in p for p in paths), paths
    _check_rows(rows, n, dtype, log)


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_direct_poisoned_and_strided(dtype, log):
    """Called directly into NaN-poisoned outputs (every element written, nothing outside the
    rows), on rows with a row stride beyond n (16-byte aligned, then not: element by element, and
    the windowed kernels where the output's rows start as far into their vectors)."""
    from vitrail.ops.softmax import FAMILY, Variant, configs
    from vitrail.ops.softmax.reference import softmax
    rows, n = 16, 262144
    for off in (8, 3):
        base = (torch.randn(rows, n + 64, device="cuda") * 3).to(dtype)
        x = base[:, off:off + n]
        v = vector(dtype) if off % vector(dtype) == 0 else 1
        assert configs.use_split(n, rows, v, 1, sm_count())
        y = torch.full((rows, n), float("nan"), device="cuda", dtype=dtype)
        FAMILY[Variant("split", "fwd", dtype, v, log)]("test", (n, rows), y, x, x)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y.double(), softmax(x, -1, log), rtol=tol, atol=tol)
        yy = softmax(x, -1, log).to(dtype)
        dy = (torch.randn(rows, n + 64, device="cuda")).to(dtype)[:, off:off + n]
        dx = torch.full((rows, n), float("nan"), device="cuda", dtype=dtype)
        FAMILY[Variant("split", "bwd", dtype, v, log)]("test", (n, rows), dx, yy, dy)
        _check_backward(dx, yy, dy, log)
        import vitrail.ops as ops  # the public path on the strided view
        _check((ops.log_softmax if log else ops.softmax)(x), _fns(log)[1](x, -1),
               softmax(x, -1, log))
        if off % vector(dtype):  # the windowed kernels, output rows 3 elements in as x's
            v = vector(dtype)
            poisoned = torch.full((rows, n + 64), float("nan"), device="cuda", dtype=dtype)
            y = poisoned[:, off:off + n]
            window = (n + v - 1, rows)
            _op("split", "fwd", dtype, v, log, x)("test", window, y, x, x)
            torch.testing.assert_close(y.double(), softmax(x, -1, log), rtol=tol, atol=tol)
            yy = torch.empty_like(poisoned)[:, off:off + n]
            yy.copy_(softmax(x, -1, log))
            poisoned.fill_(float("nan"))
            _op("split", "bwd", dtype, v, log, x)("test", window, y, yy, dy)
            _check_backward(y, yy, dy, log)
            assert poisoned[:, :off].isnan().all() and poisoned[:, off + n:].isnan().all()


@requires_gpu
@pytest.mark.parametrize("n", [262144, 1 << 20])
def test_split_inf_nan_large(n, log):
    """Large magnitudes, partly and fully masked rows, a NaN: as torch, on the split path."""
    ours, theirs = _fns(log)
    x = torch.randn(8, n, device="cuda") * 1e4
    x[1, : n // 2] = float("-inf")
    x[2] = float("-inf")  # fully masked: NaN as torch
    x[3, n // 3] = float("nan")
    x[4, n - 1] = float("nan")  # in the last CTA's slice
    x[5, : n - 7] = float("-inf")  # only the last CTA holds finite values
    assert _takes_split(8, n, torch.float32)
    y, ref = ours(x), theirs(x, -1)
    torch.testing.assert_close(y, ref, equal_nan=True, rtol=1e-5, atol=1e-5)
    assert y[2].isnan().all() and y[3].isnan().all() and y[4].isnan().all()


@requires_gpu
def test_split_repeated_streams_graphs(log):
    """The barrier workspace across 50 launches (no reset), on two streams at once, with a
    different G in between, and under CUDA graph capture and replay."""
    ours, theirs = _fns(log)
    xa = torch.randn(16, 262144, device="cuda").bfloat16()
    xb = torch.randn(8, 1 << 20, device="cuda")
    xc = torch.randn(3, 300_000, device="cuda")
    refs = [theirs(t, -1) for t in (xa, xb, xc)]
    for i in range(50):
        t = (xa, xb, xc)[i % 3]
        torch.testing.assert_close(ours(t), refs[i % 3], rtol=2e-2, atol=1e-5)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    outs = {1: [], 2: []}
    for _ in range(10):
        with torch.cuda.stream(s1):
            outs[1].append(ours(xa))
        with torch.cuda.stream(s2):
            outs[2].append(ours(xb))
    torch.cuda.synchronize()
    for a, b in zip(outs[1], outs[2]):
        torch.testing.assert_close(a, refs[0], rtol=2e-2, atol=1e-5)
        torch.testing.assert_close(b, refs[1])
    ours(xc)  # compile and load outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = ours(xc)
    for _ in range(5):
        yg.zero_()
        g.replay()
        torch.testing.assert_close(yg, refs[2])
