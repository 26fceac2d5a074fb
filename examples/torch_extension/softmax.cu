// A row softmax as a torch extension source file, with its op registered by TORCH_LIBRARY (a
// CUDA kernel and a Meta one, so that torch.compile traces it): built by vitrail.jit.load.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

#include <cfloat>

namespace {

constexpr int kThreads = 256;

__device__ float block_reduce(float v, float* smem, bool max) {
  for (int o = 16; o > 0; o /= 2) {
    float w = __shfl_xor_sync(0xffffffff, v, o);
    v = max ? fmaxf(v, w) : v + w;
  }
  int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < kThreads / 32 ? smem[lane] : (max ? -FLT_MAX : 0.f);
  for (int o = 16; o > 0; o /= 2) {
    float w = __shfl_xor_sync(0xffffffff, v, o);
    v = max ? fmaxf(v, w) : v + w;
  }
  __syncthreads();  // smem is reused by the next reduction
  return v;
}

// One block per row: the row's max, the sum of exp(x - max), then the outputs.
__global__ void softmax_rows(const float* x, float* y, int64_t cols) {
  __shared__ float smem[kThreads / 32];
  const float* row = x + blockIdx.x * cols;
  float* out = y + blockIdx.x * cols;
  float m = -FLT_MAX;
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) m = fmaxf(m, row[c]);
  m = block_reduce(m, smem, true);
  float s = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) s += __expf(row[c] - m);
  s = block_reduce(s, smem, false);
  for (int64_t c = threadIdx.x; c < cols; c += kThreads) out[c] = __expf(row[c] - m) / s;
}

at::Tensor softmax_cuda(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2,
              "vitrail_example.softmax: a 2-D float32 tensor");
  auto xc = x.contiguous();
  auto y = at::empty_like(xc);
  if (xc.numel()) {
    softmax_rows<<<xc.size(0), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        xc.data_ptr<float>(), y.data_ptr<float>(), xc.size(1));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return y;
}

at::Tensor softmax_meta(const at::Tensor& x) { return at::empty_like(x); }

}  // namespace

TORCH_LIBRARY(vitrail_example, m) { m.def("softmax(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(vitrail_example, CUDA, m) { m.impl("softmax", &softmax_cuda); }
TORCH_LIBRARY_IMPL(vitrail_example, Meta, m) { m.impl("softmax", &softmax_meta); }
