"""What tests ask of the machine (a GPU, nvcc, NVRTC); the cache fixture is in ../conftest.py."""
from __future__ import annotations

import pytest

import vitrail.jit as jit


def has_gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def has_tool(find) -> bool:
    """Whether a toolchain lookup (vitrail.jit.toolchain.nvcc, .nvrtc...) finds its tool."""
    try:
        find()
        return True
    except jit.ToolchainError:
        return False


def has_nvcc() -> bool:
    return has_tool(jit.toolchain.nvcc)


requires_gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
requires_nvcc = pytest.mark.skipif(not has_nvcc(), reason="needs nvcc")
requires_nvrtc = pytest.mark.skipif(not has_tool(jit.toolchain.nvrtc),
                                    reason="needs NVRTC (cuda-bindings)")


