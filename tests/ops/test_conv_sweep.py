"""The conv sweep (vitrail.ops.conv.sweep): its cases and its report without a GPU; on a
Hopper GPU, every config timed on two small cases."""
from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import has_gpu
from vitrail.ops.conv import benchmarks as bm
from vitrail.ops.conv import sweep


def test_the_cases_are_the_launches_a_scratch_copy_can_time():
    """The benchmark's dense layers and HELD_OUT's, each kind: none the GEMM runs (1x1 unpadded
    at unit stride), no depthwise or refused layer, no strided dgrad of several phases; a
    strided 1x1 dgrad (one phase) is in. Parts: ResNet-50 and the U-Net are fit, the rest
    held out."""
    cases = sweep.cases()
    names = {c.name for c in cases}
    assert len(names) == len(cases)
    assert all(not bm.runs_gemm(c.layer) and c.layer.groups == 1 for c in cases)
    assert {c.network for c in cases} == {"resnet50", "unet", "convnext_t", "small32", "small8"}
    assert "resnet50 layer2.0.conv2 C128 56x56 K128 3x3/2 dgrad" not in names  # four phases
    assert "resnet50 layer2.0.conv2 C128 56x56 K128 3x3/2 fprop" in names
    assert "resnet50 layer2.0.downsample C256 56x56 K512 1x1/2 dgrad" in names  # one phase
    assert "resnet50 layer1.0.conv1 C64 56x56 K64 1x1 fprop" not in names  # the GEMM's
    assert "small32 c64p1x1 C64 56x56 K64 1x1 fprop" in names  # padded: implicit GEMM
    assert {sweep.part(c.network) for c in cases if c.network in sweep.FIT} == {"fit"}
    assert sweep.part("small8") == sweep.part("convnext_t") == "held out"
    held = [c for c in cases if sweep.part(c.network) == "held out"]
    assert len(held) > len(cases) // 4


def _row(network, kind, problem, ms):
    return {"case": f"{network} {problem} {kind}", "network": network, "kind": kind,
            "problem": problem._asdict(), "sms": 132, "ms": ms, "errors": {}}


def test_the_report_compares_the_cooperative_kernel():
    """The report's last lines: per kind, the fastest cooperative config's speed over the fastest
    non-persistent config's, on the problems where both ran."""
    from vitrail.ops.conv.configs import WIDE, Problem
    ws, coop = (f"tile={WIDE},stages=0,schedule={s}" for s in ("warpspecialized", "cooperative"))
    p = Problem("fprop", 512, 512, 9, 1 << 15)
    rows = [_row("resnet50", "fprop", p, {ws: 2.0, coop: 1.0}),
            _row("unet", "fprop", p, {ws: 1.0, coop: 2.0}),
            _row("unet", "dgrad", p._replace(kind="dgrad"), {ws: 1.0, coop: None})]
    lines = sweep.report(rows)
    fprop = next(line for line in lines if line.split()[:2] == ["fprop", "2"]).split()
    assert float(fprop[2]) == pytest.approx(1.0) and fprop[3:5] == ["0.50", "2.00"]
    assert "resnet50 " in lines[-1]  # where it is fastest
    assert not any(line.split()[:1] == ["dgrad"] for line in lines)  # no cooperative time


def test_the_report_is_the_heuristics_loss_against_the_fastest_config():
    """Each part and kind: the heuristic's config's time over the fastest config's, geometric
    mean and worst, judged with the heuristic as it is (a config it would not take costs what
    it measured; a problem whose chosen config has no time counts as infinitely worse)."""
    from vitrail.ops.conv.configs import NARROW, WIDE, Problem
    ws = ",schedule=warpspecialized"
    wide, narrow, short = (f"tile={WIDE},stages=0{ws}", f"tile={NARROW['fprop']},stages=0{ws}",
                           f"tile={NARROW['fprop']},stages=3{ws}")
    c64 = Problem("fprop", 64, 512, 9, 1 << 19)  # the heuristic: narrow, 3 stages
    c512 = Problem("fprop", 512, 512, 9, 1 << 15)  # the heuristic: wide
    rows = [_row("resnet50", "fprop", c64, {wide: 2.0, narrow: 1.5, short: 1.0}),
            _row("resnet50", "fprop", c512, {wide: 1.2, narrow: 1.0, short: None}),
            _row("small8", "fprop", c64, {wide: 1.0, narrow: 1.0, short: 2.0}),
            _row("small8", "fprop", c512, {wide: None, narrow: 1.0, short: 1.0})]
    lines = sweep.report(rows)
    fit = next(line for line in lines if "fit" in line).split()
    assert fit[:3] == ["fit", "fprop", "2"]
    assert float(fit[3]) == pytest.approx(math.sqrt(1.2), abs=1e-3)
    assert float(fit[4]) == pytest.approx(1.2, abs=1e-2)
    held = next(line for line in lines if "held out" in line).split()
    assert held[2:4] == ["fprop", "2"] and held[4:6] == ["inf", "inf"]


@pytest.mark.gpu
@pytest.mark.warm_cache
@pytest.mark.skipif(not has_gpu() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs a Hopper (sm_90) GPU")
def test_every_config_is_timed_on_the_cases_launches():
    """On the GPU: two small cases (a wgrad in batch chunks, a strided 1x1 dgrad's one phase),
    each config of the space timed, and the row's problem the launch's."""
    from vitrail.ops.conv.configs import Problem
    lay = bm.Layer("t", 64, 28, 28, 64, 3, 3, 1, 1)
    one = bm.Layer("t1x1", 64, 28, 28, 128, 1, 1, 2, 0)
    cases = [bm.Case("small", lay, 16, "wgrad"), bm.Case("small", one, 8, "dgrad")]
    rows = list(sweep.time_configs(only=cases))
    assert [r["case"] for r in rows] == [c.name for c in cases]
    for row in rows:
        assert len(row["ms"]) == 3 and all(v and v > 0 for v in row["ms"].values()), row
    assert Problem(**rows[0]["problem"]) == Problem("wgrad", 64, 64, 9, 16 * 28 * 28)
    assert Problem(**rows[1]["problem"]) == Problem("dgrad", 128, 64, 1, 8 * 14 * 14)
