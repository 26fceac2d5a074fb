"""Device unit test of vitrail/tprod.cuh (the tensor product of register fragments): compiled for
sm_90a in CI (NVRTC, no spills), values against torch on the GPU."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import requires_gpu, requires_nvrtc

# One thread per case: fragments of N values for P factors, out = s * x0 (x) ... (x) x_{P-1},
# the gradient of <out, dout> by tprod_pow_bwd (whole block) and tprod_pow_bwd_rows (streamed);
# tprod (two fragments of different sizes) checked on the first two factors.
SOURCE = r"""
#include <vitrail/tprod.cuh>
constexpr int P = FACTORS, N = SIZE;  // (macros named P or N would clash with template names)
extern "C" __global__ void tprod_test(float* out, float* dx, float* dx_rows, float* out2,
                                      const float* x, const float* dout, float scale, int cases) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cases) return;
  constexpr int B = vitrail::ipow<N, P>::value;
  float xf[P][N], o[B], g[B], gx[P][N], gr[P][N];
#pragma unroll
  for (int l = 0; l < P; ++l)
#pragma unroll
    for (int a = 0; a < N; ++a) {
      xf[l][a] = x[(c * P + l) * N + a];
      gx[l][a] = gr[l][a] = 0.f;
    }
#pragma unroll
  for (int e = 0; e < B; ++e) g[e] = dout[c * B + e];
  vitrail::tprod_pow<P, N>(o, xf, scale);
  vitrail::tprod_pow_bwd<P, N>(gx, xf, g, scale);
  vitrail::tprod_pow_bwd_rows<P, N>(gr, xf, [&](int lead, float (&row)[N]) {
#pragma unroll
    for (int b = 0; b < N; ++b) row[b] = dout[c * B + lead * N + b];
  }, scale);
#pragma unroll
  for (int e = 0; e < B; ++e) out[c * B + e] = o[e];
#pragma unroll
  for (int l = 0; l < P; ++l)
#pragma unroll
    for (int a = 0; a < N; ++a) {
      dx[(c * P + l) * N + a] = gx[l][a];
      dx_rows[(c * P + l) * N + a] = gr[l][a];
    }
  float pair[N * 2];
  const float two[2] = {xf[P - 1][0], xf[P - 1][N - 1]};
  vitrail::tprod<N, 2>(pair, xf[0], two, scale);
#pragma unroll
  for (int e = 0; e < 2 * N; ++e) out2[c * 2 * N + e] = pair[e];
}
"""

CASES = [(1, 8), (2, 4), (2, 5), (3, 3), (4, 2)]  # blocks up to 27 values: the test kernel
# holds three whole blocks in registers (the ops stream theirs, see tests/ops/test_sympow.py)


def _kernel(P, N):
    from vitrail import jit
    return jit.compile(SOURCE, name="tprod_test", backend="nvrtc", defines={"FACTORS": P, "SIZE": N})


@pytest.mark.slow
@requires_nvrtc
def test_tprod_builds_for_sm90a_without_spills(monkeypatch):
    monkeypatch.setenv("VITRAIL_ARCH", "90a")
    for P, N in CASES:
        res = _kernel(P, N).resources()["tprod_test"]
        assert res.spill_stores == 0 and res.spill_loads == 0, (P, N, res)


def _tensor_power(x, scale):
    """x [cases, P, N] -> [cases, N^P], first factor most significant."""
    z = x[:, 0]
    for l in range(1, x.shape[1]):
        z = (z[:, :, None] * x[:, l, None, :]).flatten(1)
    return z * scale


@requires_gpu
@pytest.mark.parametrize("P,N", CASES)
def test_tprod_values(P, N):
    cases, scale = 77, 0.7
    x = torch.randn(cases, P, N, device="cuda")
    dout = torch.randn(cases, N ** P, device="cuda")
    nan = lambda *s: torch.full(s, float("nan"), device="cuda")
    out, dx, dxr = nan(cases, N ** P), nan(cases, P, N), nan(cases, P, N)
    out2 = nan(cases, 2 * N)
    _kernel(P, N).kernel("tprod_test")[(cases + 63) // 64, 64](out, dx, dxr, out2, x, dout,
                                                                scale, cases)
    xr = x.double().requires_grad_(True)
    ref = _tensor_power(xr, scale)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    (want,) = torch.autograd.grad(ref, xr, dout.double())
    torch.testing.assert_close(dx.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dxr.double(), want, rtol=1e-4, atol=1e-4)
    two = torch.stack([x[:, -1, 0], x[:, -1, -1]], 1)
    want2 = (x[:, 0, :, None] * two[:, None, :]).flatten(1) * scale
    torch.testing.assert_close(out2, want2, rtol=1e-5, atol=1e-5)
