"""vitrail.jit: compile CUDA C++ on first use, cache it on disk, call it on torch tensors.

    mod = vitrail.jit.compile(source, name="add")            # nvcc: a shared library
    mod.launch_add(x, y, x.numel(), 2.0)                      # extern "C" entry point

    ext = vitrail.jit.load_inline("ext", cpp_sources=src, functions=["f"])  # torch extension

    k = vitrail.jit.RawKernel(source, "saxpy")                # NVRTC: a device-only kernel
    k[(n + 255) // 256, 256](2.0, x, y, n)

Names are loaded on first use, so tools that only look at the cache (``vitrail cache ls``)
do not import torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "compile": "loading", "clear_memory_cache": "loading",
    "RawKernel": "loading", "Kernel": "kernel", "CubinModule": "kernel",
    "Module": "module", "SharedLibrary": "module", "EntryPoint": "module", "Resources": "module",
    "Arch": "toolchain", "target_arch": "toolchain",
    "VitrailError": "errors", "ToolchainError": "errors", "CompileError": "errors",
    "CacheLockTimeout": "errors", "CacheError": "errors", "LaunchError": "errors",
    "ArgumentError": "errors",
    "load_inline": "extension", "load": "extension",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"vitrail.jit.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    if name in ("toolchain", "cache", "index", "compiler", "module", "kernel", "signature",
                "arguments", "launcher", "housekeeping", "errors", "tma", "sass", "database",
                "extension", "loading"):
        return importlib.import_module(f"vitrail.jit.{name}")
    raise AttributeError(f"module 'vitrail.jit' has no attribute '{name}'")


if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ loads these
    from vitrail.jit.loading import RawKernel, clear_memory_cache, compile  # noqa: F401
    from vitrail.jit.errors import (ArgumentError, CacheError, CacheLockTimeout,  # noqa: F401
                                    CompileError, LaunchError, ToolchainError, VitrailError)
    from vitrail.jit.kernel import CubinModule, Kernel  # noqa: F401
    from vitrail.jit.module import EntryPoint, Module, Resources, SharedLibrary  # noqa: F401
    from vitrail.jit.toolchain import Arch, target_arch  # noqa: F401
