"""C prototypes read from CUDA source, and Python values checked against them; no GPU needed.

find_prototype is fed realistic sources (comments, calls of the function, extern "C" blocks,
templates, namespaces, launch bounds); scalar_value and pointer_of are checked against NumPy's
and torch's own conversions; Marshaller runs with int addresses and an int stream handle, which
need no GPU; parse_ptxas reads a log captured from ptxas -v (CUDA 13.0).
"""
from __future__ import annotations

import ctypes
import math
import random
import shutil

import numpy as np
import pytest
import torch

from vitrail.jit.errors import ArgumentError
from vitrail.jit.module import parse_ptxas
from vitrail.jit.arguments import Marshaller, pointer_of, scalar_value, stream_of
from vitrail.jit.signature import Param, Prototype, find_prototype, parse_signature


def kinds(proto: Prototype) -> list[tuple[str, str, str]]:
    return [(p.name, p.type, p.kind) for p in proto.params]


# -------------------------------------------------------------------------- extern "C" entries
ENTRY = r'''
#include <cuda_runtime.h>
#include <cstdint>
#include "ops.h"   // declares launch_add(const float*, float*, int64_t, float, cudaStream_t)

// launch_add(x, y, n) adds alpha * x to y; launch_add(double) does not exist
/* launch_add(int bogus) in a block comment,
   spanning lines: extern "C" void launch_add(char c); */
#define LAUNCH_ADD_ALIAS(a, b) launch_add(a, b, 0, 1.0f, 0)

extern "C" cudaError_t run_twice(const float* x, float* y, int64_t n) {
  cudaError_t err = launch_add(x, y, n, 1.0f, 0);   // a call before the definition
  if (err != cudaSuccess) return err;
  else launch_add(x, y, n, 1.0f, nullptr);
  return launch_add(x, y, n, 2.0f, 0);
}

__global__ void add_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n,
                           float alpha) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) y[i] += alpha * x[i];
}

extern "C" cudaError_t launch_add(const float* __restrict__ x,
                                  float* __restrict__ y,
                                  int64_t n,
                                  float alpha = 1.0f,   /* the scale, launch_add(...) style */
                                  cudaStream_t stream = nullptr) {
  add_kernel<<<(n + 255) / 256, 256, 0, stream>>>(x, y, n, alpha);
  return cudaGetLastError();
}

extern "C" {
void fill(float x[], unsigned int, double value);
int version(void);
size_t workspace_bytes(int64_t m, int64_t n, const int* const sizes, CUstream_st* s);
}
'''


def test_an_entry_point_with_const_restrict_defaults_and_a_stream():
    proto = find_prototype(ENTRY, "launch_add", kernel=False)
    assert proto.name == "launch_add" and proto.result == "cudaError_t"
    assert kinds(proto) == [("x", "float*", "pointer"), ("y", "float*", "pointer"),
                            ("n", "int64_t", "scalar"), ("alpha", "float", "scalar"),
                            ("stream", "cudaStream_t", "stream")]
    assert [p.fmt for p in proto.params[2:4]] == ["q", "f"]
    assert proto.params[2].ctype is ctypes.c_int64 and proto.params[3].ctype is ctypes.c_float
    assert str(proto) == ("cudaError_t launch_add(float* x, float* y, int64_t n, float alpha, "
                          "cudaStream_t stream)")


def test_the_function_calling_it_is_found_too():
    proto = find_prototype(ENTRY, "run_twice", kernel=False)
    assert kinds(proto) == [("x", "float*", "pointer"), ("y", "float*", "pointer"),
                            ("n", "int64_t", "scalar")]


