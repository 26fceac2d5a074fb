"""GPU tests of both JIT paths: values against torch on fresh random inputs, streams, devices,
argument checking. Skipped where no GPU is visible; run on an H100 before an issue is closed."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import vitrail.jit as jit
from tests.conftest import requires_gpu
from vitrail.doctor import CUTE_SOURCE

pytestmark = [requires_gpu, pytest.mark.gpu]

SAXPY = r"""
extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
"""

TYPED = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
template <typename T, int Factor>
__global__ void scale(T* __restrict__ y, const T* __restrict__ x, T alpha, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * alpha * T(Factor);
}
extern "C" __global__ void scale_bf16(__nv_bfloat16* y, const __nv_bfloat16* x,
                                      __nv_bfloat16 alpha, long long n) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = __hmul(x[i], alpha);
}
extern "C" __global__ void transpose(float* out, const float* in, int rows, int cols) {
  int c = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y * blockDim.y + threadIdx.y;
  if (r < rows && c < cols) out[(size_t)c * rows + r] = in[(size_t)r * cols + c];
}
extern "C" __global__ void reverse_smem(float* out, const float* in, int n) {
  extern __shared__ float tile[];  // n floats: more than 48 KiB when n > 12288
  for (int i = threadIdx.x; i < n; i += blockDim.x) tile[i] = in[i];
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = tile[n - 1 - i];
}
extern "C" __global__ void reverse_smem_static(float* out, const float* in, int n) {
  extern __shared__ float tile[];  // n floats beside 128 static bytes
  __shared__ float first[32];
  if (threadIdx.x < 32) first[threadIdx.x] = in[threadIdx.x % n];
  for (int i = threadIdx.x; i < n; i += blockDim.x) tile[i] = in[i];
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = tile[n - 1 - i] + 0.f * first[i % 32];
}
"""

AXPY_ENTRY = r"""
#include <cuda_runtime.h>
#include <cstdint>
__global__ void axpy(const float* x, float* y, long long n, float a) {
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] += a * x[i];
}
extern "C" cudaError_t launch_axpy(const float* x, float* y, long long n, float a,
                                   cudaStream_t stream) {
  axpy<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(x, y, n, a);
  return cudaGetLastError();
}
extern "C" cudaError_t launch_too_big(float* y, cudaStream_t stream) {
  axpy<<<1, 4096, 0, stream>>>(y, y, 1, 1.f);  // 4096 threads: an invalid configuration
  return cudaGetLastError();
}
extern "C" int64_t add_ints(int64_t a, int b) { return a + b; }
"""


def poisoned_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


