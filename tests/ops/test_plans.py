"""Plans of the ops' eager calls (vitrail.plan) on the GPU: the hit path against references on
fresh data, after calls with other strides and alignments of the same shape; errors of the miss
path intact; every public op captured in a CUDA graph and replayed against eager."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import requires_gpu
from vitrail.jit.errors import ArgumentError
from vitrail.plan import GENERAL

pytestmark = [requires_gpu, pytest.mark.warm_cache]
BF = torch.bfloat16


@pytest.fixture(autouse=True)
def kernels_only():
    """GEMMs on vitrail's kernels: the plans of kernel launches are under test here (the GEMM
    selection's torch route has its own plan: tests/ops/test_gemm.py)."""
    from vitrail.gemm.ops import testing
    with testing.kernels_only():
        yield


def _ops():
    import vitrail.ops as ops
    return ops


def _close(got, want, tol):
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _cases():
    """[(name, fn(*tensors), reference(*tensors), make tensors(seed), tolerance)]"""
    ops = _ops()
    from vitrail.ops.sympow.reference import (mma_sympow_bwd_reference, sympow_mma_reference,
                                              sympow_reference)

    def mats(*shapes, scale=1.0):
        return lambda: tuple(torch.randn(*s, device="cuda", dtype=BF) * scale for s in shapes)

    def scaled(*shapes):  # ((shape, scale), ...): outputs of order 1 to 30
        return lambda: tuple(torch.randn(*s, device="cuda", dtype=BF) * k for s, k in shapes)

    return [
        ("mm", ops.mm, lambda a, b: a.float() @ b.float(), mats((96, 80), (80, 136)), 0.05),
        ("bmm", ops.bmm, lambda a, b: a.float() @ b.float(), mats((3, 64, 48), (3, 48, 72)),
         0.05),
        ("gemm bias relu", lambda a, b, c: ops.gemm(a, b, bias=c, activation="relu"),
         lambda a, b, c: F.relu(a.float() @ b.float() + c.float()), mats((64, 96), (96, 128),
                                                                          (128,)), 0.05),
        ("softmax", ops.softmax, lambda x: torch.softmax(x.float(), -1), mats((33, 1000)), 2e-2),
        ("log_softmax", lambda x: ops.log_softmax(x, 0),
         lambda x: torch.log_softmax(x.float(), 0), mats((300, 24)), 2e-2),
        ("copy transpose", lambda x: ops.copy(x.t()), lambda x: x.t().contiguous(),
         mats((200, 136)), 0),
        ("copy to fp32", lambda x: ops.copy(x, dtype=torch.float32), lambda x: x.float(),
         mats((77, 130)), 0),
        ("sympow", lambda x: ops.sympow(x, 2, 8), lambda x: sympow_reference(x, 2, 8),
         mats((3, 50, 64)), 3e-2),
        ("sympow_mma query", lambda a, b: ops.sympow_mma(a, b, -1, 2, 8),
         lambda a, b: sympow_mma_reference(a, b, -1, 2, 8),
         scaled(((4, 256, 64), 1.0), ((4, 2304, 64), 0.1)), 0.1),  # bf16 out of ~5: 3 ulp
        ("sympow_mma state", lambda a, b: ops.sympow_mma(a, b, -2, 2, 8),
         lambda a, b: sympow_mma_reference(a, b, -2, 2, 8),
         scaled(((4, 64, 256), 1.0), ((4, 256, 64), 0.1)), 0.1),
        ("mma_sympow_bwd", lambda g, bt, c: ops.mma_sympow_bwd(g, bt, c, -1, 2, 8),
         lambda g, bt, c: mma_sympow_bwd_reference(g, bt, c, -1, 2, 8),
         scaled(((4, 256, 64), 0.3), ((4, 64, 2304), 0.3), ((4, 256, 64), 1.0)), 0.1),
        ("grouped_mm packed", ops.grouped_mm,
         lambda a, b, ends: torch.cat([a[s:e].float() @ b[g].float() for g, (s, e) in
                                       enumerate(((0, 50), (50, 120), (120, 200)))]),
         lambda: mats((200, 64), (3, 64, 48))() + (
             torch.tensor([50, 120, 200], device="cuda", dtype=torch.int32),), 0.05),
        ("scaled_mm rowwise", lambda a, b, sa, sb: ops.scaled_mm(a, b, sa, sb),
         lambda a, b, sa, sb: (a.float() @ b.float()) * sa * sb, lambda: (
             (torch.randn(96, 128, device="cuda") * 0.5).to(torch.float8_e4m3fn),
             (torch.randn(80, 128, device="cuda") * 0.5).to(torch.float8_e4m3fn).t(),
             torch.rand(96, 1, device="cuda") + 0.5, torch.rand(1, 80, device="cuda") + 0.5),
         0.05),
        ("conv2d bias relu", lambda x, w, b: ops.conv2d(x, w, b, padding=1, activation="relu"),
         lambda x, w, b: F.relu(F.conv2d(x.float(), w.float(), b.float(), padding=1)),
         lambda: tuple(t.contiguous(memory_format=torch.channels_last) for t in mats(
             (2, 32, 9, 11), (48, 32, 3, 3), scale=0.25)()) + mats((48,))(), 0.05),
    ]


