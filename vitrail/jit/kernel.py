"""Device-only kernels built by NVRTC: loading through the driver API and launching.

``RawKernel(source, name)[grid, block](*args, shared_mem=0, stream=None)`` compiles on first
use (through the cache), loads the cubin as a context-independent CUDA library, and launches on
the current torch stream of the arguments' device. A zero-sized grid launches nothing.

The per-launch path is: match arguments to the parsed prototype, pack them into one buffer
(one ``struct.pack_into``), one ``cuLaunchKernel``. Dynamic shared memory above 48 KiB raises
the kernel's limit once per device and size.
"""
from __future__ import annotations

import ctypes
import struct
import threading

from vitrail.jit.cache import Entry
from vitrail.jit.errors import ArgumentError, LaunchError
from vitrail.jit.module import Module
from vitrail.jit.signature import (Prototype, find_prototype, opaque_bytes, parse_signature,
                                   pointer_of, scalar_value, stream_of)

_driver_lock = threading.Lock()
_driver_ready = False
_primary: dict[int, object] = {}
_STATIC_SMEM_LIMIT = 48 * 1024


def _driver():
    global _driver_ready
    from cuda.bindings import driver
    if not _driver_ready:
        with _driver_lock:
            if not _driver_ready:
                _check(driver.cuInit(0)[0], "cuInit")
                _driver_ready = True
    return driver


def _check(err, what: str) -> None:
    if int(err) != 0:
        from cuda.bindings import driver
        name = driver.cuGetErrorName(err)[1]
        raise LaunchError(f"{what} failed: {name.decode() if name else err}")


def _make_current(device: int) -> None:
    """Make device's primary context current in this thread (what cudaSetDevice does)."""
    driver = _driver()
    ctx = _primary.get(device)
    if ctx is None:
        err, ctx = driver.cuDevicePrimaryCtxRetain(device)
        _check(err, f"cuDevicePrimaryCtxRetain({device})")
        _primary[device] = ctx
    _check(driver.cuCtxSetCurrent(ctx)[0], "cuCtxSetCurrent")


class CubinModule(Module):
    """An NVRTC-built cubin; ``module.kernel(name)`` gives a launchable :class:`Kernel`."""

    def __init__(self, entry: Entry, source: str, how: str):
        super().__init__(entry, source, how)
        self._cubin = entry.artifact_bytes
        self._library = None
        self._lock = threading.Lock()

    def kernel(self, name: str, signature: str | None = None) -> "Kernel":
        lowered = self.meta.get("lowered", {}).get(name, name)
        proto = (parse_signature(signature, name) if signature is not None
                 else find_prototype(self.source, name, kernel=True))
        return Kernel(self, lowered, proto)

    def _load(self):
        with self._lock:
            if self._library is None:
                driver = _driver()
                err, lib = driver.cuLibraryLoadData(self._cubin, None, None, 0, None, None, 0)
                _check(err, f"loading kernel module '{self.name}'")
                self._library = lib
        return self._library

    @property
    def ptx(self) -> str:
        """PTX from a second NVRTC compile for the virtual arch (a diagnostic; not cached)."""
        from vitrail.jit.compiler import nvrtc_compile
        opts = [o if not o.startswith("-arch=") else o.replace("sm_", "compute_")
                for o in self.meta["options"]]
        data, _, _ = nvrtc_compile(self.source, self.meta["source"], opts,
                                   list(self.meta.get("lowered", {})), "nvrtc", "PTX")
        return data.rstrip(b"\x00").decode()


