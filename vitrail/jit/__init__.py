"""vitrail.jit: compile CUDA C++ on first use, cache it on disk, call it on torch tensors.

    mod = vitrail.jit.compile(source, name="add")            # nvcc: a shared library
    mod.launch_add(x, y, x.numel(), 2.0)                      # extern "C" entry point

    k = vitrail.jit.RawKernel(source, "saxpy")                # NVRTC: a device-only kernel
    k[(n + 255) // 256, 256](2.0, x, y, n)
"""
from vitrail.jit.compiler import clear_memory_cache, compile
from vitrail.jit.errors import (ArgumentError, CacheLockTimeout, CompileError, LaunchError,
                                ToolchainError, VitrailError)
from vitrail.jit.kernel import CubinModule, Kernel, RawKernel
from vitrail.jit.module import EntryPoint, Module, Resources, SharedLibrary
from vitrail.jit.toolchain import Arch, target_arch

__all__ = ["compile", "clear_memory_cache", "RawKernel", "Kernel", "Module", "SharedLibrary",
           "CubinModule", "EntryPoint", "Resources", "Arch", "target_arch", "VitrailError",
           "ToolchainError", "CompileError", "CacheLockTimeout", "LaunchError", "ArgumentError"]
