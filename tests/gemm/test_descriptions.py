"""CPU tests of the GEMM descriptions: validation, emitted C++, can_implement reasons."""
from __future__ import annotations

import pytest
import torch

from vitrail.gemm import (GemmOperation, LinearCombination, MathInstruction, TensorDescription,
                          TileDescription)
from vitrail.gemm.arguments import GemmArguments, describe


def make_op(dtype="bf16", layouts="rrr", epilogue=None, **tile):
    a, b, d = (("row" if x == "r" else "col") for x in layouts)
    return GemmOperation(A=TensorDescription(dtype, a), B=TensorDescription(dtype, b),
                         D=TensorDescription(epilogue.element_output if epilogue else dtype, d),
                         math=MathInstruction(dtype, dtype), tile=TileDescription(**tile),
                         epilogue=epilogue)


# ------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("kwargs, words", [
    (dict(tile_shape=(64, 128, 64)), "cooperative schedule splits tile M"),
    (dict(tile_shape=(256, 128, 64), kernel_schedule="pingpong"), "pingpong"),
    (dict(tile_shape=(128, 24, 64)), "tile N must be a multiple of 16"),
    (dict(cluster_shape=(3, 1, 1)), "powers of two"),
    (dict(cluster_shape=(4, 4, 1)), r"m \* n <= 8"),
    (dict(kernel_schedule="pingpong", tile_shape=(64, 128, 64), tile_scheduler="stream_k"),
     "stream-K scheduler needs the cooperative"),
    (dict(kernel_schedule="warp"), "kernel_schedule"),
    (dict(stages=1), "stages"),
    (dict(fp8_promotion="fast"), "fp8_promotion"),
    (dict(tile_shape=(128, 96, 128), fp8_promotion="overlapped"), "at least two slices"),
])
def test_tile_description_refuses(kwargs, words):
    with pytest.raises(ValueError, match=words):
        TileDescription(**kwargs)


def test_math_instruction_refuses():
    with pytest.raises(ValueError, match="do not pair"):
        MathInstruction("bf16", "f16")
    with pytest.raises(ValueError, match="use 'tf32'"):
        MathInstruction("f32", "f32")
    with pytest.raises(ValueError, match="SIMT is not implemented"):
        MathInstruction("bf16", "bf16", opcode_class="simt")
    with pytest.raises(ValueError, match="for FP8"):
        MathInstruction("bf16", "bf16", math_operation="multiply_add_fast_accum")
    with pytest.raises(ValueError, match="64 x N x 16"):
        MathInstruction("bf16", "bf16", instruction_shape=(64, 128, 32))
    assert MathInstruction("e4m3", "e5m2").k_step == 32
    assert MathInstruction("bf16", "bf16", instruction_shape=(64, 256, 16)).k_step == 16


def test_operation_refuses():
    with pytest.raises(ValueError, match="A must be 'row' and B 'col'"):
        make_op("tf32", "rrr", LinearCombination("f32"))
    with pytest.raises(ValueError, match="D.element=bf16 does not match"):
        GemmOperation(A=TensorDescription("bf16"), B=TensorDescription("bf16"),
                      D=TensorDescription("bf16"), math=MathInstruction("bf16", "bf16"),
                      epilogue=LinearCombination("f16"))
    with pytest.raises(ValueError, match="expected one of gemm, batched"):
        GemmOperation(A=TensorDescription("bf16"), B=TensorDescription("bf16"),
                      D=TensorDescription("bf16"), math=MathInstruction("bf16", "bf16"),
                      mode="arrays")
    with pytest.raises(ValueError, match="stream-K tile scheduler"):
        GemmOperation(A=TensorDescription("bf16"), B=TensorDescription("bf16"),
                      D=TensorDescription("bf16"), math=MathInstruction("bf16", "bf16"),
                      mode="split_k_serial")
    with pytest.raises(ValueError, match="shared memory"):
        make_op(tile_shape=(256, 256, 128))
    with pytest.raises(ValueError, match="multiple of 64 bytes"):
        make_op("e4m3", "rcr", LinearCombination("bf16"), tile_shape=(128, 128, 48))
    with pytest.raises(ValueError, match="16-byte alignment"):
        TensorDescription("bf16", alignment=4)
    with pytest.raises(ValueError, match="activation"):
        LinearCombination("bf16", activation="swish")
    with pytest.raises(ValueError, match="bias"):
        LinearCombination("bf16", bias="both")


