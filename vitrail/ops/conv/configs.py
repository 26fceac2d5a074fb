"""Configs of conv2d's implicit-GEMM kernels: the family's variants, the CTA tile and pipeline
stages each kind may take (the tuning space) and the heuristic's choice.

A kind's GEMM (fprop: M = N P Q pixels, N = K, K = C R S; dgrad: M = N H W, N = C, K = K R S;
wgrad: M = K, N = C R S, K = N P Q) runs 128x128x64 tiles (WIDE) or tiles 64 wide on the side
the channels give (NARROW: fprop's N = K, dgrad's N = C, wgrad's M = K), with as many pipeline
stages as fit in shared memory (one CTA an SM) or few (STAGES: two CTAs an SM). The heuristic,
chosen on a sweep of every config on the dense layers of `vitrail bench conv`, with
small-channel layers held out (vitrail.ops.conv.sweep, on the H200):

- a channel side of at most 64: the narrow tile, not half a wide one of padding; for fprop and
  dgrad with few stages, two CTAs an SM (but where the last rule takes the persistent kernel,
  which runs one CTA an SM at deep stages). wgrad keeps the deep pipeline: its batch chunks put
  about one CTA on each SM, where few stages gained little on some layers and lost much on
  others (a 1x1's);
- fprop or dgrad whose wide tiles would fill at most half the SMs in one wave (few pixels,
  e.g. 8x8 maps of a batch of 8; a strided dgrad's pixels are all its phases', one launch):
  the narrow tile, twice the CTAs in that one wave;
- else the wide tile;
- fprop or dgrad whose GEMM K (C R S, or K R S) is at most COOPERATIVE_K, where the launch may
  take a persistent kernel (not dgrad's stride phases in one launch): the cooperative kernel
  on that tile, at deep stages; a CTA's next tile's loads then overlap this tile's epilogue,
  which weighs most where the mainloop is short. With a longer K the non-persistent kernel
  was faster. Likewise wgrad's wide tile where its GEMM K, the pixels N P Q, is at most
  COOPERATIVE_K_WGRAD (the U-Net's 8x8 maps at batch 8).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from vitrail.device import DEFAULT_SM_COUNT
from vitrail.tune import Space, bucket, require

WIDE, NARROW = "128x128x64", {"wgrad": "64x128x64", "fprop": "128x64x64", "dgrad": "128x64x64"}
# Pipeline stages: 0 lets CUTLASS fill shared memory with them (one CTA an SM); 3 stages of the
# narrow tile leave room for a second CTA on the SM (its registers allow two), whose mainloop
# runs beside the other's prologue and epilogue. The wide tile's registers allow one CTA an SM.
STAGES = (0, 3)
# Kernels: CUTLASS's non-persistent one (one consumer warpgroup, one CTA a tile) and the GEMM's
# persistent cooperative kernel on the same mainloop (two consumer warpgroups on a tile of 128
# rows, a CTA an SM looping over tiles: include/vitrail/sm90_conv_cooperative.cuh). PickBest
# times both; the heuristic takes the second for a GEMM K of at most COOPERATIVE_K.
SCHEDULES = ("warpspecialized", "cooperative")
COOPERATIVE_K = 2304  # 36 K blocks of 64: the longest K of the sweep where the second won
# wgrad's (its K the pixels N P Q): between the sweep's 512, where the cooperative kernel won on
# every layer, and 2048, where it won on some and lost on others
COOPERATIVE_K_WGRAD = 1024
# the dims of `vitrail tune conv2d.<kind>.<dtype> --shape` (problems.py makes the problem)
SHAPE = "NxCxHxWxKxR"


class Variant(NamedTuple):
    """One instantiation of the conv template, an Op of the family (its name, its compile and
    tuning key): the kind, dtype, the epilogue (bias, activation), wgrad's fp32 partials of batch
    chunks, dgrad's stride phases in one launch."""
    kind: str
    dtype: torch.dtype
    bias: bool = False
    activation: Optional[str] = None
    partials: bool = False
    phased: bool = False

    @property
    def name(self) -> str:
        """conv2d.fprop.bf16.bias.relu, conv2d.wgrad.f16.partials, conv2d.fprop.tf32, ..."""
        dtype = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "tf32"}[self.dtype]
        parts = [self.kind, dtype, "bias" if self.bias else "", self.activation or "",
                 "partials" if self.partials else "", "phased" if self.phased else ""]
        return "conv2d." + ".".join(p for p in parts if p)


