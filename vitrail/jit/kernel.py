"""Device-only kernels built by NVRTC: loading through the driver API and launching.

``RawKernel(source, name)[grid, block](*args, shared_mem=0, stream=None)`` (vitrail.jit.loading)
compiles on first use (through the cache); this module loads the cubin as a context-independent
CUDA library, and launches on the current torch stream of the arguments' device. A zero-sized
grid launches nothing.

The per-launch path is: match arguments to the parsed prototype, pack them into one buffer
(one ``struct.pack_into``), one ``cuLaunchKernel``. Dynamic shared memory raises the kernel's
limit once per device and size: without it, static and dynamic shared memory together must stay
within 48 KiB, which a kernel with static shared memory exceeds below 48 KiB of dynamic memory.
"""
from __future__ import annotations

import ctypes
import struct
import threading

import torch

from vitrail.jit import toolchain
from vitrail.jit.cache import Entry
from vitrail.jit.errors import ArgumentError, LaunchError
from vitrail.jit.module import HOOKS, Module
from vitrail.jit.arguments import Marshaller, current_device, stream_of
from vitrail.jit.signature import Prototype, find_prototype, parse_signature

_driver_lock = threading.Lock()
_DRIVER = None  # cuda.bindings.driver, once cuInit has run
_LAUNCH = None  # launch(function, gx, gy, gz, bx, by, bz, smem, stream, params) -> CUresult
_primary: dict[int, object] = {}


def driver_api():
    global _DRIVER
    if _DRIVER is None:
        with _driver_lock:
            if _DRIVER is None:
                from cuda.bindings import driver
                check_result(driver.cuInit(0)[0], "cuInit")
                _DRIVER = driver
    return _DRIVER


def _launch_through_bindings(fn, gx, gy, gz, bx, by, bz, smem, stream, params) -> int:
    return int(_DRIVER.cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, smem, stream, params, 0)[0])


def _launcher():
    global _LAUNCH
    if _LAUNCH is None:
        from vitrail.jit import launcher
        _LAUNCH = launcher.get() or _launch_through_bindings
    return _LAUNCH


def check_result(err, what: str) -> None:
    """Raise a LaunchError naming what failed where a driver call returned err (not 0)."""
    if int(err) != 0:
        from cuda.bindings import driver
        name = driver.cuGetErrorName(err)[1]
        raise LaunchError(f"{what} failed: {name.decode() if name else err}")


def _make_current(device: int) -> None:
    """Make device's primary context current in this thread (what cudaSetDevice does)."""
    driver = driver_api()
    ctx = _primary.get(device)
    if ctx is None:
        err, ctx = driver.cuDevicePrimaryCtxRetain(device)
        check_result(err, f"cuDevicePrimaryCtxRetain({device})")
        _primary[device] = ctx
    check_result(driver.cuCtxSetCurrent(ctx)[0], "cuCtxSetCurrent")