CASES = 14


@pytest.mark.parametrize("case", range(CASES))
def test_hit_path_matches_the_reference_on_fresh_data(case):
    name, fn, ref, make, tol = _cases()[case]
    for _ in range(4):  # the first call plans, the others replay the plan
        args = make()
        _close(fn(*args), ref(*args), tol)


def test_plans_are_recorded_for_the_common_calls():
    ops = _ops()
    from vitrail.ops.copy import PLANS as copy_plans
    from vitrail.gemm.ops.launch import PLANS as gemm_plans
    from vitrail.ops.softmax import PLANS as softmax_plans
    from vitrail.ops.sympow import PLANS as sympow_plans
    x = torch.randn(64, 512, device="cuda", dtype=BF)
    xs = torch.randn(64, 64, device="cuda", dtype=BF)
    w = torch.randn(64, 64, device="cuda", dtype=BF)
    for plans, call in ((softmax_plans, lambda: ops.softmax(x)),
                        (gemm_plans, lambda: ops.mm(x[:, :64], w)),
                        (copy_plans, lambda: ops.copy(x.t())),
                        (sympow_plans, lambda: ops.sympow(xs, 2, 8))):
        before = len(plans)
        call()
        call()
        assert len(plans) == before + 1
        made = list(plans._plans.values())[-1]
        assert made is not GENERAL, plans
        assert "f0(" in made.source or "k0(" in made.source


@pytest.fixture(scope="module")
def native():
    """The C++ hit path, built (it builds in the background at the first plan otherwise)."""
    from vitrail.plan import native
    if native.load(wait=True) is None:
        pytest.fail("the C++ hit path did not build (see the log)")
    return native


NATIVE = [("mm", lambda ops: ops.mm, 2), ("bmm", lambda ops: ops.bmm, 2),
          ("softmax", lambda ops: ops.softmax, 1), ("log_softmax", lambda ops: ops.log_softmax, 1),
          ("copy to fp32", lambda ops: ops.copy, 1), ("sympow", lambda ops: ops.sympow, 1),
          ("sympow_mma query", lambda ops: ops.sympow_mma, 2),
          ("sympow_mma state", lambda ops: ops.sympow_mma, 2),
          ("mma_sympow_bwd", lambda ops: ops.mma_sympow_bwd, 3),
          ("grouped_mm packed", lambda ops: ops.grouped_mm, 3)]


