"""C prototypes read from CUDA source, and Python arguments turned into what they declare.

A kernel's or entry point's parameter list is parsed once from its source, so calling it from
Python needs no hand-written ctypes. Each parameter gets a *kind*:

- ``pointer`` (any ``T*`` or ``T[]``): a CUDA torch tensor (contiguous), an object with
  ``__cuda_array_interface__`` or a CUDA DLPack capsule provider, an int address, or None (null).
  Host memory is refused, and so is a non-contiguous tensor (a raw pointer cannot carry strides:
  pass ``t.contiguous()``, or the address and strides yourself).
- ``scalar``: bool, 8- to 64-bit integers, float, double, half and bfloat16, from Python numbers.
- ``stream`` (``cudaStream_t``/``CUstream``): filled with the current torch stream when left out;
  or a torch/CuPy stream, an object with ``__cuda_stream__``, or a raw handle.
- ``opaque`` (a struct or template type passed by value, kernels only): a ctypes instance, a
  NumPy scalar or a bytes-like value of the right size.
"""
from __future__ import annotations

import ctypes
import math
import re
import struct
from dataclasses import dataclass
from typing import Callable

import torch

from vitrail.jit.errors import ArgumentError

_Tensor = torch.Tensor

# spelled type -> (struct format, ctypes type)
_SCALARS: dict[str, tuple[str, type]] = {}
for _names, _fmt, _ct in (
    ("bool", "?", ctypes.c_bool),
    ("char|signed char|int8_t", "b", ctypes.c_int8),
    ("unsigned char|uint8_t", "B", ctypes.c_uint8),
    ("short|short int|signed short|int16_t", "h", ctypes.c_int16),
    ("unsigned short|unsigned short int|uint16_t", "H", ctypes.c_uint16),
    ("int|signed|signed int|int32_t", "i", ctypes.c_int32),
    ("unsigned|unsigned int|uint32_t", "I", ctypes.c_uint32),
    ("long|long int|long long|long long int|int64_t|ssize_t|ptrdiff_t|intptr_t", "q",
     ctypes.c_int64),
    ("unsigned long|unsigned long int|unsigned long long|unsigned long long int|uint64_t|size_t"
     "|uintptr_t", "Q", ctypes.c_uint64),
    ("float", "f", ctypes.c_float),
    ("double", "d", ctypes.c_double),
    ("half|__half", "e", ctypes.c_uint16),
    ("__nv_bfloat16|nv_bfloat16|bfloat16_t|cutlass::bfloat16_t", "bf16", ctypes.c_uint16),
):
    for _n in _names.split("|"):
        _SCALARS[_n] = (_fmt, _ct)
_STREAMS = {"cudaStream_t", "CUstream", "CUstream_st", "cudaStream"}
_CHECKED_RESULTS = {"cudaError_t", "cudaError", "CUresult"}
_TYPE_WORDS = {"int", "long", "short", "char", "unsigned", "signed", "float", "double", "bool",
               "void"}
_QUALIFIERS = re.compile(r"\b(const|volatile|__restrict__|__restrict|restrict|__grid_constant__|"
                         r"struct|class|typename)\b|__attribute__\s*\(\(.*?\)\)|alignas\s*\(.*?\)")


@dataclass(frozen=True)
class Param:
    name: str
    type: str  # as declared, qualifiers dropped: "float*", "int64_t", "cudaStream_t"
    kind: str  # pointer | scalar | stream | opaque
    fmt: str = "Q"  # struct format of a scalar ("bf16" for bfloat16)
    ctype: type = ctypes.c_void_p


@dataclass(frozen=True)
class Prototype:
    name: str
    result: str
    params: tuple[Param, ...]

    def __str__(self) -> str:
        return f"{self.result} {self.name}({', '.join(f'{p.type} {p.name}' for p in self.params)})"


# -------------------------------------------------------------------------------------- parsing
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_PREPROCESSOR = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.M)


def find_prototype(source: str, name: str, *, kernel: bool) -> Prototype:
    """The declaration of ``name`` in source: a ``__global__`` kernel, or a host function.

    ``name`` may be a name expression (``ns::k<float, 128>``); its template arguments are
    ignored and parameters of template type become ``opaque`` unless they are pointers.
    """
    base = re.sub(r"<.*>$", "", name.strip()).split("::")[-1].strip()
    text = _PREPROCESSOR.sub(" ", _COMMENTS.sub(" ", source))
    for m in re.finditer(rf"(?<![\w.>:]){re.escape(base)}\s*\(", text):
        params_text, end = _balanced(text, m.end() - 1)
        if end < 0:
            continue
        after = text[end:].lstrip()
        if not after or (after[0] not in "{;" and not re.match(r"(noexcept|throw|__attribute__|"
                                                                 r"const\b)", after)):
            continue
        start = max(text.rfind(c, 0, m.start()) for c in ";{}") + 1
        prefix = text[start:m.start()]
        if not _declares(prefix):
            continue
        if kernel != ("__global__" in prefix):
            continue
        result = _result_type(prefix)
        params = [_substitute(p, prefix, name) for p in _split(params_text) if p.strip()]
        if len(params) == 1 and params[0].strip() == "void":
            params = []
        return Prototype(base, result, tuple(_param(p, i) for i, p in enumerate(params)))
    what = "__global__ kernel" if kernel else 'host function (extern "C")'
    raise ArgumentError(f"no {what} named '{base}' is declared in the source; declare it, or give "
                        f"its signature explicitly")


