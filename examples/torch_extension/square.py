"""The square kernel of a torch load_inline lesson, built through vitrail: the same arguments and
the same module back, from vitrail's cache (content-keyed, per user, never a stale lock)."""
from __future__ import annotations

import torch

from vitrail import jit

CUDA = r"""
__global__ void square_kernel(const float* x, float* y, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * x[i];
}

torch::Tensor square(torch::Tensor x) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat, "square: a float32 CUDA tensor");
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  int64_t n = xc.numel();
  if (n) {
    int threads = 256;
    square_kernel<<<(n + threads - 1) / threads, threads, 0,
                    c10::cuda::getCurrentCUDAStream()>>>(xc.data_ptr<float>(),
                                                        y.data_ptr<float>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return y;
}
"""
CPP = "torch::Tensor square(torch::Tensor x);"
HEADERS = "#include <c10/cuda/CUDAStream.h>\n#include <c10/cuda/CUDAException.h>\n"


def module(build_only: bool = False):
    """The extension (built on first use); build_only: the built library's path (no GPU)."""
    make = jit.extension.build_inline if build_only else jit.load_inline
    return make("vitrail_example_square", cpp_sources=CPP, cuda_sources=HEADERS + CUDA,
                functions=["square"])


def square(x: torch.Tensor) -> torch.Tensor:
    return module().square(x)