class Problem(NamedTuple):
    """What the heuristic and tuner take: a group's output and input channels, the filter's
    taps, and the pixels of the GEMM's long side (fprop's N P Q, dgrad's N H W, wgrad's N P Q)."""
    kind: str
    k: int
    c: int
    taps: int
    pixels: int


def problem_key(p: Problem) -> str:
    return f"k{bucket(p.k)};c{bucket(p.c)};rs{p.taps};px{bucket(p.pixels)}"


def tile(config) -> tuple[int, int, int]:
    """A config's tile as (M, N, K)."""
    m, n, k = (int(v) for v in config["tile"].split("x"))
    return m, n, k


def heuristic(kind: str, persistent: bool = True):
    def choose(problem: Optional[Problem], lim) -> dict:
        ws, coop = SCHEDULES
        if problem is None:  # precompile: the wide tile
            return {"tile": WIDE, "stages": 0, "schedule": ws}
        if kind == "wgrad":  # its GEMM K: the pixels; the cooperative kernel: the wide tile
            gemm_k, longest = problem.pixels, COOPERATIVE_K_WGRAD
        else:
            gemm_k, longest = (problem.k if kind == "dgrad" else problem.c) * problem.taps, \
                COOPERATIVE_K
        schedule = coop if persistent and gemm_k <= longest else ws
        side = problem.c if kind == "dgrad" else problem.k
        if side <= 64:
            if kind == "wgrad":  # a tile of 64 rows: the non-persistent kernel
                return {"tile": NARROW[kind], "stages": 0, "schedule": ws}
            stages = 0 if schedule == coop else max(STAGES)
            return {"tile": NARROW[kind], "stages": stages, "schedule": schedule}
        sms = (lim.sm_count if lim is not None else None) or DEFAULT_SM_COUNT
        wide_tiles = -(-problem.pixels // 128) * -(-side // 128)
        if kind != "wgrad" and 2 * wide_tiles <= sms:
            return {"tile": NARROW[kind], "stages": 0, "schedule": schedule}
        return {"tile": WIDE, "stages": 0, "schedule": schedule}
    return choose


def space(kind: str, persistent: bool = True) -> Space:
    """A kind's tiles, the wide one and the one with a 64-wide channel side, their pipeline
    stages (STAGES; the wide tile's as many as fit) and kernels (SCHEDULES; persistent: the
    variant's launch may take the persistent one, which wgrad's chunks and dgrad's phases in one
    launch may not)."""
    def coop(c) -> bool:
        return c["schedule"] == "cooperative"
    return Space({"tile": [WIDE, NARROW[kind]], "stages": list(STAGES),
                  "schedule": list(SCHEDULES)},
                 constraints=[require(lambda c, lim: c["tile"] != WIDE or not c["stages"],
                                      "the wide tile runs one CTA an SM: its stages fill "
                                      "shared memory"),
                              require(lambda c, lim: not coop(c) or tile(c)[0] == 128,
                                      "the cooperative kernel splits a tile's 128 rows between "
                                      "two warpgroups"),
                              require(lambda c, lim: not coop(c) or not c["stages"],
                                      "the cooperative kernel runs one CTA an SM: its stages "
                                      "fill shared memory"),
                              require(lambda c, lim: not coop(c) or persistent,
                                      "wgrad's chunks and dgrad's phases pick their problem by "
                                      "blockIdx.z: the non-persistent kernel only")],
                 heuristic=heuristic(kind, persistent))


def examples(kind: str) -> list[Optional[Problem]]:
    """The problems `vitrail precompile conv2d` builds a variant's kernels for: one a branch of
    the heuristic (no problem: the wide tile; a 64-channel side, with a short and a long GEMM K;
    wide channels with a short K; wide channels on few pixels)."""
    pixels = 128 * 56 * 56
    long_k = Problem(kind, 512, 64, 9, pixels) if kind == "dgrad" else \
        Problem(kind, 64, 512, 9, pixels)
    return [None, Problem(kind, 64, 64, 9, pixels), long_k, Problem(kind, 256, 256, 9, pixels),
            Problem(kind, 1024, 1024, 9, 8 * 8 * 8)]


# the variants `vitrail precompile conv2d` builds (their examples' kernels): the plain bf16
# kernels of each kind, ResNet's fused relu and the U-Net's silu forward, and the chunked wgrad
DEFAULTS = (Variant("fprop", torch.bfloat16), Variant("dgrad", torch.bfloat16),
            Variant("wgrad", torch.bfloat16), Variant("wgrad", torch.bfloat16, partials=True),
            Variant("fprop", torch.bfloat16, True, "relu"),
            Variant("fprop", torch.bfloat16, True, "silu"))
