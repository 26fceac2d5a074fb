"""Loaded artifacts: what the compiler made, how to call into it, and what it costs.

- :class:`SharedLibrary` (nvcc): ``module.launch_add(x, y, n, 2.0)`` calls the ``extern "C"``
  function ``launch_add``; its prototype is read from the source once, tensors become pointers,
  and an omitted ``cudaStream_t`` parameter gets the current torch stream. A ``cudaError_t``
  result that is not ``cudaSuccess`` raises :class:`LaunchError`.
- :class:`CubinModule` (NVRTC): ``module.kernel("saxpy")[grid, block](...)`` (see kernel.py).

Both report ``resources()`` (registers, shared memory, stack and spills per kernel, from ptxas),
``ptx`` and ``sass`` (through cuobjdump, where the toolkit has it).
"""
from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from vitrail.jit.cache import Entry
from vitrail.jit.errors import ArgumentError, LaunchError, ToolchainError
from vitrail.jit.ptxas import parse_ptxas  # noqa: F401 (part of this module's interface)
from vitrail.jit.arguments import Marshaller, current_device
from vitrail.jit.signature import (Param, Prototype, find_prototype, parse_signature,
                                   result_is_checked)


@dataclass(frozen=True)
class Resources:
    """What ptxas reported for one kernel (bytes, except registers and barriers)."""
    registers: int = 0
    shared: int = 0  # static shared memory; dynamic shared memory is set at launch
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    barriers: int = 0
    mangled: str = ""

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads)




class Hooks:
    """Observers of the launch paths: ``record(kind, target, values, extra)``, when set, sees
    every entry-point call ("entry", the EntryPoint, its C values) and kernel launch ("kernel",
    the bound launch, its arguments, shared memory; kernel.py) before it runs;
    ``tensor_map(encoded, how)`` sees each TMA descriptor encoded (tma.py: the bytes, and the
    TensorMap that makes them). vitrail.plan sets them while a plan is recorded; otherwise each
    costs one attribute read a call."""
    record: Callable | None = None
    tensor_map: Callable | None = None


HOOKS = Hooks()


class Module:
    """A verified build from the cache, loaded into this process."""

    def __init__(self, entry: Entry, source: str, how: str):
        self._entry, self.source = entry, source
        # "compiled" (by this call), "disk" (found in the cache) or "shared" (found in a shared
        # read-only cache, VITRAIL_SHARED_CACHE, and copied into this user's)
        self.how = how
        meta = entry.meta
        self.name, self.backend, self.arch, self.key = (meta["name"], meta["backend"],
                                                        meta["arch"], entry.key)
        self.path = entry.artifact

    @property
    def dir(self) -> Path:
        """The cache entry: artifact, source, meta.json, build log."""
        return self._entry.dir

    @property
    def meta(self) -> dict:
        return self._entry.meta

    @property
    def compile_seconds(self) -> float:
        return self.meta["compile_seconds"]

    def resources(self) -> dict[str, Resources]:
        """Registers, static shared memory, stack and spills of each kernel, from ptxas."""
        return {k: Resources(**v) for k, v in self.meta.get("resources", {}).items()}

    @property
    def log(self) -> str:
        return (self._entry.dir / "build.log").read_text(errors="replace")

    @property
    def ptx(self) -> str:
        path = self._entry.dir / "kernel.ptx"
        if path.is_file():
            return path.read_text(errors="replace")
        raise ToolchainError(f"no PTX was kept for kernel '{self.name}'")

    @property
    def sass(self) -> str:
        """The machine code, disassembled by cuobjdump (part of the CUDA toolkit)."""
        from vitrail.jit import toolchain
        tool = shutil.which("cuobjdump")
        if tool is None:
            try:
                candidate = Path(toolchain.nvcc().path).parent / "cuobjdump"
                tool = str(candidate) if candidate.is_file() else None
            except ToolchainError:
                pass
        if tool is None:
            raise ToolchainError("cuobjdump not found: install the CUDA toolkit's cuobjdump "
                                 "(cuda-cuobjdump) and put it on PATH")
        done = subprocess.run([tool, "-sass", str(self.path)], capture_output=True, text=True)
        if done.returncode != 0:
            raise ToolchainError(f"cuobjdump -sass {self.path} failed: {done.stderr.strip()}")
        return done.stdout

    def __repr__(self) -> str:
        return f"<{type(self).__name__} '{self.name}' {self.backend} {self.arch} {self.key[:12]}>"


