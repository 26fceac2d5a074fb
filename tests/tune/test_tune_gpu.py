"""GPU tests of tuning: PickBest against timing every config by hand, user tensors untouched,
CUDA-graph capture, and a second process that benchmarks nothing."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import vitrail
from tests.conftest import requires_gpu
from tests.tune.scale_op import OP, scale
from vitrail.tune import TuningError, TuningStore, limits, problem_key, tuner

pytestmark = [requires_gpu, pytest.mark.gpu]
N = 1 << 24  # 64 MiB per tensor: well past L2, so configs differ by how they use HBM


@pytest.fixture(autouse=True)
def fresh_op():
    OP._configs.clear()
    OP._modules.clear()
    yield


def test_pick_best_picks_the_fastest_config_and_leaves_user_tensors_alone():
    from vitrail.profile import measure
    x = torch.randn(N, device="cuda")
    y = torch.full_like(x, float("nan"))
    x_before = x.clone()
    key = problem_key(x)
    with vitrail.settings(policy=vitrail.PickBest):
        chosen = OP.config(key, N, (y, x, 3.0))
    assert torch.equal(x, x_before) and torch.isnan(y).all()  # tuning ran on scratch copies
    lim = limits()
    by_hand = {}
    for config in OP.space.valid(lim):
        module = OP.module(config)
        by_hand[config] = measure(lambda: OP.launch(module, config, y, x, 3.0)).median
    fastest = min(by_hand.values())
    assert by_hand[chosen] <= 1.15 * fastest, (chosen, by_hand[chosen], fastest)
    slowest = max(by_hand.values())
    assert slowest > 1.5 * fastest  # the space has clearly slow corners: the test can fail
    record = TuningStore().get(tuner.record_key(OP.tunable, key, lim))
    assert record.config == chosen and len(record.timings) == len(by_hand)
    OP(key, N, y, x, 3.0)
    torch.testing.assert_close(y, 3.0 * x)


def test_tuning_is_refused_during_graph_capture_and_tuned_ops_capture_and_replay():
    x = torch.randn(1 << 20, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with vitrail.settings(policy=vitrail.PickBest):
        with pytest.raises(TuningError, match="captured into a CUDA graph"):
            with torch.cuda.graph(graph):
                scale(x, 2.0)
        scale(x, 2.0)  # tunes and stores, outside any capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = scale(x, 2.0)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, 2.0 * x)


def test_a_second_process_benchmarks_nothing():
    x = torch.randn(1 << 22, device="cuda")
    with vitrail.settings(policy=vitrail.PickBest):
        chosen = OP.config(problem_key(x), x.numel(), (torch.empty_like(x), x, 1.0))
    code = (
        "import torch, vitrail\n"
        "from vitrail.tune import tuner, problem_key\n"
        "from tests.tune.scale_op import OP\n"
        "def forbidden(*a, **k): raise AssertionError('benchmarked or compiled candidates')\n"
        "tuner.compile_all = forbidden\n"
        "tuner._default_timer = forbidden\n"
        "x = torch.randn(1 << 22, device='cuda')\n"
        "with vitrail.settings(policy=vitrail.PickBest):\n"
        "    print(OP.config(problem_key(x), x.numel(), (torch.empty_like(x), x, 1.0)).label)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=os.environ.copy(), cwd=os.getcwd(), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == chosen.label


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_pick_best_spreads_timing_over_the_local_gpus():
    from vitrail.profile import measure
    x = torch.randn(N, device="cuda:0")
    y = torch.full_like(x, float("nan"))
    x_before = x.clone()
    key = problem_key(x)
    with vitrail.settings(policy=vitrail.PickBest, devices="all"):
        chosen = OP.config(key, N, (y, x, 3.0))
    assert torch.equal(x, x_before) and torch.isnan(y).all()
    lim = limits()
    record = TuningStore().get(tuner.record_key(OP.tunable, key, lim))
    used = {t["device"] for t in record.timings}
    assert used == set(range(torch.cuda.device_count())), used
    by_hand = {}
    for config in OP.space.valid(lim):
        module = OP.module(config)
        by_hand[config] = measure(lambda: OP.launch(module, config, y, x, 3.0)).median
    assert by_hand[chosen] <= 1.15 * min(by_hand.values()), (chosen, by_hand[chosen])
    OP(key, N, y, x, 3.0)
    torch.testing.assert_close(y, 3.0 * x)
