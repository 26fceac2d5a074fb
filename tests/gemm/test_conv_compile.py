"""Compile-only builds of the convolutions for sm_90a (CI has no GPU): two of the kernels
vitrail.ops.conv2d runs for bf16, fprop with its bias and relu fused, and the chunked wgrad
(the batch in chunks in one launch, fp32 partials), the fp32 fprop as TF32, and the bf16
fprop on the persistent cooperative kernel (sm90_conv_cooperative.cuh): each on TMA
(im2col for the activation) and wgmma, without spills, and the entry point's checks. Two
builds at a time, about 60 s each on one core (CI's budget: no more conv builds than these;
dgrad and the one-pass wgrad build on the GPU machine, in tests/ops/test_conv.py, and in
`vitrail bench conv --compile-only`)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.conftest import requires_nvcc


@pytest.mark.slow
@requires_nvcc
def test_compile_representative_convolutions(monkeypatch):
    monkeypatch.setenv("VITRAIL_ARCH", "90a")
    from vitrail.gemm import (ConvOperation, LinearCombination, MathInstruction,
                              TensorDescription, TileDescription, compile_many)
    from vitrail.gemm.conv_arguments import MAX_CHUNKS
    from vitrail.ops.conv import operation

    f32, tf32 = TensorDescription("f32"), TensorDescription("tf32")
    bf16 = TensorDescription("bf16")
    ops = [operation("fprop", torch.bfloat16, bias=True, activation="relu"),
           operation("wgrad", torch.bfloat16, partials=True),
           ConvOperation("fprop", tf32, tf32, f32, MathInstruction("tf32", "tf32"),
                         TileDescription((128, 128, 32), kernel_schedule="warpspecialized"),
                         LinearCombination("f32", bias="col", activation="relu")),
           ConvOperation("fprop", bf16, bf16, bf16, MathInstruction("bf16", "bf16"),
                         TileDescription((128, 128, 64), kernel_schedule="cooperative"),
                         LinearCombination("bf16", bias="col", activation="relu"))]
    failures = compile_many(ops, arch="90a", max_workers=2)
    assert not failures, failures
    for op in ops:
        mod = op.compile(arch="90a")  # from the cache now
        assert mod.how == "disk"
        wgmma = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+\.\w+\.\w+)",
                               mod.ptx))
        tf32 = op.math.element_a == "tf32"
        assert wgmma == ({"m64n128k8.f32.tf32"} if tf32 else {"m64n128k16.f32.bf16"}), \
            (op.name, wgmma)
        assert "cp.async.bulk.tensor" in mod.ptx
        # the activation (A of fprop, B of wgrad) comes through TMA's im2col mode
        assert re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::cluster\.global\.im2col", mod.ptx)
        res = mod.resources()
        kernel = [r for name, r in res.items() if "ConvUniversal" in name
                  or "vitrail_conv_chunks" in name or "vitrail4conv8Mainloop" in name]
        assert kernel and not any(r.spills or r.stack for r in kernel), res
        # the chunked wgrad's middle chunks: chunk 0's parameters with their TMA descriptors'
        # addresses replaced (the driver's entry point looked up by name)
        assert (b"cuTensorMapReplaceAddress" in Path(mod.path).read_bytes()) == op.chunked
        if op.chunked:  # none yet: the count the GPU test reads
            assert mod.function("vitrail_conv_readdressed")() == 0
        run = mod.function("vitrail_conv")  # the entry point loads and checks (no GPU needed)
        # A, B, C, D, bias; N H W C K R S; padding, stride, dilation; x, w, y and C strides;
        # alpha, beta, slope, lo, hi; splits, phases; workspace, its bytes, SM count
        args = [16, 32, 0, 64, 0, 1, 8, 8, 64, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1,
                4096, 512, 64, 576, 192, 64, 4096, 512, 64, 4096, 512, 64,
                1.0, 0.0, 0.01, float("-inf"), float("inf"), 1, 0, 0, 0, 132]
        assert run(*args[:5], 0, *args[6:], stream=0) == -3  # N = 0
        assert run(*args[:12], -1, *args[13:], stream=0) == -3  # negative padding
        assert run(17, *args[1:], stream=0) == -1  # A not 16-byte aligned
        # C not a multiple of 16 bytes' elements (8 of bf16, 4 of fp32)
        assert run(*args[:8], 62, *args[9:], stream=0) == -8
        if not tf32:  # 60 channels: 240 bytes of fp32, 120 of bf16
            assert run(*args[:8], 60, *args[9:], stream=0) == -8
        assert run(*args[:20], 4102, *args[21:], stream=0) == -2  # a stride not of 16 bytes
        # splits: 1 but for the chunked wgrad; there at most MAX_CHUNKS, none empty (N is 1)
        for splits in ((2,) if op.kind == "fprop" else (0, MAX_CHUNKS + 1, 2)):
            assert run(*args[:37], splits, *args[38:], stream=0) == -9, splits
        assert run(*args[:38], 64, *args[39:], stream=0) == -9  # a phase table: phased only
