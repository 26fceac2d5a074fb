"""vitrail.ops.copy: any strides and dtypes, into a new tensor or into out; autograd, opcheck,
torch.compile; compile-only builds for sm_90a in CI."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import requires_gpu, requires_nvcc

pytestmark = pytest.mark.warm_cache


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.slow
@requires_nvcc
def test_compile_flat_and_tiled(monkeypatch):
    monkeypatch.setenv("VITRAIL_ARCH", "90a")
    from vitrail.ops.copy import FLAT_OPS, TILED_OPS
    from vitrail.tune import limits
    lim = limits(arch="90a")
    for op in (FLAT_OPS[torch.bfloat16, torch.float32, 4], TILED_OPS[torch.float16, torch.float32]):
        res = op.module(op.space.default(None, lim)).resources()
        assert res and not any(r.spills for r in res.values())


def _inputs(dtype):
    g = lambda *s: torch.randn(*s, device="cuda").to(dtype)  # noqa: E731
    return {
        "contiguous": g(1000, 37),
        "odd flat": g(12345),
        "offset": g(4097)[1:],
        "transpose": g(333, 517).t(),
        "permute3": g(7, 65, 130).permute(2, 0, 1),
        "slice": g(64, 300)[:, 5:260],
        "step": g(50, 80)[::3, ::2],
        "expand": g(1, 70).expand(90, 70),
        "5d": g(3, 4, 5, 6, 7).permute(4, 2, 0, 3, 1),
        "scalar": g(()),
    }


@requires_gpu
@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_copy_values(src, dst):
    import vitrail.ops as ops
    for name, x in _inputs(src).items():
        y = ops.copy(x, dtype=dst)
        assert y.is_contiguous() and y.dtype == dst and y.shape == x.shape, name
        assert torch.equal(y, x.to(dst)), name
        out = torch.full((x.shape[::-1]), float("nan"), device="cuda", dtype=dst)
        out = out.permute(*reversed(range(x.dim()))) if x.dim() else out
        ops.copy(x, out=out)
        assert torch.equal(out, x.to(dst)), name


@requires_gpu
def test_copy_autograd_opcheck_compile_errors():
    import vitrail.ops as ops
    from vitrail.jit import ArgumentError
    from vitrail.ops.copy import copy_op, copy_out_op
    x = torch.randn(30, 40, device="cuda", requires_grad=True)
    y = ops.copy(x.t(), dtype=torch.bfloat16)
    (g,) = torch.autograd.grad(y.float().sum(), x)
    torch.testing.assert_close(g, torch.ones_like(x))
    torch.library.opcheck(copy_op, (x.detach().t(), torch.float16))
    torch.library.opcheck(copy_out_op, (x.detach().t(), torch.empty(40, 30, device="cuda")))
    f = torch.compile(lambda t: ops.copy(t.t()) * 2, fullgraph=True)
    torch.testing.assert_close(f(x.detach()), x.detach().t() * 2)
    with pytest.raises(ArgumentError, match="shape"):
        ops.copy(x, out=torch.empty(3, device="cuda"))
    with pytest.raises(ArgumentError, match="dtype"):
        ops.copy(x, dtype=torch.int32)
