"""ConvOperation without a GPU or a compiler: what it refuses and why, what it emits, the runtime
checks (can_implement) on tensors' shapes and strides, and the torch ops' fake shapes."""
from __future__ import annotations

import pytest
import torch

from vitrail.gemm import (Conv2dProblem, ConvArguments, ConvOperation, LinearCombination,
                          MathInstruction, TensorDescription, TileDescription)
from vitrail.gemm.conv import default_tile


def _op(kind="fprop", el="bf16", tile=None, chunked=False, out=None, phased=False, **epi):
    t = TensorDescription(el)
    return ConvOperation(kind, t, t, TensorDescription(out or el), MathInstruction(el, el),
                         tile or default_tile(), LinearCombination(out or el, **epi),
                         chunked=chunked, phased=phased)


@pytest.mark.parametrize("change, says", [
    (dict(kind="conv"), "kind"),
    (dict(tile=TileDescription((128, 128, 64), kernel_schedule="pingpong")), "'cooperative'"),
    (dict(bias="row"), "bias='col'"),
    (dict(kind="wgrad", bias="col"), "wgrad takes no bias"),
    (dict(kind="fprop", chunked=True), "wgrad only"),
    (dict(kind="wgrad", chunked=True, element_source="bf16"), "wgrad only"),
])
def test_refusals_say_what_to_change(change, says):
    with pytest.raises(ValueError, match=says):
        _op(**change)


def test_16_bit_operands_or_tf32_for_fprop():
    t = TensorDescription("tf32")
    op = ConvOperation("fprop", t, t, TensorDescription("f32"), MathInstruction("tf32", "tf32"),
                       default_tile(), LinearCombination("f32"))
    source = op.emit()
    assert "using ElementA = float;" in source and "using ElementD = float;" in source
    assert "conv2d_fprop_tf32_f32_" in op.name
    p = Conv2dProblem(2, 8, 8, 16, 32, 3, 3, pad=(1, 1))
    f32 = dict(dtype=torch.float32)  # TF32's operands are fp32 tensors
    x, w, y = _nhwc(2, 8, 8, 16, **f32), _nhwc(32, 3, 3, 16, **f32), _nhwc(2, 8, 8, 32, **f32)
    assert op.can_implement(_args("fprop", p, x, w, y)) == []
    why = op.can_implement(_args("fprop", p, x.bfloat16(), w, y))
    assert any("A has dtype bf16, the operation takes f32" in r for r in why), why
    for kind, which in (("dgrad", "filter is"), ("wgrad", "operands are")):
        with pytest.raises(ValueError, match=f"K-major, and {kind}'s {which} not"):
            ConvOperation(kind, t, t, TensorDescription("f32"),
                          MathInstruction("tf32", "tf32"), default_tile(),
                          LinearCombination("f32"))
    e = TensorDescription("e4m3")
    with pytest.raises(ValueError, match="bf16 or fp16 operands"):
        ConvOperation("fprop", e, e, TensorDescription("bf16"), MathInstruction("e4m3", "e4m3"),
                      default_tile(), LinearCombination("bf16"))


def test_the_cooperative_schedule():
    """kernel_schedule='cooperative': the conv mainloop under the GEMM's persistent cooperative
    kernel (two consumer warpgroups on a 128- or 256-row tile); refused where a launch picks
    its problem by blockIdx.z (chunked wgrad, phased dgrad)."""
    coop = TileDescription((128, 128, 64), kernel_schedule="cooperative")
    for kind in ("fprop", "dgrad", "wgrad"):
        op = _op(kind, tile=coop)
        source = op.emit()
        assert op.name.endswith("_coop_lincomb") and op.name != _op(kind).name
        assert "#include <vitrail/sm90_conv_cooperative.cuh>" in source
        assert "vitrail::conv::CooperativeKernel<ProblemShape" in source
        assert "cutlass::epilogue::TmaWarpSpecializedCooperative" in source
        assert "ConvUniversal" not in source
        assert "GemmUniversalMode::kGemm" in source
    assert "ConvUniversal" in _op("fprop").emit()
    with pytest.raises(ValueError, match="tile M must be 128 or 256"):
        TileDescription((64, 128, 64), kernel_schedule="cooperative")
    for change in (dict(kind="wgrad", chunked=True), dict(kind="dgrad", phased=True)):
        with pytest.raises(ValueError, match="persistent kernel cannot"):
            _op(tile=coop, **change)