class SharedLibrary(Module):
    """An nvcc-built shared library; its extern "C" functions are attributes.

    ``module.function(name)`` always works; attribute access is the short form for names that
    are not also attributes of a module (name, key, path, dir, arch, backend, how, log, meta,
    source, ptx, sass, resources).
    """

    def __init__(self, entry: Entry, source: str, how: str):
        super().__init__(entry, source, how)
        from vitrail.jit import toolchain
        toolchain.check_driver_runs("nvcc", self.meta["compiler"])  # not an error at the launch
        self._lib = ctypes.CDLL(str(self.path), mode=ctypes.RTLD_LOCAL)
        self._entries: dict[str, EntryPoint] = {}

    def function(self, name: str, signature: str | None = None) -> "EntryPoint":
        """The entry point ``name``; its prototype from ``signature`` or else the source."""
        ep = self._entries.get(name)
        if ep is None or signature is not None:
            proto = (parse_signature(signature, name) if signature is not None
                     else find_prototype(self.source, name, kernel=False))
            try:
                fn = getattr(self._lib, name)
            except AttributeError:
                raise AttributeError(f"module '{self.name}' exports no function '{name}'; is it "
                                     f'declared extern "C"?') from None
            ep = self._entries[name] = EntryPoint(fn, proto, self.name)
        return ep

    def __getattr__(self, name: str) -> "EntryPoint":
        if name.startswith("_"):
            raise AttributeError(name)
        return self.function(name)


class EntryPoint:
    """A host function of a SharedLibrary, callable with tensors, numbers and streams."""

    def __init__(self, fn, proto: Prototype, module: str):
        self.proto, self.where = proto, f"{module}.{proto.name}"
        for p in proto.params:
            if p.kind == "opaque":
                raise ArgumentError(
                    f"{self.where}: parameter '{p.name}' has type '{p.type}', which cannot be "
                    f"passed from Python; entry points take pointers, numbers and cudaStream_t")
        fn.argtypes = [p.ctype for p in proto.params]
        fn.restype = _restype(proto.result)
        self._fn = fn
        self._fast: Callable | None = None
        self.checked = result_is_checked(proto.result)  # a cudaError_t: 0 or raise
        self._marshal = Marshaller(proto, self.where).function

    def __call__(self, *args, stream=None):
        values, device = self._marshal(args, stream)
        if HOOKS.record is not None:
            HOOKS.record("entry", self, values, None)
        if device is not None and device != current_device():
            with torch.cuda.device(device):  # the runtime launches on the current device
                result = self._fn(*values)
        else:
            result = self._fn(*values)
        if self.checked:
            if result != 0:
                raise self.error(result)
            return None
        return result

    @property
    def fast(self) -> Callable:
        """``fast(*values) -> result``: the function called with C values as they are (pointers
        and the stream as ints, integers in range, numbers for floats) through its generated C
        caller (launcher.caller), else through ctypes. For hot paths (vitrail.plan) whose values
        come from checked arguments: nothing is checked here, the device is the caller's to make
        current, and a checked result that is not 0 the caller's to raise (``error(result)``)."""
        if self._fast is None:
            from vitrail.jit import launcher
            call = launcher.caller(self.proto)
            self._fast = functools.partial(call, self.address) if call is not None else self._fn
        return self._fast

    @property
    def address(self) -> int:
        """The function's address (vitrail.plan's C++ hit path calls it)."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value

    def error(self, result: int) -> LaunchError:
        """The error a cudaError_t result that is not cudaSuccess raises."""
        return LaunchError(f"{self.where} returned {_cuda_error_name(result)} ({result}) "
                           f"[{self.proto}]")

    def __repr__(self) -> str:
        return f"<EntryPoint {self.proto}>"


def _restype(result: str):
    if result == "void":
        return None
    if result.endswith("*"):
        return ctypes.c_void_p
    if result_is_checked(result):
        return ctypes.c_int
    param: Param = parse_signature(f"{result} r", "result").params[0]
    return param.ctype


def _cuda_error_name(code: int) -> str:
    try:
        from cuda.bindings import runtime
        return runtime.cudaGetErrorName(runtime.cudaError_t(code))[1].decode()
    except Exception:
        return "cudaError"