class CubinModule(Module):
    """An NVRTC-built cubin; ``module.kernel(name)`` gives a launchable :class:`Kernel`."""

    def __init__(self, entry: Entry, source: str, how: str):
        super().__init__(entry, source, how)
        self._cubin = entry.artifact_bytes
        self._library = None
        self._lock = threading.Lock()
        self._kernels: dict[tuple[str, str | None], Kernel] = {}

    def kernel(self, name: str, signature: str | None = None) -> "Kernel":
        """The kernel ``name`` (parsed, and its launcher generated, once per name)."""
        found = self._kernels.get((name, signature))
        if found is None:
            lowered = self.meta.get("lowered", {}).get(name, name)
            proto = (parse_signature(signature, name) if signature is not None
                     else find_prototype(self.source, name, kernel=True))
            found = self._kernels[(name, signature)] = Kernel(self, lowered, proto)
        return found

    def _load(self):
        with self._lock:
            if self._library is None:
                # a cubin from a newer CUDA major than the driver's: say so before it loads
                toolchain.check_driver_runs("NVRTC", self.meta["compiler"])
                driver = driver_api()
                err, lib = driver.cuLibraryLoadData(self._cubin, None, None, 0, None, None, 0)
                if int(err) != 0:
                    raise LaunchError(
                        f"loading kernel module '{self.name}' (a cubin for {self.arch} from NVRTC "
                        f"{self.meta['compiler']}, on a driver for CUDA "
                        f"{toolchain.driver_version()}) failed: {driver.cuGetErrorName(err)[1]}")
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
        self._kernel = None  # the context-independent CUkernel
        self._functions: dict[int, int] = {}  # device -> CUfunction (handle) in its primary ctx
        self._smem_set: dict[int, int] = {}
        self._launches: dict[object, Launch] = {}  # (grid, block) as written -> launcher
        self._local = threading.local()  # a reusable parameter buffer per thread
        # The parameter buffer: n pointers, then one 8-byte slot per value. cuLaunchKernel copies
        # the values during the call, so each thread reuses one buffer. Opaque (struct) values
        # have sizes known only at the call: they take the general path.
        if proto.params and all(p.kind != "opaque" for p in proto.params):
            n = len(proto.params)
            body = "".join(f + "x" * (8 - struct.calcsize("<" + f))
                           for f in map(slot_format, proto.params))
            values = struct.Struct("<" + body)
            local, pack_into = self._local, values.pack_into

            def pack(*v):
                try:
                    buf, base = local.slot
                except AttributeError:
                    buf = ctypes.create_string_buffer(8 * n + values.size)
                    base = ctypes.addressof(buf)
                    struct.pack_into(f"<{n}Q", buf, 0, *[base + 8 * (n + i) for i in range(n)])
                    local.slot = buf, base
                pack_into(buf, 8 * n, *v)
                return base
            self._marshal = Marshaller(proto, self.where, pack).function
        else:
            self._marshal = Marshaller(proto, self.where, self._pack_general).function

    def __getitem__(self, config) -> "Launch":
        try:
            return self._launches[config]
        except (KeyError, TypeError):  # a new configuration, or an unhashable one (lists)
            pass
        try:
            grid, block = config
        except (TypeError, ValueError):
            raise ArgumentError(f"{self.where}: launch as kernel[grid, block](...)") from None
        launch = Launch(self, _dim3(grid, "grid", self.where), _dim3(block, "block", self.where))
        if len(self._launches) < 256:
            try:
                self._launches[config] = launch
            except TypeError:
                pass
        return launch

    def _function(self, device: int):
        """The CUfunction of this kernel in device's primary context (made current if none is)."""
        driver = driver_api()
        if self._kernel is None:
            err, kernel = driver.cuLibraryGetKernel(self.module._load(), self.lowered.encode())
            check_result(err, f"looking up {self.where}")
            self._kernel = kernel
        err, ctx = driver.cuCtxGetCurrent()
        if int(err) != 0 or not int(ctx):
            _make_current(device)
        err, fn = driver.cuKernelGetFunction(self._kernel)
        check_result(err, f"loading {self.where} on cuda:{device}")
        _launcher()
        self._functions[device] = int(fn)
        return int(fn)

    def loaded_function(self, device: int) -> int | None:
        """The CUfunction handle of this kernel on device, where a launch has loaded it."""
        return self._functions.get(device)

    def _pack_general(self, *values) -> int:
        """The address of a void*[] of the values (valid until this thread's next launch)."""
        if not values:
            return 0
        held = [ctypes.create_string_buffer(v if p.kind == "opaque" else
                                            struct.pack("<" + slot_format(p), v))
                for p, v in zip(self.proto.params, values)]
        array = (ctypes.c_void_p * len(held))(*[ctypes.addressof(h) for h in held])
        self._local.held = (held, array)  # alive until this thread's next launch
        return ctypes.addressof(array)

    def _raise_smem_limit(self, device: int, shared_mem: int) -> None:
        driver = driver_api()
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        function = driver.CUfunction(self._functions[device])
        check_result(driver.cuFuncSetAttribute(function, attr, shared_mem)[0],
               f"{self.where}: raising its dynamic shared memory limit to {shared_mem} bytes")
        self._smem_set[device] = shared_mem

    def __repr__(self) -> str:
        return f"<Kernel {self.proto}>"


class Launch:
    """A kernel bound to a grid and block shape; calling it launches."""
    __slots__ = ("kernel", "grid", "block", "dims", "empty")

    def __init__(self, kernel: Kernel, grid: tuple, block: tuple):
        self.kernel, self.grid, self.block = kernel, grid, block
        self.dims = (*grid, *block)
        self.empty = not (grid[0] and grid[1] and grid[2])  # an empty grid launches nothing

    def __call__(self, *args, shared_mem: int = 0, stream=None) -> None:
        params, device = self.kernel._marshal(args, None)  # packed into this thread's buffer
        if HOOKS.record is not None:
            HOOKS.record("kernel", self, args, (shared_mem, stream))
        if self.empty:
            return
        current = current_device()
        if device is not None and device != current:  # the tensors' GPU, for this launch only
            with torch.cuda.device(device):
                return self._launch(device, params, shared_mem, stream)
        self._launch(current, params, shared_mem, stream)

    def _launch(self, device: int, params: int, shared_mem: int, stream) -> None:
        k = self.kernel
        fn = k._functions.get(device) or k._function(device)
        if shared_mem and k._smem_set.get(device, 0) < shared_mem:  # see the module doc
            k._raise_smem_limit(device, shared_mem)
        handle = _current_stream(device) if stream is None else stream_of(stream, device)
        err = _LAUNCH(fn, *self.dims, shared_mem, handle, params)
        if err:
            self._failed(err, fn, device, shared_mem, handle, params)

    def _failed(self, err, fn, device: int, shared_mem: int, handle: int, params: int) -> None:
        if int(err) == 201:  # CUDA_ERROR_INVALID_CONTEXT: a thread with no context yet
            _make_current(device)
            err = _LAUNCH(fn, *self.dims, shared_mem, handle, params)
        if err:
            name = _DRIVER.cuGetErrorName(_DRIVER.CUresult(err))[1]
            raise LaunchError(f"launching {self.kernel.where} with grid {self.grid}, block "
                              f"{self.block}, shared_mem {shared_mem} failed: "
                              f"{name.decode() if name else int(err)}")


_current_stream = torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else None


def slot_format(p) -> str:
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
