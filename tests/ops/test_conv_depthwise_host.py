"""The depthwise kernels' own CUDA source, compiled as host C++ (a thread at a time, in order:
the kernels share no memory and never synchronize, so that is one valid schedule) and driven by
vitrail.ops.conv.depthwise's own host code, against torch's convolution and its gradients in
fp64 on the CPU: the index math, the vector widths, the strides and every output element
(NaN-filled outputs and partials) checked without a GPU. The GPU tests run the same kernels."""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

# The device-only parts of the source, for the host: fp16 conversions are not used (bf16 only)
_SHIMS = r"""
#include <cmath>
#include <cstring>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
static Dim3 blockIdx, threadIdx, blockDim, gridDim;
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __fdividef(float a, float b) { return a / b; }
static inline float host_expf(float a) { return std::exp(a); }
static inline unsigned short host_bf16(float f) {  // round to nearest even (finite values)
  unsigned u;
  std::memcpy(&u, &f, 4);
  return static_cast<unsigned short>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
"""
_LOAD_F16 = """  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;"""
_STORE = """  unsigned short h;
  if (kBf16) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;"""
_VECTORS = (8, 4, 2, 1)
_GEOMETRY = ("long long n_, long long h_, long long w_, long long c_, long long p_, "
             "long long q_, long long k_, long long r_, long long s_, long long xs0, "
             "long long xs1, long long xs2, long long ys0, long long ys1, long long ys2, "
             "long long ws0, long long ws1, long long ws2, int sh_, int sw_, int ph_, int pw_, "
             "int dh_, int dw_, int m_")
_NAMES = ("n_, h_, w_, c_, p_, q_, k_, r_, s_, xs0, xs1, xs2, ys0, ys1, ys2, ws0, ws1, ws2, "
          "sh_, sw_, ph_, pw_, dh_, dw_, m_")