# ---------------------------------------------------------------------------------- emitter
def test_emitted_source_plain():
    src = make_op().emit()
    assert 'extern "C" int vitrail_gemm(' in src
    assert 'extern "C" int64_t vitrail_gemm_workspace(' in src
    assert "KernelTmaWarpSpecializedCooperative" in src
    assert "using ElementC = void;" in src  # no source: C is never read
    assert "Sm90SrcFetch" not in src and "ActClamp" not in src
    assert "gemm_universal_adapter" not in src  # the minimal instantiation
    assert "Shape<_128, _128, _64>" in src and "PersistentScheduler" in src
    assert "cutlass::layout::RowMajor" in src


def test_emitted_source_fused():
    epi = LinearCombination("bf16", element_source="bf16", bias="col", activation="gelu_tanh",
                            clamp=True)
    op = make_op("f16", "rcc", epilogue=epi, tile_shape=(128, 256, 64), cluster_shape=(2, 1, 1),
                 tile_scheduler="stream_k")
    src = op.emit()
    assert "Sm90SrcFetch<cutlass::bfloat16_t>" in src
    assert "Sm90RowBroadcast<0, TileShape, cutlass::bfloat16_t" in src  # N values: a row
    assert "ActClamp<4, true>" in src
    assert "StreamKScheduler" in src and "Decomposition::SplitK" in src
    assert "using ElementA = cutlass::half_t;" in src
    assert "using LayoutB = cutlass::layout::ColumnMajor;" in src
    assert "Shape<_2, _1, _1>" in src
    assert op.name.endswith("lincomb_c_biascol_gelu_tanh_clamp")
    row = make_op(epilogue=LinearCombination("bf16", bias="row")).emit()
    assert "Sm90ColBroadcast<0, TileShape, cutlass::bfloat16_t" in row


def test_emitted_source_fp8_scales():
    epi = LinearCombination("bf16", scale_a="row", scale_b="tensor")
    op = GemmOperation(A=TensorDescription("e4m3", "row"), B=TensorDescription("e5m2", "col"),
                       D=TensorDescription("bf16"), math=MathInstruction(
                           "e4m3", "e5m2", math_operation="multiply_add_fast_accum"),
                       tile=TileDescription((128, 128, 128)), epilogue=epi)
    src = op.emit()
    assert "KernelTmaWarpSpecializedCooperativeFP8FastAccum" in src
    assert "cutlass::float_e4m3_t" in src and "cutlass::float_e5m2_t" in src
    assert "Sm90ColBroadcast<0, TileShape, float" in src  # row-wise scale_a: one per row
    assert "static_cast<float const*>(scale_b)" in src  # per-tensor scale_b: a device scalar
    with pytest.raises(ValueError, match="for FP8"):
        make_op(epilogue=LinearCombination("bf16", scale_a="tensor"))


def _fp8(math_operation="multiply_add", mode="gemm", **tile):
    return GemmOperation(A=TensorDescription("e4m3", "row"), B=TensorDescription("e4m3", "col"),
                         D=TensorDescription("bf16"), mode=mode,
                         math=MathInstruction("e4m3", "e4m3", math_operation=math_operation),
                         tile=TileDescription(**tile), epilogue=LinearCombination("bf16"))


