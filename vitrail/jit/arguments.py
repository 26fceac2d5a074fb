"""Python arguments turned into the C values a parsed prototype declares: the per-call path.

``Marshaller`` generates one straight-line function per prototype; the checking converters here
(``pointer_of``, ``scalar_value``, ``stream_of``, ``opaque_bytes``) are its slow paths, which
accept every supported kind of value and raise the errors that name the argument.
"""
from __future__ import annotations

import ctypes
import math
import struct
from typing import Callable

import torch

from vitrail.jit.errors import ArgumentError
from vitrail.jit.signature import Param, Prototype

_Tensor = torch.Tensor


def pointer_of(arg: object, param: Param, where: str) -> tuple[int, int | None]:
    """(address, CUDA device index or None) of a pointer argument; refuses host memory."""
    if isinstance(arg, torch.Tensor):
        if arg.device.type != "cuda":
            raise ArgumentError(f"{where}: argument '{param.name}' ({param.type}) is a tensor on "
                                f"{arg.device}; a kernel needs CUDA memory: use .cuda()")
        if not arg.is_contiguous():
            raise ArgumentError(
                f"{where}: argument '{param.name}' ({param.type}) is a non-contiguous tensor "
                f"(shape {tuple(arg.shape)}, strides {arg.stride()}); a raw pointer carries no "
                f"strides: pass .contiguous(), or pass data_ptr() and the strides yourself")
        return arg.data_ptr(), arg.device.index
    if arg is None:
        return 0, None
    if isinstance(arg, int) and not isinstance(arg, bool):
        if not 0 <= arg < 1 << 64:
            raise ArgumentError(f"{where}: argument '{param.name}' ({param.type}) got the int "
                                f"{arg}, which is no address (0 to 2**64 - 1)")
        return arg, None
    cai = getattr(arg, "__cuda_array_interface__", None)
    if cai is not None:
        shape, strides = cai.get("shape", ()), cai.get("strides")
        if strides is not None and not _c_contiguous(shape, strides, cai.get("typestr", "")):
            raise ArgumentError(f"{where}: argument '{param.name}' ({param.type}) is a "
                                f"non-contiguous CUDA array (strides {strides}); make it "
                                f"contiguous first")
        return int(cai["data"][0]), None
    if hasattr(arg, "__dlpack_device__"):
        dev_type, dev_id = arg.__dlpack_device__()
        if int(dev_type) not in (2, 13):  # kDLCUDA, kDLCUDAManaged
            raise ArgumentError(
                f"{where}: argument '{param.name}' ({param.type}) is in host memory "
                f"(DLPack device type {int(dev_type)}); a kernel needs CUDA memory")
        return pointer_of(torch.from_dlpack(arg), param, where)[0], int(dev_id)
    if hasattr(arg, "__array_interface__") or hasattr(arg, "__array__"):
        raise ArgumentError(f"{where}: argument '{param.name}' ({param.type}) is a host-memory "
                            f"array ({type(arg).__name__}); copy it to the GPU first (e.g. "
                            f"torch.as_tensor(x, device='cuda'))")
    raise ArgumentError(f"{where}: argument '{param.name}' ({param.type}) got "
                        f"{type(arg).__name__}; expected a CUDA tensor or array, an int address "
                        f"or None")


def _c_contiguous(shape: tuple, strides: tuple, typestr: str) -> bool:
    itemsize = int(typestr[2:]) if len(typestr) > 2 and typestr[2:].isdigit() else 0
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def stream_of(arg: object, device: int | None) -> int:
    """A raw CUDA stream handle; None means the current torch stream of ``device``."""
    if arg is None:
        return torch._C._cuda_getCurrentRawStream(current_device() if device is None else device)
    if isinstance(arg, int):
        return arg
    handle = getattr(arg, "cuda_stream", None)  # torch.cuda.Stream
    if handle is None and hasattr(arg, "__cuda_stream__"):
        handle = arg.__cuda_stream__()[1]
    if handle is None:
        handle = getattr(arg, "ptr", None)  # cupy.cuda.Stream
    if handle is None:
        raise ArgumentError(f"stream: expected a torch.cuda.Stream, an object with "
                            f"__cuda_stream__, a raw handle or None, got {type(arg).__name__}")
    return int(handle)