# words after which `name(` is a call or an expression, never a declaration
_STATEMENT_WORDS = {"return", "if", "while", "for", "switch", "case", "default", "else", "do",
                    "goto", "throw", "delete", "new", "sizeof", "alignof", "typeid", "co_return",
                    "co_yield", "co_await", "and", "or", "not"}
_DECORATION = re.compile(r'extern\s+"C"|\[\[|__\w+__\s*\(|__attribute__\s*\(|__declspec\s*\('
                         r"|alignas\s*\(|\btemplate\s*<")
_MACRO_CALL = re.compile(r"\b[A-Z_][A-Z0-9_]*\s*\(")


def _declares(prefix: str) -> bool:
    """Whether the text before ``name(`` can be a declaration's specifiers (``extern "C" int``,
    ``template <class T = float> __global__ void __launch_bounds__(256, 1)``) rather than the
    start of a call statement (``else``, ``case 0:``, ``(void)``, ``for (;;)``, ``x =``)."""
    words = _strip_balanced(prefix, _DECORATION)
    if set(re.findall(r"\w+", words)) & _STATEMENT_WORDS:
        return False
    words = _strip_balanced(words, _MACRO_CALL).strip()  # MY_BOUNDS(256) __global__ void
    if not words or any(c in words for c in "=()"):
        return False
    return not words.replace("::", "").endswith(":")  # a label, or a case


def _strip_balanced(text: str, pattern: re.Pattern) -> str:
    """text without each match of pattern and the rest of its (...), <...> or [[...]]."""
    rest, i = [], 0
    while (m := pattern.search(text, i)) is not None:
        rest.append(text[i:m.start()])
        i = m.end()
        opener = m.group()[-1]
        if opener not in "(<[":  # extern "C"
            continue
        closer = {"(": ")", "<": ">", "[": "]"}[opener]
        depth = 2 if opener == "[" else 1
        while i < len(text) and depth:
            depth += (text[i] == opener) - (text[i] == closer)
            i += 1
    rest.append(text[i:])
    return " ".join(rest)


def _substitute(param: str, prefix: str, name: str) -> str:
    """Replace template type parameters by the name expression's arguments: T -> float."""
    header = re.search(r"template\s*<(.*)>", prefix, re.S)
    args = re.search(r"<(.*)>\s*$", name, re.S)
    if not header or not args:
        return param
    for decl, arg in zip(_split(header.group(1)), _split(args.group(1))):
        m = re.fullmatch(r"\s*(?:typename|class)\s+(\w+)\s*(?:=.*)?", decl, re.S)
        if m:
            param = re.sub(rf"\b{m.group(1)}\b", arg.strip(), param)
    return param


def parse_signature(signature: str, name: str) -> Prototype:
    """``"void(const float*, float*, int)"`` or just the parameter list: ``"const float*, int"``."""
    sig = signature.strip()
    m = re.fullmatch(r"(.*?)\((.*)\)", sig, re.S)
    result, params_text = (m.group(1).strip() or "void", m.group(2)) if m else ("void", sig)
    params = [p for p in _split(params_text) if p.strip() and p.strip() != "void"]
    return Prototype(name, result, tuple(_param(p, i) for i, p in enumerate(params)))


def _balanced(text: str, open_at: int) -> tuple[str, int]:
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:i], i + 1
    return "", -1


def _split(params: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in params:
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def _result_type(prefix: str) -> str:
    text = _strip_balanced(_strip_balanced(prefix, _DECORATION), _MACRO_CALL)
    words = [w for w in re.findall(r"[\w:]+|\*", text)
             if w not in {"__global__", "__host__", "static", "inline", "__forceinline__",
                          "__noinline__", "extern", "constexpr"}]
    return " ".join(words).replace(" *", "*") or "void"


def _param(text: str, index: int) -> Param:
    decl = _split_default(text)
    is_array = bool(re.search(r"\[[^\]]*\]\s*$", decl))
    decl = re.sub(r"\[[^\]]*\]\s*$", "", decl)
    if "&" in decl:
        raise ArgumentError(f"parameter {index} '{text.strip()}' is a C++ reference, which cannot "
                            f"be passed from Python; take a pointer instead")
    stars = decl.count("*") + is_array
    words = re.findall(r"[A-Za-z_][\w]*(?:\s*::\s*[A-Za-z_]\w*)*(?:\s*<[^()]*>)?",
                       _QUALIFIERS.sub(" ", decl.replace("*", " ")))
    words = [re.sub(r"\s+", "", w) if "::" in w or "<" in w else w for w in words]
    name = f"arg{index}"
    if len(words) >= 2 and words[-1] not in _TYPE_WORDS:
        name = words.pop()
    base = " ".join(words)
    spelled = base + "*" * stars
    if base in _STREAMS and (stars == 0 or (base == "CUstream_st" and stars == 1)):
        return Param(name, spelled, "stream")
    if stars:
        return Param(name, spelled, "pointer")
    if base in _SCALARS:
        fmt, ct = _SCALARS[base]
        return Param(name, spelled, "scalar", fmt, ct)
    return Param(name, spelled, "opaque", "", ctypes.c_void_p)


def _split_default(text: str) -> str:
    depth = 0
    for i, ch in enumerate(text):
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        elif ch == "=" and depth == 0:
            return text[:i]
    return text


def result_is_checked(result: str) -> bool:
    return result in _CHECKED_RESULTS


# ----------------------------------------------------------------------------------- arguments
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
    if isinstance(arg, int):
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
        self._call = self._generate(pack)

    def __call__(self, args: tuple, stream: object = None) -> tuple[object, int | None]:
        return self._call(args, stream)

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
