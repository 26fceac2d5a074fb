"""The example GEMM: compiles for sm_90a (CI; wgmma, no spills), matches fp64 on the GPU."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import requires_gpu

pytestmark = pytest.mark.warm_cache


@pytest.mark.slow
def test_compiles_for_sm90a_with_unserialized_wgmma():
    from examples.tiled_mma.gemm import CONFIG, HERE, source
    from vitrail.jit import compiler
    entry, _ = compiler.build_entry(source(torch.bfloat16, CONFIG), name="example_tiled_gemm",
                                    backend="nvrtc", arch="90a", include_dirs=[HERE],
                                    flags=["-default-device"])
    res = entry.meta["resources"]
    assert "tiled_gemm" in res, res
    assert res["tiled_gemm"]["spill_stores"] == 0 and res["tiled_gemm"]["stack"] == 0
    assert "C7515" not in (entry.dir / "build.log").read_text()  # wgmma serialized


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@requires_gpu
@pytest.mark.skipif(not _sm90(), reason="needs sm_90 (wgmma, TMA)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(128, 256, 64), (1, 8, 8), (7, 264, 72), (1000, 520, 1000),
                                   (4096, 4096, 4096), (300, 4096, 8)])
def test_values(m, n, k, dtype):
    from examples.tiled_mma.gemm import gemm
    a = torch.randn(m, k, device="cuda").to(dtype)
    b = torch.randn(n, k, device="cuda").to(dtype)
    c = gemm(a, b)
    ref = a.double() @ b.double().T
    torch.testing.assert_close(c.double(), ref, rtol=1e-2, atol=1e-2 * k ** 0.5)


@requires_gpu
@pytest.mark.skipif(not _sm90(), reason="needs sm_90 (wgmma, TMA)")
def test_strided_rows_and_a_zero_k():
    from examples.tiled_mma.gemm import gemm
    big = torch.randn(200, 136, device="cuda", dtype=torch.bfloat16)
    a, b = big[:, :72], big[:64, 64:]  # rows 136 elements apart; b starts 128 bytes in
    torch.testing.assert_close(gemm(a, b).double(), a.double() @ b.double().T, rtol=1e-2,
                               atol=1e-1)
    z = gemm(torch.empty(5, 0, device="cuda", dtype=torch.bfloat16),
             torch.empty(16, 0, device="cuda", dtype=torch.bfloat16))
    assert z.shape == (5, 16) and not z.any()


def test_refuses_what_it_cannot_take():
    from examples.tiled_mma.gemm import gemm
    from vitrail.jit import ArgumentError
    with pytest.raises(ArgumentError, match="a must be on a CUDA device"):
        gemm(torch.ones(8, 8), torch.ones(8, 8))