@pytest.mark.parametrize("name,public,tensors", NATIVE, ids=[n for n, _, _ in NATIVE])
def test_the_cpp_hit_path_runs_the_plans_of_public_calls(native, name, public, tensors):
    """After its first call, a public call's signature is a C++ plan: the front's table answers
    it (not MISS), on fresh data, equal to the reference; torch's matmul route too."""
    ops = _ops()
    case = next(c for c in _cases() if c[0] == name)
    _, fn, ref, make, tol = case
    front = public(ops).front
    for _ in range(4):
        args = make()
        _close(fn(*args), ref(*args), tol)
    extra = {"log_softmax": (0,), "copy to fp32": (None, torch.float32), "sympow": (2, 8),
             "sympow_mma query": (-1, 2, 8), "sympow_mma state": (-2, 2, 8),
             "mma_sympow_bwd": (-1, 2, 8)}
    args = make()
    got = front.call(*args[:tensors], *extra.get(name, ()), *_defaults(public(ops), tensors,
                                                                      len(extra.get(name, ()))))
    if name == "log_softmax":  # along dim 0: a transposed copy, which no plan repeats
        assert got is native.MISS and not front.pending()
        return
    assert got is not native.MISS, f"{name}: no C++ plan ({front})"
    _close(got, ref(*args), tol)


def _defaults(fn, given: int, extra: int) -> tuple:
    """The defaults of fn's parameters after the first given + extra (as the front passes)."""
    import inspect
    params = list(inspect.signature(fn).parameters.values())[given + extra:]
    return tuple(p.default for p in params)


def test_the_cpp_hit_path_keeps_aliasing_strides_and_the_torch_route_right(native):
    ops = _ops()
    from vitrail.gemm.ops import testing
    a, b = (torch.randn(64, 64, device="cuda", dtype=BF) for _ in range(2))
    for _ in range(3):  # one tensor twice, then two: never the first twice
        _close(ops.mm(a, a), a.float() @ a.float(), 0.1)
    for _ in range(3):
        _close(ops.mm(a, b), a.float() @ b.float(), 0.1)
    base = torch.randn(70, 257, device="cuda", dtype=BF)
    for x in (base[:, :256], base[:, 1:], base.t()[:256].t(), base[:, 1:].contiguous()):
        for _ in range(3):
            _close(ops.softmax(x), torch.softmax(x.float(), -1), 2e-2)
    with testing.kernels_only(False):  # the selection's routes: torch's matmul where faster
        x, w = (torch.randn(*s, device="cuda", dtype=BF) for s in ((2048, 2048), (2048, 2048)))
        for _ in range(3):
            _close(ops.mm(x, w), x.float() @ w.float(), 0.5)
        assert ops.mm.front.call(x, w, None) is not native.MISS


def test_the_cpp_hit_path_runs_torchs_ops_for_a_fused_epilogue(native):
    """A fused epilogue on torch's route (16 rows against K = 14336) is a C++ plan after its
    first call (at::addmm and the ops in place), equal to the reference on fresh data; one
    with C beside the bias too; a batched one keeps its Python plan."""
    ops = _ops()
    from vitrail.gemm.ops import model, testing
    from vitrail.gemm.ops.reference import gemm_reference
    M, N, K = 16, 4096, 14336
    assert model.choose(M, N, K, torch_ok=True, passes=3) == model.TORCH_CONFIG

    def make():
        return (torch.randn(M, K, device="cuda", dtype=BF),
                torch.randn(K, N, device="cuda", dtype=BF) / 64,
                torch.randn(M, N, device="cuda", dtype=BF), torch.randn(N, device="cuda"))
    with testing.kernels_only(False):
        for kw in (dict(activation="silu", clamp_max=1.0), dict(beta=0.5, activation="gelu"),
                   dict(alpha=2.0, activation="leaky_relu", slope=0.2, clamp_min=-0.5)):
            c_beta = kw.get("beta", 0.0)
            for _ in range(3):
                a, b, c, bias = make()
                ref = gemm_reference(a, b, c, bias=bias, out_dtype=torch.float32,
                                     activation_name=kw.get("activation"),
                                     **{k: v for k, v in kw.items() if k != "activation"})
                _close(ops.gemm(a, b, c, bias=bias, **kw), ref, 3e-2)
            a, b, c, bias = make()
            got = ops.gemm.front.call(a, b, c, kw.get("alpha", 1.0), c_beta, bias,
                                      kw["activation"], None, kw.get("slope", 0.01),
                                      kw.get("clamp_min"), kw.get("clamp_max"))
            assert got is not native.MISS, kw
            ref = gemm_reference(a, b, c, bias=bias, out_dtype=torch.float32,
                                 activation_name=kw.get("activation"),
                                 **{k: v for k, v in kw.items() if k != "activation"})
            _close(got, ref, 3e-2)
        for _ in range(3):  # alpha alone: inside the product (addmm with beta 0)
            a, b, _, _ = make()
            _close(ops.gemm(a, b, alpha=0.5), 0.5 * (a.float() @ b.float()), 3e-2)
        a, b, _, _ = make()
        got = ops.gemm.front.call(a, b, None, 0.5, 0.0, None, None, None, 0.01, None, None)
        assert got is not native.MISS
        _close(got, 0.5 * (a.float() @ b.float()), 3e-2)
        x = torch.randn(2, 8, K, device="cuda", dtype=BF)
        for _ in range(3):
            _close(ops.gemm(x, b, bias=bias, activation="silu"),
                   gemm_reference(x, b, bias=bias, activation_name="silu",
                                  out_dtype=torch.float32), 3e-2)


