"""TMA tensor maps (vitrail.jit.tma) and the SASS check for wgmma register hazards
(vitrail.jit.sass). Refusals and the checker need no GPU; the encoding runs on the GPU (the
sympow expand-M kernel's TMA mainloop is its user, tested in tests/ops/test_sympow.py)."""
from __future__ import annotations

import struct

import pytest
import torch

from tests.conftest import requires_gpu
from vitrail.jit.errors import ArgumentError
from vitrail.jit.sass import kernel_sass, wgmma_register_hazards
from vitrail.jit.tma import tensor_map

X = torch.zeros(4, 64, 128, dtype=torch.bfloat16)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dims=(128, 64, 4), strides=(128,), box=(64, 64, 1)), "disagree"),
    (dict(dims=(128, 64, 4, 1, 1, 1), strides=(128, 1, 1, 1, 1), box=(64,) * 6), "rank 1 to 5"),
    (dict(dims=(128, 0, 4), strides=(128, 8192), box=(64, 64, 1)), "dims must be 1 to 2"),
    (dict(dims=(128, 64, 4), strides=(128, 8192), box=(64, 300, 1)), "box sizes"),
    (dict(dims=(128, 64, 4), strides=(128, 8192), box=(4, 64, 1)), "multiple of 16 bytes"),
    (dict(dims=(128, 64, 4), strides=(100, 8192), box=(64, 64, 1)), "strides must be"),
    (dict(dims=(128, 64, 4), strides=(128, 8192), box=(64, 64, 1), swizzle=48), "swizzle"),
    (dict(dims=(128, 64, 4), strides=(128, 8192), box=(128, 64, 1), swizzle=128), "swizzle"),
    (dict(dims=(128, 64, 4), strides=(128, 8192), box=(64, 64, 1)), "CUDA device"),
])
def test_tensor_map_refusals_name_what_is_wrong(kwargs, match):
    with pytest.raises(ArgumentError, match=match):
        tensor_map(X, **kwargs)
    with pytest.raises(ArgumentError, match="torch tensor"):
        tensor_map([1, 2], dims=(2,), strides=(), box=(8,))
    with pytest.raises(ArgumentError, match="no TMA element type"):
        tensor_map(X.to(torch.complex64), dims=(128,), strides=(), box=(8,))


@requires_gpu
def test_tensor_map_encodes_on_the_gpu():
    """128 bytes from the driver, different for different boxes; a misaligned view refused."""
    x = X.cuda()
    a = tensor_map(x, dims=(128, 64, 4), strides=(128, 64 * 128), box=(64, 64, 1))
    b = tensor_map(x, dims=(128, 64, 4), strides=(128, 64 * 128), box=(64, 32, 1))
    assert len(a) == len(b) == 128 and a != b and any(struct.unpack("<16Q", a))
    # a view whose strides are out of order (the sympow kernel's permuted rows) is accepted
    tensor_map(x.view(-1, 64), dims=(64, 2, 64, 2, 4), strides=(64, 1024, 128, 256),
               box=(64, 2, 4, 2, 4))
    with pytest.raises(ArgumentError, match="16-byte aligned"):
        tensor_map(x, dims=(64,), strides=(), box=(64,), offset=1)


# A loop of two k-blocks' worth of RS wgmmas as cuobjdump prints them (sm_90a, CUDA 13): the
# last group (R56) is left in flight at the back edge, and the loop's top writes R57 before the
# next wait retires it: the hazard the sympow kernels once had.
HAZARD = """
        Function : kern
        /*0100*/                   IMAD R57, R73, 0x1, R4 ;
        /*0110*/                   LDS.128 R60, [R12] ;
        /*0120*/                   WARPGROUP.ARRIVE ;
        /*0130*/                   HGMMA.64x64x16.F32.BF16 R24, R60, gdesc[UR4].tnspB, R24, gsb0 ;
        /*0140*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0150*/                   HMUL2.BF16_V2 R56, R4, R8 ;
        /*0160*/                   WARPGROUP.ARRIVE ;
        /*0170*/                   HGMMA.64x64x16.F32.BF16 R24, R56, gdesc[UR8].tnspB, R24, gsb0 ;
        /*0180*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0190*/              @!P0 BRA 0x100 ;
        /*01a0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*01b0*/                   EXIT ;
        Function : other
        /*0000*/                   EXIT ;
"""


def test_wgmma_register_hazards_across_a_back_edge():
    code = kernel_sass(HAZARD, "kern")
    found = wgmma_register_hazards(code)
    assert len(found) == 1 and "0100 IMAD" in found[0] and "R57" in found[0], found
    # waiting for every group at the block's end (as the kernels now do) removes it
    fixed = code.replace("/*0180*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1",
                         "/*0180*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert wgmma_register_hazards(fixed) == []
    # a write inside the straight-line code, before the group's wait, is one too
    inside = code.replace("/*0140*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;",
                          "/*0140*/                   IADD3 R61, R1, R2, RZ ;")
    assert any("0140 IADD3" in h for h in wgmma_register_hazards(inside))
    with pytest.raises(KeyError):
        kernel_sass(HAZARD, "missing")
