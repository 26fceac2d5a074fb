"""Loading: ``vitrail.jit.compile`` (a build from vitrail.jit.compiler, loaded into this process)
and :class:`RawKernel` (an NVRTC kernel compiled and loaded on first launch).

The first call of a process for a given input builds (the cache key, then the artifact from disk
or compiled under the key's lock) and loads the artifact. Every later call with the same
arguments is a dictionary lookup: no file is touched, no source is hashed.
"""
from __future__ import annotations

import os
import threading
from typing import Mapping, Sequence

from vitrail.jit import toolchain
from vitrail.jit.compiler import build_entry
from vitrail.jit.kernel import CubinModule, Kernel, Launch
from vitrail.jit.module import Module, SharedLibrary

_memo: dict[tuple, Module] = {}
_memo_locks: dict[tuple, threading.Lock] = {}
_memo_guard = threading.Lock()


def compile(source: str, *, name: str, backend: str = "nvcc", arch: str | None = None,
            flags: Sequence[str] = (), include_dirs: Sequence[str | os.PathLike] = (),
            defines: Mapping[str, object] | None = None, kernels: Sequence[str] = ()) -> Module:
    """Compile CUDA C++ ``source`` (or fetch it from the cache) and load it.

    Args:
        source: the translation unit.
        name: a short name for logs, the cache index and saved sources.
        backend: "nvcc" (shared library with host entry points) or "nvrtc" (device-only cubin).
        arch: target such as "90a"; default :func:`toolchain.target_arch`.
        flags: extra compiler flags (part of the cache key).
        include_dirs: extra include directories; vitrail's, CUTLASS's and the toolkit's are added.
        defines: macros, ``{"BLOCK": 128}`` -> ``-DBLOCK=128`` (None -> ``-DNAME``).
        kernels: nvrtc only: name expressions of templated kernels to instantiate and look up,
            e.g. ``["scale<float>"]`` (extern "C" kernels need none).
    """
    target = toolchain.Arch.parse(arch) if arch is not None else toolchain.target_arch()
    memo_key = (source, name, backend, target.name, tuple(flags), tuple(map(str, include_dirs)),
                tuple(sorted((defines or {}).items())), tuple(kernels))
    hit = _memo.get(memo_key)
    if hit is not None:
        return hit
    with _memo_guard:
        lock = _memo_locks.setdefault(memo_key, threading.Lock())
    with lock:  # threads of one process asking for one kernel compile it once
        hit = _memo.get(memo_key)
        if hit is None:
            hit = _memo[memo_key] = _compile_uncached(
                source, name, backend, target, list(flags), list(include_dirs), defines or {},
                list(kernels))
    return hit


def clear_memory_cache() -> None:
    """Forget loaded modules (the next compile() call goes to disk again); for tests and tools."""
    _memo.clear()


def _compile_uncached(source: str, name: str, backend: str, arch: toolchain.Arch,
                      flags: list[str], include_dirs: list, defines: Mapping[str, object],
                      kernels: list[str]) -> Module:
    entry, how = build_entry(source, name=name, backend=backend, arch=arch, flags=flags,
                             include_dirs=include_dirs, defines=defines, kernels=kernels)
    cls = SharedLibrary if backend == "nvcc" else CubinModule
    return cls(entry, source, how)


class RawKernel:
    """A device-only CUDA kernel compiled with NVRTC on first launch.

    ``name`` is an extern "C" ``__global__`` function, or a name expression of a templated one
    (``"scale<float>"``). Its parameters are read from the source; pass ``signature=`` (e.g.
    ``"const float*, float*, int"``) where they cannot be.
    """

    def __init__(self, source: str, name: str, *, signature: str | None = None,
                 arch: str | None = None, flags=(), include_dirs=(), defines=None):
        self.source, self.name, self.signature = source, name, signature
        self._options = dict(arch=arch, flags=tuple(flags), include_dirs=tuple(include_dirs),
                             defines=defines)
        self._kernel: Kernel | None = None

    def compile(self) -> Kernel:
        if self._kernel is None:
            templated = "<" in self.name or "::" in self.name
            module = compile(self.source, name=self.name, backend="nvrtc",
                             kernels=[self.name] if templated else [], **self._options)
            self._kernel = module.kernel(self.name, self.signature)
        return self._kernel

    @property
    def module(self) -> CubinModule:
        return self.compile().module

    def __getitem__(self, config) -> Launch:
        kernel = self._kernel or self.compile()
        return kernel[config]

    def __repr__(self) -> str:
        return f"<RawKernel '{self.name}'>"