def test_the_split_path_is_planned_per_stream(native):
    """Long rows take the split path (cooperative grids, counters in a workspace kept per
    stream): a C++ plan, whose workspace is its stream's; calls on two streams at once, each
    against the reference."""
    import importlib
    sm = importlib.import_module("vitrail.ops.softmax")  # the module (ops.softmax: the function)
    y = torch.softmax(torch.randn(32, 131072, device="cuda", dtype=BF).float(), -1).to(BF)
    dys = [torch.randn_like(y) for _ in range(4)]
    op, _, _ = sm.route_contiguous("bwd", *y.shape, BF, False, y.device)
    if "split" not in op.name:
        pytest.skip(f"32 x 131072 takes {op.name} on this GPU, not the split path")

    def want(dy):
        yf, dyf = y.float(), dy.float()
        return yf * (dyf - (yf * dyf).sum(-1, keepdim=True))
    streams = [torch.cuda.Stream() for _ in range(2)]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = {}
    for round_ in range(3):  # the first call on each stream plans, the others replay
        for k, s in enumerate(streams):
            with torch.cuda.stream(s):
                outs[k] = sm._backward(y, dys[2 * k + round_ % 2], 1, False)
        torch.cuda.synchronize()
        for k in range(2):
            _close(outs[k], want(dys[2 * k + round_ % 2]), 2e-2)
    for s in streams:
        with torch.cuda.stream(s):
            assert sm._backward.front.call(y, dys[0], 1, False) is not native.MISS
    torch.cuda.synchronize()


def test_strides_and_alignment_of_one_shape_take_their_own_plans():
    ops = _ops()
    base = torch.randn(70, 257, device="cuda", dtype=BF)
    for x in (base[:, :256], base[:, 1:], base[:, :256].contiguous(), base.t()[:256].t(),
              base[:, 1:].contiguous()):
        for _ in range(2):
            _close(ops.softmax(x), torch.softmax(x.float(), -1), 2e-2)
            _close(ops.copy(x), x, 0)
            w = torch.randn(256, 32, device="cuda", dtype=BF)
            _close(ops.mm(x, w), x.float() @ w.float(), 0.1)


def test_aliased_operands_are_not_planned_for_other_tensors():
    """mm(a, a) stores no plan: a later mm(a, b) of the same signatures must read b."""
    ops = _ops()
    a, b = (torch.randn(64, 64, device="cuda", dtype=BF) for _ in range(2))
    for _ in range(2):
        _close(ops.mm(a, a), a.float() @ a.float(), 0.1)
    for _ in range(2):
        _close(ops.mm(a, b), a.float() @ b.float(), 0.1)