class Kernel:
    """One kernel of a CubinModule: ``kernel[grid, block](*args, shared_mem=0, stream=None)``."""

    def __init__(self, module: CubinModule, lowered: str, proto: Prototype):
        self.module, self.lowered, self.proto = module, lowered, proto
        self.where = f"kernel '{proto.name}' ({module.name})"
        self._params = proto.params
        self._function = None
        self._smem_set: dict[int, int] = {}
        n = len(proto.params)
        self._packer = None
        if all(p.kind != "opaque" for p in proto.params):
            fmts = [_slot_format(p) for p in proto.params]
            body = "".join(f + "x" * (8 - struct.calcsize("<" + f)) for f in fmts)
            self._packer = struct.Struct("<" + "Q" * n + body)
            self._offsets = [8 * n + 8 * i for i in range(n)]

    def __getitem__(self, config) -> "_Launch":
        try:
            grid, block = config
        except (TypeError, ValueError):
            raise ArgumentError(f"{self.where}: launch as kernel[grid, block](...)") from None
        return _Launch(self, _dim3(grid, "grid", self.where), _dim3(block, "block", self.where))

    def launch(self, grid, block, args, shared_mem: int = 0, stream=None) -> None:
        self[grid, block](*args, shared_mem=shared_mem, stream=stream)

    def _handle(self):
        if self._function is None:
            driver = _driver()
            err, k = driver.cuLibraryGetKernel(self.module._load(), self.lowered.encode())
            _check(err, f"looking up {self.where}")
            self._kernel = k
            self._function = driver.CUfunction(int(k))
        return self._function

    def _marshal(self, args: tuple) -> tuple[list, int | None]:
        params = self._params
        if len(args) != len(params):
            raise ArgumentError(f"{self.where} takes {len(params)} arguments ({self.proto}), "
                                f"got {len(args)}")
        values: list = []
        device = None
        for p, a in zip(params, args):
            kind = p.kind
            if kind == "pointer":
                ptr, dev = pointer_of(a, p, self.where)
                if dev is not None:
                    if device is not None and dev != device:
                        raise ArgumentError(f"{self.where}: argument '{p.name}' is on cuda:{dev} "
                                            f"but an earlier one is on cuda:{device}")
                    device = dev
                values.append(ptr)
            elif kind == "scalar":
                values.append(scalar_value(a, p, self.where))
            elif kind == "stream":
                values.append(a)
            else:
                values.append(opaque_bytes(a, p, self.where))
        for i, p in enumerate(params):
            if p.kind == "stream":
                values[i] = stream_of(values[i], device)
        return values, device

    def _param_buffer(self, values: list):
        if self._packer is not None:
            buf = ctypes.create_string_buffer(self._packer.size or 1)
            base = ctypes.addressof(buf)
            self._packer.pack_into(buf, 0, *[base + o for o in self._offsets], *values)
            return buf, base
        held = [ctypes.create_string_buffer(v if p.kind == "opaque" else
                                            struct.pack("<" + _slot_format(p), v))
                for p, v in zip(self._params, values)]
        array = (ctypes.c_void_p * len(held))(*[ctypes.addressof(h) for h in held])
        return (array, held), ctypes.addressof(array)

    def _raise_smem_limit(self, device: int, shared_mem: int) -> None:
        driver = _driver()
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._handle()
        _check(driver.cuKernelSetAttribute(attr, shared_mem, self._kernel, device)[0],
               f"{self.where}: raising its dynamic shared memory limit to {shared_mem} bytes")
        self._smem_set[device] = shared_mem

    def __repr__(self) -> str:
        return f"<Kernel {self.proto}>"


class _Launch:
    __slots__ = ("kernel", "grid", "block")

    def __init__(self, kernel: Kernel, grid: tuple, block: tuple):
        self.kernel, self.grid, self.block = kernel, grid, block

    def __call__(self, *args, shared_mem: int = 0, stream=None) -> None:
        k = self.kernel
        values, device = k._marshal(args)
        grid, block = self.grid, self.block
        if not (grid[0] and grid[1] and grid[2]):
            return  # an empty grid: nothing to do
        import torch
        current = torch.cuda.current_device()
        if device is None:
            device = current
        if shared_mem > _STATIC_SMEM_LIMIT and k._smem_set.get(device, 0) < shared_mem:
            k._raise_smem_limit(device, shared_mem)
        handle = stream_of(stream, device)
        keep, params = k._param_buffer(values) if values else (None, 0)
        driver = _driver()
        f = k._handle()
        if device != current:
            with torch.cuda.device(device):
                err = driver.cuLaunchKernel(f, *grid, *block, shared_mem, handle, params, 0)[0]
        else:
            err = driver.cuLaunchKernel(f, *grid, *block, shared_mem, handle, params, 0)[0]
        if int(err) == 201:  # CUDA_ERROR_INVALID_CONTEXT: a new thread with no context yet
            _make_current(device)
            err = driver.cuLaunchKernel(f, *grid, *block, shared_mem, handle, params, 0)[0]
        if int(err) != 0:
            name = driver.cuGetErrorName(err)[1]
            raise LaunchError(f"launching {k.where} with grid {grid}, block {block}, "
                              f"shared_mem {shared_mem} failed: "
                              f"{name.decode() if name else int(err)}")
        del keep


def _slot_format(p) -> str:
    """struct format of one parameter's value (16-bit floats arrive as their bits)."""
    if p.kind != "scalar":
        return "Q"
    return "H" if p.fmt in ("e", "bf16") else p.fmt


def _dim3(value, what: str, where: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int) and d >= 0 for d in dims):
        raise ArgumentError(f"{where}: {what} must be an int or a tuple of 1 to 3 non-negative "
                            f"ints, got {value!r}")
    return (*dims, 1, 1)[:3]  # type: ignore[return-value]


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
            from vitrail.jit.compiler import compile as jit_compile
            templated = "<" in self.name or "::" in self.name
            module = jit_compile(self.source, name=self.name, backend="nvrtc",
                                 kernels=[self.name] if templated else [], **self._options)
            self._kernel = module.kernel(self.name, self.signature)
        return self._kernel

    @property
    def module(self) -> CubinModule:
        return self.compile().module

    def __getitem__(self, config) -> _Launch:
        kernel = self._kernel or self.compile()
        return kernel[config]

    def __repr__(self) -> str:
        return f"<RawKernel '{self.name}'>"

