"""The example op: compiles for sm_90a (CI), matches an fp64 reference on the GPU."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import requires_gpu, requires_nvcc

pytestmark = pytest.mark.warm_cache


@pytest.mark.slow
@requires_nvcc
def test_compiles_for_sm90a(monkeypatch):
    monkeypatch.setenv("VITRAIL_ARCH", "90a")
    from examples.memory_bound_op.rms_norm import module
    res = module(4096, torch.bfloat16).resources()
    assert res and not any(r.spills for r in res.values())


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 8), (37, 1000), (5, 4096), (3, 2, 16384)])
def test_values(shape, dtype):
    from examples.memory_bound_op.rms_norm import rms_norm
    x = (torch.randn(shape, device="cuda") * 3).to(dtype)
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    y = rms_norm(x)
    torch.testing.assert_close(y.double(), ref, rtol=2e-2 if dtype != torch.float32 else 1e-5,
                               atol=2e-2 if dtype != torch.float32 else 1e-5)
