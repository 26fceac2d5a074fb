"""Modes split_k_parallel and array, and the accurate fp32 (3xTF32) operation: descriptions
validate and emit, can_implement gives reasons (CPU); one compile-only build (split_k_parallel,
~40 s); values against an fp64 reference on odd shapes (GPU)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import requires_gpu, requires_nvcc
from vitrail.gemm import (GemmArguments, GemmOperation, LinearCombination, MathInstruction,
                          TensorDescription, TileDescription)
from vitrail.gemm.arguments import ArrayArguments, _common_layout
from vitrail.gemm.accurate import AccurateF32Operation

pytestmark = pytest.mark.warm_cache


def op_of(mode, epilogue=None, el="bf16", lb="col", **tile):
    return GemmOperation(A=TensorDescription(el, "row"), B=TensorDescription(el, lb),
                         D=TensorDescription(el, "row"), math=MathInstruction(el, el),
                         tile=TileDescription((128, 128, 64), **tile), mode=mode,
                         epilogue=epilogue)


SKP = op_of("split_k_parallel", LinearCombination("bf16", element_source="bf16", bias="col",
                                                  activation="gelu", clamp=True))
ARRAY = op_of("array", LinearCombination("bf16", element_source="bf16"))


# ------------------------------------------------------------------------------ CPU tests
def test_split_k_parallel_description_and_source():
    src = SKP.emit()
    assert SKP.name.endswith("_skp")
    assert "static int vitrail_partial_gemm(" in src and 'extern "C" int vitrail_gemm(' in src
    assert "reduce_slices" in src and "x = vitrail_act::apply<Act>(x, slope);" in src
    assert src.count('extern "C"') == 2  # the partial GEMM's entry points are static
    with pytest.raises(ValueError, match="persistent tile scheduler"):
        op_of("split_k_parallel", tile_scheduler="stream_k")


def operand(ptr, dtype, rows, cols, ld, layout="row"):
    from vitrail.gemm.arguments import Operand
    return Operand(ptr, dtype, rows, cols, layout, ld, ld * rows, (ld, 1))


def test_split_k_parallel_reasons():
    plain = op_of("split_k_parallel")
    args = GemmArguments(A=operand(0, "bf16", 64, 4096, 4096),
                         B=operand(0, "bf16", 4096, 64, 4096, "col"),
                         D=operand(0, "bf16", 64, 64, 64), M=64, N=64, K=4096, L=1, splits=8)
    assert plain.can_implement(args) == []
    args.L = 2
    assert any("split_k_parallel' takes one problem" in r for r in plain.can_implement(args))
    args.L, args.splits = 1, 0
    assert any("splits=0 must be >= 1" in r for r in plain.can_implement(args))
    persistent = op_of("gemm")
    args.splits = 4
    assert any("needs the stream-K tile scheduler or mode 'split_k_parallel'" in r
               for r in persistent.can_implement(args))


def test_array_description_source_and_reasons():
    src = ARRAY.emit()
    assert "ArrayProblemShape" in src and "KernelPtrArrayTmaWarpSpecializedCooperative" in src
    assert "kArray" in src and ARRAY.name.endswith("_array")
    for epi, what in ((LinearCombination("bf16", bias="col"), "bias"),
                      (LinearCombination("bf16", activation="relu"), "activation")):
        with pytest.raises(ValueError, match=f"mode 'array'.*{what}"):
            op_of("array", epi)
    a = [torch.randn(7, 16).bfloat16() for _ in range(3)]
    b = [torch.randn(24, 16).bfloat16().t() for _ in range(3)]  # column-major K x N
    d = [torch.empty(7, 24).bfloat16() for _ in range(3)]
    c = [torch.empty(7, 24).bfloat16() for _ in range(3)]

    def args_of(a, b, d, c):
        lay = [_common_layout(x, w) for x, w in ((a, "row"), (b, "col"), (c, "row"),
                                                  (d, "row"))]
        return ArrayArguments(A=a, B=b, D=d, C=c, M=7, N=24, K=16,
                              lds=tuple(x[0] for x in lay), layouts=tuple(x[1] for x in lay))
    why = ARRAY.can_implement(args_of(a, b, d, c))
    assert why == [] or all("aligned" in w for w in why), why  # CPU allocations are aligned
    bad = ARRAY.can_implement(args_of(a, [y.t().contiguous() for y in b], d, None))
    assert any("B is row-major" in r for r in bad) and any("reads C" in r for r in bad)
    mixed = ARRAY.can_implement(args_of(a[:2] + [torch.randn(7, 24).bfloat16()[:, :16]], b, d, c))
    assert any("differ in layout or leading stride" in r for r in mixed)
    assert ARRAY.can_implement("not arguments")[0].startswith("mode 'array' takes")


def test_accurate_f32_description():
    op = AccurateF32Operation("row", "col")
    src = op.emit()
    assert "OpMultiplyAddFastF32" in src and "cutlass::arch::Sm80" in src
    assert op.name == "gemm_f32x3_rcr_128x128x32_w64x32_s3_sm80"
    with pytest.raises(ValueError, match="layout_a"):
        AccurateF32Operation("diag")
    with pytest.raises(ValueError, match="warp tile"):
        AccurateF32Operation(warp_shape=(48, 32, 32))


@pytest.mark.slow
@requires_nvcc
def test_compile_split_k_parallel(monkeypatch):
    """The one compile-only build of this file: the GEMM of the slices (wgmma, TMA) and the
    reduction kernel in one library, no spills."""
    monkeypatch.setenv("VITRAIL_ARCH", "90a")
    mod = SKP.compile(arch="90a")
    assert "wgmma.mma_async" in mod.ptx and "cp.async.bulk.tensor" in mod.ptx
    res = mod.resources()
    assert any("reduce_slices" in name for name in res)
    assert not any(r.spills for r in res.values()), res
    run = mod.function("vitrail_gemm")
    mod.function("vitrail_gemm_workspace")
    args = [16, 32, 48, 64, 0, 0, 0, 128, 128, 128, 1, 128, 0, 128, 0, 128, 0, 128, 0, 0,
            1.0, 0.0, 0.01, float("-inf"), float("inf"), 4, 8, 0, 0, 0, 132]
    assert run(*args[:7], 0, *args[8:], stream=0) == -3  # M = 0
    assert run(*args[:10], 2, *args[11:], stream=0) == -3  # L = 2


# ------------------------------------------------------------------------------ GPU tests
SHAPES = [(1, 1, 1), (7, 7, 7), (1000, 7, 4097), (7, 1000, 1000), (64, 72, 4097)]


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda").to(dtype)


def check(out, ref64, dtype, k):
    """Error against fp64 within a few ulps of the output plus the fp32 accumulation's."""
    assert not torch.isnan(out).any(), "NaN in the output (an element was not written)"
    scale = ref64.abs().max().item() + 1e-6
    ulp = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -22}
    err = (out.double() - ref64).abs().max().item()
    assert err <= 2 * ulp[dtype] * scale + 2.0 ** -22 * k ** 0.5 * scale, (err, scale)