def test_one_warpgroup_tiles():
    with pytest.raises(ValueError, match="tile M must be 64 or 128"):
        TileDescription((256, 128, 64), kernel_schedule="warpspecialized")
    assert TileDescription((64, 128, 64), kernel_schedule="warpspecialized").threads == 256


def test_layout_and_spatial_dims_are_checked():
    t, col = TensorDescription("f16"), TensorDescription("f16", "col")
    with pytest.raises(ValueError, match="channels-last"):
        ConvOperation("fprop", col, t, t, MathInstruction("f16", "f16"), default_tile())
    with pytest.raises(ValueError, match="2-D"):
        ConvOperation("fprop", t, t, t, MathInstruction("f16", "f16"), default_tile(),
                      spatial_dims=3)


def test_gemm_operations_refuse_the_conv_schedule():
    from vitrail.gemm import GemmOperation
    t = TensorDescription("bf16")
    with pytest.raises(ValueError, match="convolutions"):
        GemmOperation(t, t, t, MathInstruction("bf16", "bf16"),
                      TileDescription((128, 128, 64), kernel_schedule="warpspecialized"))


@pytest.mark.parametrize("kind, operator, layout, tile_n", [
    ("fprop", "kFprop", "TensorNHWC", "_128,"), ("dgrad", "kDgrad", "TensorNHWC", "_128,"),
    ("wgrad", "kWgrad", "TensorKCSR", "Shape<_128>,")])
def test_emission(kind, operator, layout, tile_n):
    src = _op(kind).emit()
    assert f"cutlass::conv::Operator::{operator}" in src
    assert f"using LayoutOut = cutlass::layout::{layout};" in src
    assert f"using TileShape = Shape<_128, {tile_n} Shape<_64>>;" in src
    assert "cutlass::conv::KernelImplicitTmaWarpSpecializedSm90" in src
    assert "cudaLaunchKernelEx" in src and 'extern "C" int vitrail_conv(' in src
    assert ("return -7;" in src) == (kind == "dgrad")
    assert "vitrail_conv_chunks" not in src and "vitrail_conv_phases" not in src
    assert "if (splits != 1 || phases != nullptr) return -9;" in src
    fused = _op(kind, activation="gelu").emit()
    assert "vitrail_epi::ActClamp<3, false>" in fused
    if kind == "fprop":
        assert "Sm90RowBroadcast" in _op(kind, bias="col").emit()


def test_a_chunked_wgrad_launches_every_chunk_in_one_grid():
    from vitrail.gemm.conv_arguments import MAX_CHUNKS
    op = _op("wgrad", chunked=True, out="f32")
    src = op.emit()
    assert op.name.endswith("_chunked") and op.name != _op("wgrad", out="f32").name
    assert f"constexpr int kMaxChunks = {MAX_CHUNKS};" in src
    assert "op(params.chunk[blockIdx.z], smem);" in src
    assert "config.gridDim.z = splits;" in src
    assert "cudaLaunchKernelEx(&config, vitrail_conv_chunks, params)" in src
    assert "device_kernel<GemmKernel>" not in src  # one kernel: the chunked one


def test_a_phased_dgrad_launches_every_stride_phase_in_one_grid():
    from vitrail.gemm.conv_arguments import MAX_CHUNKS, PHASE_VALUES
    op = ConvOperation("dgrad", TensorDescription("bf16"), TensorDescription("bf16"),
                       TensorDescription("bf16"), MathInstruction("bf16", "bf16"),
                       TileDescription((128, 128, 64), kernel_schedule="warpspecialized"),
                       phased=True)
    src = op.emit()
    assert op.name.endswith("_phased")
    assert f"constexpr int kMaxPhases = {MAX_CHUNKS};" in src
    assert f"constexpr int kPhaseValues = {len(PHASE_VALUES)};" in src
    assert "op(params.phase[blockIdx.z], smem);" in src
    assert "cudaLaunchKernelEx(&config, vitrail_conv_phases, params)" in src
    assert "device_kernel<GemmKernel>" not in src and "vitrail_conv_chunks" not in src
    for bad in (dict(kind="fprop"), dict(kind="dgrad", element_source="bf16")):
        with pytest.raises(ValueError, match="phased"):
            _op(phased=True, **bad)
    with pytest.raises(ValueError, match="cluster"):
        ConvOperation("dgrad", TensorDescription("bf16"), TensorDescription("bf16"),
                      TensorDescription("bf16"), MathInstruction("bf16", "bf16"),
                      TileDescription((128, 128, 64), (2, 1, 1),
                                      kernel_schedule="warpspecialized"), phased=True)