def scalar_value(arg: object, param: Param, where: str) -> object:
    """Check a Python number against a scalar parameter; 16-bit floats become their bits."""
    if param.fmt in "fd":
        if not isinstance(arg, (int, float)) or isinstance(arg, bool):
            arg = _number(arg, param, where, float)
        return float(arg)
    if param.fmt == "e":
        return struct.unpack("<H", _pack("<e", float(_number(arg, param, where, float))))[0]
    if param.fmt == "bf16":
        return _bf16_bits(float(_number(arg, param, where, float)))
    if param.fmt == "?":
        return bool(_number(arg, param, where, bool))
    value = _number(arg, param, where, int)
    if isinstance(value, float) and not value.is_integer():
        raise ArgumentError(f"{where}: argument '{param.name}' ({param.type}) got {arg!r}; "
                            f"expected an integer")
    value = int(value)
    bits = 8 * struct.calcsize(param.fmt)
    lo, hi = (0, 2**bits - 1) if param.fmt.isupper() else (-(2**(bits - 1)), 2**(bits - 1) - 1)
    if not lo <= value <= hi:
        raise ArgumentError(f"{where}: argument '{param.name}' ({param.type}) got {value}, "
                            f"outside [{lo}, {hi}]")
    return value


def _number(arg: object, param: Param, where: str, kind: type) -> object:
    if isinstance(arg, (int, float)):
        return arg
    if isinstance(arg, (str, bytes, bytearray)):  # int("3") would take it
        raise ArgumentError(f"{where}: argument '{param.name}' ({param.type}) got "
                            f"{type(arg).__name__} {arg!r}; expected a number")
    try:  # NumPy and torch scalars, 0-d tensors on the CPU
        return kind(arg.item() if hasattr(arg, "item") else arg)  # type: ignore[call-overload]
    except (TypeError, ValueError, RuntimeError):
        raise ArgumentError(f"{where}: argument '{param.name}' ({param.type}) got "
                            f"{type(arg).__name__}; expected a number") from None


def _pack(fmt: str, value: float) -> bytes:
    """struct.pack of a float; a value that rounds past the largest finite one becomes +-inf
    (what IEEE round-to-nearest, NumPy and CUDA's conversions give) instead of OverflowError."""
    try:
        return struct.pack(fmt, value)
    except OverflowError:
        return struct.pack(fmt, math.copysign(math.inf, value))


def _bf16_bits(value: float) -> int:
    bits = struct.unpack("<I", _pack("<f", value))[0]
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x7FFFFF:  # NaN stays NaN
        return (bits >> 16) | 0x40
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF  # round to nearest even


def opaque_bytes(arg: object, param: Param, where: str) -> bytes:
    if isinstance(arg, (bytes, bytearray, memoryview)):
        return bytes(arg)
    if isinstance(arg, ctypes._SimpleCData) or isinstance(arg, (ctypes.Structure, ctypes.Union)):
        return bytes(memoryview(arg).cast("B"))
    if hasattr(arg, "tobytes") and getattr(arg, "ndim", 1) == 0:  # a NumPy scalar
        return arg.tobytes()
    raise ArgumentError(f"{where}: argument '{param.name}' has type '{param.type}', which vitrail "
                        f"cannot build from {type(arg).__name__}; pass a ctypes instance, a NumPy "
                        f"scalar or bytes of that type, or give the kernel an explicit signature")


_cuda_ready = False


def current_device() -> int:
    """torch's current CUDA device (which the CUDA runtime shares); once CUDA is initialized,
    the plain C call without torch's lazy-init checks."""
    global _cuda_ready
    if _cuda_ready or torch.cuda.is_initialized():
        _cuda_ready = True
        return torch._C._cuda_getDevice()
    return torch.cuda.current_device()