def test_fp8_exact_takes_the_overlapped_promotion():
    """FP8 with exact accumulation runs vitrail's overlapped mainloop where the tile's N cuts into
    slices (of 64 columns, else two halves); fast accumulation, 16-bit types, stock requests,
    narrower tiles and the pointer-array mode keep CUTLASS's, and the name says so."""
    slices = {(128, 128, 128): 2, (128, 192, 128): 3, (64, 256, 128): 4, (128, 144, 128): 2,
              (128, 208, 128): 2}
    for shape, parts in slices.items():
        schedule = "pingpong" if shape[0] == 64 else "cooperative"
        op = _fp8(tile_shape=shape, kernel_schedule=schedule)
        assert op.overlapped_promotion and "_stockpromo" not in op.name
        src = op.emit()
        assert f"Sm90Fp8OverlappedPromotion<StockMainloop, {parts}, 4>" in src
        assert "#include <vitrail/sm90_fp8_mainloop.cuh>" in src
    stock = [_fp8(tile_shape=(128, 128, 128), fp8_promotion="stock"),
             _fp8(tile_shape=(128, 64, 128)),
             _fp8(tile_shape=(128, 128, 128), math_operation="multiply_add_fast_accum"),
             _fp8(tile_shape=(128, 128, 128), mode="array")]
    for op in stock:
        assert not op.overlapped_promotion
        assert "Sm90Fp8OverlappedPromotion" not in op.emit()
    assert [op.name.endswith("_stockpromo") or "_stockpromo_" in op.name for op in stock] == \
        [True, True, False, True]
    assert "Sm90Fp8OverlappedPromotion" not in make_op().emit()  # bf16
    with pytest.raises(ValueError, match="pointer-array"):
        _fp8(tile_shape=(128, 128, 128), mode="array", fp8_promotion="overlapped")


def test_sources_take_every_wgmma_n():
    """CuTe's wgmma selectors cut a tile N outside {8, 16, 32, 64, 96, 128, 192, 256} into
    narrower instructions (144 into 9 x n16) unless CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED is
    defined before its headers: a source whose MMAs take such an N defines it first (an FP8
    overlapped mainloop's slice too); the others leave its headers out (a slower front end)."""
    ext = "#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED"

    def grouped(n):
        return GemmOperation(A=TensorDescription("bf16", "row"),
                             B=TensorDescription("bf16", "row"),
                             D=TensorDescription("bf16", "row"),
                             math=MathInstruction("bf16", "bf16"),
                             tile=TileDescription((128, n, 64), (1, 1, 1)), mode="grouped")
    extended = [make_op(tile_shape=(128, 144, 64)), _fp8(tile_shape=(128, 144, 128)),
                _fp8(tile_shape=(128, 144, 128), mode="array"), grouped(144),
                _fp8(tile_shape=(128, 160, 128))]
    for op in extended:
        src = op.emit()
        assert src.index(ext) < src.index("#include"), op.name
    for op in [make_op(tile_shape=(128, 256, 64)), make_op(tile_shape=(64, 96, 64), kernel_schedule="pingpong"),
               _fp8(tile_shape=(128, 256, 128)), grouped(128)]:
        assert not any(n % 8 for n in op.wgmma_n)
        assert ext not in op.emit(), op.name


def test_distinct_configs_distinct_sources():
    ops = [make_op(), make_op(cluster_shape=(2, 1, 1)), make_op("f16"),
           make_op(layouts="crr"), make_op(epilogue=LinearCombination("bf16", activation="relu"))]
    assert len({op.key() for op in ops}) == len(ops)
    assert len({op.name for op in ops}) == len(ops)


# ---------------------------------------------------------------------------- can_implement
def args_for(op, a, b, d, **kw):
    L = a.shape[0] if a.dim() == 3 else 1
    return GemmArguments(A=describe(a, "a", op.A.layout), B=describe(b, "b", op.B.layout),
                         D=describe(d, "d", op.D.layout), M=a.shape[-2], N=b.shape[-1],
                         K=a.shape[-1], L=L, **kw)


def test_can_implement_accepts_and_reads_transposes():
    op = make_op(layouts="rcr")
    a = torch.randn(100, 64, dtype=torch.bfloat16)
    b = torch.randn(40, 64, dtype=torch.bfloat16).t()  # K x N, K contiguous: 'col'
    d = torch.empty(100, 40, dtype=torch.bfloat16)
    args = args_for(op, a, b, d)
    assert args.B.layout == "col" and args.B.ld == 64
    assert op.can_implement(args) == []


