"""Configs of the softmax kernels: the space PickBest searches and the heuristic's choice.

A row of n elements is held by TPR threads x CLUSTER CTAs, ITERS vectors of V elements each
(V = 16 bytes / element size, or 1 when rows are not 16-byte aligned). The heuristic picks the
fewest threads that keep ITERS at its target (8 vectors per thread forward, 4 per array backward:
enough loads in flight without spilling), then clusters when one CTA of 512 threads is not enough.
Rows beyond the largest config go to the chunked path (no length limit, one more read).
"""
from __future__ import annotations

import math

import torch

from vitrail.tune import Space, max_threads, require

CTYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
MAX_TPR, MAX_CLUSTER = 512, 8


def vec(dtype: torch.dtype) -> int:
    return 16 // torch.empty((), dtype=dtype).element_size()


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def registers(c, v: int, arrays: int) -> int:
    """Estimated registers per thread: the row's fragments plus working registers."""
    return c.ITERS * (4 if v > 1 else 1) * arrays + 40


def space(v: int, arrays: int) -> Space:
    return Space(
        {"TPR": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], "THREADS": [128, 256, 512],
         "ITERS": [1, 2, 4, 8, 16], "CLUSTER": [1, 2, 4, 8]},
        constraints=[
            max_threads(lambda c: c.THREADS),
            require(lambda c, lim: c.THREADS >= c.TPR, "THREADS={THREADS} < TPR={TPR}"),
            require(lambda c, lim: c.CLUSTER == 1 or (c.TPR == c.THREADS and c.TPR >= 128),
                    "a cluster (CLUSTER={CLUSTER}) takes one row per CTA of >= 128 threads"),
            require(lambda c, lim: c.CLUSTER <= lim.max_cluster_size,
                    "CLUSTER={CLUSTER} > the target's cluster limit"),
            require(lambda c, lim: registers(c, v, arrays) <= 255 and
                    registers(c, v, arrays) * c.THREADS <= lim.registers_per_sm,
                    "ITERS={ITERS} x THREADS={THREADS}: too many registers"),
        ],
        heuristic=lambda problem, lim: heuristic(problem, v, arrays, lim))


def heuristic(n: int | None, v: int, arrays: int, lim=None) -> dict:
    """The config for rows of n elements (n a power of two: the problem key's bucket)."""
    vectors = math.ceil((n or 4096) / v)
    target = (8 if arrays == 1 else 4) if v > 1 else 16
    tpr = 1
    while tpr < MAX_TPR and math.ceil(vectors / tpr) > target:
        tpr *= 2
    iters, cluster = _pow2(math.ceil(vectors / tpr)), 1
    if iters > target:
        cluster = min(MAX_CLUSTER, _pow2(math.ceil(vectors / (MAX_TPR * target))))
        iters = min(_max_iters(v, arrays), _pow2(math.ceil(vectors / (MAX_TPR * cluster))))
    return {"TPR": tpr, "THREADS": max(tpr, 256), "ITERS": iters, "CLUSTER": cluster}


def capacity(config, v: int) -> int:
    return config.TPR * config.ITERS * v * config.CLUSTER


def _max_iters(v: int, arrays: int) -> int:
    return 16 if arrays == 1 or v == 1 else 8


def max_register_row(v: int, arrays: int) -> int:
    """The longest row the register path takes; longer rows go chunked."""
    return MAX_TPR * _max_iters(v, arrays) * v * MAX_CLUSTER
