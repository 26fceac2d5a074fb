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


# ------------------------------------------------------------- the op: space, custom op, bench
def test_the_heuristic_is_the_hand_written_config_and_fits_hopper():
    from examples.memory_bound_op import rms_norm
    from examples.memory_bound_op.op import FAMILY, SPACE
    from vitrail.tune import limits
    lim = limits(arch="90a")
    for n in (8, 1000, 4096, 32768):
        chosen = SPACE.default((n, torch.bfloat16), lim)
        assert dict(chosen) == rms_norm.config(n, torch.bfloat16)
        # the Op compiles what the plain function compiles: one cache entry for both
        assert (FAMILY[torch.bfloat16].render(chosen)
                == rms_norm.compile_kwargs(rms_norm.config(n, torch.bfloat16), torch.bfloat16))
    assert len(SPACE.valid(lim)) > 1  # something for PickBest to choose from


def test_the_fake_impl_gives_shape_and_dtype_without_a_gpu():
    from examples.memory_bound_op.op import rms_norm
    x = torch.empty(3, 5, 4096, device="meta", dtype=torch.float16)
    y = rms_norm(x)
    assert y.shape == x.shape and y.dtype == x.dtype


def test_the_gradient_is_autograds_of_the_reference():
    from types import SimpleNamespace

    from examples.memory_bound_op.op import _backward
    x = torch.randn(4, 64, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(4, 64, dtype=torch.float64)
    (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).backward(dy)
    ctx = SimpleNamespace(saved_tensors=(x.detach(),), eps=1e-6)
    dx, _ = _backward(ctx, dy)
    torch.testing.assert_close(dx.double(), x.grad, rtol=1e-5, atol=1e-5)


def test_the_benchmark_registers_and_names_its_baseline():
    from examples.memory_bound_op.op import register_benchmark
    from vitrail import bench
    before = dict(bench.REGISTRY)
    try:
        register_benchmark()
        assert "rms_norm" in bench.REGISTRY and not bench.REGISTRY["rms_norm"].by_name
    finally:
        bench.REGISTRY.clear()
        bench.REGISTRY.update(before)


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_tunes_and_differentiates(dtype):
    import vitrail
    from examples.memory_bound_op.op import rms_norm
    x = (torch.randn(37, 1024, device="cuda") * 3).to(dtype).requires_grad_()
    with vitrail.settings(policy=vitrail.PickBest):
        y = rms_norm(x)
    xd = x.detach().double().requires_grad_()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    tol = 2e-2 if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
    dy = torch.randn_like(ref)
    y.backward(dy.to(dtype))
    ref.backward(dy)
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=5 * tol, atol=5 * tol)
