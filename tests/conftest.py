"""Shared fixtures: every test gets a private cache directory and a clean module memo."""
from __future__ import annotations

import os
import shutil

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


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """A fresh VITRAIL_CACHE_DIR per test; VITRAIL_ARCH=90a when no GPU is present."""
    root = tmp_path / "vitrail-cache"
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(root))
    monkeypatch.delenv("VITRAIL_FORCE_RECOMPILE", raising=False)
    if not has_gpu() and not os.environ.get("VITRAIL_ARCH"):
        monkeypatch.setenv("VITRAIL_ARCH", "90a")
    jit.clear_memory_cache()
    yield root
    jit.clear_memory_cache()
    shutil.rmtree(root, ignore_errors=True)