class Marshaller:
    """Turns one call's Python arguments into C values for a prototype; built once per function.

    ``marshaller(args, stream)`` returns (C values, the CUDA device of the pointer arguments or
    None). The body is generated per prototype, straight-line code with a fast path for the
    common case of each parameter (a contiguous CUDA tensor, an int in range, a float); anything
    else goes to that parameter's checking converter, which accepts the other kinds (arrays,
    DLPack, NumPy scalars...) and raises the precise errors. Generated as Triton generates its
    launchers: a loop over per-parameter closures costs more than the launch it prepares.
    """

    def __init__(self, proto: Prototype, where: str, pack: Callable | None = None):
        """With ``pack(*values)`` given, the call returns (pack's result, device) instead of
        building a list: the kernel launcher packs the values straight into its buffer."""
        self.proto, self.where = proto, where
        self.n = len(proto.params)
        self._streams = [i for i, p in enumerate(proto.params) if p.kind == "stream"]
        # function(args, stream) -> (values or pack's result, device): callers on the per-call
        # path hold this generated function itself, one Python frame fewer than __call__.
        self.function = self._generate(pack)

    def __call__(self, args: tuple, stream: object = None) -> tuple[object, int | None]:
        return self.function(args, stream)

    def _generate(self, pack: Callable | None) -> Callable:
        n = self.n
        names = ", ".join(f"a{i}" for i in range(n)) + ("," if n == 1 else "")
        lines = ["def marshal(args, stream):", f"    if len(args) != {n}:",
                 "        args = fill(args, stream)", "    device = None"]
        if n:
            lines.append(f"    {names} = args")
        for i, p in enumerate(self.proto.params):
            lines += [f"    {line}" for line in _fast_path(i, p)]
        for i in self._streams:
            lines.append(f"    v{i} = stream_of(v{i}, device)")
        values = ", ".join(f"v{i}" for i in range(n))
        lines.append(f"    return pack({values}), device" if pack else
                     f"    return [{values}], device")
        scope = {"Tensor": torch.Tensor, "stream_of": stream_of, "fill": self._fill_stream,
                 "pack": pack,
                 "mixed": self._mixed_devices,
                 "slow": [_converter(p, self.where) for p in self.proto.params]}
        exec(compile("\n".join(lines), f"<vitrail marshal {self.where}>", "exec"), scope)
        return scope["marshal"]

    def _fill_stream(self, args: tuple, stream: object) -> tuple:
        if len(args) == self.n - 1 and self._streams == [self.n - 1]:
            return (*args, stream)
        raise ArgumentError(f"{self.where} takes {self.n} arguments ({self.proto}), got "
                            f"{len(args)}")

    def _mixed_devices(self, args: tuple) -> None:
        seen = [(p.name, pointer_of(a, p, self.where)[1])
                for p, a in zip(self.proto.params, args) if p.kind == "pointer"]
        raise ArgumentError(f"{self.where}: arguments are on different GPUs: "
                            + ", ".join(f"'{name}' on cuda:{d}" for name, d in seen
                                        if d is not None))


def _fast_path(i: int, p: Param) -> list[str]:
    """Generated lines that set v{i} (and the call's device) from argument a{i}."""
    if p.kind == "pointer":
        return [f"if type(a{i}) is Tensor and (d := a{i}.get_device()) >= 0 "  # -1: on the CPU
                f"and a{i}.is_contiguous():",
                f"    v{i} = a{i}.data_ptr()",
                "else:",
                f"    v{i}, d = slow[{i}](a{i})",
                "if d is not None and d != device:",
                "    if device is not None:",
                "        mixed(args)",
                "    device = d"]
    if p.kind == "scalar" and p.fmt in "bBhHiIqQ":
        bits = 8 * struct.calcsize(p.fmt)
        lo, hi = (0, 2**bits - 1) if p.fmt.isupper() else (-(2**(bits - 1)), 2**(bits - 1) - 1)
        return [f"v{i} = a{i} if type(a{i}) is int and {lo} <= a{i} <= {hi} "
                f"else slow[{i}](a{i})[0]"]
    if p.kind == "scalar" and p.fmt in "fd":
        return [f"v{i} = a{i} if type(a{i}) is float else slow[{i}](a{i})[0]"]
    if p.kind == "stream":
        return [f"v{i} = a{i}"]  # resolved once the device is known
    return [f"v{i} = slow[{i}](a{i})[0]"]


def _converter(p: Param, where: str) -> Callable[[object], tuple[object, int | None]]:
    if p.kind == "pointer":
        def pointer(arg):
            if type(arg) is _Tensor and arg.is_cuda and arg.is_contiguous():
                return arg.data_ptr(), arg.get_device()
            return pointer_of(arg, p, where)
        return pointer
    if p.kind == "scalar" and p.fmt in "bBhHiIqQ":
        bits = 8 * struct.calcsize(p.fmt)
        lo, hi = (0, 2**bits - 1) if p.fmt.isupper() else (-(2**(bits - 1)), 2**(bits - 1) - 1)

        def integer(arg):
            if type(arg) is int and lo <= arg <= hi:
                return arg, None
            return scalar_value(arg, p, where), None
        return integer
    if p.kind == "scalar" and p.fmt in "fd":
        def real(arg):
            if type(arg) is float:
                return arg, None
            return scalar_value(arg, p, where), None
        return real
    if p.kind == "scalar":
        return lambda arg: (scalar_value(arg, p, where), None)
    if p.kind == "stream":
        return lambda arg: (arg, None)  # resolved once the device is known
    return lambda arg: (opaque_bytes(arg, p, where), None)