def test_problem_extents():
    p = Conv2dProblem(2, 33, 7, 16, 32, 3, 3, pad=(1, 1), stride=(2, 2), dilation=(1, 2))
    assert (p.P, p.Q) == (17, 3)
    y = torch.nn.functional.conv2d(torch.zeros(2, 16, 33, 7), torch.zeros(32, 16, 3, 3),
                                   stride=2, padding=1, dilation=(1, 2))
    assert tuple(y.shape[2:]) == (p.P, p.Q)
    assert p.gemm_shape("fprop") == (2 * 17 * 3, 32, 9 * 16)
    assert p.gemm_shape("wgrad") == (32, 9 * 16, 2 * 17 * 3)


def _nhwc(n, h, w, c, dtype=torch.bfloat16):
    return torch.zeros(n, c, h, w, dtype=dtype).to(memory_format=torch.channels_last) \
        .permute(0, 2, 3, 1)


def _args(kind, problem, x, w, y, **kw):
    return ConvArguments(problem, x, w, y, kind=kind, **kw)


def test_can_implement_reasons():
    op = _op("fprop")
    p = Conv2dProblem(2, 8, 8, 16, 32, 3, 3, pad=(1, 1))
    ok = _args("fprop", p, _nhwc(2, 8, 8, 16), _nhwc(32, 3, 3, 16), _nhwc(2, 8, 8, 32))
    assert op.can_implement(ok) == []
    odd = Conv2dProblem(2, 8, 8, 12, 32, 3, 3, pad=(1, 1))
    why = op.can_implement(_args("fprop", odd, _nhwc(2, 8, 8, 12), _nhwc(32, 3, 3, 12),
                                 _nhwc(2, 8, 8, 32)))
    assert any("C (input channels)=12 is not a multiple of 8" in w for w in why), why
    nchw = torch.zeros(2, 16, 8, 8, dtype=torch.bfloat16).permute(0, 2, 3, 1)
    why = op.can_implement(_args("fprop", p, nchw, _nhwc(32, 3, 3, 16), _nhwc(2, 8, 8, 32)))
    assert any("channels-last" in w for w in why), why
    big = Conv2dProblem(1, 8, 8, 16, 16, 3, 3, pad=(300, 1))
    why = op.can_implement(_args("fprop", big, _nhwc(1, 8, 8, 16), _nhwc(16, 3, 3, 16),
                                 _nhwc(1, 606, 8, 16)))
    assert any("outside [0, 256]" in w for w in why), why
    wide = Conv2dProblem(1, 8, 300, 16, 16, 1, 3, dilation=(1, 130))
    why = op.can_implement(_args("fprop", wide, _nhwc(1, 8, 300, 16), _nhwc(16, 1, 3, 16),
                                 _nhwc(1, 8, 40, 16)))
    assert any("filter offsets below 255" in w for w in why), why
    dgrad = _op("dgrad")
    strided = Conv2dProblem(2, 8, 8, 16, 32, 3, 3, pad=(1, 1), stride=(2, 2))
    why = dgrad.can_implement(_args("dgrad", strided, _nhwc(2, 8, 8, 16), _nhwc(32, 3, 3, 16),
                                    _nhwc(2, 4, 4, 32)))
    assert any("unit stride only" in w for w in why), why
    why = _op("fprop", bias="col").can_implement(ok)
    assert any("none is given" in w for w in why), why
    why = _op("wgrad").can_implement(_args("wgrad", p, _nhwc(2, 8, 8, 16), _nhwc(32, 3, 3, 16),
                                           _nhwc(2, 8, 16, 32)[:, :, :8]))
    assert any("must be packed" in w for w in why), why
    chunked = _op("wgrad", chunked=True, out="f32")
    x, dy = _nhwc(6, 8, 8, 16), _nhwc(6, 8, 8, 32)
    p6 = Conv2dProblem(6, 8, 8, 16, 32, 3, 3, pad=(1, 1))

    def partials(rows):
        return torch.zeros(rows, 3, 3, 16)
    assert chunked.can_implement(_args("wgrad", p6, x, partials(3 * 32), dy, splits=3)) == []
    for splits, rows, says in ((4, 4 * 32, "leave the last empty"),  # chunks of 2: 3 of them
                               (3, 32, "D has 32 rows; 3 chunks of K=32 take 96"),
                               (21, 21 * 32, "at most 20 chunks")):
        why = chunked.can_implement(_args("wgrad", p6, x, partials(rows), dy, splits=splits))
        assert any(says in w for w in why), (splits, why)
    why = _op("wgrad").can_implement(_args("wgrad", p6, x, _nhwc(32, 3, 3, 16), dy, splits=2))
    assert any("only a chunked wgrad kernel" in w for w in why), why
    expanded = _nhwc(1, 8, 8, 16).expand(2, 8, 8, 16)  # stride 0 along N
    why = op.can_implement(_args("fprop", p, expanded, _nhwc(32, 3, 3, 16), _nhwc(2, 8, 8, 32)))
    assert any("A has a stride of 0" in w and "pass a copy" in w for w in why), why


