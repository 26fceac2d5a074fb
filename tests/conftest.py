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


def smem_check(launch_bytes: int, kernel: str = "attention") -> str:
    """Source to append to a kernel's: it fails to compile unless the shared memory the launch
    gives (launch_bytes, from Python) is what the kernel lays out (its namespace's kSmemBytes)."""
    return (f"\nstatic_assert({kernel}::kSmemBytes == {launch_bytes}, \"the launch's shared "
            f"memory is not the kernel's layout\");\n")


def assert_builds_clean(source: str, name: str, kernels: list[str], **build) -> dict:
    """source built for sm_90a with NVRTC (build: build_entry's include_dirs, flags): each of
    kernels with no spill and no stack, and no wgmma serialized (ptxas's C7515); returns the
    build's resources."""
    from vitrail.jit import compiler
    entry, _ = compiler.build_entry(source, name=name, backend="nvrtc", arch="90a", **build)
    res = entry.meta["resources"]
    for kernel in kernels:
        assert kernel in res, res
        assert res[kernel]["spill_stores"] == 0 and res[kernel]["stack"] == 0, res[kernel]
    log = (entry.dir / "build.log").read_text()
    assert "C7515" not in log and "serialized" not in log, log  # wgmma serialized
    return res