def test_can_implement_reasons():
    op = make_op()
    a = torch.randn(100, 64, dtype=torch.bfloat16)
    d = torch.empty(100, 40, dtype=torch.bfloat16)
    b_col = torch.randn(40, 64, dtype=torch.bfloat16).t()
    why = op.can_implement(args_for(op, a, b_col, d))
    assert len(why) == 1 and "B is col-major" in why[0] and "'row'" in why[0]

    b = torch.randn(64, 40, dtype=torch.bfloat16)
    odd = torch.randn(100, 70, dtype=torch.bfloat16)[:, :64]  # leading stride 70
    why = op.can_implement(args_for(op, odd, b, d))
    assert any("leading stride 70 is not a multiple of 8" in w for w in why)

    shifted = torch.randn(100 * 64 + 1, dtype=torch.bfloat16)[1:].view(100, 64)
    why = op.can_implement(args_for(op, shifted, b, d))
    assert any("not 16-byte aligned" in w for w in why)

    why = op.can_implement(args_for(op, a.half(), b, d))
    assert any("A has dtype f16, the operation takes bf16" in w for w in why)

    why = op.can_implement(args_for(op, a, b, d, splits=4))
    assert any("stream-K" in w for w in why)

    why = op.can_implement(args_for(op, a, b, d, swizzle=3, raster="diagonal"))
    assert any("swizzle=3 must be one of (1, 2, 4, 8)" in w for w in why)
    assert any("raster='diagonal' must be one of" in w for w in why)
    assert op.can_implement(args_for(op, a, b, d, swizzle=4, raster="along_n")) == []

    bias = torch.randn(40, dtype=torch.bfloat16)
    why = op.can_implement(args_for(op, a, b, d, bias=bias))
    assert any("epilogue has none" in w for w in why)

    with_bias = make_op(epilogue=LinearCombination("bf16", bias="row"))
    why = with_bias.can_implement(args_for(with_bias, a, b, d, bias=bias))
    assert any("must be 100 contiguous values" in w for w in why)
    assert with_bias.can_implement(args_for(with_bias, a, b, d,
                                            bias=torch.randn(100, dtype=torch.bfloat16))) == []

    a3 = torch.randn(1, 100, 64, dtype=torch.bfloat16).expand(3, 100, 64)
    b3 = torch.randn(3, 64, 40, dtype=torch.bfloat16)
    d3 = torch.empty(3, 100, 40, dtype=torch.bfloat16)
    why = op.can_implement(args_for(op, a3, b3, d3))
    assert any("broadcast over the batch" in w for w in why)
    assert op.can_implement(args_for(op, a3.contiguous(), b3, d3)) == []


def test_degenerate_dims_get_aligned_strides():
    op = make_op(layouts="rcr")
    a = torch.randn(1, 64, dtype=torch.bfloat16)  # one row: its row stride is never used
    b = torch.randn(64, 1, dtype=torch.bfloat16)  # one column: strides (1, 1)
    d = torch.empty(1, 1, dtype=torch.bfloat16)
    args = args_for(op, a, b, d)
    assert args.B.layout == "col" and args.B.ld % 8 == 0  # the aligned reading of (1, 1)
    assert op.can_implement(args) == []