def test_an_expanded_input_is_copied_for_the_kernel(monkeypatch):
    """conv2d on x broadcast over the batch (stride 0): a channels-last copy with one warning,
    not TMA's refusal of a zero stride; a channels-last tensor is taken as it is."""
    import importlib
    conv = importlib.import_module("vitrail.ops.conv")
    monkeypatch.setattr("vitrail.gemm.ops.operands._WARNED", set())  # warnings said once
    x = torch.randn(1, 16, 5, 5).contiguous(memory_format=torch.channels_last)
    assert conv._channels_last(x, "x") is x
    wide = x.expand(3, -1, -1, -1)
    with pytest.warns(UserWarning, match="x is expanded"):
        copied = conv._channels_last(wide, "x")
    assert copied.stride(0) > 0 and copied.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(copied, wide)


def test_fake_shapes_on_meta_tensors():
    import importlib
    importlib.import_module("vitrail.ops.conv")  # registers the custom ops
    x = torch.empty(2, 16, 33, 7, device="meta", dtype=torch.bfloat16)
    w = torch.empty(32, 16, 3, 3, device="meta", dtype=torch.bfloat16)
    y = torch.ops.vitrail.conv2d(x, w, None, [2, 2], [1, 1], [1, 1], [1, 2], "relu")
    assert tuple(y.shape) == (2, 32, 17, 3)
    assert y.is_contiguous(memory_format=torch.channels_last)
    dx = torch.ops.vitrail.conv2d_dgrad(y, w, [33, 7], [2, 2], [1, 1], [1, 1], [1, 2])
    assert tuple(dx.shape) == tuple(x.shape)
    dw = torch.ops.vitrail.conv2d_wgrad(y, x, [3, 3], [2, 2], [1, 1], [1, 1], [1, 2])
    assert tuple(dw.shape) == tuple(w.shape)
    wg = torch.empty(32, 4, 3, 3, device="meta", dtype=torch.bfloat16)  # groups=4
    yg = torch.ops.vitrail.conv2d(x, wg, None, [1, 1], [1, 1], [1, 1], [1, 1], None, 4)
    assert tuple(yg.shape) == (2, 32, 33, 7)
    assert tuple(torch.ops.vitrail.conv2d_dgrad(yg, wg, [33, 7], [1, 1], [1, 1], [1, 1],
                                                [1, 1], 4).shape) == tuple(x.shape)
    assert tuple(torch.ops.vitrail.conv2d_wgrad(yg, x, [3, 3], [1, 1], [1, 1], [1, 1], [1, 1],
                                                4).shape) == tuple(wg.shape)


def test_public_function_refusals():
    from vitrail.jit.errors import ArgumentError
    from vitrail.ops import conv2d
    x = torch.zeros(1, 16, 8, 8, dtype=torch.bfloat16)
    with pytest.raises(ArgumentError, match="x must be on a CUDA device"):
        conv2d(x, torch.zeros(16, 16, 3, 3, dtype=torch.bfloat16))


def test_strides_of_size_one_dimensions_are_made_packed():
    """torch keeps a (K, C, 1, 1) channels-last filter's NCHW strides (16, 1, 1, 1); TMA checks
    every stride, so size-1 dimensions get the strides a packed tensor would have."""
    import torch
    from vitrail.gemm.conv_arguments import strides
    w = torch.randn(24, 16, 1, 1).contiguous(memory_format=torch.channels_last)
    nhwc = w.permute(0, 2, 3, 1)
    assert nhwc.stride() == (16, 1, 1, 1)
    assert strides(nhwc) == (16, 16, 16, 1)
    x = torch.randn(2, 16, 7, 1).contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1)
    assert strides(x) == x.stride()  # nothing to change where no dimension has size 1
    view = torch.randn(2, 9, 1, 40)[..., :32]  # a strided view: its real strides stay
    assert strides(view) == (360, 40, 32, 1)  # the real strides stay; size 1: packed