def _entries() -> str:
    """extern "C" functions that run a kernel's grid one thread after another."""
    run = ("static void run(unsigned gx, unsigned gy, void (*f)(void*), void* a) {\n"
           "  gridDim.x = gx; gridDim.y = gy; blockDim.x = 256;\n"
           "  for (unsigned y = 0; y < gy; ++y) for (unsigned b = 0; b < gx; ++b)\n"
           "    for (unsigned t = 0; t < 256; ++t) {\n"
           "      blockIdx.x = b; blockIdx.y = y; threadIdx.x = t; f(a);\n"
           "    }\n}\n")
    out = [run, 'extern "C" {',
           "void taps(unsigned g, const unsigned short* wt, unsigned short* out, long long k, "
           "long long r, long long s, long long wk, long long wr, long long ws) {\n"
           "  auto f = [&] { vitrail_dw_taps(wt, out, k, r, s, wk, wr, ws); };\n"
           "  run(g, 1, [](void* p) { (*static_cast<decltype(f)*>(p))(); }, &f);\n}"]
    for v in _VECTORS:
        for act in (0, 5):
            for bias in (0, 1):
                out.append(
                    f"void fprop_{v}_{act}_{bias}(unsigned g, const unsigned short* x, "
                    f"const unsigned short* wt, const unsigned short* b, unsigned short* y, "
                    f"float slope, {_GEOMETRY}) {{\n"
                    f"  auto f = [&] {{ vitrail_dw_fprop<1, {v}, {act}, {bias}>(x, wt, b, y, "
                    f"slope, {_NAMES}); }};\n"
                    f"  run(g, 1, [](void* p) {{ (*static_cast<decltype(f)*>(p))(); }}, &f);\n}}")
        out.append(
            f"void dgrad_{v}(unsigned g, const unsigned short* dy, const unsigned short* wt, "
            f"unsigned short* dx, {_GEOMETRY}) {{\n"
            f"  auto f = [&] {{ vitrail_dw_dgrad<1, {v}>(dy, wt, dx, {_NAMES}); }};\n"
            f"  run(g, 1, [](void* p) {{ (*static_cast<decltype(f)*>(p))(); }}, &f);\n}}")
        out.append(
            f"void wgrad_{v}(unsigned gx, unsigned gy, const unsigned short* dy, "
            f"const unsigned short* x, float* part, long long chunk, {_GEOMETRY}) {{\n"
            f"  auto f = [&] {{ vitrail_dw_wgrad<1, {v}>(dy, x, part, chunk, {_NAMES}); }};\n"
            f"  run(gx, gy, [](void* p) {{ (*static_cast<decltype(f)*>(p))(); }}, &f);\n}}")
    return "\n".join(out + ["}"])


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    """The kernels as a host library, and depthwise._kernel answering with its functions."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("needs g++")
    from vitrail.ops.conv import depthwise
    source = depthwise._SOURCE
    for device, host in ((_LOAD_F16, "  return 0.f;  // fp16: not emulated"),
                         (_STORE, "  return host_bf16(f);"), ("__expf(", "host_expf(")):
        assert device in source, f"the kernels' source changed: update the shims ({device!r})"
        source = source.replace(device, host)
    path = tmp_path_factory.mktemp("depthwise")
    (path / "k.cpp").write_text(_SHIMS + source + _entries())
    subprocess.run([compiler, "-std=c++17", "-O2", "-shared", "-fPIC", "-o", str(path / "k.so"),
                    str(path / "k.cpp")], check=True, capture_output=True)
    lib = ctypes.CDLL(str(path / "k.so"))
    ll, i32, ptr = ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p
    geometry = [ll] * 18 + [i32] * 7
    grid = ctypes.c_uint

    class Launch:
        def __init__(self, kind: str, template: tuple):
            self.kind, self.template = kind, template

        def __getitem__(self, config):
            blocks, threads = config
            assert threads == depthwise.THREADS == 256
            if self.kind == "taps":
                f, head = lib.taps, [grid, ptr, ptr] + [ll] * 6
            elif self.kind == "fprop":
                _, v, act, bias = self.template
                f, head = getattr(lib, f"fprop_{v}_{act}_{bias}"), \
                    [grid, ptr, ptr, ptr, ptr, ctypes.c_float] + geometry
            elif self.kind == "dgrad":
                f = getattr(lib, f"dgrad_{self.template[1]}")
                head = [grid, ptr, ptr, ptr] + geometry
            else:
                f, head = getattr(lib, f"wgrad_{self.template[1]}"), \
                    [grid, grid, ptr, ptr, ptr, ll] + geometry
            f.argtypes = head
            grids = blocks if isinstance(blocks, tuple) else (blocks,)
            return lambda *args: f(*grids, *(a.data_ptr() if isinstance(a, torch.Tensor)
                                             else 0 if a is None else a for a in args))

    saved = depthwise._kernel
    depthwise._kernel = lambda kind, *template: Launch(kind, template)
    yield depthwise
    depthwise._kernel = saved


def _cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("C, m, R, S, stride, padding, dilation, activation", [
    (32, 1, 3, 3, (1, 1), (1, 1), (1, 1), "silu"),  # 8 channels a thread
    (20, 1, 7, 7, (2, 2), (3, 3), (1, 1), None),  # 4 a thread, 7x7 at stride 2
    (6, 1, 3, 3, (2, 3), (1, 2), (2, 1), "silu"),  # 2 a thread, uneven stride and dilation
    (13, 1, 5, 3, (2, 1), (2, 0), (1, 2), "silu"),  # odd channels: one a thread
    (8, 3, 3, 3, (1, 1), (1, 1), (1, 1), None),  # 3 filters a channel
    (16, 2, 4, 4, (3, 3), (0, 0), (1, 1), "silu"),  # 2 filters a channel, pixels no tap reaches
])
def test_the_kernels_source_computes_a_depthwise_convolution(host_kernels, C, m, R, S, stride,
                                                             padding, dilation, activation):
    depthwise = host_kernels
    g = torch.Generator().manual_seed(C * 7 + R)
    n, h, w = 2, 13, 11
    x = _cl(torch.randn(n, C, h, w, generator=g).bfloat16())
    wt = _cl(torch.randn(C * m, 1, R, S, generator=g).bfloat16())
    b = torch.randn(C * m, generator=g).bfloat16()
    z = F.conv2d(x.double(), wt.double(), b.double(), stride, padding, dilation, C)
    want = F.silu(z) if activation else z
    y = _cl(torch.full(want.shape, float("nan"), dtype=torch.bfloat16))
    scratch = lambda k, dtype: torch.full((k,), float("nan"), dtype=dtype)  # noqa: E731
    depthwise.fprop(x.permute(0, 2, 3, 1), wt, b, y.permute(0, 2, 3, 1), stride, padding,
                    dilation, activation, scratch)
    dy = _cl(torch.randn(want.shape, generator=g).bfloat16())
    dx = _cl(torch.full(x.shape, float("nan"), dtype=torch.bfloat16))
    depthwise.dgrad(dy.permute(0, 2, 3, 1), wt, dx.permute(0, 2, 3, 1), stride, padding,
                    dilation, scratch)
    dw = _cl(torch.empty(wt.shape, dtype=torch.bfloat16))
    partials, blocks = depthwise.wgrad(dy.permute(0, 2, 3, 1), x.permute(0, 2, 3, 1), dw, stride,
                                       padding, dilation, lambda k: scratch(k, torch.float32))
    dw = partials.view(blocks, *wt.shape).sum(0)  # the sum kernel's work
    dx64 = torch.nn.grad.conv2d_input(x.shape, wt.double(), dy.double(), stride, padding,
                                      dilation, C)
    dw64 = torch.nn.grad.conv2d_weight(x.double(), wt.shape, dy.double(), stride, padding,
                                       dilation, C)
    for got, ref, what in ((y, want, "y"), (dx, dx64, "dx"), (dw, dw64, "dw")):
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 0.01, f"{what}: relative error {err}"  # bf16 rounding: about 0.004
