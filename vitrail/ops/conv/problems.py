"""conv2d in ``vitrail tune`` and ``vitrail precompile``: precompile builds the family's default
kernels (configs.DEFAULTS); a variant tunes from a shape (``vitrail tune conv2d.fprop.bf16
--shape NxCxHxWxKxR``: an R x R filter, stride 1, padding R // 2), its configs (tile, stages)
timed on random operands laid out as conv2d's own calls lay them (NHWC views)."""
from __future__ import annotations

import torch

from vitrail.op import Shaped, family
from vitrail.ops.conv import FAMILY, wgrad_chunks
from vitrail.ops.conv.configs import SHAPE, Problem, Variant, problem_key


def variant_problem(variant: Variant, shape: tuple[int, ...],
                    dtype: str | None = None) -> Shaped:
    """The problem of N images of C x H x W through K filters of R x R (stride 1, padding
    R // 2) on a variant; ValueError for what the variant cannot tune from a shape."""
    if len(shape) != 6:
        raise ValueError(f"--shape {'x'.join(map(str, shape))}: expected {SHAPE}")
    if variant.phased:
        raise ValueError(f"{variant.name}: the phased dgrad takes the heuristic's tile (its phase "
                         f"table reaches past what a scratch copy holds); tune "
                         f"conv2d.dgrad.{variant.name.split('.')[2]} instead")
    n, c, h, w, k, r = shape
    pad = r // 2
    p, q = h + 2 * pad - r + 1, w + 2 * pad - r + 1
    kind, dt = variant.kind, variant.dtype
    if kind == "wgrad" and not variant.partials:
        from vitrail.device import target_limits, with_sm_count
        sms = with_sm_count(target_limits()).sm_count
        chunks = wgrad_chunks(k, r * r * c, n, p * q, sms)  # (1 for one image)
        if chunks > 1:  # the one-pass kernel would be timed on a problem conv2d never gives it
            raise ValueError(
                f"{variant.name}: conv2d runs this wgrad's batch in {chunks} chunks on "
                f"{sms} SMs, in the chunked kernel: tune {variant.name}.partials")
    pixels = n * (h * w if kind == "dgrad" else p * q)
    problem = Problem(kind, k, c, r * r, pixels)

    def args() -> tuple:
        from vitrail.device import sm_count

        def nhwc(*dims: int) -> torch.Tensor:
            return (torch.randn(*dims, device="cuda") / 8).to(dt)
        x, wt, y = nhwc(n, h, w, c), nhwc(k, r, r, c), nhwc(n, p, q, k)
        bias = (torch.randn(k, device="cuda") / 8).to(dt) if variant.bias else None
        splits = 1
        if kind == "fprop":
            a, b, d = x, wt, y
        elif kind == "dgrad":
            a, b, d = y, wt, x
        else:
            a, b, d = y, x, wt
            if variant.partials:
                splits = max(2, wgrad_chunks(k, r * r * c, n, p * q, sm_count()))
                d = torch.empty(splits * k, r, r, c, device="cuda")
        return (a, b, d, bias, (pad, pad), (1, 1), (1, 1), (pad, pad), splits, None)
    return Shaped(FAMILY[variant], problem_key(problem), problem, args)


family("conv2d", "", "", (), None,
       why_not="`vitrail tune conv2d --shape` needs a variant: name one "
               f"(`vitrail tune conv2d.fprop.bf16 --shape {SHAPE}`; `vitrail tune --list`), or "
               "call conv2d under vitrail.settings(policy=vitrail.PickBest) to time its tiles on "
               "your problems; `vitrail precompile conv2d` builds its default kernels")
FAMILY.set_problems(variant_problem)
