"""conv2d's GEMM route (1x1 filters, no padding, one group) on the CPU: the custom ops with
vitrail's GEMM replaced by torch's matmul, in float64 against torch's conv2d and its autograd,
so that the pixels' views, the stride's copies and dx's scatter are checked without a GPU."""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

C2D = importlib.import_module("vitrail.ops.conv")


@pytest.fixture
def gemm_on_the_cpu(monkeypatch):
    """gemm and mm as torch computes them; the GEMM route taken on the CPU."""
    from vitrail.gemm.ops.reference import activation as act
    runs = []

    def gemm(a, b, bias=None, activation=None):
        runs.append("gemm")
        return act(a @ b + (0 if bias is None else bias), activation)
    monkeypatch.setattr(C2D, "gemm", gemm)
    monkeypatch.setattr(C2D, "mm", lambda a, b: runs.append("mm") or a @ b)
    monkeypatch.setattr(C2D, "_require_hopper", lambda device: None)
    monkeypatch.setattr(C2D, "_run", lambda *a: pytest.fail("an implicit-GEMM kernel ran"))
    return runs


@pytest.mark.parametrize("stride", [(1, 1), (2, 2), (3, 2)])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_a_1x1_convolution_is_a_gemm_over_pixels(gemm_on_the_cpu, stride, activation):
    g = torch.Generator().manual_seed(sum(stride))
    n, c, h, w, k = 2, 5, 7, 6, 3
    x = torch.randn(n, c, h, w, generator=g, dtype=torch.float64).contiguous(
        memory_format=torch.channels_last).requires_grad_(True)
    wt = torch.randn(k, c, 1, 1, generator=g, dtype=torch.float64).contiguous(
        memory_format=torch.channels_last).requires_grad_(True)
    b = torch.randn(k, generator=g, dtype=torch.float64).requires_grad_(True)
    y = C2D._conv2d(x, wt, b, list(stride), [0, 0], [0, 0], [1, 1], activation)
    x2, w2, b2 = (t.detach().clone().requires_grad_(True) for t in (x, wt, b))
    want = F.conv2d(x2, w2, b2, stride)
    want = want.relu() if activation == "relu" else want
    assert y.shape == want.shape and y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, want)
    dy = torch.randn(want.shape, generator=g, dtype=torch.float64).contiguous(
        memory_format=torch.channels_last)
    y.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(x.grad, x2.grad, msg="dx")
    torch.testing.assert_close(wt.grad, w2.grad, msg="dw")
    torch.testing.assert_close(b.grad, b2.grad, rtol=1e-5, atol=1e-5)  # summed in fp32
    assert x.grad.is_contiguous(memory_format=torch.channels_last)
    assert wt.grad.is_contiguous(memory_format=torch.channels_last)
    assert gemm_on_the_cpu.count("mm") == 2 and "gemm" in gemm_on_the_cpu


def test_what_takes_the_gemm_route():
    """1x1, unpadded, one group; and reasons() says such a convolution runs, whatever its
    channel counts (3x3's need multiples of 8)."""
    w1 = torch.empty(8, 4, 1, 1)
    assert C2D._is_gemm(w1, (0, 0), (0, 0), 1)
    assert not C2D._is_gemm(w1, (1, 0), (1, 0), 1)  # padded
    assert not C2D._is_gemm(w1, (0, 0), (0, 0), 2)  # grouped
    assert not C2D._is_gemm(torch.empty(8, 4, 3, 1), (0, 0), (0, 0), 1)
    assert C2D._is_gemm([1, 1], [0, 0], [0, 0], 1)
    x = torch.empty(2, 12, 9, 9, dtype=torch.bfloat16, device="meta")
    assert C2D.reasons(x, torch.empty(20, 12, 1, 1, dtype=torch.bfloat16, device="meta"),
                       stride=2) == []
    assert C2D.reasons(x, torch.empty(20, 12, 3, 3, dtype=torch.bfloat16, device="meta"),
                       padding=1) != []
