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


def _ops():
    import vitrail.ops as ops
    return ops


def _close(got, want, tol):
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _cases():
    """[(name, fn(*tensors), reference(*tensors), make tensors(seed), tolerance)]"""
    ops = _ops()
    from vitrail.ops.sympow.reference import sympow_reference

    def mats(*shapes, scale=1.0):
        return lambda: tuple(torch.randn(*s, device="cuda", dtype=BF) * scale for s in shapes)

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
    ]


@pytest.mark.parametrize("case", range(8))
def test_hit_path_matches_the_reference_on_fresh_data(case):
    name, fn, ref, make, tol = _cases()[case]
    for _ in range(4):  # the first call plans, the others replay the plan
        args = make()
        _close(fn(*args), ref(*args), tol)


def test_plans_are_recorded_for_the_common_calls():
    ops = _ops()
    from vitrail.ops.copy import PLANS as copy_plans
    from vitrail.ops.gemm.launch import PLANS as gemm_plans
    from vitrail.ops.softmax import PLANS as softmax_plans
    from vitrail.ops.sympow import PLANS as sympow_plans
    x = torch.randn(64, 512, device="cuda", dtype=BF)
    xs = torch.randn(64, 64, device="cuda", dtype=BF)
    for plans, call in ((softmax_plans, lambda: ops.softmax(x)),
                        (gemm_plans, lambda: ops.mm(x[:, :64], x[:64])),
                        (copy_plans, lambda: ops.copy(x.t())),
                        (sympow_plans, lambda: ops.sympow(xs, 2, 8))):
        before = len(plans)
        call()
        call()
        assert len(plans) == before + 1
        made = list(plans._plans.values())[-1]
        assert made is not GENERAL, plans
        assert "f0(" in made.source or "k0(" in made.source


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


@pytest.mark.parametrize("case", range(8))
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
