"""The depthwise kernels' own CUDA source (and the shared sum of dw's partials,
vitrail.ops.conv.partials), compiled as host C++ (blocks one after another, a
block's threads in turn or, where they synchronize, as host threads: valid schedules) and
driven by
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

# The device-only parts of the source, for the host: blocks one after another, a block's 256
# threads one after another (kernels that never synchronize) or as host threads that meet at a
# barrier (__syncthreads; a block's shared memory is a static); fp16 conversions are not used
# (bf16 only)
_SHIMS = r"""
#include <barrier>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
static thread_local Dim3 blockIdx, threadIdx;
static Dim3 blockDim, gridDim;
static std::barrier<>* block_barrier;
static inline void __syncthreads() { block_barrier->arrive_and_wait(); }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __fdividef(float a, float b) { return a / b; }
static inline float host_expf(float a) { return std::exp(a); }
static inline unsigned short host_bf16(float f) {  // round to nearest even (finite values)
  unsigned u;
  std::memcpy(&u, &f, 4);
  return static_cast<unsigned short>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
// a grid's blocks in order; a block's threads one after another, or (kSync: the kernel
// synchronizes them) as 256 host threads that run every block and meet at one barrier, at the
// kernel's __syncthreads and after each block (its shared memory is the next block's)
template <bool kSync, class F>
static void run(unsigned gx, unsigned gy, unsigned gz, const F& f) {
  gridDim = {gx, gy, gz};
  blockDim = {256, 1, 1};
  auto blocks = [&](unsigned t) {
    threadIdx = {t, 0, 0};
    for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        blockIdx = {x, y, z};
        if (!kSync) {
          for (unsigned u = 0; u < 256; ++u) { threadIdx = {u, 0, 0}; f(); }
          continue;
        }
        f();
        block_barrier->arrive_and_wait();
      }
  };
  if (!kSync) return blocks(0);
  std::barrier<> barrier(256);
  block_barrier = &barrier;
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < 256; ++t) threads.emplace_back(blocks, t);
  for (auto& thread : threads) thread.join();
}
"""
_SYNCHRONIZING = ("wgrad", "sum")  # the kernels that call __syncthreads
_LOAD_F16 = """  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;"""
_STORE = """  unsigned short h;
  if (kBf16) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;"""
_C_TYPES = {"long long": ctypes.c_longlong, "int": ctypes.c_int, "float": ctypes.c_float}


def _entry(j: int, kind: str, template: tuple, signature: str) -> tuple[str, list]:
    """An extern "C" function entry<j>(gx, gy, gz, kernel arguments...) that runs the kernel's
    grid on the host, and its ctypes argument types (kind "sum": the shared sum of partials)."""
    types = [t.strip() for t in signature.split(",")]
    names = [f"a{i}" for i in range(len(types))]
    name = ("vitrail_conv_partials_sum" if kind == "sum" else f"vitrail_dw_{kind}") + (
        f"<{', '.join(map(str, template))}>" if template else "")
    source = (f'extern "C" void entry{j}(unsigned gx, unsigned gy, unsigned gz, '
              f'{", ".join(f"{t} {a}" for t, a in zip(types, names))}) {{\n'
              f'  run<{str(kind in _SYNCHRONIZING).lower()}>(gx, gy, gz, '
              f'[&] {{ {name}({", ".join(names)}); }});\n}}\n')
    grid = [ctypes.c_uint] * 3
    return source, grid + [ctypes.c_void_p if t.endswith("*") else _C_TYPES[t] for t in types]


def _cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


CASES = [  # C, m, R, S, stride, padding, dilation, activation, width
    (32, 1, 3, 3, (1, 1), (1, 1), (1, 1), "silu", 11),  # 8 channels a thread; dx as an fprop
    (20, 1, 7, 7, (2, 2), (3, 3), (1, 1), None, 11),  # 4 a thread, 7x7 at stride 2
    (6, 1, 3, 3, (2, 3), (1, 2), (2, 1), "silu", 11),  # 2 a thread, tap by tap (stride 3)
    (13, 1, 5, 3, (2, 1), (2, 0), (1, 2), "silu", 11),  # odd channels, tap by tap (dilation 2)
    (8, 3, 3, 3, (1, 1), (1, 1), (1, 1), None, 11),  # 3 filters a channel
    (16, 2, 4, 4, (3, 3), (0, 0), (1, 1), "silu", 11),  # 2 filters a channel, pixels no tap reaches
    (40, 1, 5, 9, (1, 1), (3, 4), (2, 1), None, 75),  # rows dilated; runs of outputs in dw
    (16, 1, 3, 10, (1, 2), (1, 4), (1, 1), "silu", 23),  # wider than the kernels compile in
    (8, 1, 2, 2, (3, 3), (0, 0), (1, 1), None, 11),  # dx phases that no tap reaches: zeros
    (24, 1, 5, 3, (2, 3), (2, 1), (1, 1), None, 14),  # dx: 6 phases of 3x1, 3x1, 2x1 taps
]
SEGMENT = 4  # dw's segments: many units, and more partials than the sum's 8 lanes


def _convolve(depthwise, C, m, R, S, stride, padding, dilation, activation, width) -> list:
    """(got, want, what) of y, dx and dw: depthwise's host code (its kernels, outputs and
    scratch NaN-filled first) against torch's convolution and gradients in fp64."""
    g = torch.Generator().manual_seed(C * 7 + R)
    n, h, w = 2, 13, width
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
    dw = _cl(torch.full(wt.shape, float("nan"), dtype=torch.bfloat16))
    depthwise.wgrad(dy.permute(0, 2, 3, 1), x.permute(0, 2, 3, 1), dw, stride, padding, dilation,
                    lambda k: scratch(k, torch.float32))
    dx64 = torch.nn.grad.conv2d_input(x.shape, wt.double(), dy.double(), stride, padding,
                                      dilation, C)
    dw64 = torch.nn.grad.conv2d_weight(x.double(), wt.shape, dy.double(), stride, padding,
                                       dilation, C)
    return [(y, want, "y"), (dx, dx64, "dx"), (dw, dw64, "dw")]


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    """depthwise._kernel (and partials._kernel, the sum of dw's partials: kind "sum")
    answering with the kernels built as one host library: the kernels that the host code
    launches for CASES (a first pass over them, launching nothing, lists them)."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("needs g++")
    from vitrail.ops.conv import depthwise, partials
    sources = [depthwise._SOURCE, partials.SOURCE]
    for device, host, where in ((_LOAD_F16, "  return 0.f;  // fp16: not emulated", (0,)),
                                (_STORE, "  return host_bf16(f);", (0, 1)),
                                ("__expf(", "host_expf(", (0,))):
        for i in where:
            assert device in sources[i], (f"the kernels' source changed: update the shims "
                                          f"({device!r})")
            sources[i] = sources[i].replace(device, host)
    source = "".join(sources)
    saved = depthwise._kernel, depthwise.SEGMENT, partials._kernel
    kernels: list[tuple] = []

    class Listed:  # depthwise._kernel(kind, *template)
        def __init__(self, kind: str, *template: int):
            if (kind, template) not in kernels:
                kernels.append((kind, template))

        def __getitem__(self, config):
            return lambda *args: None
    depthwise._kernel, depthwise.SEGMENT = Listed, SEGMENT
    partials._kernel = lambda bf16: Listed("sum", bf16)
    try:
        for case in CASES:
            _convolve(depthwise, *case)
    finally:
        depthwise._kernel, depthwise.SEGMENT, partials._kernel = saved
    assert ("sum", (1,)) in kernels, "the sum of dw's partials is no longer partials._kernel's"
    signatures = dict(depthwise._SIGNATURES, sum=partials.SIGNATURE)
    entries = [_entry(j, kind, template, signatures[kind])
               for j, (kind, template) in enumerate(kernels)]
    path = tmp_path_factory.mktemp("depthwise")
    (path / "k.cpp").write_text(_SHIMS + source + "".join(e for e, _ in entries))
    subprocess.run([compiler, "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-o",
                    str(path / "k.so"), str(path / "k.cpp")], check=True, capture_output=True)
    lib = ctypes.CDLL(str(path / "k.so"))
    functions = {}
    for j, (key, (_, argtypes)) in enumerate(zip(kernels, entries)):
        functions[key] = getattr(lib, f"entry{j}")
        functions[key].argtypes = argtypes

    class Launch:  # depthwise._kernel(kind, *template)
        def __init__(self, kind: str, *template: int):
            self.f = functions[kind, template]

        def __getitem__(self, config):
            blocks, threads = config
            assert threads == depthwise.THREADS == 256
            grid = (tuple(blocks) if isinstance(blocks, tuple) else (blocks,)) + (1, 1)
            return lambda *args: self.f(*grid[:3], *(
                a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args))

    depthwise._kernel = Launch
    partials._kernel = lambda bf16: Launch("sum", bf16)
    yield depthwise
    depthwise._kernel, partials._kernel = saved[0], saved[2]


@pytest.mark.parametrize("C, m, R, S, stride, padding, dilation, activation, width", CASES)
def test_the_kernels_source_computes_a_depthwise_convolution(host_kernels, C, m, R, S, stride,
                                                             padding, dilation, activation,
                                                             width, monkeypatch):
    monkeypatch.setattr(host_kernels, "SEGMENT", SEGMENT)
    for got, ref, what in _convolve(host_kernels, C, m, R, S, stride, padding, dilation,
                                    activation, width):
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 0.01, f"{what}: relative error {err}"  # bf16 rounding: about 0.004