def with_pitch(rows, cols, dtype):
    """A padded (rows, cols) view: leading stride a multiple of 16 bytes."""
    align = 16 // torch.empty((), dtype=dtype).element_size()
    return rand(rows, (cols + align - 1) // align * align, dtype=dtype)[:, :cols]


@requires_gpu
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_split_k_parallel_values(M, N, K, splits):
    from vitrail.gemm.ops.reference import gemm_reference
    a = with_pitch(M, K, torch.bfloat16)
    b = with_pitch(N, K, torch.bfloat16).t()
    c = with_pitch(M, N, torch.bfloat16)
    bias = rand(N)
    d = with_pitch(M, N, torch.bfloat16).fill_(float("nan"))
    args = GemmArguments.from_tensors(SKP, a, b, d, c=c, bias=bias, alpha=0.5, beta=-1.5,
                                      lo=-2.0, hi=3.0, splits=splits)
    assert SKP.can_implement(args) == []
    SKP.run(args)
    ref = gemm_reference(a, b, c, alpha=0.5, beta=-1.5, bias=bias, activation_name="gelu",
                         clamp_min=-2.0, clamp_max=3.0, compute_dtype=torch.float64,
                         out_dtype=torch.float64)
    torch.cuda.synchronize()
    check(d, ref, torch.bfloat16, K)


@requires_gpu
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("L", [1, 3])
def test_array_values(M, N, K, L):
    a = [with_pitch(M, K, torch.bfloat16) for _ in range(L)]
    b = [with_pitch(N, K, torch.bfloat16).t() for _ in range(L)]
    # every matrix of a list shares one leading stride: padded views of equal shapes do
    c = [with_pitch(M, N, torch.bfloat16) for _ in range(L)]
    d = [with_pitch(M, N, torch.bfloat16).fill_(float("nan")) for _ in range(L)]
    args = ArrayArguments.from_tensors(ARRAY, a, b, d, c=c, alpha=2.0, beta=0.5)
    assert ARRAY.can_implement(args) == []
    ARRAY.run(args)
    outs = args.sync()
    for x, y, z, o in zip(a, b, c, outs):
        ref = 2.0 * (x.double() @ y.double()) + 0.5 * z.double()
        check(o, ref, torch.bfloat16, K)


@requires_gpu
def test_array_refuses_with_reasons():
    from vitrail.jit.errors import ArgumentError
    a = [rand(64, 64), rand(64, 64)]
    b = [rand(64, 64).t(), rand(64, 64)]  # the second is row-major
    args = ArrayArguments.from_tensors(ARRAY, a, b, c=[rand(64, 64)] * 2)
    with pytest.raises(ArgumentError, match="differ in layout"):
        ARRAY.run(args)
    with pytest.raises(ArgumentError, match=r"b\[1\] has shape"):
        ArrayArguments.from_tensors(ARRAY, a, [b[0], rand(32, 64)])
