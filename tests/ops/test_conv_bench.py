"""`vitrail bench conv` without a GPU: its layer lists (the networks' convolutions, each output
shape as the op's fake and torch compute it), its registration, the refused rows (decided by
the op's checks on meta tensors), a case's rows with the timing faked, and the summary's math;
`vitrail precompile conv2d` building the family's defaults, and a variant's problem from a
shape (`vitrail tune conv2d.dgrad.bf16 --shape ...`)."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from vitrail.ops.conv import benchmarks as bm
from vitrail.ops.conv import reasons
from vitrail.profile.timing import timing_from_samples

BF = torch.bfloat16


def _meta(*shape):
    return torch.empty(shape, dtype=BF, device="meta")


def _geometry(layer):
    return (layer.C, layer.H, layer.W, layer.K, layer.R, layer.S, layer.stride, layer.padding,
            layer.groups)


def _resnet50():
    """torchvision's resnet50 (v1.5) at 224x224, derived from its stages: every convolution."""
    convs = [(3, 224, 224, 64, 7, 7, 2, 3, 1)]
    c, h = 64, 56  # after the stem's stride-2 conv and max pool
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            s = stride if b == 0 else 1
            ho = (h + 2 - 3) // s + 1
            convs += [(c, h, h, width, 1, 1, 1, 0, 1), (width, h, h, width, 3, 3, s, 1, 1),
                      (width, ho, ho, 4 * width, 1, 1, 1, 0, 1)]
            if b == 0:
                convs.append((c, h, h, 4 * width, 1, 1, s, 0, 1))  # downsample
            c, h = 4 * width, ho
    return convs


def _unet():
    """SD 1.5's UNet2DConditionModel at a 64x64 latent, derived from its config (widths
    320/640/1280/1280, 2 resnets per down block, 3 per up block on the skips, 2 in the middle):
    every convolution but the transformers' proj_in/proj_out."""
    def resnet(cin, cout, h):
        out = [(cin, h, h, cout, 3, 3, 1, 1, 1), (cout, h, h, cout, 3, 3, 1, 1, 1)]
        return out + ([(cin, h, h, cout, 1, 1, 1, 0, 1)] if cin != cout else [])
    widths = (320, 640, 1280, 1280)
    convs, c, h = [(4, 64, 64, 320, 3, 3, 1, 1, 1)], 320, 64
    skips = [(c, h)]
    for i, width in enumerate(widths):
        for _ in range(2):
            convs += resnet(c, width, h)
            c = width
            skips.append((c, h))
        if i < len(widths) - 1:
            convs.append((c, h, h, c, 3, 3, 2, 1, 1))
            h //= 2
            skips.append((c, h))
    convs += resnet(c, c, h) + resnet(c, c, h)
    for i, width in enumerate(reversed(widths)):
        for _ in range(3):
            skip, at = skips.pop()
            assert at == h
            convs += resnet(c + skip, width, h)
            c = width
        if i < len(widths) - 1:
            h *= 2
            convs.append((c, h, h, c, 3, 3, 1, 1, 1))  # after the nearest 2x upsampling
    assert not skips
    return convs + [(320, 64, 64, 4, 3, 3, 1, 1, 1)]


def _convnext_t():
    """torchvision's convnext_tiny at 224x224, derived from its stages (depths 3/3/9/3, widths
    96/192/384/768): the stem, each block's depthwise 7x7, the downsamplers."""
    convs, h = [(3, 224, 224, 96, 4, 4, 4, 0, 1)], 56
    widths = (96, 192, 384, 768)
    for i, (width, depth) in enumerate(zip(widths, (3, 3, 9, 3))):
        if i:
            convs.append((widths[i - 1], 2 * h, 2 * h, width, 2, 2, 2, 0, 1))
        convs += [(width, h, h, width, 7, 7, 1, 3, width)] * depth
        h //= 2
    return convs