@pytest.mark.parametrize("n", [1, 1000, (1 << 20) + 3])
def test_rawkernel_saxpy_matches_torch(n):
    k = jit.RawKernel(SAXPY, "saxpy")
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    expected = 2.5 * x + y
    k[(n + 255) // 256, 256](2.5, x, y, n)
    torch.testing.assert_close(y, expected)


@pytest.mark.parametrize("dtype,name", [(torch.float32, "scale<float, 3>"),
                                        (torch.float16, "scale<__half, 3>"),
                                        (torch.float64, "scale<double, 3>")])
def test_templated_kernel_every_dtype(dtype, name):
    n = 4097
    k = jit.RawKernel(TYPED, name)
    x = torch.randn(n, device="cuda", dtype=dtype)
    y = poisoned_like(x)
    k[(n + 127) // 128, 128](y, x, 0.75, n)
    torch.testing.assert_close(y, x * 0.75 * 3)


def test_bf16_scalar_argument():
    n = 3000
    k = jit.RawKernel(TYPED, "scale_bf16")
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = poisoned_like(x)
    k[(n + 255) // 256, 256](y, x, 1.7, n)
    torch.testing.assert_close(y, x * torch.tensor(1.7, dtype=torch.bfloat16))


@pytest.mark.parametrize("rows,cols", [(1, 1), (37, 1000), (513, 129)])
def test_2d_grid_transpose(rows, cols):
    k = jit.RawKernel(TYPED, "transpose")
    a = torch.randn(rows, cols, device="cuda")
    out = torch.full((cols, rows), float("nan"), device="cuda")
    k[((cols + 15) // 16, (rows + 15) // 16), (16, 16)](out, a, rows, cols)
    torch.testing.assert_close(out, a.t())


def test_dynamic_shared_memory_above_48k():
    n = 40_000  # 160 KB of shared memory
    k = jit.RawKernel(TYPED, "reverse_smem")
    x = torch.randn(n, device="cuda")
    out = poisoned_like(x)
    k[1, 1024](out, x, n, shared_mem=n * 4)
    torch.testing.assert_close(out, x.flip(0))


def test_dynamic_shared_memory_with_static_at_48k():
    """48 KiB of dynamic shared memory beside static shared memory: over the default 48 KiB
    total, so the launch must raise the kernel's limit there too."""
    n = 12288  # exactly 48 KiB dynamic
    k = jit.RawKernel(TYPED, "reverse_smem_static")
    x = torch.randn(n, device="cuda")
    out = poisoned_like(x)
    k[1, 1024](out, x, n, shared_mem=n * 4)
    torch.testing.assert_close(out, x.flip(0))


def test_non_default_stream_orders_with_torch():
    k = jit.RawKernel(SAXPY, "saxpy")
    n = 1 << 22
    s = torch.cuda.Stream()
    x = torch.randn(n, device="cuda")
    with torch.cuda.stream(s):  # current stream: s
        y = torch.ones(n, device="cuda") * 3  # queued on s; the kernel must follow it
        k[(n + 255) // 256, 256](2.0, x, y, n)
        z = y * 2
    s.synchronize()
    torch.testing.assert_close(z, (2.0 * x + 3) * 2)
    # an explicit stream argument, with torch's current stream left as it is
    y2 = torch.zeros(n, device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    k[(n + 255) // 256, 256](1.0, x, y2, n, stream=s)
    s.synchronize()
    torch.testing.assert_close(y2, x)


def test_launch_from_a_new_thread():
    k = jit.RawKernel(SAXPY, "saxpy")
    x, y = torch.randn(999, device="cuda"), torch.zeros(999, device="cuda")
    errors = []

    def work():
        try:
            k[4, 256](1.0, x, y, 999)
            torch.cuda.synchronize()
        except Exception as e:  # reported below
            errors.append(e)
    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    torch.testing.assert_close(y, x)


def test_cuda_array_interface_and_dlpack_arguments():
    k = jit.RawKernel(SAXPY, "saxpy")
    x, y = torch.randn(500, device="cuda"), torch.randn(500, device="cuda")
    expected = 2 * x + y

    class CAI:  # anything with __cuda_array_interface__
        __cuda_array_interface__ = x.__cuda_array_interface__

    class DL:  # anything with a CUDA DLPack capsule
        def __dlpack__(self, **kw):
            return y.__dlpack__(**kw)

        def __dlpack_device__(self):
            return y.__dlpack_device__()
    k[2, 256](2.0, CAI(), DL(), 500)
    torch.cuda.synchronize()
    torch.testing.assert_close(y, expected)


def test_cupy_array_argument():
    cupy = pytest.importorskip("cupy")
    k = jit.RawKernel(SAXPY, "saxpy")
    x = cupy.random.standard_normal(300, dtype=cupy.float32)
    y = cupy.zeros(300, dtype=cupy.float32)
    torch.cuda.synchronize()
    k[2, 256](1.5, x, y, 300)
    torch.cuda.synchronize()
    np.testing.assert_allclose(cupy.asnumpy(y), 1.5 * cupy.asnumpy(x), rtol=1e-6)


def test_bad_arguments_are_refused_with_names():
    k = jit.RawKernel(SAXPY, "saxpy")
    x = torch.randn(64, 64, device="cuda")
    with pytest.raises(jit.ArgumentError, match=r"'x'.*non-contiguous"):
        k[1, 64](1.0, x.t(), torch.zeros(4096, device="cuda"), 4096)
    with pytest.raises(jit.ArgumentError, match=r"'y'.*cpu"):
        k[1, 64](1.0, x, torch.zeros(4096), 4096)
    with pytest.raises(jit.ArgumentError, match=r"'x'.*host"):
        k[1, 64](1.0, np.zeros(4096, np.float32), x, 4096)
    with pytest.raises(jit.ArgumentError, match=r"takes 4 arguments"):
        k[1, 64](1.0, x, x)
    with pytest.raises(jit.ArgumentError, match=r"'n'.*outside"):
        k[1, 64](1.0, x, x, 2**40)


def test_empty_grid_launches_nothing():
    k = jit.RawKernel(SAXPY, "saxpy")
    y = torch.randn(10, device="cuda")
    before = y.clone()
    k[0, 256](1.0, y, y, 10)
    torch.testing.assert_close(y, before)


def test_invalid_launch_configuration_raises():
    k = jit.RawKernel(SAXPY, "saxpy")
    y = torch.randn(10, device="cuda")
    with pytest.raises(jit.LaunchError, match="saxpy.*block"):
        k[1, 4096](1.0, y, y, 10)


def test_nvcc_entry_point_matches_torch():
    mod = jit.compile(AXPY_ENTRY, name="axpy_entry")
    for n in (1, 777, 1 << 20):
        x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
        expected = y + 0.5 * x
        mod.launch_axpy(x, y, n, 0.5)
        torch.testing.assert_close(y, expected)
    assert mod.add_ints(2**40, -3) == 2**40 - 3


def test_nvcc_entry_point_on_a_side_stream():
    mod = jit.compile(AXPY_ENTRY, name="axpy_entry")
    n = 1 << 22
    s = torch.cuda.Stream()
    x = torch.randn(n, device="cuda")
    with torch.cuda.stream(s):
        y = torch.full((n,), 2.0, device="cuda")
        mod.launch_axpy(x, y, n, 1.0)  # cudaStream_t omitted: torch's current stream, s
        z = y.clone()
    s.synchronize()
    torch.testing.assert_close(z, x + 2)


def test_nvcc_entry_point_cuda_error_raises():
    mod = jit.compile(AXPY_ENTRY, name="axpy_entry")
    with pytest.raises(jit.LaunchError, match=r"launch_too_big returned cudaError\w+ \(\d+\)"):
        mod.launch_too_big(torch.zeros(1, device="cuda"))
    with pytest.raises(jit.ArgumentError, match="non-contiguous"):
        mod.launch_axpy(torch.zeros(8, 8, device="cuda").t(), torch.zeros(64, device="cuda"),
                        64, 1.0)


def test_cute_kernel_runs_and_targets_sm90a():
    mod = jit.compile(CUTE_SOURCE, name="doctor_cute")
    n = 12345
    x = torch.randn(n, device="cuda")
    y = poisoned_like(x)
    mod.vitrail_doctor_scale(x, y, n, -1.25)
    torch.testing.assert_close(y, -1.25 * x)
    if torch.cuda.get_device_capability() == (9, 0):
        assert mod.arch == "sm_90a"
        assert "WARPGROUP.ARRIVE" in mod.sass


def test_resources_agree_with_the_driver():
    from cuda.bindings import driver
    kernel = jit.RawKernel(TYPED, "transpose").compile()
    regs = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS
    kernel._function(torch.cuda.current_device())  # looks the kernel up in the loaded library
    err, n = driver.cuKernelGetAttribute(regs, kernel._kernel, torch.cuda.current_device())
    assert int(err) == 0
    resources = kernel.module.resources()
    assert "transpose" in resources, list(resources)
    assert resources["transpose"].registers == n
    assert "transpose" in kernel.module.sass


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_on_another_device():
    k = jit.RawKernel(SAXPY, "saxpy")
    x, y = torch.randn(100, device="cuda:1"), torch.randn(100, device="cuda:1")
    expected = x + y
    assert torch.cuda.current_device() == 0
    k[1, 128](1.0, x, y, 100)
    torch.cuda.synchronize(1)
    torch.testing.assert_close(y, expected)
    mod = jit.compile(AXPY_ENTRY, name="axpy_entry")
    mod.launch_axpy(x, y, 100, -1.0)
    torch.cuda.synchronize(1)
    torch.testing.assert_close(y, expected - x)
    with pytest.raises(jit.ArgumentError, match="cuda:0"):
        k[1, 128](1.0, torch.zeros(100, device="cuda:0"), y, 100)


def test_launches_take_the_c_launcher_where_python_headers_exist():
    import sysconfig
    from pathlib import Path

    from vitrail.jit import kernel, launcher
    jit.RawKernel(SAXPY, "saxpy")[1, 32](1.0, None, None, 0)  # resolves the launch function
    if (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        assert launcher.get() is not None and kernel._LAUNCH is launcher.get()
    else:
        assert kernel._LAUNCH is kernel._launch_through_bindings