def test_entries_in_an_extern_c_block():
    fill = find_prototype(ENTRY, "fill", kernel=False)
    assert fill.result == "void"
    assert kinds(fill) == [("x", "float*", "pointer"), ("arg1", "unsigned int", "scalar"),
                           ("value", "double", "scalar")]
    assert [p.fmt for p in fill.params] == ["Q", "I", "d"]
    version = find_prototype(ENTRY, "version", kernel=False)
    assert version.result == "int" and version.params == ()
    ws = find_prototype(ENTRY, "workspace_bytes", kernel=False)
    assert ws.result == "size_t"
    assert kinds(ws) == [("m", "int64_t", "scalar"), ("n", "int64_t", "scalar"),
                         ("sizes", "int*", "pointer"), ("s", "CUstream_st*", "stream")]


def test_a_kernel_is_not_an_entry_point_and_vice_versa():
    with pytest.raises(ArgumentError, match="no host function .*'add_kernel'"):
        find_prototype(ENTRY, "add_kernel", kernel=False)
    assert kinds(find_prototype(ENTRY, "add_kernel", kernel=True))[3] == ("alpha", "float",
                                                                         "scalar")
    with pytest.raises(ArgumentError, match="no __global__ kernel named 'launch_add'"):
        find_prototype(ENTRY, "launch_add", kernel=True)


@pytest.mark.parametrize("call", [
    "f(c, 1.0f);",
    "return f(c, 1.0f);",
    "int r = f(c, 1.0f);",
    "if (c) f(c, 1.0f);",
    "if (c) return; else f(c, 1.0f);",
    "(void)f(c, 1.0f);",
    "switch (c) { case 0: f(c, 1.0f); break; default: f(c, 2.0f); }",
    "for (int i = 0; i < c; ++i) f(i, 1.0f);",
    "for (;;) f(c, 1.0f);",
    "do f(c, 1.0f); while (0);",
    "again: f(c, 1.0f);",
    "throw f(c, 1.0f);",
    "CHECK(f(c, 1.0f));",
    "int r{f(c, 1.0f)};",
])
def test_a_call_before_the_definition_is_not_taken_for_it(call):
    # f is declared in a header, so the caller may come first; the parameters must be f's
    source = ('#include "f.h"\nextern "C" void caller(int c) {\n  ' + call + "\n}\n"
              'extern "C" int f(int a, float b) { return a + (int)b; }\n')
    proto = find_prototype(source, "f", kernel=False)
    assert str(proto) == "int f(int a, float b)"


def test_a_forward_declaration_with_unnamed_parameters_counts():
    source = ('extern "C" void g(const float*, int, cudaStream_t);\n'
              'extern "C" void h() { g(nullptr, 1, 0); }\n'
              'extern "C" void g(const float* p, int n, cudaStream_t s) {}\n')
    assert kinds(find_prototype(source, "g", kernel=False)) == [
        ("arg0", "float*", "pointer"), ("arg1", "int", "scalar"), ("arg2", "cudaStream_t",
                                                                    "stream")]


def test_references_are_refused():
    source = 'extern "C" void r(const float* x, float& out, int n) {}\n'
    with pytest.raises(ArgumentError, match=r"parameter 1 'float& out' is a C\+\+ reference"):
        find_prototype(source, "r", kernel=False)


def test_a_missing_name_is_an_argument_error():
    with pytest.raises(ArgumentError, match="no host function .*'nope'"):
        find_prototype(ENTRY, "nope", kernel=False)
    # mentioned only in comments and calls: still missing
    with pytest.raises(ArgumentError, match="'launch_add'"):
        find_prototype('#include "ops.h"\n// launch_add(int)\n'
                       'extern "C" int g() { return launch_add(1); }\n', "launch_add",
                       kernel=False)


def test_scalar_type_spellings():
    proto = parse_signature(
        "void(bool a, signed char b, unsigned char c, short d, unsigned short e, unsigned f, "
        "long long g, unsigned long long h, uint64_t i, ptrdiff_t j, __half k, "
        "__nv_bfloat16 l, const double m, char* n)", "k")
    assert [(p.name, p.fmt) for p in proto.params] == [
        ("a", "?"), ("b", "b"), ("c", "B"), ("d", "h"), ("e", "H"), ("f", "I"), ("g", "q"),
        ("h", "Q"), ("i", "Q"), ("j", "q"), ("k", "e"), ("l", "bf16"), ("m", "d"), ("n", "Q")]
    assert proto.params[-1].kind == "pointer"


