"""C prototypes read from CUDA source: what a kernel or entry point takes, parsed once.

A kernel's or entry point's parameter list is parsed from its source, so calling it from Python
needs no hand-written ctypes (arguments.py turns Python values into what the prototype declares).
Each parameter gets a *kind*:

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
import re
from dataclasses import dataclass

from vitrail.jit.errors import ArgumentError

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
