"""The example kernel made an op: a tuning space, an Op per dtype, a torch custom op with a fake
impl and a gradient, and a `vitrail bench` entry (docs/tutorial.md walks through it).

    from examples.memory_bound_op.op import rms_norm
    y = rms_norm(x)                 # the heuristic's config, or the tuning store's
    with vitrail.settings(policy=vitrail.PickBest):
        y = rms_norm(x)             # a store miss compiles the candidates, times them, keeps one

    python -m examples.memory_bound_op.op   # benchmark against torch (builds only, with no GPU)
"""
from __future__ import annotations

import sys

import torch

from examples.memory_bound_op.rms_norm import ENTRY, HERE, compile_kwargs, config
from vitrail.device import vector
from vitrail.op import OpFamily
from vitrail.ops.common import FLOATS, check_tensor
from vitrail.tune import Space, max_threads, require

# The compile-time parameters and the values a tuner may try; sizes stay runtime arguments.
# The heuristic is rms_norm.config; a config too small for a row fails at launch (the kernel's
# `require`), and PickBest scores such a candidate inf and keeps another.
SPACE = Space({"TPR": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], "THREADS": [256, 512],
               "ITERS": [1, 2, 4, 8]},
              constraints=[max_threads(lambda c: c.THREADS),
                           require(lambda c, lim: c.TPR <= c.THREADS,
                                   "TPR={TPR} threads a row must fit in THREADS={THREADS}")],
              heuristic=lambda problem, lim: config(*problem) if problem else
              {"TPR": 64, "THREADS": 256, "ITERS": 8})

KERNEL = (HERE / "rms_norm.cuh").read_text() + ENTRY  # its hash keys the tuning records


def _launch(module, c, y, x2, eps):
    module.rms_norm(y.data_ptr(), x2.data_ptr(), x2.shape[0], x2.shape[1], x2.stride(0), eps)


def _variant(dtype: torch.dtype) -> dict:
    """The Op of one dtype: its name (the tuning key), space, source, render and launch."""
    return dict(name=f"example.rms_norm.{str(dtype).removeprefix('torch.')}", space=SPACE,
                kernel_source=KERNEL, render=lambda c: compile_kwargs(c, dtype),
                launch=_launch, examples=[(4096, dtype)])


# The op family: an Op per dtype (the kernel is a template on T), made on first use.
# register=False keeps it out of the CLI; register it (the default) to reach it with
# `vitrail tune --module ...`.
FAMILY = OpFamily("example.rms_norm", _variant, keys=lambda: FLOATS, register=False)


@torch.library.custom_op("example::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, eps: float) -> torch.Tensor:
    check_tensor("rms_norm", "x", x, dtypes=FLOATS, min_ndim=1)
    n = x.shape[-1]
    if n % vector(x.dtype):
        raise ValueError(f"rms_norm: the last dim ({n}) must be a multiple of "
                         f"{vector(x.dtype)} for 16-byte rows")
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    # the problem key says which problems share a tuned config; the problem feeds the heuristic
    FAMILY[x.dtype](f"n={n}", (n, x.dtype), y, x2, eps)
    return y.view(x.shape)


@rms_norm_op.register_fake
def _(x, eps):  # the output's shape and dtype, for torch.compile and meta tensors
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.eps = inputs[1]


def _backward(ctx, dy):
    """dx = r * dy - r^3 * x * mean(dy * x), r = rsqrt(mean(x^2) + eps), in fp32."""
    (x,) = ctx.saved_tensors
    xf, g = x.float(), dy.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
    dx = r * g - r.pow(3) * xf * (g * xf).mean(-1, keepdim=True)
    return dx.to(x.dtype), None


torch.library.register_autograd("example::rms_norm", _backward, setup_context=_setup)


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) over the last dim; autograd and torch.compile work."""
    return rms_norm_op(x, eps)


CASES = [((16384, 4096), torch.bfloat16), ((65536, 1024), torch.bfloat16),
         ((8192, 8192), torch.float32)]


def build() -> None:
    """Compile the configs the benchmark's cases take, without a GPU (`--compile-only`)."""
    from vitrail.bench.memory import build_configs
    from vitrail.tune import limits
    lim = limits()
    build_configs([(FAMILY[dt], SPACE.default((n, dt), lim)) for (_, n), dt in CASES], "rms_norm")


def run() -> list:
    """GB/s of vitrail's rms_norm and torch's, beside a copy of the same bytes (the ceiling)."""
    from vitrail.bench.memory import copy_gbps, rows_for
    ceiling = copy_gbps()
    rows = []
    for (m, n), dt in CASES:
        x = torch.randn(m, n, device="cuda", dtype=dt)
        rows += rows_for(f"rms_norm {str(dt).removeprefix('torch.')} {m}x{n}", {
            "vitrail": lambda: rms_norm(x),
            "torch eager": lambda: torch.nn.functional.rms_norm(x, (n,), eps=1e-6)},
            2 * x.numel() * x.element_size(), ceiling)
    return rows


def register_benchmark() -> None:
    from vitrail import bench
    bench.register("rms_norm", "examples.memory_bound_op rms_norm vs torch", build)(run)


if __name__ == "__main__":
    from vitrail import bench
    register_benchmark()
    sys.exit(bench.main(sys.argv[1:] or ["rms_norm"]))