# ------------------------------------------------------------------------------------- kernels
KERNELS = r'''
#include <cuda_fp16.h>
struct Params { float* out; int n; };

template <typename T, int N>
__global__ void __launch_bounds__(256, 1) scale(T* __restrict__ out, const T* in, T factor,
                                                int n) {
  // scale(out, in, 2, n) would not compile here; the comment must not confuse the parser
  for (int i = threadIdx.x; i < n; i += N) out[i] = in[i] * factor;
}

namespace ns {
template <class U>
__global__ void k(U* p, U v, const __half h, __nv_bfloat16 b, Params params) {}
}  // namespace ns

template <typename T = float, int BLOCK = 128>
__global__ void __launch_bounds__(BLOCK) with_defaults(T* p, T v) {}

extern "C" __global__ void __launch_bounds__(128) plain(float x[], const int* __restrict__ idx,
                                                       unsigned long long seed) {}
'''


def test_a_template_kernel_gets_its_template_arguments():
    proto = find_prototype(KERNELS, "scale<float, 4>", kernel=True)
    assert proto.name == "scale" and proto.result == "void"
    assert kinds(proto) == [("out", "float*", "pointer"), ("in", "float*", "pointer"),
                            ("factor", "float", "scalar"), ("n", "int", "scalar")]
    assert proto.params[2].fmt == "f"
    half = find_prototype(KERNELS, "scale<__half, 8>", kernel=True)
    assert (half.params[2].type, half.params[2].fmt) == ("__half", "e")
    # without template arguments, T stays a template type: an opaque value, a pointer
    raw = find_prototype(KERNELS, "scale", kernel=True)
    assert kinds(raw)[:3] == [("out", "T*", "pointer"), ("in", "T*", "pointer"),
                              ("factor", "T", "opaque")]


def test_a_kernel_in_a_namespace():
    proto = find_prototype(KERNELS, "ns::k<int>", kernel=True)
    assert kinds(proto) == [("p", "int*", "pointer"), ("v", "int", "scalar"),
                            ("h", "__half", "scalar"), ("b", "__nv_bfloat16", "scalar"),
                            ("params", "Params", "opaque")]
    assert [p.fmt for p in proto.params[1:4]] == ["i", "e", "bf16"]


def test_template_default_arguments():
    # the '=' of a template default argument was taken for an assignment: kernel not found
    proto = find_prototype(KERNELS, "with_defaults<double>", kernel=True)
    assert kinds(proto) == [("p", "double*", "pointer"), ("v", "double", "scalar")]


def test_launch_bounds_arrays_and_extern_c_kernels():
    proto = find_prototype(KERNELS, "plain", kernel=True)
    assert kinds(proto) == [("x", "float*", "pointer"), ("idx", "int*", "pointer"),
                            ("seed", "unsigned long long", "scalar")]
    assert proto.params[2].fmt == "Q"


def test_parse_signature_full_and_bare():
    full = parse_signature("void(const float*, int)", "k")
    bare = parse_signature("const float*, int", "k")
    for proto in (full, bare):
        assert proto.name == "k" and proto.result == "void"
        assert kinds(proto) == [("arg0", "float*", "pointer"), ("arg1", "int", "scalar")]
    named = parse_signature("cudaError_t(const __half* x, int64_t n, cudaStream_t s)", "f")
    assert named.result == "cudaError_t"
    assert kinds(named) == [("x", "__half*", "pointer"), ("n", "int64_t", "scalar"),
                            ("s", "cudaStream_t", "stream")]
    assert parse_signature("void(void)", "k").params == ()
    assert parse_signature("", "k").params == ()