def _mobilenet_v2_depthwise():
    """torchvision's mobilenet_v2 at 224x224, derived from its inverted-residual settings
    (t, c, n, s): each block's depthwise 3x3 (on t x its input channels, the block's first
    at stride s)."""
    convs, c, h = [], 32, 112
    for t, out, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                         (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)):
        for b in range(n):
            stride = s if b == 0 else 1
            convs.append((t * c, h, h, t * c, 3, 3, stride, 1, t * c))
            c, h = out, h // stride
    return convs


def test_the_layer_lists_are_the_networks_convolutions():
    assert (len(bm.RESNET50), sum(lay.count for lay in bm.RESNET50)) == (23, 53)
    assert (len(bm.UNET), sum(lay.count for lay in bm.UNET)) == (31, 66)
    assert (len(bm.CONVNEXT_T), sum(lay.count for lay in bm.CONVNEXT_T)) == (8, 22)
    assert (len(bm.MOBILENET_V2), sum(lay.count for lay in bm.MOBILENET_V2)) == (10, 17)
    for layers, derived in ((bm.RESNET50, _resnet50()), (bm.UNET, _unet()),
                            (bm.CONVNEXT_T, _convnext_t()),
                            (bm.MOBILENET_V2, _mobilenet_v2_depthwise())):
        assert len({_geometry(lay) for lay in layers}) == len(layers)  # distinct
        assert len({lay.name for lay in layers}) == len(layers)
        assert {_geometry(lay): lay.count for lay in layers} == Counter(derived)
    assert {n: (b, a) for n, (b, _, a) in bm.NETWORKS.items()} == {
        "resnet50": (128, "relu"), "unet": (8, "silu"), "convnext_t": (64, None),
        "mobilenet_v2": (128, None)}


