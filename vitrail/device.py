"""The facts about a GPU and a dtype that every op family needs, read and cached in one place.

SM count and limits per device (cached by device index: the op call paths look them up on every
call, so a lookup is one dict access, never a properties query or a torch.device), the build
target's limits where no GPU is visible (with DEFAULT_SM_COUNT SMs), the CUDA C type name of a
torch dtype (what a rendered kernel source says: ``using T = __nv_bfloat16;``) and the elements
of a 16-byte vector of a dtype.

Why here, beside knobs.py: the ops (vitrail.ops) and the GEMM library below them (vitrail.gemm)
both need these facts, so they cannot live in either; the limits are vitrail.tune's ``Limits``
(what configs are checked against), and this module only caches them per device and fills in the
SM count the arch table lacks. The tuning store keys records by the GPU's own SM count
(vitrail.tune.tuner.record_key), so ``vitrail.tune.limits`` itself never makes one up.
"""
from __future__ import annotations

import dataclasses

import torch

from vitrail.tune.space import Limits, limits as _limits

# The SM count heuristics and routes assume where no GPU gives one (building or routing for the
# target without a GPU): an H100 SXM's.
DEFAULT_SM_COUNT = 132
VECTOR_BYTES = 16  # the widest load or store a thread issues (ld.global.v4.b32)

# CUDA C type names of torch dtypes, as kernel sources spell them (cuda_fp16.h, cuda_bf16.h,
# cuda_fp8.h). The GEMM library names its element types in CUTLASS's spelling instead
# (vitrail.gemm.descriptions.DTYPES), which its CUTLASS templates take.
CTYPES: dict[torch.dtype, str] = {
    torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16",
    torch.float8_e4m3fn: "__nv_fp8_e4m3", torch.float8_e5m2: "__nv_fp8_e5m2",
    torch.int32: "int", torch.int64: "long long",
}

_SMS: dict[int, int] = {}
_LIMITS: dict[int, Limits] = {}
_TARGETS: dict[str, Limits] = {}


def sm_count(index: int | None = None) -> int:
    """The SM count of GPU ``index`` (None: the current device), read once per index."""
    n = _SMS.get(index)  # None is never a key: the current device may change
    if n is None:
        index = torch.cuda.current_device() if index is None else index
        n = _SMS.get(index)
        if n is None:
            n = _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


_HOPPER: dict[int, bool] = {}


def is_hopper(device: torch.device) -> bool:
    """Whether a CUDA device is sm_90 (the Hopper kernels' target), cached per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    hit = _HOPPER.get(index)
    if hit is None:
        hit = _HOPPER[index] = torch.cuda.get_device_capability(index) == (9, 0)
    return hit


def gpu_limits(index: int | None = None) -> Limits:
    """The limits of GPU ``index`` (None: the current device), read once per index."""
    lim = _LIMITS.get(index)
    if lim is None:
        index = torch.cuda.current_device() if index is None else index
        lim = _LIMITS.get(index)
        if lim is None:
            lim = _LIMITS[index] = _limits(index)
    return lim


def with_sm_count(lim: Limits) -> Limits:
    """lim, with DEFAULT_SM_COUNT SMs where no GPU gave its count (an arch table's limits)."""
    return lim if lim.sm_count else dataclasses.replace(lim, sm_count=DEFAULT_SM_COUNT)


def target_limits(arch: str | None = None) -> Limits:
    """The limits routes and heuristics take where no device is given: those of ``arch``, else of
    the build target (vitrail.tune.limits: the GPU's where one is visible and is that arch, else
    the arch's table), with DEFAULT_SM_COUNT SMs where no GPU gives its count. An arch named is
    read once; the build target at each call (VITRAIL_ARCH may change between calls)."""
    if arch is None:
        return with_sm_count(_limits())
    lim = _TARGETS.get(arch)
    if lim is None:
        lim = _TARGETS[arch] = with_sm_count(_limits(arch=arch))
    return lim


def ctype(dtype: torch.dtype) -> str:
    """The CUDA C type of a torch dtype (``__nv_bfloat16``); KeyError naming it if none."""
    name = CTYPES.get(dtype)
    if name is None:
        raise KeyError(f"no CUDA C type for {dtype}; known: "
                       f"{', '.join(str(d).removeprefix('torch.') for d in CTYPES)}")
    return name


class _VectorWidths(dict):
    """dtype -> the elements of a 16-byte vector of it, each computed at its first lookup."""

    def __missing__(self, dtype: torch.dtype) -> int:
        width = self[dtype] = VECTOR_BYTES // dtype.itemsize
        return width


# vector(dtype): the elements of dtype in a 16-byte vector (8 for bf16, 4 for fp32). A dict's
# own lookup, as cheap as ``16 // t.element_size()`` (a Python function would add a call).
vector = _VectorWidths().__getitem__
