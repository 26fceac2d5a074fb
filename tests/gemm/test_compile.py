"""Compile-only builds of three representative GEMM operations for sm_90a (CI has no GPU): the
torch op's default kernel (bf16, persistent, 2x1 cluster), a fused-epilogue kernel (fp16,
C + column bias + silu + clamp, B column-major, stream-K, a 144-wide tile: one m64n144
wgmma, not nine m64n16) and scaled_mm's default FP8 kernel with exact accumulation on the
overlapped-promotion mainloop (128x256 tiles). Built in parallel: three builds, about 80 s each
on one core."""
from __future__ import annotations

import re

import pytest

from tests.conftest import requires_nvcc


@pytest.mark.slow
@requires_nvcc
def test_compile_representative_operations(monkeypatch):
    monkeypatch.setenv("VITRAIL_ARCH", "90a")
    from vitrail.gemm import (GemmOperation, LinearCombination, MathInstruction,
                              TensorDescription, TileDescription, compile_many)
    from vitrail.gemm.ops.configs import Kind, Problem, default_kinds, operation
    from vitrail.gemm.ops.launch import op_for
    from vitrail.tune import limits

    lim = limits(arch="90a")
    op = op_for(default_kinds()[0])
    config = op.space.default(Problem(8192, 8192, 8192), lim)  # a kernel, not torch's matmul
    assert config.backend == "vitrail"
    plain = operation(default_kinds()[0], config)
    fused = GemmOperation(
        A=TensorDescription("f16", "row"), B=TensorDescription("f16", "col"),
        D=TensorDescription("f16", "row"), math=MathInstruction("f16", "f16"),
        tile=TileDescription((128, 144, 64), (1, 2, 1), tile_scheduler="stream_k"),
        epilogue=LinearCombination("f16", element_source="f16", bias="col",
                                   activation="silu", clamp=True))
    # scaled_mm's default (exact accumulation, row-wise scale_a): 128x256 tiles, whose 64 x 256
    # warpgroup accumulators and two rotating 64-column temporaries must fit without spilling
    fp8_kind = Kind("e4m3", "e4m3", "row", "col",
                    LinearCombination("bf16", scale_a="row", scale_b="tensor"))
    fp8 = operation(fp8_kind, op_for(fp8_kind).space.default(Problem(4096, 4096, 4096), lim))
    assert fp8.tile.tile_shape == (128, 256, 128)
    assert "Sm90Fp8OverlappedPromotion<StockMainloop, 4, 4>;" in fp8.emit()
    failures = compile_many([plain, fused, fp8], arch="90a", max_workers=2)
    assert not failures, failures
    mod = fp8.compile(arch="90a")
    # the promotions overlap the wgmma: waits for all but the newest group, no serialized wgmma
    # (ptxas C7514, C7520, ...), no accumulator in local memory
    assert "wgmma.wait_group.sync.aligned 1" in mod.ptx
    assert "wgmma.mma_async instructions are serialized" not in mod.log, mod.log
    assert all(r.stack == 0 for r in mod.resources().values()), mod.resources()
    wgmma = {g: set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)",
                               g.compile(arch="90a").ptx)) for g in (plain, fused)}
    assert wgmma == {plain: {"m64n256k16"}, fused: {"m64n144k16"}}, wgmma
    # silu's division is the fast one: an IEEE division per element branches to a slow path
    # (a CALL in the SASS) and kept ptxas from interleaving the epilogue's elements
    assert "div.rn.f32" not in fused.compile(arch="90a").ptx
    for g in (plain, fused, fp8):
        mod = g.compile(arch="90a")  # from the cache now
        assert mod.how == "disk"
        assert "wgmma.mma_async" in mod.ptx and "cp.async.bulk.tensor" in mod.ptx
        res = mod.resources()
        kernel = [r for name, r in res.items() if "GemmUniversal" in name]
        assert kernel and not any(r.spills for r in kernel), res
        run = mod.function("vitrail_gemm")  # the entry points load and check (no GPU needed)
        mod.function("vitrail_gemm_workspace")
        args = [16, 32, 48, 64, 0, 0, 0, 128, 128, 128, 1, 128, 0, 128, 0, 128, 0, 128, 0, 0,
                1.0, 0.0, 0.01, float("-inf"), float("inf"), 1, 8, 0, 0, 0, 132]
        assert run(*args[:7], 0, *args[8:], stream=0) == -3  # M = 0
        assert run(17, *args[1:], stream=0) == -1  # A not 16-byte aligned
        assert run(*args[:11], 100, *args[12:], stream=0) == -2  # lda not 16 bytes' multiple
    assert op.module(config).key == plain.compile(arch="90a").key  # the op's kernel is this one