# ---------------------------------------------------------------------------------- scalar_value
def param(decl: str) -> Param:
    return parse_signature(decl, "k").params[0]


@pytest.mark.parametrize("ctype, lo, hi", [
    ("int8_t", -128, 127), ("uint8_t", 0, 255), ("int16_t", -2**15, 2**15 - 1),
    ("uint16_t", 0, 2**16 - 1), ("int", -2**31, 2**31 - 1), ("uint32_t", 0, 2**32 - 1),
    ("int64_t", -2**63, 2**63 - 1), ("size_t", 0, 2**64 - 1),
])
def test_integer_ranges(ctype, lo, hi):
    p = param(f"{ctype} count")
    for ok in (lo, hi, 0, (lo + hi) // 2):
        assert scalar_value(ok, p, "mod.f") == ok
    for bad in (lo - 1, hi + 1):
        with pytest.raises(ArgumentError) as e:
            scalar_value(bad, p, "mod.f")
        assert "mod.f: argument 'count'" in str(e.value)
        assert f"outside [{lo}, {hi}]" in str(e.value) and str(bad) in str(e.value)


def test_the_named_range_cases():
    with pytest.raises(ArgumentError, match=r"argument 'x' \(int8_t\) got 128"):
        scalar_value(128, param("int8_t x"), "k")
    with pytest.raises(ArgumentError, match=r"'u' \(uint32_t\) got -1"):
        scalar_value(-1, param("uint32_t u"), "k")
    with pytest.raises(ArgumentError, match="'n'"):
        scalar_value(2**63, param("int64_t n"), "k")


def test_integers_accept_integral_floats_and_numpy_scalars():
    p = param("int n")
    assert scalar_value(3.0, p, "k") == 3 and type(scalar_value(3.0, p, "k")) is int
    with pytest.raises(ArgumentError, match="expected an integer"):
        scalar_value(3.5, p, "k")
    assert scalar_value(np.int8(-5), p, "k") == -5
    assert scalar_value(np.uint64(7), p, "k") == 7
    assert scalar_value(torch.tensor(9), p, "k") == 9
    assert scalar_value(np.uint64(2**64 - 1), param("uint64_t u"), "k") == 2**64 - 1
    with pytest.raises(ArgumentError, match="outside"):
        scalar_value(np.int64(-1), param("unsigned u"), "k")
    with pytest.raises(ArgumentError, match="expected a number"):
        scalar_value(object(), p, "k")


@pytest.mark.parametrize("decl", ["int n", "float n", "bool n", "__half n", "double n"])
def test_strings_are_not_numbers(decl):
    # int("3") and float("1.5") used to accept them, and bool("false") was True
    for text in ("3", "false", b"1"):
        with pytest.raises(ArgumentError, match="expected a number"):
            scalar_value(text, param(decl), "k")


def test_floats_accept_ints_and_numpy_scalars():
    f, d = param("float a"), param("double b")
    for value, want in ((3, 3.0), (-2**40, float(-2**40)), (np.float32(1.5), 1.5),
                        (np.float64(0.1), 0.1), (np.int16(-7), -7.0), (2.5, 2.5)):
        for p in (f, d):
            got = scalar_value(value, p, "k")
            assert type(got) is float and got == want
    assert math.isnan(scalar_value(float("nan"), d, "k"))


def test_bool():
    p = param("bool flag")
    for value, want in ((True, True), (False, False), (1, True), (0, False),
                        (np.bool_(True), True), (np.bool_(False), False)):
        got = scalar_value(value, p, "k")
        assert type(got) is bool and got is want


HALF_VALUES = [0.0, -0.0, 1.0, -2.5, 0.1, 1 / 3, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6e-8,
               2.0**-24, 3e-8, 1e-10, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, math.inf, -math.inf,
               np.float32(0.3), np.float16(0.5)]


@pytest.mark.parametrize("value", HALF_VALUES, ids=str)
def test_half_bits_are_ieee_round_to_nearest_even(value):
    # 65520 and 1e6 round past the largest half: inf, as NumPy and __float2half give (this
    # raised struct's OverflowError); 1 + 2**-11 is a tie that rounds to even
    with np.errstate(over="ignore"):
        want = int(np.float16(value).view(np.uint16))
    assert scalar_value(value, param("__half h"), "k") == want


def test_half_nan_stays_nan():
    bits = scalar_value(math.nan, param("half h"), "k")
    assert bits & 0x7C00 == 0x7C00 and bits & 0x03FF


def _bf16_reference(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # 1e39 -> inf, as in the conversion under test
        t = torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16)
    return (t.view(torch.int16).numpy().astype(np.int64) & 0xFFFF)


def test_bfloat16_bits_match_torch_on_random_float32s():
    rng = np.random.default_rng(1234)
    bits = rng.integers(0, 2**32, size=3000, dtype=np.uint64).astype(np.uint32)
    ties = (rng.integers(0, 2**16, size=500, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000
    values = np.concatenate([bits, ties]).view(np.float32)
    values = values[~np.isnan(values)]
    want = _bf16_reference(values)
    p = param("__nv_bfloat16 b")
    got = np.array([scalar_value(float(v), p, "k") for v in values])
    mismatch = np.nonzero(got != want)[0]
    assert mismatch.size == 0, [(float(values[i]), hex(got[i]), hex(want[i]))
                                for i in mismatch[:5]]


def test_bfloat16_of_python_floats_and_specials():
    rng = random.Random(7)
    values = ([rng.uniform(-1e3, 1e3) for _ in range(300)]
              + [rng.gauss(0, 1) * 10.0**rng.randint(-40, 38) for _ in range(300)]
              + [0.0, -0.0, 1.0, 1.00390625, 1.01171875, 3.4e38, 3.4028234663852886e38,
                 1e39, -1e39, math.inf, -math.inf, 1e-45, 1e-40])
    want = _bf16_reference(np.array(values, dtype=np.float64))
    p = param("nv_bfloat16 b")
    got = [scalar_value(v, p, "k") for v in values]
    assert got == want.tolist()
    assert scalar_value(np.float32(2.0), p, "k") == 0x4000
    for nan in (math.nan, -math.nan, float(np.array(0x7F800001, np.uint32).view(np.float32))):
        b = scalar_value(nan, p, "k")
        assert b & 0x7F80 == 0x7F80 and b & 0x7F, hex(b)  # a NaN, not inf


# ------------------------------------------------------------------------------------ pointer_of
PTR = Param("x", "float*", "pointer")


class FakeCudaArray:
    def __init__(self, ptr: int, shape: tuple, strides: tuple | None, typestr: str = "<f4"):
        self.__cuda_array_interface__ = {"shape": shape, "strides": strides, "typestr": typestr,
                                         "data": (ptr, False), "version": 3}


class NumpyDLPack:
    """Only the DLPack protocol of a NumPy array (host memory, device type 1)."""

    def __init__(self, a: np.ndarray):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


@pytest.mark.parametrize("host", [
    torch.zeros(4), np.zeros(4, np.float32), NumpyDLPack(np.zeros(4, np.float32)),
    np.float32(1.0),
], ids=["cpu-tensor", "numpy", "numpy-dlpack", "numpy-scalar"])
def test_host_memory_is_refused(host):
    with pytest.raises(ArgumentError) as e:
        pointer_of(host, PTR, "mod.f")
    msg = str(e.value)
    assert "mod.f: argument 'x' (float*)" in msg
    assert "cpu" in msg or "host memory" in msg or "host-memory" in msg


def test_addresses_and_none_pass_through():
    assert pointer_of(0x7F00_1234_5000, PTR, "k") == (0x7F00_1234_5000, None)
    assert pointer_of(None, PTR, "k") == (0, None)


def test_cuda_array_interface():
    assert pointer_of(FakeCudaArray(0xABC000, (16,), None), PTR, "k") == (0xABC000, None)
    assert pointer_of(FakeCudaArray(0xABC000, (4, 3), (12, 4)), PTR, "k") == (0xABC000, None)
    assert pointer_of(FakeCudaArray(0xABC000, (4, 1), (4, 999)), PTR, "k")[0] == 0xABC000
    assert pointer_of(FakeCudaArray(0xABC000, (4, 3), (24, 8), "<f8"), PTR, "k")[0] == 0xABC000
    for strides in ((4, 16), (24, 4)):  # transposed; every other row
        with pytest.raises(ArgumentError, match=r"'x' \(float\*\) is a non-contiguous CUDA"):
            pointer_of(FakeCudaArray(0xABC000, (4, 3), strides), PTR, "k")


def test_other_objects_are_refused():
    for bad in (1.5, "0x1000", [1, 2]):
        with pytest.raises(ArgumentError, match="argument 'x'"):
            pointer_of(bad, PTR, "k")


def test_stream_of_without_a_gpu():
    class Dunder:
        def __cuda_stream__(self):
            return (0, 0xBEEF)

    class TorchLike:
        cuda_stream = 0xCAFE

    assert stream_of(1234, None) == 1234
    assert stream_of(Dunder(), None) == 0xBEEF
    assert stream_of(TorchLike(), None) == 0xCAFE
    with pytest.raises(ArgumentError, match="stream: expected"):
        stream_of("default", None)


# ------------------------------------------------------------------------------------ Marshaller
def test_marshaller_converts_and_fills_the_stream():
    proto = find_prototype(ENTRY, "launch_add", kernel=False)
    m = Marshaller(proto, "mod.launch_add")
    values, device = m((0x1000, None, 10, 2), stream=0x5151)
    assert values == [0x1000, 0, 10, 2.0, 0x5151] and device is None
    assert type(values[3]) is float
    values, _ = m((0x1000, 0x2000, np.int64(7), np.float32(0.5), 99), stream=0x5151)
    assert values == [0x1000, 0x2000, 7, 0.5, 99]  # an explicit stream wins
    fake = FakeCudaArray(0x3000, (8,), None)
    assert m((fake, fake, 1, 1.0), stream=1)[0][:2] == [0x3000, 0x3000]


def test_marshaller_arity_and_ranges():
    proto = find_prototype(ENTRY, "launch_add", kernel=False)
    m = Marshaller(proto, "mod.launch_add")
    with pytest.raises(ArgumentError) as e:
        m((0x1000, 0x2000), stream=1)
    assert "mod.launch_add takes 5 arguments" in str(e.value) and str(proto) in str(e.value)
    assert "got 2" in str(e.value)
    with pytest.raises(ArgumentError, match="takes 5 arguments"):
        m((1, 2, 3, 4.0, 5, 6))
    with pytest.raises(ArgumentError, match=r"'n' \(int64_t\) got 9223372036854775808"):
        m((0x1000, 0x2000, 2**63, 1.0), stream=1)
    with pytest.raises(ArgumentError, match=r"'x' \(float\*\) is a tensor on cpu"):
        m((torch.zeros(3), 0x2000, 3, 1.0), stream=1)
    with pytest.raises(ArgumentError, match="'alpha'"):
        m((0x1000, 0x2000, 3, "fast"), stream=1)


def test_marshaller_stream_is_filled_only_when_last():
    proto = parse_signature("void(cudaStream_t s, int n)", "f")
    m = Marshaller(proto, "mod.f")
    assert m((5, 3))[0] == [5, 3]
    with pytest.raises(ArgumentError, match="takes 2 arguments"):
        m((3,), stream=5)


def test_marshaller_16_bit_floats_bools_and_pack():
    proto = find_prototype(KERNELS, "ns::k<int8_t>", kernel=True)
    assert [p.kind for p in proto.params] == ["pointer", "scalar", "scalar", "scalar", "opaque"]
    packed = []
    m = Marshaller(proto, "k", pack=lambda *v: packed.append(v) or "packed")
    out, device = m((None, -128, 1.0, 1.0, b"\x00" * 12))
    assert (out, device) == ("packed", None)
    assert packed == [(0, -128, 0x3C00, 0x3F80, b"\x00" * 12)]
    with pytest.raises(ArgumentError, match=r"'v' \(int8_t\) got -129"):
        m((None, -129, 1.0, 1.0, b""))
    flags = Marshaller(parse_signature("void(bool a, uint8_t b)", "g"), "g")
    assert flags((np.bool_(True), np.uint8(255)))[0] == [True, 255]
    assert Marshaller(parse_signature("void(void)", "h"), "h")(())[0] == []


# ------------------------------------------------------------------------------------ parse_ptxas
# Captured from `nvcc -c -arch=sm_90a -Xptxas=-v -maxrregcount=32` (CUDA 13.0) on a source with
# an extern "C" kernel that spills, a __noinline__ device function and a template kernel with
# static shared memory; the last entry is in the older format (cmem, no barriers).
PTXAS_LOG = """\
ptxas warning : Too big maxrregcount value specified 32, will be ignored
ptxas info    : Overriding maximum register limit 256 for 'spill' with  32 of maxrregcount option
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'spill' for 'sm_90a'
ptxas info    : Function properties for spill
    2064 bytes stack frame, 2456 bytes spill stores, 2848 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 2064 bytes cumulative stack size
ptxas info    : Compile time = 75.617 ms
ptxas info    : Function properties for _Z6helperPfi
    16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function '_Z5scaleIfLi4EEvPT_PKS0_S0_i' for 'sm_90a'
ptxas info    : Function properties for _Z5scaleIfLi4EEvPT_PKS0_S0_i
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 1 barriers, 4096 bytes smem
ptxas info    : Compile time = 1.569 ms
ptxas info    : Compiling entry function 'saxpy' for 'sm_90a'
ptxas info    : Function properties for saxpy
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, 380 bytes cmem[0]
"""


def test_parse_ptxas():
    found = parse_ptxas(PTXAS_LOG)
    scale = ("void scale<float, 4>(float*, float const*, float, int)" if shutil.which("c++filt")
             else "_Z5scaleIfLi4EEvPT_PKS0_S0_i")
    assert list(found) == ["spill", scale, "saxpy"]  # no device function, in log order
    assert found["spill"] == {"mangled": "spill", "registers": 32, "shared": 0, "barriers": 0,
                              "stack": 2064, "spill_stores": 2456, "spill_loads": 2848}
    assert found[scale] == {"mangled": "_Z5scaleIfLi4EEvPT_PKS0_S0_i", "registers": 12,
                            "shared": 4096, "barriers": 1, "stack": 0, "spill_stores": 0,
                            "spill_loads": 0}
    assert found["saxpy"] == {"mangled": "saxpy", "registers": 10, "shared": 0, "barriers": 0,
                              "stack": 0, "spill_stores": 0, "spill_loads": 0}
    from vitrail.jit.module import Resources
    r = Resources(**found["spill"])
    assert r.spills and not Resources(**found["saxpy"]).spills
    assert parse_ptxas("") == {} and parse_ptxas("nvcc warning : nothing to see\n") == {}


@pytest.mark.parametrize("bad", [-1, 2 ** 64, 2 ** 70, True])
def test_an_int_that_is_no_address_is_refused_by_name(bad):
    with pytest.raises(ArgumentError, match="k: argument 'x' \\(float\\*\\) got"):
        pointer_of(bad, PTR, "k")
