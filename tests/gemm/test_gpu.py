"""The description API on a GPU: GemmOperation.run on NumPy, DLPack and torch arguments, split-K
(serial, on the stream-K scheduler), can_implement refusing a misaligned operand."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import requires_gpu
from vitrail.gemm import (GemmArguments, GemmOperation, LinearCombination, MathInstruction,
                          TensorDescription, TileDescription)
from vitrail.jit.errors import ArgumentError

# one kernel for every test here (fp16, all row-major, C read, stream-K scheduler)
OP = GemmOperation(A=TensorDescription("f16", "row"), B=TensorDescription("f16", "row"),
                   D=TensorDescription("f16", "row"), math=MathInstruction("f16", "f16"),
                   tile=TileDescription((128, 128, 64), (1, 1, 1), tile_scheduler="stream_k"),
                   epilogue=LinearCombination("f16", element_source="f16"),
                   mode="split_k_serial")

pytestmark = pytest.mark.warm_cache


def close(out, ref, scale=None):
    ref = np.asarray(ref, dtype=np.float64)
    err = np.abs(np.asarray(out, dtype=np.float64) - ref).max()
    assert err <= 2.0 ** -9 * (scale or np.abs(ref).max()), err


@requires_gpu
def test_numpy_in_and_out():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((300, 520)).astype(np.float16)
    b = rng.standard_normal((520, 200)).astype(np.float16)
    c = rng.standard_normal((300, 200)).astype(np.float16)
    d = np.full((300, 200), np.nan, dtype=np.float16)
    args = GemmArguments.from_tensors(OP, a, b, d, c=c, alpha=0.5, beta=2.0)
    assert OP.can_implement(args) == []
    OP.run(args)
    out = args.sync()
    assert out is d and not np.isnan(d).any()
    close(d, 0.5 * (a.astype(np.float64) @ b) + 2.0 * c)


class Capsule:
    """A DLPack producer that is not a torch tensor."""
    def __init__(self, t):
        self.t = t

    def __dlpack__(self, stream=None):
        return self.t.__dlpack__()

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


@requires_gpu
@pytest.mark.parametrize("splits", [1, 3])
def test_dlpack_and_split_k(splits):
    a = torch.randn(7, 4096, device="cuda", dtype=torch.float16)
    b = torch.randn(4096, 1000, device="cuda", dtype=torch.float16)
    c = torch.randn(7, 1000, device="cuda", dtype=torch.float16)
    d = torch.full((7, 1000), float("nan"), device="cuda", dtype=torch.float16)
    args = GemmArguments.from_tensors(OP, Capsule(a), Capsule(b), d, c=c, beta=1.0,
                                      splits=splits)
    OP.run(args)
    ref = a.double() @ b.double() + c.double()
    close(d.cpu(), ref.cpu())


@requires_gpu
def test_reused_arguments_keep_no_memory_and_other_streams_work():
    a = torch.randn(7, 4096, device="cuda", dtype=torch.float16)
    b = torch.randn(4096, 1000, device="cuda", dtype=torch.float16)
    d = torch.empty(7, 1000, device="cuda", dtype=torch.float16)
    args = GemmArguments.from_tensors(OP, a, b, d, c=torch.zeros_like(d), splits=3)
    OP.run(args)  # the workspace is allocated once by the caching allocator
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(20):
        OP.run(args)
    side = torch.cuda.Stream()
    d.fill_(float("nan"))
    side.wait_stream(torch.cuda.current_stream())
    OP.run(args, stream=side.cuda_stream)  # its workspace is recorded on that stream
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    close(d.cpu(), (a.double() @ b.double()).cpu())


@requires_gpu
def test_run_refuses_with_reasons():
    a = torch.randn(64, 70, device="cuda", dtype=torch.float16)[:, :64]  # leading stride 70
    b = torch.randn(64, 32, device="cuda", dtype=torch.float16)
    c = torch.randn(64, 32, device="cuda", dtype=torch.float16)
    args = GemmArguments.from_tensors(OP, a, b, c=c)
    with pytest.raises(ArgumentError, match="leading stride 70 is not a multiple of 8"):
        OP.run(args)


# the persistent scheduler with a 2 x 1 cluster (OP above is stream-K)
PERSISTENT = GemmOperation(A=TensorDescription("f16", "row"), B=TensorDescription("f16", "row"),
                           D=TensorDescription("f16", "row"), math=MathInstruction("f16", "f16"),
                           tile=TileDescription((128, 128, 64), (2, 1, 1)),
                           epilogue=LinearCombination("f16", element_source="f16"))


@requires_gpu
@pytest.mark.parametrize("op", [OP, PERSISTENT], ids=["stream_k", "persistent"])
@pytest.mark.parametrize("swizzle", [None, 1, 2, 4, 8])
def test_every_scheduler_order(op, swizzle):
    """Each swizzle and raster order covers every output tile once (values against fp64), on a
    grid of 9 x 17 tiles (padded by CUTLASS where the swizzle needs it), batched too."""
    a = torch.randn(2, 9 * 128 - 5, 256, device="cuda", dtype=torch.float16)
    b = torch.randn(2, 256, 17 * 128 - 8, device="cuda", dtype=torch.float16)  # N: 16 bytes
    ref = a.double() @ b.double()
    for raster in ("heuristic", "along_m", "along_n"):
        d = torch.full(ref.shape, float("nan"), device="cuda", dtype=torch.float16)
        args = GemmArguments.from_tensors(op, a, b, d, c=torch.zeros_like(d), swizzle=swizzle,
                                          raster=raster)
        op.run(args)
        close(d.cpu(), ref.cpu())


# a tile N outside CuTe's default wgmma list: one m64n144k16 (the emitter enables the extended
# shapes; without them CuTe cut it into nine m64n16)
WIDE = GemmOperation(A=TensorDescription("f16", "row"), B=TensorDescription("f16", "col"),
                     D=TensorDescription("f16", "row"), math=MathInstruction("f16", "f16"),
                     tile=TileDescription((128, 144, 64), (1, 2, 1)))


@requires_gpu
@pytest.mark.parametrize("M,N,K", [(1000, 1000, 1000), (129, 2168, 264), (8, 144, 64)])
def test_tile_n_outside_the_default_wgmma_list(M, N, K):
    a = torch.randn(M, K, device="cuda", dtype=torch.float16)
    b = torch.randn(N, K, device="cuda", dtype=torch.float16).t()
    d = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)
    WIDE.run(GemmArguments.from_tensors(WIDE, a, b, d))
    close(d.cpu(), (a.double() @ b.double()).cpu())


def _fp8_exact(tile, cluster=(1, 1, 1), schedule="cooperative", scheduler="persistent",
               promotion="auto"):
    return GemmOperation(
        A=TensorDescription("e4m3", "row"), B=TensorDescription("e4m3", "col"),
        D=TensorDescription("f32", "row"), math=MathInstruction("e4m3", "e4m3"),
        tile=TileDescription(tile, cluster, kernel_schedule=schedule, tile_scheduler=scheduler,
                             fp8_promotion=promotion),
        epilogue=LinearCombination("f32", scale_a="row", scale_b="tensor"))


# FP8 exact accumulation: the overlapped mainloop (slices of 64 columns: 4, 2, 3, 2 and 2 of them;
# two halves of 72 columns, m64n72 wgmma; two temporaries taking them in turn) on both kernel
# schedules and both tile schedulers, against CUTLASS's stock mainloop (m64n144 at 128x144)
FP8_TILES = [((128, 256, 128), (2, 1, 1), "cooperative", "persistent"),
             ((128, 128, 128), (2, 1, 1), "cooperative", "persistent"),
             ((128, 192, 128), (1, 2, 1), "cooperative", "persistent"),
             ((128, 128, 128), (1, 1, 1), "cooperative", "stream_k"),
             ((64, 128, 128), (1, 1, 1), "pingpong", "persistent"),
             ((128, 144, 128), (1, 2, 1), "cooperative", "persistent")]


@requires_gpu
@pytest.mark.parametrize("tile,cluster,schedule,scheduler", FP8_TILES,
                         ids=["128x256", "128x128", "128x192", "stream_k", "pingpong", "128x144"])
def test_fp8_overlapped_promotion_matches_stock(tile, cluster, schedule, scheduler):
    """The same promotions in the same order: the same bits as the stock mainloop, for 1 to 33
    k-tiles (sequences of 4 and the single k-tiles left over; a partial last k-tile), odd M and
    N, row-wise scales; and values against fp64, relative to sum |a_k b_k| per element."""
    ovl = _fp8_exact(tile, cluster, schedule, scheduler)
    stock = _fp8_exact(tile, cluster, schedule, scheduler, promotion="stock")
    assert ovl.overlapped_promotion and not stock.overlapped_promotion
    for M, N, K in ((1, 8, 128), (300, 200, 384), (1000, 136, 640), (517, 1000, 1152),
                    (256, 384, 4160)):
        a = (torch.randn(M, K, device="cuda") * 2).to(torch.float8_e4m3fn)
        b = (torch.randn(N, K, device="cuda") * 2).to(torch.float8_e4m3fn).t()
        sa = torch.rand(M, device="cuda") + 0.5
        sb = torch.tensor([0.75], device="cuda")
        outs = []
        for op in (ovl, stock):
            d = torch.full((M, N), float("nan"), device="cuda")
            op.run(GemmArguments.from_tensors(op, a, b, d, scale_a=sa, scale_b=sb))
            outs.append(d)
        assert torch.equal(outs[0], outs[1]), (M, N, K, (outs[0] - outs[1]).abs().max())
        scale = sa.double()[:, None] * 0.75
        ref = (a.double() @ b.double()) * scale
        # a GEMM's error scales with sum |a_k b_k| (not with |result|, which cancels: a 1 x 8
        # output's max measured 6e-4 of itself); the tensor cores' sums, promoted every 128
        err = ((outs[0].double() - ref).abs() / ((a.double().abs() @ b.double().abs()) * scale))
        assert err.max() < 2.0 ** -10, (M, N, K, err.max())