def test_the_miss_path_still_refuses_bad_input():
    ops = _ops()
    x = torch.randn(8, 16, device="cuda", dtype=BF)
    ops.softmax(x)
    ops.softmax(x)  # planned
    with pytest.raises(ArgumentError, match="dim=2 is out of range"):
        ops.softmax(x, 2)
    with pytest.raises(ArgumentError, match="dim=-3 is out of range"):
        ops.softmax(x, -3)
    with pytest.raises(ArgumentError, match="dim must be an int"):
        ops.softmax(x, True)
    with pytest.raises(ArgumentError, match="dtype"):
        ops.softmax(x.int())
    a = torch.randn(16, 32, device="cuda", dtype=BF)
    ops.mm(a, a.t())
    ops.mm(a, a.t())
    with pytest.raises(ArgumentError, match="cannot be multiplied"):
        ops.mm(a, a)
    with pytest.raises(ArgumentError):
        ops.mm(a, a.t().float())


@pytest.mark.parametrize("case", range(CASES))
def test_graph_capture_and_replay_match_eager(case):
    name, fn, ref, make, tol = _cases()[case]
    args = make()
    eager = fn(*args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    fresh = make()
    for a, f in zip(args, fresh):
        a.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    _close(out, ref(*args), tol)
    assert eager.shape == out.shape


@pytest.mark.parametrize("case", range(CASES))
def test_reduce_overhead_compiles_capture_and_replay(case):
    """torch.compile(mode="reduce-overhead") captures each public op into CUDA graphs (through
    its custom op) and replays them: equal to the reference on fresh data at every call."""
    name, fn, ref, make, tol = _cases()[case]
    torch._dynamo.reset()
    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # warm-up, recording, then replays
        args = make()
        out = compiled(*args).clone()
        _close(out, ref(*args), tol)


# ------------------------------------------------------------------ the autograd path
def _grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g)


def _double(*ts):
    return tuple(t.detach().double().requires_grad_() for t in ts)


@pytest.mark.parametrize("activation,clamp", [(None, None), ("relu", None), ("gelu", None),
                                              ("sigmoid", None), ("relu", (-0.5, 0.5))])
def test_gemm_autograd_path_matches_fp64_and_the_custom_op(native, activation, clamp):
    """An eager call that records gradients runs the family's autograd.Function (not the custom
    op), then its C++ plan with vitrail's C++ autograd node: its gradients equal the custom
    op's and fp64 autograd's, through the output's derivative (relu, sigmoid) or z recomputed
    (gelu, clamps), with or without bias's gradient; create_graph goes through the custom op,
    so a second derivative exists."""
    ops = _ops()
    from vitrail.gemm.ops.reference import gemm_reference
    lo, hi = clamp or (None, None)
    for k in range(4):
        a, b, bias = (torch.randn(*s, device="cuda", dtype=BF) for s in ((70, 48), (48, 40),
                                                                          (40,)))
        a, b = (t.requires_grad_() for t in (a, b))
        bias.requires_grad_(k < 3)  # the last: a key of its own, bias's gradient not needed
        g = torch.randn(70, 40, device="cuda", dtype=BF)
        out = ops.gemm(a, b, bias=bias, activation=activation, clamp_min=lo, clamp_max=hi)
        if k in (0, 3):
            assert type(out.grad_fn).__name__ == "_GemmBackward"
        else:
            assert out.grad_fn.name() == "vitrail::GemmBackward"
        leaves = (a, b, bias) if bias.requires_grad else (a, b)
        ours = _grads(out, leaves, g)
        via_op = _grads(torch.ops.vitrail.gemm(a, b, None, bias, 1.0, 0.0, activation, 0.01, lo,
                                               hi, None), leaves, g)
        a2, b2, bias2 = _double(a, b, bias)
        ref = gemm_reference(a2, b2, bias=bias2, activation_name=activation, clamp_min=lo,
                             clamp_max=hi, out_dtype=torch.float64)
        refs = _grads(ref, (a2, b2, bias2)[:len(leaves)], g.double())
        for mine, op, r in zip(ours, via_op, refs):
            scale = r.abs().max().item() + 1e-3
            assert (mine.double() - r).abs().max().item() <= 0.03 * scale
            assert (mine.double() - op.double()).abs().max().item() <= 0.02 * scale
    if activation is None:  # create_graph: a second derivative, as torch.mm's (C++ the 2nd)
        for k in range(2):
            w = b.detach().requires_grad_()
            y = ops.mm(a, w)
            assert k == 0 or y.grad_fn.name() == "vitrail::GemmBackward"
            (gx,) = torch.autograd.grad(y, a, g, create_graph=True)
            (gw,) = torch.autograd.grad((gx.float() ** 2).sum(), w)
            a2, w2 = _double(a, w)
            (gx2,) = torch.autograd.grad(a2 @ w2, a2, g.double(), create_graph=True)
            (want,) = torch.autograd.grad((gx2 ** 2).sum(), w2)
            _close(gw, want, 0.03 * want.abs().max().item())


