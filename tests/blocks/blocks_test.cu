// Device unit tests of vitrail's building blocks: one kernel per block, one entry point each.
#include <vitrail/launch.cuh>
#include <vitrail/pipeline.cuh>
#include <vitrail/smart_reduce.cuh>
#include <vitrail/tile_copy.cuh>

using namespace vitrail;

// load_frg / store_frg with a ragged edge: out[i] = 2 * in[i] (half), n arbitrary.
__global__ void frg_kernel(__half* out, const __half* in, int n) {
  const int col = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  Frg<__half, 8> f = load_frg<8>(in + col, n - col, __float2half(0.f));
#pragma unroll
  for (int k = 0; k < 8; ++k) f[k] = __float2half(2.f * __half2float(f[k]));
  store_frg<8>(out + col, f, n - col);
}
extern "C" cudaError_t test_frg(void* out, const void* in, int n, cudaStream_t stream) {
  return launch(frg_kernel, dim3(ceil_div(n, 8 * 128)), dim3(128), 0, stream, 1, (__half*)out,
                (const __half*)in, n);
}

// load_frg / store_frg over a window: out[i] = 2 * in[i] for i in [lo, hi) (half), the vectors
// from 0 on; the first may start and the last end inside a vector.
__global__ void frg_window_kernel(__half* out, const __half* in, int lo, int hi) {
  const int col = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  Frg<__half, 8> f = load_frg<8>(in + col, lo - col, hi - col, __float2half(0.f));
#pragma unroll
  for (int k = 0; k < 8; ++k) f[k] = __float2half(2.f * __half2float(f[k]));
  store_frg<8>(out + col, f, lo - col, hi - col);
}
extern "C" cudaError_t test_frg_window(void* out, const void* in, int lo, int hi,
                                       cudaStream_t stream) {
  return launch(frg_window_kernel, dim3(ceil_div(hi, 8 * 128)), dim3(128), 0, stream, 1,
                (__half*)out, (const __half*)in, lo, hi);
}

// TileCopy: a 32 x 64 float tile at (r0, c0) of a rows x cols slab, through shared memory with
// cp.async (2 stages of half tiles), back to out at the same place (+1 per element).
__global__ void tile_kernel(float* out, const float* in, int rows, int cols, long long ld) {
  __shared__ alignas(16) float tile[2][16][64];
  const int r0 = blockIdx.y * 32, c0 = blockIdx.x * 64;
  for (int s = 0; s < 2; ++s) {
    TileCopy<float, 128>::g2s_async(&tile[s][0][0], 64, in + (r0 + 16 * s) * ld + c0, ld, 16, 64,
                                    rows - r0 - 16 * s, cols - c0);
    async_commit();
  }
  for (int s = 0; s < 2; ++s) {
    if (s == 0) async_wait<1>(); else async_wait<0>();
    __syncthreads();
    for (int e = threadIdx.x; e < 16 * 64; e += 128) tile[s][e / 64][e % 64] += 1.f;
    __syncthreads();
    TileCopy<float, 128>::s2g(out + (r0 + 16 * s) * ld + c0, ld, &tile[s][0][0], 64, 16, 64,
                              rows - r0 - 16 * s, cols - c0);
  }
}
extern "C" cudaError_t test_tile(void* out, const void* in, int rows, int cols, long long ld,
                                 cudaStream_t stream) {
  VITRAIL_TRY(require(cols % 4 == 0 && ld % 4 == 0));
  return launch(tile_kernel, dim3(ceil_div(cols, 64), ceil_div(rows, 32)), dim3(128), 0, stream, 1,
                (float*)out, (const float*)in, rows, cols, ld);
}

// Reductions: out[t] = group sum (groups of 8 lanes), CTA max, cluster-of-2 sum of in[t].
template <int Cluster>
__global__ void reduce_kernel(float* sums8, float* maxes, float* csum, const float* in) {
  __shared__ float scratch[3][8 + 2];
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  const float v = in[g];
  sums8[g] = SmartReduce<8>::reduce(v, Sum{}, scratch[0]);
  maxes[g] = SmartReduce<256>::reduce(v, Max{}, scratch[1]);
  csum[g] = SmartReduce<256, Cluster>::reduce(v, Sum{}, scratch[2]);
  SmartReduce<256, Cluster>::cluster_done();
}
extern "C" cudaError_t test_reduce(void* sums8, void* maxes, void* csum, const void* in, int ctas,
                                   cudaStream_t stream) {
  return launch(reduce_kernel<2>, dim3(ctas), dim3(256), 0, stream, 2, (float*)sums8,
                (float*)maxes, (float*)csum, (const float*)in);
}

// Pipeline + Bulk: warp 0's lane 0 TMA-loads chunks of 256 floats into a 3-stage ring; warps 1-2
// (the consumers) write 3 * x + 1 to out; then the tile is stored back with a bulk store as well.
constexpr int kStages = 3, kChunk = 256;
__global__ void pipe_kernel(float* out, float* out_bulk, const float* in, int chunks) {
  __shared__ alignas(128) float ring[kStages][kChunk];
  __shared__ alignas(16) float last[kChunk];
  __shared__ alignas(8) Pipeline<kStages>::Storage bars;
  Pipeline<kStages> pipe(bars);
  if (threadIdx.x == 0) pipe.init(1, 2);
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == 0) {
    if (lane == 0) {
      PipeState<kStages> w = PipeState<kStages>::producer();
      for (int c = 0; c < chunks; ++c, w.advance()) {
        pipe.acquire(w);
        pipe.expect(w, kChunk * 4);
        Bulk::load(ring[w.index], in + (long long)c * kChunk, kChunk * 4, pipe.full(w));
      }
    }
  } else {
    PipeState<kStages> r;
    for (int c = 0; c < chunks; ++c, r.advance()) {
      pipe.wait(r);
      for (int e = threadIdx.x - 32; e < kChunk; e += 64) {
        out[(long long)c * kChunk + e] = 3.f * ring[r.index][e] + 1.f;
        if (c == chunks - 1) last[e] = ring[r.index][e];
      }
      __syncwarp();
      if (lane == 0) pipe.release(r);
    }
    Bulk::fence_shared();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    Bulk::store(out_bulk, last, kChunk * 4);
    Bulk::commit();
    Bulk::store_wait<0>();
  }
}
extern "C" cudaError_t test_pipeline(void* out, void* out_bulk, const void* in, int chunks,
                                     cudaStream_t stream) {
  return launch(pipe_kernel, dim3(1), dim3(96), 0, stream, 1, (float*)out, (float*)out_bulk,
                (const float*)in, chunks);
}

// launch errors surface: a CTA of 2048 threads cannot launch; require() refuses.
__global__ void noop_kernel(float* p) { if (p == nullptr && threadIdx.x == 0) p[0] = 0.f; }
extern "C" cudaError_t test_bad_launch(void* p, int threads, cudaStream_t stream) {
  VITRAIL_TRY(require(p != nullptr));
  return launch(noop_kernel, dim3(1), dim3(threads), 0, stream, 1, (float*)p);
}