@pytest.mark.parametrize("network", list(bm.NETWORKS))
def test_each_layers_output_shape_is_torchs(network):
    """The op's shape function (its fake, run on meta tensors) and the benchmark's FLOPs
    count the output torch's conv2d gives."""
    batch, layers, _ = bm.NETWORKS[network]
    for lay in layers:
        x = _meta(batch, lay.C, lay.H, lay.W)
        w = _meta(lay.K, lay.C // lay.groups, lay.R, lay.S)
        s, p, g = [lay.stride] * 2, [lay.padding] * 2, lay.groups
        want = F.conv2d(x, w, None, s, p, 1, g).shape
        assert torch.ops.vitrail.conv2d(x, w, None, s, p, p, [1, 1], None, g).shape == want
        assert (batch, lay.K, *lay.out_hw()) == tuple(want), lay.name
        case = bm.Case(network, lay, batch, "fprop")
        assert case.flops == 2.0 * want.numel() * w.shape[1] * lay.R * lay.S


def test_the_benchmark_registers_as_conv():
    from vitrail import ops
    registry = ops.load_benchmarks()
    b = registry["conv"]
    assert b.run is bm.run and b.build is bm.build
    assert b.by_name  # run when named, until the op's GPU tests all pass
    kinds = [c.kind for c in bm.cases()]
    assert len(kinds) == 4 * (23 + 31) + 3 * (8 + 10)  # no fused rows: ConvNeXt, MobileNetV2
    assert Counter(kinds) == {"fprop": 72, "dgrad": 72, "wgrad": 72, "fprop+bias+relu": 23,
                              "fprop+bias+silu": 31}


def test_the_no_gpu_build_list_is_what_the_rows_run():
    """operations(): each kind's kernel once. The persistent cooperative kernel for the fprop
    and dgrad of short GEMM K (ResNet's and ConvNeXt's layers of few channels: narrow tiles for
    their 64-channel sides, wide ones else, ResNet's fused relu); the non-persistent one for
    the rest: narrow tiles with a short pipeline where a 64-channel side meets a long K, the
    chunked wgrad (a deep pipeline) where a layer's dw is small against its batch, the one-pass
    wgrad where it fills the GPU (the cooperative one on the U-Net's 8x8 maps, of few pixels),
    the phased dgrad of the strided layers, the U-Net's silu, narrow tiles with a deep
    pipeline for its 8x8 maps (whose wide tiles would fill half the GPU). The depthwise layers take none (their kernels are NVRTC ones); the 3- and 4-channel
    layers take kernels of these (ResNet's 7x7/2 stem's dgrad the phased one with few stages,
    the U-Net's conv_out (K 4) the silu forward with few stages)."""
    ops = bm.operations()
    names = [op.name for op in ops]
    assert len(set(names)) == len(names) == 22
    ws, coop = "warpspecialized", "cooperative"
    assert {(op.kind, op.tile.tile_shape[:2], op.tile.stages, op.chunked or op.phased,
             op.epilogue.activation, op.tile.kernel_schedule) for op in ops} == {
        ("fprop", (128, 64), 0, False, None, coop), ("fprop", (128, 64), 0, False, "relu", coop),
        ("dgrad", (128, 64), 0, False, None, coop), ("fprop", (128, 128), 0, False, None, coop),
        ("fprop", (128, 128), 0, False, "relu", coop), ("dgrad", (128, 128), 0, False, None, coop),
        ("fprop", (128, 64), 3, False, None, ws), ("fprop", (128, 64), 3, False, "silu", ws),
        ("dgrad", (128, 64), 3, False, None, ws), ("dgrad", (128, 64), 3, True, None, ws),
        ("fprop", (128, 64), 0, False, None, ws), ("fprop", (128, 64), 0, False, "silu", ws),
        ("dgrad", (128, 64), 0, False, None, ws),
        ("fprop", (128, 128), 0, False, None, ws), ("fprop", (128, 128), 0, False, "relu", ws),
        ("fprop", (128, 128), 0, False, "silu", ws), ("dgrad", (128, 128), 0, False, None, ws),
        ("dgrad", (128, 128), 0, True, None, ws),
        ("wgrad", (64, 128), 0, True, None, ws), ("wgrad", (128, 128), 0, True, None, ws),
        ("wgrad", (128, 128), 0, False, None, ws), ("wgrad", (128, 128), 0, False, None, coop)}
    assert all(op.math.element_a == "bf16" for op in ops)


def test_every_layer_runs_the_3_and_4_channel_ones_zero_padded():
    """No layer is refused: the 3-channel stems and the U-Net's 4-channel conv_in and conv_out
    run on channels zero-padded to 8 (reasons judge the padded operands)."""
    refused = {(c.network, c.layer.name, c.kind): bm.refusal(c) for c in bm.cases()}
    assert not {k: why for k, why in refused.items() if why}
    stems = {(c.network, c.layer.name) for c in bm.cases() if c.layer.C % 8 or c.layer.K % 8}
    assert {("resnet50", "conv1"), ("unet", "conv_in"), ("unet", "conv_out"),
            ("convnext_t", "stem")} <= stems


def test_reasons_judge_what_the_kernels_get_on_meta_tensors():
    x, w = _meta(8, 64, 56, 56), _meta(128, 64, 3, 3)
    for kind in ("fprop", "dgrad", "wgrad"):  # dgrad at stride 2: the unit-stride kernel
        assert reasons(x, w, None, 2, 1, kind=kind) == []
    assert reasons(x, w, _meta(128), 1, 1, activation="silu") == []
    for kind in ("fprop", "dgrad", "wgrad"):  # two groups of 32 -> 32 channels: one kernel each
        assert reasons(_meta(8, 64, 8, 8), _meta(64, 32, 3, 3), groups=2, kind=kind) == []
    for kind in ("fprop", "dgrad", "wgrad"):  # depthwise, m = 1 and 2, odd channels too
        for c, k in ((64, 64), (64, 128), (13, 13)):
            assert reasons(_meta(8, c, 8, 8), _meta(k, 1, 3, 3), None, 2, 1, groups=c,
                           kind=kind) == []
    narrow = reasons(_meta(8, 64, 8, 8), _meta(64, 2, 3, 3), groups=32)  # 2 -> 2 a group
    assert len(narrow) == 1 and "the depthwise kernels groups of one input" in narrow[0]
    assert "use torch.nn.functional.conv2d" in narrow[0]
    four = [reasons(_meta(8, 64, 8, 8), _meta(64, 16, 3, 3), groups=4, kind=k)
            for k in ("fprop", "wgrad")]  # 16 -> 16 channels a group
    assert four == [[], []]
    assert "16 input and 4 output" in reasons(_meta(8, 64, 8, 8), _meta(16, 16, 3, 3),
                                              groups=4)[0]
    assert reasons(_meta(8, 12, 8, 8), _meta(64, 12, 3, 3), None, 1, 1) == []  # padded to 16
    assert reasons(_meta(8, 12, 8, 8), _meta(64, 12, 1, 1)) == []  # 1x1: vitrail's GEMM runs it
    with pytest.raises(TypeError, match="kind must be"):
        reasons(x, w, kind="bprop")


def _fake_timing(monkeypatch, ms: dict):
    """vitrail.profile.compare answering ``ms[impl]`` for each implementation it is given."""
    import vitrail.profile
    monkeypatch.setattr(vitrail.profile, "compare", lambda fns, **kw: {
        name: timing_from_samples([ms[name]]) for name in fns})


def _case(network, name, kind):
    batch, layers, _ = bm.NETWORKS[network]
    return bm.Case(network, next(lay for lay in layers if lay.name == name), batch, kind)


def test_a_refused_layer_is_a_row_with_its_reason_beside_cudnns(monkeypatch, capsys):
    _fake_timing(monkeypatch, {"cuDNN": 0.25})

    def never():
        raise AssertionError("a refused case is not called")
    monkeypatch.setattr(bm, "_calls", lambda case: (never, lambda: None))
    import importlib
    conv = importlib.import_module("vitrail.ops.conv")
    case = _case("resnet50", "conv1", "fprop")
    with monkeypatch.context() as m:  # reasons that refuse it (none of the layers has any)
        m.setattr(conv, "reasons", lambda *args, **kw: ["a reason", "another"])
        ours, theirs = bm.time_case(case)
    assert (ours.impl, ours.value, ours.ms, ours.baseline) == ("vitrail fprop", 0.0, None, False)
    assert ours.extra["refused"] == "a reason; another"
    assert (theirs.impl, theirs.baseline, theirs.ms) == ("cuDNN fprop", True, 0.25)
    assert theirs.value == pytest.approx(case.flops / 0.25e-3 / 1e12)
    assert "refused" in capsys.readouterr().out

    def refuses():  # the op's own refusal at its call (the GPU is not a Hopper, say)
        raise NotImplementedError("vitrail.ops.conv2d: the convolution kernels are sm_90a")
    monkeypatch.setattr(bm, "_calls", lambda case: (refuses, lambda: None))
    ours, _ = bm.time_case(_case("unet", "down0.res0.conv1", "wgrad"))
    assert ours.value == 0.0 and "sm_90a" in ours.extra["refused"]


def test_a_timed_case_rows_tflops_and_its_error_against_cudnn(monkeypatch):
    _fake_timing(monkeypatch, {"vitrail": 0.1, "cuDNN": 0.2})
    want = torch.ones(4, 4)
    monkeypatch.setattr(bm, "_calls", lambda case: (lambda: want * 1.01, lambda: want))
    case = _case("resnet50", "layer2.0.conv2", "dgrad")  # stride 2: one dgrad a phase
    ours, theirs = bm.time_case(case)
    assert ours.value == pytest.approx(case.flops / 0.1e-3 / 1e12)
    assert ours.extra["max_rel_err"] == pytest.approx(0.01)
    assert "4 unit-stride dgrads" in ours.extra["note"] and "note" not in theirs.extra
    assert ours.group == theirs.group == "resnet50 dgrad"
    assert ours.extra["geometry"]["stride"] == 2 and ours.extra["count"] == 1


def _rows(network, kind, timings):
    """Fake rows: {layer name: (vitrail ms or None for refused, cuDNN ms)}."""
    out = []
    for name, (ours, theirs) in timings.items():
        case = _case(network, name, kind)
        out.append(bm.row(case, bm.OURS, ours, **({} if ours else {"refused": "no"})))
        out.append(bm.row(case, bm.THEIRS, theirs))
    return out


def test_the_summary_per_network_and_kind():
    rows = _rows("resnet50", "fprop", {
        "conv1": (None, 1.0), "layer1.0.conv1": (1.0, 2.0),  # count 1, 2x
        "layer1.0.conv2": (2.0, 1.0),  # count 3, 0.5x: the worst
        "layer1.0.conv3": (1.0, 1.0)})  # count 4, 1x
    rows += _rows("resnet50", "wgrad", {"layer2.0.conv2": (1.0, 3.0)})
    rows += _rows("unet", "fprop", {"conv_in": (None, 1.0)})
    summary = bm.summarize(rows)
    assert [(e["network"], e["kind"]) for e in summary] == [
        ("resnet50", "fprop"), ("resnet50", "wgrad"), ("unet", "fprop")]
    fprop = summary[0]
    assert fprop["layers"] == 3 and fprop["refused"] == ["conv1"] and fprop["failed"] == []
    assert fprop["geomean"] == pytest.approx(1.0)  # 2 x 0.5 x 1
    assert (fprop["worst"], fprop["worst_layer"]) == (pytest.approx(0.5), "layer1.0.conv2")
    assert (fprop["best"], fprop["best_layer"]) == (pytest.approx(2.0), "layer1.0.conv1")
    assert fprop["at_or_above_1x"] == 2
    # the network's convs together: cuDNN 1*2 + 3*1 + 4*1 = 9 ms, vitrail 1*1 + 3*2 + 4*1 = 11
    assert fprop["weighted"] == pytest.approx(9 / 11)
    assert summary[1]["geomean"] == pytest.approx(3.0) and summary[1]["weighted"] == 3.0
    assert summary[2]["layers"] == 0 and summary[2]["refused"] == ["conv_in"]
    lines = bm.summary_lines(summary)
    assert "layer1.0.conv2; refused: conv1" in lines[1] and "1.00x" in lines[1]
    assert "0.82x" in lines[1] and "2/3" in lines[1]
    assert "none ran; refused: conv_in" in lines[3]


def test_the_runs_summary_has_one_entry_per_kind():
    """vitrail bench's own summary (vitrail.bench.report) pairs "vitrail KIND" with "cuDNN
    KIND" over both networks; refused rows enter no speedup."""
    from vitrail.bench import report
    rows = _rows("resnet50", "fprop", {"conv1": (None, 1.0), "layer1.0.conv1": (1.0, 2.0)})
    rows += _rows("unet", "fprop", {"down0.res0.conv1": (2.0, 1.0)})
    rows += _rows("unet", "dgrad", {"up1.upsample": (1.0, 1.5)})
    entries = report.summarize({"conv": rows})["conv"]
    got = {(e["impl"], e["baseline"]): e for e in entries}
    assert set(got) == {("vitrail fprop", "cuDNN fprop"), ("vitrail dgrad", "cuDNN dgrad")}
    fprop = got["vitrail fprop", "cuDNN fprop"]
    assert fprop["cases"] == 2 and math.isclose(fprop["geomean"], 1.0)
    assert fprop["min_case"].startswith("unet down0.res0.conv1")


def test_precompile_builds_conv2d_defaults_and_a_variant_tunes_from_a_shape():
    from vitrail.cli import _Usage, _load_ops, _select_ops, resolve_tune
    from vitrail.device import target_limits
    from vitrail.ops.conv import configs
    registry = _load_ops([])
    chosen = _select_ops(["conv2d"], registry, "precompile")
    assert {op.name for op in chosen} >= {v.name for v in configs.DEFAULTS}
    assert all(op.name.startswith("conv2d.") for op in chosen)
    lim = target_limits("90a")  # each default variant: the heuristic's every branch
    ws, coop = configs.SCHEDULES
    for v in configs.DEFAULTS:
        narrow = configs.NARROW[v.kind]
        # wgrad's chunks (partials) pick their problem by blockIdx.z: not the persistent kernel
        want = [(configs.WIDE, 0, ws), (narrow, 0, ws)] + \
            ([] if v.partials else [(configs.WIDE, 0, coop)]) if v.kind == "wgrad" else \
            [(configs.WIDE, 0, ws), (narrow, 0, coop), (narrow, 3, ws), (configs.WIDE, 0, coop),
             (narrow, 0, ws)]
        got = [(c["tile"], c["stages"], c["schedule"])
               for c in registry[v.name].default_configs(lim)]
        assert got == want, v.name
    with pytest.raises(_Usage, match="needs a variant.*PickBest.*precompile conv2d"):
        resolve_tune("conv2d", "8x8", None, False, registry)
    shaped, _ = resolve_tune("conv2d.dgrad.bf16", "32x64x56x56x64x3", None, False, registry)
    assert shaped.op is registry["conv2d.dgrad.bf16"]
    assert shaped.problem == configs.Problem("dgrad", 64, 64, 9, 32 * 56 * 56)
    assert shaped.op.space.default(shaped.problem, None)["tile"] == "128x64x64"  # C <= 64
    with pytest.raises(_Usage, match="NxCxHxWxKxR"):
        resolve_tune("conv2d.fprop.bf16", "8x8", None, False, registry)
    # a wgrad that conv2d runs in batch chunks tunes the chunked kernel, not the one-pass one
    with pytest.raises(_Usage, match=r"in \d+ chunks.*tune conv2d\.wgrad\.bf16\.partials"):
        resolve_tune("conv2d.wgrad.bf16", "128x64x56x56x64x3", None, False, registry)
    shaped, _ = resolve_tune("conv2d.wgrad.bf16.partials", "128x64x56x56x64x3", None, False,
                             registry)
    assert shaped.problem == configs.Problem("wgrad", 64, 64, 9, 128 * 56 * 56)
    shaped, _ = resolve_tune("conv2d.wgrad.bf16", "64x1024x14x14x1024x3", None, False,
                             registry)  # dw of 64 wide tiles, a batch of 64: one pass
    assert shaped.problem == configs.Problem("wgrad", 1024, 1024, 9, 64 * 14 * 14)


def test_a_depthwise_layer_runs_and_counts_its_groups_flops(monkeypatch):
    case = _case("mobilenet_v2", "features.4", "dgrad")  # 144 channels, stride 2
    assert bm.refusal(case) == "" and case.layer.label == "features.4 C144 56x56 K144 3x3/2 dw"
    assert case.layer.out_hw() == (28, 28)
    assert case.flops == 2.0 * 128 * 28 * 28 * 144 * 1 * 3 * 3  # one input channel a filter
    _fake_timing(monkeypatch, {"vitrail": 0.1, "cuDNN": 0.2})
    monkeypatch.setattr(bm, "_calls", lambda case: (lambda: torch.ones(2), lambda: torch.ones(2)))
    ours, theirs = bm.time_case(case)
    assert ours.extra["geometry"]["groups"] == 144 and "note" not in ours.extra  # no phases
    assert ours.group == "mobilenet_v2 dgrad" and ours.value == pytest.approx(2 * theirs.value)
