// launch.cuh: launching kernels from an extern "C" entry point and reporting errors.
//
// Entry points return cudaError_t; vitrail.jit turns a non-zero result into jit.LaunchError and
// vitrail.op.Op prefixes the op's name and config. VITRAIL_TRY returns the first failing call's
// error from the entry point; launch launches, with a thread-block cluster (sm_90) through
// cudaLaunchKernelEx where asked, after raising the kernel's dynamic shared memory limit
// (allow_shared). launch_cooperative launches a grid whose CTAs are all resident at once
// (or refuses it with cudaErrorCooperativeLaunchTooLarge), the requirement of a spin barrier
// across CTAs (group_barrier.cuh); ctas_per_sm is what the occupancy API says fits.
#pragma once
#include <cuda_runtime.h>

#include <mutex>
#include <vector>

// Return the error of a CUDA runtime call from the enclosing function (an entry point).
#define VITRAIL_TRY(expr)                        \
  do {                                           \
    cudaError_t vitrail_err_ = (expr);           \
    if (vitrail_err_ != cudaSuccess) return vitrail_err_; \
  } while (0)

namespace vitrail {

// Refuse arguments the kernel cannot implement (an entry point's can_implement check).
inline cudaError_t require(bool ok) { return ok ? cudaSuccess : cudaErrorInvalidValue; }

inline unsigned ceil_div(long long a, long long b) { return (unsigned)((a + b - 1) / b); }

// Allow a kernel `bytes` of dynamic shared memory. Without the attribute, static and dynamic
// shared memory together must stay within 48 KiB, so any kernel with static shared memory needs
// it just below 48 KiB of dynamic memory too (a tile kernel refused 48 KiB on an H100 for its 128
// static bytes): set it whenever there is dynamic memory. The attribute stays with the kernel in
// the device's context, so it is set once per kernel, device and size, not at every launch
// (launches of a few microseconds, short softmax rows, are bound by the host's time a call).
template <class Kernel>
inline cudaError_t allow_shared(Kernel kernel, size_t bytes) {
  if (bytes == 0) return cudaSuccess;
  struct Allowed {
    const void* kernel;
    int device;
    size_t bytes;
  };
  static std::mutex lock;
  static std::vector<Allowed> allowed;  // per kernel and device: the most bytes set so far
  int device = 0;
  VITRAIL_TRY(cudaGetDevice(&device));
  const void* key = reinterpret_cast<const void*>(kernel);
  std::lock_guard<std::mutex> guard(lock);
  for (Allowed& a : allowed) {
    if (a.kernel == key && a.device == device) {
      if (a.bytes >= bytes) return cudaSuccess;
      VITRAIL_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)bytes));
      a.bytes = bytes;
      return cudaSuccess;
    }
  }
  VITRAIL_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)bytes));
  allowed.push_back({key, device, bytes});
  return cudaSuccess;
}

// cudaLaunchKernelEx with one launch attribute (a cluster shape, cooperative, ...).
template <class... Params, class... Args>
inline cudaError_t launch_ex(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t stream, cudaLaunchAttribute attr, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

// Launch kernel<<<grid, block, smem, stream>>>(args...) with clusters of `cluster` CTAs along x
// (1: an ordinary launch); returns the launch's error.
template <class... Params, class... Args>
inline cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t stream, int cluster, Args... args) {
  VITRAIL_TRY(allow_shared(kernel, smem));
  if (cluster <= 1) {
    kernel<<<grid, block, smem, stream>>>(args...);
    return cudaGetLastError();
  }
  if (cluster > 8)
    VITRAIL_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  return launch_ex(kernel, grid, block, smem, stream, attr, args...);
}

// CTAs of `kernel` (block threads, smem dynamic bytes) resident per SM at once: 0 where none fits.
template <class Kernel>
inline int ctas_per_sm(Kernel kernel, int block, size_t smem) {
  int n = 0;
  if (allow_shared(kernel, smem) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, block, smem) != cudaSuccess)
    return 0;
  return n;
}

// A cooperative launch: every CTA of the grid is resident at the same time, or nothing runs and
// the error is cudaErrorCooperativeLaunchTooLarge (grids of at most ctas_per_sm x SMs CTAs fit).
template <class... Params, class... Args>
inline cudaError_t launch_cooperative(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                                      cudaStream_t stream, Args... args) {
  VITRAIL_TRY(allow_shared(kernel, smem));
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  return launch_ex(kernel, grid, block, smem, stream, attr, args...);
}

}  // namespace vitrail
