"""A tunable test op: y = alpha * x, with a space whose configs differ clearly in speed.

BLOCK threads per CTA, ITEMS elements per thread, and COALESCED: 1 has neighbouring threads read
neighbouring elements; 0 gives each thread a contiguous run of ITEMS elements, so a warp's loads
are ITEMS elements apart (uncoalesced for ITEMS > 1: a clearly slower corner of the space).
"""
from __future__ import annotations

import math

import torch

from vitrail.op import Op, Shaped
from vitrail.tune import Space, max_threads, problem_key, require

KERNEL = r"""
extern "C" __global__ void __launch_bounds__(BLOCK) scale(float* y, const float* x, float alpha,
                                                          long long n) {
  long long base = (long long)blockIdx.x * BLOCK * ITEMS;
#pragma unroll
  for (int k = 0; k < ITEMS; ++k) {
    long long i = COALESCED ? base + k * BLOCK + threadIdx.x
                            : base + (long long)threadIdx.x * ITEMS + k;
    if (i < n) y[i] = alpha * x[i];
  }
}
"""

SPACE = Space(
    {"BLOCK": [32, 128, 256, 1024], "ITEMS": [1, 4, 16], "COALESCED": [1, 0]},
    constraints=[max_threads(lambda c: c.BLOCK),
                 require(lambda c, lim: c.BLOCK * c.ITEMS <= 8192,
                         "BLOCK*ITEMS = {BLOCK}*{ITEMS} elements per CTA is over 8192")],
    heuristic=lambda n, lim: {"BLOCK": 256, "ITEMS": 4 if (n or 0) >= 1 << 20 else 1,
                              "COALESCED": 1})


def render(config) -> dict:
    return dict(source=KERNEL, name="tests_scale", backend="nvrtc", defines=dict(config))


def launch(module, config, y: torch.Tensor, x: torch.Tensor, alpha: float) -> None:
    n = x.numel()
    per_cta = config.BLOCK * config.ITEMS
    module.kernel("scale")[(n + per_cta - 1) // per_cta, config.BLOCK](y, x, alpha, n)


def make_problem(shape: tuple[int, ...], dtype: str | None = None) -> Shaped:
    dt = getattr(torch, dtype or "float32")

    def args() -> tuple:
        x = torch.randn(shape, device="cuda", dtype=dt)
        return torch.empty_like(x), x, 2.0
    return Shaped(OP, problem_key(torch.empty(shape, dtype=dt, device="meta")),
                  math.prod(shape), args)


OP = Op("tests.scale", space=SPACE, kernel_source=KERNEL, render=render, launch=launch,
        examples=[1 << 10, 1 << 24], make_problem=make_problem, shape="N[xM]")


def scale(x: torch.Tensor, alpha: float) -> torch.Tensor:
    y = torch.empty_like(x)
    OP(problem_key(x), x.numel(), y, x, alpha)
    return y
