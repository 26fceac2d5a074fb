"""TMA tensor maps (CUtensorMap) for kernels that load with ``cp.async.bulk.tensor``.

    desc = tensor_map(x, dims=(K, d, P), strides=(K, d * K), box=(64, d, 1))
    kernel[grid, block](out, desc, ...)     # the kernel takes `const __grid_constant__ M desc`,
                                            # M a 64-byte aligned struct of 128 bytes

Dimensions, strides and box are given innermost first, as the driver takes them, with strides
in elements of the outer dimensions (the innermost is contiguous). Strides need not grow with
the dimension: a box of a view whose strides are out of order lands rows in a permuted order
(the sympow kernels use it). The result is the 128 bytes the driver encoded, for a kernel's
opaque (by-value struct) parameter.
"""
from __future__ import annotations

import struct
import threading
from typing import NamedTuple, Sequence

from vitrail.jit.errors import ArgumentError

SWIZZLES = (0, 32, 64, 128)  # bytes; 0: none
_ELEMENT = {  # torch dtype name -> (CUtensorMapDataType name, bytes)
    "float32": ("FLOAT32", 4), "float16": ("FLOAT16", 2), "bfloat16": ("BFLOAT16", 2),
    "float64": ("FLOAT64", 8), "int32": ("INT32", 4), "int64": ("INT64", 8),
    "uint8": ("UINT8", 1), "int8": ("UINT8", 1), "float8_e4m3fn": ("UINT8", 1),
    "float8_e5m2": ("UINT8", 1),
}


_thread = threading.local()


def _bind_context(driver, device: int) -> None:
    """Make the device's primary context current where this thread has none: a thread that has
    made no CUDA call yet (torch's autograd engine thread on device 0) has none, and encoding a
    tensor map fails without one (CUDA_ERROR_INVALID_CONTEXT). Once per thread."""
    from vitrail.jit.kernel import check_result
    err, ctx = driver.cuCtxGetCurrent()
    check_result(err, "cuCtxGetCurrent")
    if not int(ctx):
        err, primary = driver.cuDevicePrimaryCtxRetain(device)
        check_result(err, "cuDevicePrimaryCtxRetain")
        (err,) = driver.cuCtxSetCurrent(primary)
        check_result(err, "cuCtxSetCurrent")
    _thread.bound = True


def tensor_map(tensor, dims: Sequence[int], strides: Sequence[int], box: Sequence[int], *,
               swizzle: int = 128, offset: int = 0) -> bytes:
    """The CUtensorMap of a tiled view of ``tensor``'s memory (a CUDA torch tensor; the view
    starts ``offset`` elements past its data pointer): ``dims`` and ``box`` per dimension,
    ``strides`` (elements) of all but the innermost. Zero fill out of bounds."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ArgumentError(f"tensor_map: tensor must be a CUDA torch tensor, got "
                            f"{type(tensor).__name__}")
    name = str(tensor.dtype).replace("torch.", "")
    if name not in _ELEMENT:
        raise ArgumentError(f"tensor_map: dtype {tensor.dtype} has no TMA element type "
                            f"(supported: {', '.join(sorted(_ELEMENT))})")
    kind, size = _ELEMENT[name]
    rank = len(dims)
    if not 1 <= rank <= 5 or len(box) != rank or len(strides) != rank - 1:
        raise ArgumentError(f"tensor_map: dims (rank 1 to 5), box (one per dimension) and "
                            f"strides (one per dimension but the innermost) disagree: dims "
                            f"{tuple(dims)}, strides {tuple(strides)}, box {tuple(box)}")
    if any(not 1 <= int(n) <= 1 << 32 for n in dims):
        raise ArgumentError(f"tensor_map: dims must be 1 to 2^32, got {tuple(dims)}")
    if any(not 1 <= int(b) <= 256 for b in box) or box[0] * size % 16:
        raise ArgumentError(f"tensor_map: box sizes must be 1 to 256 and the innermost one a "
                            f"multiple of 16 bytes, got {tuple(box)} of {size}-byte elements")
    if any(s * size % 16 or not 0 < s * size < 1 << 40 for s in strides):
        raise ArgumentError(f"tensor_map: strides must be positive multiples of 16 bytes, got "
                            f"{tuple(strides)} of {size}-byte elements")
    if swizzle not in SWIZZLES or (swizzle and box[0] * size > swizzle):
        raise ArgumentError(f"tensor_map: swizzle must be one of {SWIZZLES} bytes and at least "
                            f"the innermost box ({box[0] * size} bytes), got {swizzle!r}")
    if not tensor.is_cuda:
        raise ArgumentError(f"tensor_map: tensor must be on a CUDA device, got {tensor.device}")
    address = tensor.data_ptr() + offset * size
    if address % 16:
        raise ArgumentError(f"tensor_map: the view's address must be 16-byte aligned, got "
                            f"{address:#x}")
    from vitrail.jit.kernel import check_result, driver_api
    driver = driver_api()
    if not getattr(_thread, "bound", False):
        _bind_context(driver, tensor.device.index or 0)
    u32, u64 = driver.cuuint32_t, driver.cuuint64_t
    err, desc = driver.cuTensorMapEncodeTiled(
        getattr(driver.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{kind}"), u32(rank),
        address, [u64(int(n)) for n in dims], [u64(int(s) * size) for s in strides],
        [u32(int(b)) for b in box], [u32(1)] * rank,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(driver.CUtensorMapSwizzle,
                f"CU_TENSOR_MAP_SWIZZLE_{swizzle}B" if swizzle else "CU_TENSOR_MAP_SWIZZLE_NONE"),
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    check_result(err, f"cuTensorMapEncodeTiled(dims {tuple(dims)}, strides {tuple(strides)}, "
                      f"box {tuple(box)})")
    encoded = struct.pack("<16Q", *(int(v) for v in desc.opaque))
    from vitrail.jit.module import HOOKS
    if HOOKS.tensor_map is not None:  # a plan encodes it again per call, for that call's tensor
        HOOKS.tensor_map(encoded, TensorMap(
            tensor, int(getattr(driver.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{kind}")),
            size, tuple(int(n) for n in dims), tuple(int(s) * size for s in strides),
            tuple(int(b) for b in box), swizzle, int(getattr(
                driver.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{swizzle}B" if swizzle else
                "CU_TENSOR_MAP_SWIZZLE_NONE")), offset * size))
    return encoded


class TensorMap(NamedTuple):
    """How a recorded tensor map was made (vitrail.plan encodes it again per call): the tensor,
    the driver's data type, element bytes, dims, strides in bytes, box, swizzle (bytes, and the
    driver's enum) and the view's byte offset from the tensor's start."""
    tensor: object
    data_type: int
    size: int
    dims: tuple
    byte_strides: tuple
    box: tuple
    swizzle: int
    swizzle_enum: int
    byte_offset: int

    def encode(self, tensor) -> bytes:
        """The map of the same view of another tensor (of the same shape and strides)."""
        return tensor_map(tensor, self.dims, [s // self.size for s in self.byte_strides],
                          self.box, swizzle=self.swizzle, offset=self.byte_offset // self.size)