def test_autograd_paths_of_softmax_copy_and_sympow(native):
    """softmax, log_softmax, copy (with a dtype change) and sympow record their gradients through
    their autograd.Functions on the eager path, equal to fp64 autograd; a second backward of
    softmax is refused, as through the custom op."""
    ops = _ops()
    from vitrail.ops.sympow.reference import sympow_reference
    x = torch.randn(33, 1000, device="cuda", dtype=BF, requires_grad=True)
    dy = torch.randn(33, 1000, device="cuda", dtype=BF)
    for fn, ref in ((ops.softmax, torch.softmax), (ops.log_softmax, torch.log_softmax)):
        for _ in range(2):  # the second call replays plans (from C++: test_..._cpp_autograd)
            y = fn(x, -1)
            assert y.grad_fn is not None
            (gx,) = _grads(y, (x,), dy)
            (x2,) = _double(x)
            (want,) = _grads(ref(x2, -1), (x2,), dy.double())
            _close(gx, want, 2e-2)
    y = ops.softmax(x)
    (gx,) = torch.autograd.grad(y, x, dy, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(gx.float().sum(), x)
    for k in range(2):  # the first runs the autograd.Function, the second the C++ plan
        z = ops.copy(x.t(), dtype=torch.float32)
        assert z.grad_fn.name() == ("_CopyBackward" if k == 0 else "vitrail::CopyBackward")
        assert z.dtype == torch.float32
        (gx,) = _grads(z, (x,), dy.t().float())
        assert gx.dtype == BF
        torch.testing.assert_close(gx, dy)
    xs = torch.randn(3, 50, 64, device="cuda", dtype=BF, requires_grad=True)
    for k in range(2):
        z = ops.sympow(xs, 2, 8)
        assert z.grad_fn.name() == ("_SympowBackward" if k == 0 else "vitrail::SympowBackward")
        dz = torch.randn_like(z)
        (gx,) = _grads(z, (xs,), dz)
        (x2,) = _double(xs)
        (want,) = _grads(sympow_reference(x2, 2, 8), (x2,), dz.double())
        _close(gx, want, 3e-2 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_copy_and_sympow_gradients_are_recorded_from_cpp(native, dtype):
    """copy, sympow and sympow_mma calls that record gradients are C++ plans after their first
    call (the output's node is vitrail's C++ one), with the gradients of fp64 autograd on fresh
    data; a call whose result is not the plan's output (sympow along another dim, sympow_mma of
    4-D tensors), one the C++ path does not take and one needing only b's gradient stay
    right."""
    ops = _ops()
    from vitrail.ops.sympow.reference import sympow_mma_reference, sympow_reference
    for k in range(3):  # copy: a transpose, a dtype change; dy goes back exactly
        x = torch.randn(33, 1000, device="cuda", dtype=dtype, requires_grad=True)
        for target in (None, torch.float16):
            z = ops.copy(x.t(), dtype=target)
            assert k == 0 or z.grad_fn.name() == "vitrail::CopyBackward", (k, target)
            dz = torch.randn_like(z)
            (gx,) = _grads(z, (x,), dz)
            assert gx.dtype == dtype
            torch.testing.assert_close(gx, dz.t().to(dtype))
    if dtype == torch.float32:
        return  # the sympow kernels' dtypes are 16-bit ones
    for k in range(3):
        xs = torch.randn(3, 50, 64, device="cuda", dtype=dtype, requires_grad=True)
        for dim in (-1, 1):
            x = xs if dim == -1 else xs.transpose(1, 2)
            z = ops.sympow(x, 2, 8, dim)
            if k:
                assert (z.grad_fn.name() == "vitrail::SympowBackward") == (dim == -1), (k, dim)
            dz = torch.randn_like(z)
            (gx,) = _grads(z, (xs,), dz)
            (x2,) = _double(xs)
            x2d = x2 if dim == -1 else x2.transpose(1, 2)
            (want,) = _grads(sympow_reference(x2d, 2, 8, dim), (x2,), dz.double())
            _close(gx, want, 3e-2 * want.abs().max().item())
    D = 2304  # sympow_dim(64, 2, 8)
    # (the state side's K of 50 is padded to 64 per call: a plan the C++ path does not take)
    for expand_dim, sa, sb, cpp in ((-1, (3, 50, 64), (3, D, 24), True),
                                    (-2, (3, 64, 256), (3, 256, 24), True),
                                    (-2, (3, 64, 50), (3, 50, 24), None),
                                    (-1, (2, 3, 50, 64), (2, 3, D, 24), False)):
        for grads in ((True, True), (False, True)):
            for k in range(3):
                a = torch.randn(*sa, device="cuda", dtype=dtype).requires_grad_(grads[0])
                b = (torch.randn(*sb, device="cuda") / sb[-2] ** 0.5).to(dtype)
                b.requires_grad_(grads[1])
                c = ops.sympow_mma(a, b, expand_dim, 2, 8, scale_a=0.5)
                if k and cpp is not None:
                    assert (c.grad_fn.name() == "vitrail::SympowMmaBackward") == cpp, \
                        (expand_dim, sa, grads, k, c.grad_fn.name())
                dc = torch.randn_like(c)
                leaves = tuple(t for t in (a, b) if t.requires_grad)
                ours = _grads(c, leaves, dc)
                a2, b2 = _double(a, b)
                ref = sympow_mma_reference(a2, b2, expand_dim, 2, 8, 0.5)
                wants = _grads(ref, tuple(t for t, g in zip((a2, b2), grads) if g), dc.double())
                for got, want in zip(ours, wants):
                    _close(got, want, 3e-2 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF])
def test_softmax_gradients_are_recorded_from_cpp(native, dtype):
    """A softmax call that records gradients is a C++ plan after its first call: its output's
    node is vitrail's C++ one, and the gradients (through it and through torch ops around it)
    equal fp64 autograd's on fresh data; dims, shapes, log or not; a second backward refuses."""
    ops = _ops()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for fn, ref, name in ((ops.softmax, torch.softmax, "vitrail::SoftmaxBackward"),
                          (ops.log_softmax, torch.log_softmax, "vitrail::LogSoftmaxBackward")):
        for shape, dim in (((33, 1000), -1), ((4, 7, 256), 2), ((32, 8192), 1)):
            for k in range(3):
                x = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
                w = torch.randn(*shape, device="cuda", dtype=dtype)
                y = fn(x * 1.0, dim)  # x * 1.0: the gradient flows on through torch's node
                if k:
                    assert y.grad_fn.name() == name, (fn, shape, k)
                loss = (y.float() * w.float()).sum()
                (gx,) = torch.autograd.grad(loss, x)
                (x2,) = _double(x)
                want, = torch.autograd.grad((ref(x2 * 1.0, dim) * w.double()).sum(), x2)
                _close(gx, want, tol)
                _close(y, ref(x.detach().double(), dim), tol)
    x = torch.randn(16, 512, device="cuda", dtype=dtype, requires_grad=True)
    for _ in range(2):
        y = ops.softmax(x)
    assert y.grad_fn.name() == "vitrail::SoftmaxBackward"
    y.sum().backward()
    with pytest.raises(RuntimeError, match="second time"):
        y.sum().backward()
    y = ops.softmax(x)
    y.add_(1)  # the saved output changed in place
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()