def test_grouped_operation_emits_and_refuses():
    op = GemmOperation(A=TensorDescription("bf16", "row"), B=TensorDescription("bf16", "col"),
                       D=TensorDescription("bf16", "row"), math=MathInstruction("bf16", "bf16"),
                       tile=TileDescription((128, 256, 64), (2, 1, 1)), mode="grouped")
    src = op.emit()
    assert "GroupProblemShape" in src and "KernelPtrArrayTmaWarpSpecializedCooperative" in src
    assert "cutlass::layout::ColumnMajor*" in src and "kGrouped" in src
    assert 'extern "C" int vitrail_grouped_gemm(' in src
    assert "gemm_universal_adapter" not in src
    with pytest.raises(ValueError, match="'grouped' runs on the persistent tile scheduler"):
        GemmOperation(A=TensorDescription("bf16"), B=TensorDescription("bf16"),
                      D=TensorDescription("bf16"), math=MathInstruction("bf16", "bf16"),
                      tile=TileDescription(tile_scheduler="stream_k"), mode="grouped")
    with pytest.raises(ValueError, match="K-major"):
        GemmOperation(A=TensorDescription("e4m3"), B=TensorDescription("e4m3"),
                      D=TensorDescription("bf16"), math=MathInstruction("e4m3", "e4m3"),
                      tile=TileDescription((128, 128, 128)), mode="grouped")
    with pytest.raises(ValueError, match="D must be 'row'"):
        GemmOperation(A=TensorDescription("bf16"), B=TensorDescription("bf16"),
                      D=TensorDescription("bf16", "col"), math=MathInstruction("bf16", "bf16"),
                      mode="grouped")
    with pytest.raises(ValueError, match="source"):
        GemmOperation(A=TensorDescription("bf16"), B=TensorDescription("bf16"),
                      D=TensorDescription("bf16"), math=MathInstruction("bf16", "bf16"),
                      epilogue=LinearCombination("bf16", element_source="bf16"), mode="grouped")
    assert op.can_implement(object()) and "device arrays" in op.can_implement(object())[0]


def test_every_valid_config_of_the_space_emits():
    """What PickBest may compile: every config the constraints let through is a description
    that emits, and no two share a kernel name (the torch config aside: it compiles nothing)."""
    from vitrail.gemm.ops import configs, model
    from vitrail.gemm.ops.launch import op_for
    from vitrail.tune import limits
    lim = limits(arch="90a")
    for kind in configs.default_kinds():
        valid = configs.space(kind).valid(lim)
        assert model.TORCH_CONFIG in valid and op_for(kind).render(model.TORCH_CONFIG) is None
        valid.remove(model.TORCH_CONFIG)
        names = {configs.operation(kind, c).name for c in valid}
        assert len(names) == len(valid)
        for c in valid:
            assert "vitrail_gemm(" in configs.operation(kind, c).emit()


def test_host_arrays_are_refused_or_copied():
    from vitrail.gemm.arguments import as_cuda_tensor
    from vitrail.jit.errors import ArgumentError
    with pytest.raises(ArgumentError, match="a tensor on cpu"):
        as_cuda_tensor(torch.zeros(3), "a")
    with pytest.raises(ArgumentError, match="expected a torch tensor, a CuPy"):
        as_cuda_tensor([1, 2, 3], "b")


def test_scheduler_order_adds_no_tiles():
    """The default swizzle is the largest whose grid CUTLASS need not pad (a padded tile runs a
    whole mainloop on zeros); small grids get what CUTLASS would apply anyway."""
    from vitrail.gemm.arguments import _log_swizzle, round_up, scheduler_order
    big = make_op(tile_shape=(128, 256, 64), cluster_shape=(2, 1, 1))
    assert scheduler_order(big, 8192, 8192) == 8      # 64 x 32 tiles
    assert scheduler_order(big, 5000, 5000) == 4      # 40 x 20: 8 would pad 40 to 48 rows
    assert scheduler_order(big, 8000, 8000) == 8      # 63 x 32: the 2 x 1 cluster pads 63 anyway
    assert scheduler_order(big, 8400, 8192) == 1      # 66 x 32: any swizzle pads 66
    assert scheduler_order(big, 64, 8192) == 1        # one row of tiles
    for M in range(1, 6000, 97):
        for N in (64, 1000, 4096, 4097, 12288):
            s = scheduler_order(big, M, N)
            bm, bn = -(-M // 128), -(-N // 256)
            eff = 1 << _log_swizzle(bm, bn, s)
            assert round_up(bm, eff * 2) * bn == round_up(bm, 2) * bn, (M, N, s)
