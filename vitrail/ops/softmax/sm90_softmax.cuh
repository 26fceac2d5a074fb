// sm90_softmax.cuh: softmax and log_softmax over the rows of a 2-D slab, forward and backward.
//
// Rows that fit on chip stay in registers and are read once: a row belongs to a group of TPR
// threads (a few lanes, a warp, or a whole CTA) times Cluster CTAs of a thread-block cluster
// (sm_90, reductions through distributed shared memory); each thread holds Iters 16-byte vectors
// of it, vector i of a thread at column ((rank * Iters + i) * TPR + t) * V, so neighbouring threads
// read neighbouring vectors. Forward: max, sum of exp, then write; backward: one sum, then write.
// Rows of 8 KiB and more use the tile path where there are enough of them (one CTA or a cluster
// of CTAs a row, each holding its slice in shared memory, loaded by TMA bulk copies; several CTAs
// per SM); the register path keeps shorter rows, rows read element by element (V = 1) and GPUs
// without TMA (it holds rows up to a cluster of 8 CTAs). Rows too few to fill the GPU use the split
// path where the GPU holds rows x G CTAs at once (one cooperative kernel: each row split over G
// CTAs that read their slices once, keep them on chip, meet at a per-row barrier in global memory
// and write), else the chunked path (two kernels over rows x chunks CTAs that the caller sizes to
// the GPU: per-chunk statistics with an online max/sum, then normalize), which reads the input
// twice (the second time mostly from L2 where the input is not much larger than it) but has no
// length or row limit. Short rows laid end to end (up to 1 KiB) take the packed path on sm_90:
// a CTA moves a run of whole rows with bulk copies and lanes reduce them from shared memory.
//
// Rows that do not start on a 16-byte boundary (n % V != 0, or a view at an offset) can keep their
// 16-byte vectors (kernels compiled with Window): a row is read through the aligned window that
// holds it, which starts `head` elements before the row (head_of: the row start's offset in its
// vector, 0 to V - 1) and is n + head long; the window's first head elements, the end of the row
// before, are masked on load and store (load_row, store_row), and so are the elements past the
// row's end. Every path works in window columns, so a launch's capacity is n + pad: pad = V - 1
// where some row may start off a vector boundary, else 0 (window_pad).
//
// Constraints (checked by the entry points, refused with cudaErrorInvalidValue):
//   - the last dim is contiguous; every array's rows start at the same offset within a vector as
//     the first array's (base pointers equal modulo 16 bytes, row strides equal modulo V:
//     coaligned), so that one head serves them all; kernels without Window, every row on a
//     vector boundary (the Python side picks which, and V = 1 where neither serves or where
//     element-by-element kernels keep up: configs.use_window);
//   - n + pad <= TPR * Iters * V * Cluster for the register path; chunk % V == 0 and
//     rows * ceil((n + pad) / chunk) < 2^31 for the chunked one; for the split one see
//     launch_split.
// Math in fp32: y = exp(x - max) / sum; log: y = (x - max) - log(sum). A row of -inf gives NaN
// and a NaN anywhere in a row makes the row NaN, as in torch.
#pragma once
#include <vitrail/group_barrier.cuh>
#include <vitrail/launch.cuh>
#include <vitrail/smart_reduce.cuh>
#include <vitrail/tile_copy.cuh>

namespace vitrail::softmax {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// e^d as MUFU.EX2 alone (ex2.approx.ftz): exp2f adds a fix-up for results below 2^-126 (a compare
// and two predicated multiplies an element), which flushes them to zero here instead. Every other
// result has exp2f's bits (every output of 13 shapes on an H100 matched); an output is a
// probability, or a term of a sum of at least 1, so a difference under 1.2e-38 is lost in it.
// It is faster on the shared-memory and split paths (docs/perf-notes.md, softmax).
__device__ __forceinline__ float exp_of(float d) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d * kLog2e));
  return r;
}
// One output element (Mode 0: forward, a = x; 1: softmax backward, a = y, b = dy; 2: log_softmax
// backward) from the row's max m (forward) and scale: forward 1 / sum or log(sum), backward the
// row's sum. Every path (register, tile, split, chunked) writes through it.
template <int Mode, bool IsLog, class T>
__device__ __forceinline__ float output_of(T a, T b, float m, float scale) {
  if constexpr (Mode == 0) {
    const float d = to_float(a) - m;
    return IsLog ? d - scale : exp_of(d) * scale;
  } else if constexpr (Mode == 1) {
    return to_float(a) * (to_float(b) - scale);
  } else {
    return to_float(b) - exp_of(to_float(a)) * scale;
  }
}

// Window: whether a kernel serves rows that may start off a vector boundary. Kernels without it
// (every row starts on one: the launch checks) keep the plain predicated loads and stores and
// their registers (a windowed register kernel took 168 registers against 128 when every vector
// could be a row's first: 1 CTA per SM instead of 2, and slower: docs/perf-notes.md, softmax);
// windowed kernels treat only the vector at window column 0 as one.
// A row's head: the offset of its first element within its 16-byte vector, in elements (0
// without windows). The row's window starts head elements before it.
template <int V, bool Window, class T>
__device__ __forceinline__ int head_of(const T* row) {
  if constexpr (V == 1 || !Window) return 0;
  else return int(reinterpret_cast<uintptr_t>(row) % 16) / int(sizeof(T));
}
// The vector at window column col of a row, p = its address: elements [lo, hi) of it where it
// may hold the row's head (first: a compile-time fact in the unrolled loops, the vector at window
// column 0), else [0, hi) (a row's head is in its first vector only: head < V). A head vector
// that the row fills to its end (hi >= V) is one vector load, its lanes below lo then set to
// fill: the lanes it reads before the row are in the same 16 bytes as the row's first element
// (mapped memory), and it keeps the split kernel within its 64 registers (element by element it
// spilled); a row that ends in it too (n < V) is read element by element.
template <bool Window, int V, Reuse R = Reuse::Normal, class T>
__device__ __forceinline__ Frg<T, V> load_row(const T* p, int lo, int hi, T fill, bool first) {
  if (Window && first && lo > 0) {
    if (hi < V) return load_frg<V, R>(p, lo, hi, fill);
    Frg<T, V> f = Frg<T, V>::filled(fill);
    load_frg_if<V, R>(f, p, true);
#pragma unroll
    for (int i = 0; i < V; ++i)
      if (i < lo) f.v[i] = fill;
    return f;
  }
  return load_frg<V, R>(p, hi, fill);
}
template <bool Window, int V, class T>
__device__ __forceinline__ void store_row(T* p, const Frg<T, V>& f, int lo, int hi, bool first) {
  if (Window && first) store_frg<V>(p, f, lo, hi);
  else store_frg<V>(p, f, hi);
}
// Host side: whether array b's rows start at the same offsets within their vectors as a's.
template <int V, class T>
bool coaligned(const T* a, long long lda, const T* b, long long ldb) {
  return V == 1 || ((reinterpret_cast<uintptr_t>(a) - reinterpret_cast<uintptr_t>(b)) % 16 == 0 &&
                    (lda - ldb) % V == 0);
}
// Host side: the window's padding over n: V - 1 where a row may start off a vector boundary.
template <int V, class T>
int window_pad(const T* a, long long lda) {
  return V == 1 || (reinterpret_cast<uintptr_t>(a) % 16 == 0 && lda % V == 0) ? 0 : V - 1;
}
// Host side: whether array b can join a launch whose first array is a: with windows, coaligned;
// without, every row of both starts on a vector boundary.
template <int V, bool Window, class T>
bool rows_fit(const T* a, long long lda, const T* b, long long ldb) {
  return Window ? coaligned<V>(a, lda, b, ldb)
                : window_pad<V>(a, lda) == 0 && window_pad<V>(b, ldb) == 0;
}

// CTAs per SM a register-path kernel is compiled for (__launch_bounds__' minimum). A lone CTA
// per SM loads, reduces, then stores with nothing to overlap those phases; a second one keeps
// loads in flight while the first reduces or stores. CTAs of 512 threads get two where Regs
// registers per thread (the row's fragments plus working registers, as ptxas allocates them: see
// the estimates at the kernels) fit in half the SM's 64K; smaller CTAs get two or more anyway.
template <int Threads, int Regs>
constexpr int min_ctas_per_sm() {
  return Threads >= 512 && 65536 / (2 * Threads) >= Regs ? 2 : 1;
}

// Registers: the packed fragments (4-byte words) and about 32 working ones; with a cluster, ptxas
// keeps far more across the cluster barriers (91-128 at 512 threads), so one CTA per SM. fp32 rows
// of <= 512 bytes (CTAs of 128 threads, <= 4 vectors per thread) fit 32 registers without spills:
// 16 CTAs per SM, 2048 threads x 64 bytes in flight (16-bit types keep fp32 copies and need ~70).
template <class T, int V> inline constexpr int kWords = (V * int(sizeof(T)) + 3) / 4;
// Rows spread over a warp or more in CTAs of 256 threads: 3 CTAs per SM (<= 85 registers). bf16
// rows of 4096 ran 88 registers unbounded, so 2 CTAs per SM (slower: docs/perf-notes.md,
// softmax); bounded, 79 registers and no spill (rows of 8192: 80). Narrower rows (TPR 32: 2048
// bf16) spill under that bound, so they stay unbounded.
template <class T, int V, int TPR, int Threads, int Iters, int Cluster>
constexpr int fwd_min_ctas() {
  if (sizeof(T) == 4 && V > 1 && Threads == 128 && Iters <= 4 && Cluster == 1) return 16;
  if (Threads == 256 && TPR >= 64 && Cluster == 1 && Iters * kWords<T, V> + 32 <= 64) return 3;
  return min_ctas_per_sm<Threads, (Cluster > 1 ? 255 : Iters * kWords<T, V> + 32)>();
}

template <class T, int V, int TPR, int Threads, int Iters, int Cluster, bool IsLog, bool Window>
__global__ void __launch_bounds__(Threads, fwd_min_ctas<T, V, TPR, Threads, Iters, Cluster>())
fwd_kernel(T* __restrict__ y, const T* __restrict__ x, long long rows, int n, long long ldx,
           long long ldy) {
  using Reduce = SmartReduce<TPR, Cluster>;
  constexpr int RowsPerCta = Threads / TPR;
  __shared__ float scratch[2][Threads / 32 + 2];
  const int t = threadIdx.x % TPR;
  const int rank = Cluster > 1 ? int(blockIdx.x % Cluster) : 0;
  const long long row = (long long)(blockIdx.x / Cluster) * RowsPerCta + threadIdx.x / TPR;
  const bool live = row < rows;
  const T* xr = x + (live ? row : 0) * ldx;
  const int head = head_of<V, Window>(xr), end = live ? n + head : 0;  // window [head, end)
  xr -= head;
  const T neg_inf = from_float<T>(-__builtin_huge_valf());

  Frg<T, V> frg[Iters];
#pragma unroll
  for (int i = 0; i < Iters; ++i) {
    const int col = ((rank * Iters + i) * TPR + t) * V;
    frg[i] = load_row<Window, V>(xr + col, head - col, end - col, neg_inf, i == 0);
  }
  float m = -__builtin_huge_valf();
#pragma unroll
  for (int i = 0; i < Iters; ++i)
#pragma unroll
    for (int k = 0; k < V; ++k) m = fmaxf(m, to_float(frg[i][k]));
  m = Reduce::reduce(m, Max{}, scratch[0]);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < Iters; ++i)
#pragma unroll
    for (int k = 0; k < V; ++k) s += exp_of(to_float(frg[i][k]) - m);
  s = Reduce::reduce(s, Sum{}, scratch[1]);
  const float scale = IsLog ? __log2f(s) * kLn2 : 1.f / s;
  if (live) {
    T* yr = y + row * ldy - head;
#pragma unroll
    for (int i = 0; i < Iters; ++i) {
      const int col = ((rank * Iters + i) * TPR + t) * V;
      Frg<T, V> out;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        out[k] = from_float<T>(output_of<0, IsLog>(frg[i][k], frg[i][k], m, scale));
      }
      store_row<Window, V>(yr + col, out, head - col, end - col, i == 0);
    }
  }
  Reduce::cluster_done();
}

// dx = y * (dy - sum(dy * y));  log: dx = dy - exp(y) * sum(dy).
// Registers: ptxas keeps both arrays converted to fp32 from the sum to the output (one register per
// element; 16-bit scalars take two when V is 1) and about 24 working ones.
template <int V, int Threads, int Iters>
constexpr int bwd_min_ctas() {
  return min_ctas_per_sm<Threads, 2 * Iters * (V > 1 ? V : 2) + 24>();
}
template <class T, int V, int TPR, int Threads, int Iters, int Cluster, bool IsLog, bool Window>
__global__ void __launch_bounds__(Threads, bwd_min_ctas<V, Threads, Iters>())
bwd_kernel(T* __restrict__ dx, const T* __restrict__ y, const T* __restrict__ dy, long long rows,
           int n, long long ldy, long long lddy, long long lddx) {
  using Reduce = SmartReduce<TPR, Cluster>;
  constexpr int RowsPerCta = Threads / TPR;
  __shared__ float scratch[Threads / 32 + 2];
  const int t = threadIdx.x % TPR;
  const int rank = Cluster > 1 ? int(blockIdx.x % Cluster) : 0;
  const long long row = (long long)(blockIdx.x / Cluster) * RowsPerCta + threadIdx.x / TPR;
  const bool live = row < rows;
  const T* yr = y + (live ? row : 0) * ldy;
  const int head = head_of<V, Window>(yr), end = live ? n + head : 0;  // window [head, end)
  yr -= head;
  const T* dyr = dy + (live ? row : 0) * lddy - head;
  const T zero = from_float<T>(0.f);

  Frg<T, V> fy[Iters], fdy[Iters];
#pragma unroll
  for (int i = 0; i < Iters; ++i) {
    const int col = ((rank * Iters + i) * TPR + t) * V;
    fy[i] = load_row<Window, V>(yr + col, head - col, end - col, zero, i == 0);
    fdy[i] = load_row<Window, V>(dyr + col, head - col, end - col, zero, i == 0);
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < Iters; ++i)
#pragma unroll
    for (int k = 0; k < V; ++k)
      s += IsLog ? to_float(fdy[i][k]) : to_float(fdy[i][k]) * to_float(fy[i][k]);
  s = Reduce::reduce(s, Sum{}, scratch);
  if (live) {
    T* dxr = dx + row * lddx - head;
#pragma unroll
    for (int i = 0; i < Iters; ++i) {
      const int col = ((rank * Iters + i) * TPR + t) * V;
      Frg<T, V> out;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        out[k] = from_float<T>(output_of<IsLog ? 2 : 1, false>(fy[i][k], fdy[i][k], 0.f, s));
      }
      store_row<Window, V>(dxr + col, out, head - col, end - col, i == 0);
    }
  }
  Reduce::cluster_done();
}

// ------------------------------------------------------------------ chunked path (long rows)
// Running (max, sum of exp(x - max)); combining two is associative. A -inf max means "nothing
// finite yet": its sum stays 0 and contributes nothing.
struct MaxSum {
  float m, s;
};
struct CombineMaxSum {
  __device__ __forceinline__ MaxSum operator()(MaxSum a, MaxSum b) const {
    const float m = fmaxf(a.m, b.m);
    if (m == -__builtin_huge_valf()) return {m, a.s + b.s};
    return {m, a.s * exp_of(a.m - m) + b.s * exp_of(b.m - m)};
  }
};
struct SumOp {
  __device__ __forceinline__ MaxSum operator()(MaxSum a, MaxSum b) const { return {0.f, a.s + b.s}; }
};

// A row is cut into `chunks` chunks of `chunk` elements, one CTA each (rows * chunks CTAs, which
// the caller sizes to fill the GPU). Each thread moves U vectors per step, all loads of a step
// issued before any is used (U * 16 bytes in flight per thread and array); a warp's vectors of a
// step are contiguous. Mode 0: forward (a = x); 1: softmax backward (a = y, b = dy); 2:
// log_softmax backward (a = y, b = dy; its statistics read dy only).
template <int Mode> __device__ __forceinline__ MaxSum stats_identity() {
  return {Mode == 0 ? -__builtin_huge_valf() : 0.f, 0.f};
}

// Adds U vectors of a (and b) to the running statistics (see chunk_stats).
template <int Mode, class T, int V, int U>
__device__ __forceinline__ MaxSum add_stats(MaxSum acc, const Frg<T, V> (&fa)[U],
                                            const Frg<T, V> (&fb)[U]) {
  if constexpr (Mode == 0) {
    float m = acc.m;
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < V; ++k) m = fmaxf(m, to_float(fa[u][k]));
    if (m != -__builtin_huge_valf()) {
      float s = acc.s * exp_of(acc.m - m);
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int k = 0; k < V; ++k) s += exp_of(to_float(fa[u][k]) - m);
      acc = {m, s};
    } else {  // nothing above -inf yet: a -inf vector adds nothing, a NaN poisons the sum
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int k = 0; k < V; ++k)
          if (isnan(to_float(fa[u][k]))) acc.s = __builtin_nanf("");
    }
  } else {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < V; ++k)
        acc.s += Mode == 1 ? to_float(fa[u][k]) * to_float(fb[u][k]) : to_float(fb[u][k]);
  }
  return acc;
}

// output_of's scale from a row's statistics (forward: 1 / sum or log(sum); backward: the sum).
template <int Mode, bool IsLog>
__device__ __forceinline__ float scale_of(MaxSum tot) {
  return Mode == 0 ? (IsLog ? __log2f(tot.s) * kLn2 : 1.f / tot.s) : tot.s;
}

// At U <= 4, 1024 threads per SM fit (64 registers: ptxas needs at most 66 unbounded, for bf16
// backward's two arrays), so the CHUNK_CTAS_PER_SM = 4 CTAs of 256 threads that the caller
// launches per SM all run in one wave.
template <int Threads, int U>
constexpr int chunk_min_ctas() {
  return U <= 4 ? 1024 / Threads : 1;
}

// Stage 1: per (row, chunk) statistics into stats[row * chunks + c]. Forward: (max, sum exp);
// backward: (0, sum(dy * y)) or (0, sum(dy)).
template <class T, int V, int Mode, int Threads, int U, bool Window>
__global__ void __launch_bounds__(Threads, chunk_min_ctas<Threads, U>())
chunk_stats(MaxSum* __restrict__ stats, const T* __restrict__ a, const T* __restrict__ b, int n,
            int chunk, int chunks, long long lda, long long ldb) {
  __shared__ MaxSum scratch[Threads / 32];
  const long long row = blockIdx.x / chunks;
  const int c = int(blockIdx.x % chunks);
  const int head = head_of<V, Window>(a + row * lda);  // chunks cut the row's window (see the top)
  const T* ar = a + row * lda - head;
  const T* br = b + row * ldb - head;
  const int end = min(n + head, c * chunk + chunk);
  const T neg_inf = from_float<T>(-__builtin_huge_valf()), zero = from_float<T>(0.f);
  MaxSum acc = stats_identity<Mode>();
  for (int base = c * chunk + int(threadIdx.x) * V; base < end; base += Threads * U * V) {
    Frg<T, V> fa[U], fb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int col = base + u * Threads * V;
      if constexpr (Mode != 2)
        fa[u] = load_row<Window, V>(ar + col, head - col, end - col, Mode == 0 ? neg_inf : zero,
                                    u == 0);
      if constexpr (Mode != 0)
        fb[u] = load_row<Window, V>(br + col, head - col, end - col, zero, u == 0);
    }
    acc = add_stats<Mode>(acc, fa, fb);
  }
  if constexpr (Mode == 0) acc = SmartReduce<Threads>::reduce(acc, CombineMaxSum{}, scratch);
  else acc = SmartReduce<Threads>::reduce(acc, SumOp{}, scratch);
  if (threadIdx.x == 0) stats[row * chunks + c] = acc;
}

// Stage 2: combine the row's chunk statistics, then write the chunk. CTAs take the chunks in the
// reverse of stage 1's order, so the chunks stage 1 read last (the ones most likely still in L2)
// are read again first, and read them as their last use (evict-first): the lines this kernel has
// consumed make room for its output, not the lines it has still to read. A thread's first step is
// loaded before the statistics are combined, so the two latencies overlap.
template <class T, int V, int Mode, bool IsLog, int Threads, int U, bool Window>
__global__ void __launch_bounds__(Threads, chunk_min_ctas<Threads, U>())
chunk_apply(T* __restrict__ out, const MaxSum* __restrict__ stats, const T* __restrict__ a,
            const T* __restrict__ b, int n, int chunk, int chunks, long long lda, long long ldb,
            long long ldo) {
  __shared__ MaxSum scratch[Threads / 32];
  const long long id = gridDim.x - 1 - blockIdx.x;
  const long long row = id / chunks;
  const int c = int(id % chunks);
  const int head = head_of<V, Window>(a + row * lda);
  const T* ar = a + row * lda - head;
  const T* br = b + row * ldb - head;
  T* orow = out + row * ldo - head;
  const int end = min(n + head, c * chunk + chunk);
  const T zero = from_float<T>(0.f);
  Frg<T, V> fa[U], fb[U];
  auto load = [&](int base) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int col = base + u * Threads * V;
      fa[u] = load_row<Window, V, Reuse::LastUse>(ar + col, head - col, end - col, zero, u == 0);
      if constexpr (Mode != 0)
        fb[u] = load_row<Window, V, Reuse::LastUse>(br + col, head - col, end - col, zero, u == 0);
    }
  };
  int base = c * chunk + int(threadIdx.x) * V;
  load(base);

  MaxSum tot = stats_identity<Mode>();
  for (int j = threadIdx.x; j < chunks; j += Threads) {
    const MaxSum o = stats[row * chunks + j];
    tot = Mode == 0 ? CombineMaxSum{}(tot, o) : SumOp{}(tot, o);
  }
  if constexpr (Mode == 0) tot = SmartReduce<Threads>::reduce(tot, CombineMaxSum{}, scratch);
  else tot = SmartReduce<Threads>::reduce(tot, SumOp{}, scratch);
  // Forward on a row of -inf or NaN: tot.m is -inf; x - (-inf) ... gives NaN as torch does.
  const float scale = scale_of<Mode, IsLog>(tot);

  while (base < end) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int col = base + u * Threads * V;
      Frg<T, V> o;
#pragma unroll
      for (int k = 0; k < V; ++k)
        o[k] = from_float<T>(output_of<Mode, IsLog>(fa[u][k], fb[u][k], tot.m, scale));
      store_row<Window, V>(orow + col, o, head - col, end - col, u == 0);
    }
    base += Threads * U * V;
    if (base < end) load(base);
  }
}

// ------------------------------------------------------------------ split path (few long rows)
// One kernel, each row split over `groups` CTAs that are all resident at once (a cooperative launch
// sized by the occupancy API). CTA `rank` of a row owns the window columns [rank * slice, min(n +
// head, (rank + 1) * slice)) and reads them once: its first Threads * Iters * V elements into
// registers (thread t holds vector i at slice column (i * Threads + t) * V), the rest in steps of U
// vectors per thread, the first smem_vecs vectors of that rest (per array) kept in dynamic shared
// memory, what is beyond read again after the barrier (from L2 where it is still there: the
// "re-read" share, zero when the slice fits on chip). Each CTA publishes its statistics (forward
// (max, sum exp); backward (0, sum(dy * y)) or (0, sum(dy))) in partials[blockIdx.x], waits at its
// row's barrier (group_barrier.cuh: counters[row], no reset between launches), combines the row's
// `groups` partials (one warp, in the same order in every CTA: every CTA of a row gets the same
// bits; it broadcasts through shared memory), and writes its slice from what it holds. (Every warp
// combining them itself had all the grid's warps read the same few L2 lines at once after the
// barrier: with 1-2 rows of 132-264 CTAs, 2-4k warps x 5 loads on 17 lines; docs/perf-notes.md,
// softmax, has the gain.)
// Modes and numerics as the chunked path's (add_stats, CombineMaxSum, output_of).
template <class T, int V, int Mode, bool IsLog, int Threads, int Iters, int U, int Ctas,
          bool Window>
__global__ void __launch_bounds__(Threads, Ctas)
split_kernel(T* __restrict__ out, unsigned* __restrict__ counters, MaxSum* __restrict__ partials,
             const T* __restrict__ a, const T* __restrict__ b, int n, int slice, int groups,
             int smem_vecs, long long lda, long long ldb, long long ldo) {
  constexpr int Held = Threads * Iters * V;  // elements per array in registers
  constexpr int Step = Threads * U * V;
  extern __shared__ uint4 smem_raw[];
  Frg<T, V>* sa = reinterpret_cast<Frg<T, V>*>(smem_raw);  // smem_vecs vectors per array
  Frg<T, V>* sb = sa + smem_vecs;
  __shared__ MaxSum scratch[Threads / 32];
  __shared__ MaxSum total;
  const int t = threadIdx.x;
  const long long row = blockIdx.x / groups;
  const int rank = int(blockIdx.x % groups);
  const int head = head_of<V, Window>(a + row * lda);
  const int begin = rank * slice;  // the slice: window columns [begin, begin + slice)
  const int len = max(0, min(n + head - begin, slice));  // 0: past this row's window
  const int lo = head - begin;  // > 0 only in rank 0 of a row that starts off a vector boundary
  const T* ar = a + row * lda - head + begin;
  const T* br = b + row * ldb - head + begin;
  const T fill = from_float<T>(Mode == 0 ? -__builtin_huge_valf() : 0.f);

  Frg<T, V> ra[Iters], rb[Iters];
#pragma unroll
  for (int i = 0; i < Iters; ++i) {
    const int col = (i * Threads + t) * V;
    ra[i] = load_row<Window, V>(ar + col, lo - col, len - col, fill, i == 0);  // Mode 2: y
    if constexpr (Mode != 0)
      rb[i] = load_row<Window, V>(br + col, lo - col, len - col, fill, i == 0);
  }
  // The rest of the slice, while the registers' loads are in flight.
  MaxSum acc = stats_identity<Mode>();
  for (int base = Held, step = 0; base < len; base += Step, ++step) {
    Frg<T, V> fa[U], fb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int col = base + (u * Threads + t) * V;
      fa[u] = load_frg<V>(ar + col, len - col, fill);  // past the registers' share: no head
      if constexpr (Mode != 0) fb[u] = load_frg<V>(br + col, len - col, fill);
      const int sv = (step * U + u) * Threads + t;
      if (sv < smem_vecs) {
        sa[sv] = fa[u];
        if constexpr (Mode != 0) sb[sv] = fb[u];
      }
    }
    acc = add_stats<Mode>(acc, fa, fb);
  }
  acc = add_stats<Mode>(acc, ra, rb);
  if constexpr (Mode == 0) acc = SmartReduce<Threads>::reduce(acc, CombineMaxSum{}, scratch);
  else acc = SmartReduce<Threads>::reduce(acc, SumOp{}, scratch);
  if (t == 0) __stcg(reinterpret_cast<float2*>(partials + blockIdx.x), make_float2(acc.m, acc.s));

  group_sync(counters + row, unsigned(groups), rank == 0);

  if (t < 32) {  // warp 0 combines the row's partials for the CTA
    MaxSum tot = stats_identity<Mode>();
    const MaxSum* pr = partials + row * groups;
    for (int j = t; j < groups; j += 32) {
      const float2 o = ld_relaxed_gpu(reinterpret_cast<const float2*>(pr + j));
      tot = Mode == 0 ? CombineMaxSum{}(tot, {o.x, o.y}) : SumOp{}(tot, {o.x, o.y});
    }
    if constexpr (Mode == 0) tot = warp_reduce<32>(tot, CombineMaxSum{});
    else tot = warp_reduce<32>(tot, SumOp{});
    if (t == 0) total = tot;
  }
  __syncthreads();
  const MaxSum tot = total;
  // Forward on a row of -inf or NaN: tot.m is -inf; x - (-inf) ... gives NaN as torch does.
  const float scale = scale_of<Mode, IsLog>(tot);

  T* orow = out + row * ldo - head + begin;
#pragma unroll
  for (int i = 0; i < Iters; ++i) {
    const int col = (i * Threads + t) * V;
    Frg<T, V> o;
#pragma unroll
    for (int k = 0; k < V; ++k)
      o[k] = from_float<T>(output_of<Mode, IsLog>(ra[i][k], rb[i][k], tot.m, scale));
    store_row<Window, V>(orow + col, o, lo - col, len - col, i == 0);
  }
  for (int base = Held, step = 0; base < len; base += Step, ++step) {
    Frg<T, V> fa[U], fb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int col = base + (u * Threads + t) * V;
      const int sv = (step * U + u) * Threads + t;
      if (sv < smem_vecs) {  // this thread's own stores: no barrier needed
        fa[u] = sa[sv];
        if constexpr (Mode != 0) fb[u] = sb[sv];
      } else {
        fa[u] = load_frg<V, Reuse::LastUse>(ar + col, len - col, fill);
        if constexpr (Mode != 0) fb[u] = load_frg<V, Reuse::LastUse>(br + col, len - col, fill);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int col = base + (u * Threads + t) * V;
      Frg<T, V> o;
#pragma unroll
      for (int k = 0; k < V; ++k)
        o[k] = from_float<T>(output_of<Mode, IsLog>(fa[u][k], fb[u][k], tot.m, scale));
      store_frg<V>(orow + col, o, len - col);
    }
  }
}

// ------------------------------------------------------------------ tile path (rows in shared memory)
// Each row over the Cluster CTAs of a thread-block cluster (sm_90); CTA `rank` owns the slice
// [rank * slice, min(n, (rank + 1) * slice)) and holds it in shared memory (both arrays for the
// backward): one thread starts TMA bulk copies of its whole vectors in Chunks pieces, each on its
// own mbarrier, so the statistics start on the first piece while the others land; a row's edge
// vectors (partial: the first where the row starts off a vector boundary, the last) are loaded by
// the threads that own them. Statistics as
// the chunked path's (add_stats), combined over the CTA and the cluster (SmartReduce,
// distributed shared memory); then the output is written from shared memory. Slices of 16-64 KiB
// leave room for several CTAs per SM, so one loads while another reduces or writes: the overlap
// the register path's clusters (a whole SM's registers per CTA) lack. No co-residency is needed
// beyond a cluster's own CTAs, which the hardware schedules together. (A persistent variant, one
// cluster taking several rows with the next row's copies in flight in a second stage, measured
// 20-30% slower on an H100: fewer CTAs per SM, and no statistics on the first chunk.)
template <int Mode>
constexpr int tile_arrays() { return Mode == 0 ? 1 : 2; }

template <class T, int V, int Mode, bool IsLog, int Threads, int Cluster, bool Window>
__global__ void __launch_bounds__(Threads)
tile_kernel(T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b, int n, int slice,
            long long lda, long long ldb, long long ldo) {
  static_assert(V * sizeof(T) == 16, "the tile path moves whole 16-byte vectors");
  using Reduce = SmartReduce<Threads, Cluster>;
  constexpr int Chunks = 4;
  extern __shared__ __align__(128) unsigned char tile_raw[];
  __shared__ uint64_t bars[Chunks];
  __shared__ MaxSum scratch[Reduce::scratch_size];
  const int t = threadIdx.x;
  const long long row = blockIdx.x / Cluster;
  const int rank = Cluster > 1 ? int(blockIdx.x % Cluster) : 0;
  const int head = head_of<V, Window>(a + row * lda);
  const int begin = rank * slice;  // the slice: window columns [begin, begin + slice)
  const int len = max(0, min(n + head - begin, slice));  // 0: past the row's end (identity stats)
  const int vecs = len / V, tail = len - vecs * V;
  // Vectors [w0, w1) lie wholly in the row: bulk copies. The others, at most two a slice, are
  // edges that their threads load (load_row): vector 0 of rank 0 when the row starts past its
  // start (head > 0), and the partial vector at the end.
  const int w0 = Window && begin < head ? 1 : 0, w1 = max(w0, vecs);
  const int per = (w1 - w0 + Chunks - 1) / Chunks;  // vectors per chunk
  Frg<T, V>* sa = reinterpret_cast<Frg<T, V>*>(tile_raw);
  Frg<T, V>* sb = sa + slice / V;
  const T* ar = a + row * lda - head + begin;
  const T* br = b + row * ldb - head + begin;
  const T fill = from_float<T>(Mode == 0 ? -__builtin_huge_valf() : 0.f);

  if (t == 0) {
#pragma unroll
    for (int c = 0; c < Chunks; ++c) Bulk::init(&bars[c], 1);
  }
  __syncthreads();
  if (t == 0) {
#pragma unroll
    for (int c = 0; c < Chunks; ++c) {
      const int v0 = w0 + c * per, count = max(0, min(w1 - v0, per));
      Bulk::expect(&bars[c], count * 16 * tile_arrays<Mode>());
      if (count) {
        Bulk::load(sa + v0, ar + v0 * V, count * 16, &bars[c]);
        if constexpr (Mode != 0) Bulk::load(sb + v0, br + v0 * V, count * 16, &bars[c]);
      }
    }
  }
  // Edge e: vector edge[e] with its elements [lo[e], hi[e]) in the row (none where lo >= hi).
  const int edge[2] = {0, vecs};
  const int lo[2] = {w0 ? head : 0, 0};
  const int hi[2] = {w0 ? min(V, len) : 0, w0 && vecs == 0 ? 0 : tail};
  bool owns[2];
  Frg<T, V> ea[2], eb[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    owns[e] = lo[e] < hi[e] && t == edge[e] % Threads;
    if (owns[e]) {
      ea[e] = load_row<Window, V>(ar + edge[e] * V, lo[e], hi[e], fill, e == 0);
      if constexpr (Mode != 0)
        eb[e] = load_row<Window, V>(br + edge[e] * V, lo[e], hi[e], fill, e == 0);
    }
  }

  MaxSum acc = stats_identity<Mode>();
#pragma unroll 1
  for (int c = 0; c < Chunks; ++c) {
    const int v0 = w0 + c * per, v1 = min(w1, v0 + per);
    if (v0 >= v1) break;
    Bulk::wait(&bars[c], 0);
#pragma unroll 1
    for (int i = v0 + t; i < v1; i += 2 * Threads) {  // two vectors a step: one rescale per two
      Frg<T, V> fa[2], fb[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int j = i + u * Threads;
        if constexpr (Mode != 2) fa[u] = j < v1 ? sa[j] : Frg<T, V>::filled(fill);
        if constexpr (Mode != 0) fb[u] = j < v1 ? sb[j] : Frg<T, V>::filled(fill);
      }
      acc = add_stats<Mode>(acc, fa, fb);
    }
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (owns[e]) {
      const Frg<T, V> fa[1] = {ea[e]}, fb[1] = {eb[e]};
      acc = add_stats<Mode>(acc, fa, fb);
    }
  }
  MaxSum tot;
  if constexpr (Mode == 0) tot = Reduce::reduce(acc, CombineMaxSum{}, scratch);
  else tot = Reduce::reduce(acc, SumOp{}, scratch);
  // Forward on a row of -inf or NaN: tot.m is -inf; x - (-inf) ... gives NaN as torch does.
  const float scale = scale_of<Mode, IsLog>(tot);

  T* orow = out + row * ldo - head + begin;
  auto write = [&](const Frg<T, V>& fa, const Frg<T, V>& fb, int i, int lo_i, int hi_i,
                   bool first) {
    Frg<T, V> o;
#pragma unroll
    for (int e = 0; e < V; ++e)
      o[e] = from_float<T>(output_of<Mode, IsLog>(fa[e], fb[e], tot.m, scale));
    store_row<Window, V>(orow + i * V, o, lo_i, hi_i, first);
  };
#pragma unroll 4
  for (int i = w0 + t; i < w1; i += Threads) {  // whole vectors into registers first (LDS.128)
    const Frg<T, V> fa = sa[i];
    write(fa, Mode != 0 ? Frg<T, V>(sb[i]) : fa, i, 0, V, false);
  }
#pragma unroll
  for (int e = 0; e < 2; ++e)
    if (owns[e]) write(ea[e], Mode != 0 ? eb[e] : ea[e], edge[e], lo[e], hi[e], e == 0);
  Reduce::cluster_done();
}

// ------------------------------------------------------------------ packed path (short rows)
// Rows of at most TPR * Items elements (a few to a thousand) laid end to end (row stride n in
// every array): CTA c takes the run of rows [c * run, (c + 1) * run), one contiguous stretch of
// each array, and moves it as the tile path moves a slice: TMA bulk copies of its whole 16-byte
// vectors into shared memory, the run's two edge vectors (partial where the run starts or ends
// inside a vector) by the threads that own them; then groups of TPR lanes each take a row at a
// time from shared memory (element j of a row to lane j % TPR, Items per lane), reduce it with
// warp shuffles and write the output back in place; then one bulk copy of the whole vectors out,
// the edges by their threads. Where rows are a few elements long, the register path's thread a
// row reads with a warp's loads strided by the row (element by element where rows are off
// vector boundaries: 2-byte loads for odd lengths in 16-bit types); here every global access is a
// 16-byte vector or a bulk copy, whatever n is.
template <int Mode>
constexpr int packed_arrays() { return Mode == 0 ? 1 : 2; }
// Vectors of shared memory per array for a run of `run` rows of n: its window (the run, plus up
// to V - 1 elements before it in its first vector).
template <int V>
__host__ __device__ inline int packed_vecs(int run, int n) { return (run * n + 2 * V - 2) / V; }

template <class T, int V, int Mode, bool IsLog, int Threads, int TPR, int Items>
__global__ void __launch_bounds__(Threads)
packed_kernel(T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b,
              long long rows, int n, int run) {
  static_assert(V * sizeof(T) == 16, "the packed path moves whole 16-byte vectors");
  static_assert(TPR >= 1 && TPR <= 32 && Threads % 32 == 0, "a row's lanes are within a warp");
  constexpr int Groups = Threads / TPR;
  extern __shared__ __align__(128) unsigned char packed_raw[];
  __shared__ uint64_t bar;
  const int t = threadIdx.x;
  const long long r0 = (long long)blockIdx.x * run;
  const int count = int(min((long long)run, rows - r0));  // rows in this CTA's run
  const long long e0 = r0 * n;
  const int head = head_of<V, true>(a + e0);  // the run's window starts head elements before it
  const int len = count * n + head;
  const int vecs = len / V, tail = len - vecs * V;
  const int w0 = head > 0 ? 1 : 0, w1 = max(w0, vecs);  // whole vectors: bulk copies
  Frg<T, V>* sa = reinterpret_cast<Frg<T, V>*>(packed_raw);
  Frg<T, V>* sb = sa + packed_vecs<V>(run, n);
  const T* ar = a + e0 - head;
  const T* br = b + e0 - head;
  T* orow = out + e0 - head;
  const T fill = from_float<T>(Mode == 0 ? -__builtin_huge_valf() : 0.f);

  if (t == 0) {
    Bulk::init(&bar, 1);
    Bulk::expect(&bar, (w1 - w0) * 16 * packed_arrays<Mode>());
    if (w1 > w0) {
      Bulk::load(sa + w0, ar + w0 * V, (w1 - w0) * 16, &bar);
      if constexpr (Mode != 0) Bulk::load(sb + w0, br + w0 * V, (w1 - w0) * 16, &bar);
    }
  }
  // Edge e: vector edge[e] with its elements [lo[e], hi[e]) in the run (none where lo >= hi),
  // loaded by thread e * (Threads - 1) into shared memory beside the bulk copies.
  const int edge[2] = {0, vecs};
  const int lo[2] = {w0 ? head : 0, 0};
  const int hi[2] = {w0 ? min(V, len) : 0, w0 && vecs == 0 ? 0 : tail};
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (lo[e] < hi[e] && t == e * (Threads - 1)) {
      sa[edge[e]] = load_row<true, V>(ar + edge[e] * V, lo[e], hi[e], fill, e == 0);
      if constexpr (Mode != 0)
        sb[edge[e]] = load_row<true, V>(br + edge[e] * V, lo[e], hi[e], fill, e == 0);
    }
  }
  __syncthreads();  // the barrier's init and the edges
  Bulk::wait(&bar, 0);

  // Rows: group g = t / TPR takes rows g, g + Groups, ...; every lane of a warp runs every pass
  // (the shuffles need the whole warp), lanes past the run with fill values.
  T* xa = reinterpret_cast<T*>(sa) + head;  // element j of the run's first array
  const T* xb = reinterpret_cast<const T*>(sb) + head;
  const int g = t / TPR, lane = t % TPR;
  const int passes = (count + Groups - 1) / Groups;
#pragma unroll 1
  for (int p = 0; p < passes; ++p) {
    const int r = p * Groups + g;
    const int base = r * n;
    T va[Items], vb[Items];
#pragma unroll
    for (int i = 0; i < Items; ++i) {
      const int j = lane + i * TPR;
      const bool in = r < count && j < n;
      if constexpr (Mode != 2) va[i] = in ? xa[base + j] : fill;
      else va[i] = in ? xa[base + j] : from_float<T>(0.f);
      if constexpr (Mode != 0) vb[i] = in ? xb[base + j] : fill;
      else vb[i] = va[i];
    }
    float m = 0.f, s = 0.f;
    if constexpr (Mode == 0) {
      m = -__builtin_huge_valf();
#pragma unroll
      for (int i = 0; i < Items; ++i) m = fmaxf(m, to_float(va[i]));
      m = warp_reduce<TPR>(m, Max{});
#pragma unroll
      for (int i = 0; i < Items; ++i) s += exp_of(to_float(va[i]) - m);
    } else {
#pragma unroll
      for (int i = 0; i < Items; ++i)
        s += Mode == 1 ? to_float(va[i]) * to_float(vb[i]) : to_float(vb[i]);
    }
    s = warp_reduce<TPR>(s, Sum{});
    const float scale = scale_of<Mode, IsLog>(MaxSum{m, s});
#pragma unroll
    for (int i = 0; i < Items; ++i) {
      const int j = lane + i * TPR;
      if (r < count && j < n)
        xa[base + j] = from_float<T>(output_of<Mode, IsLog>(va[i], vb[i], m, scale));
    }
  }
  Bulk::fence_shared();  // the output in shared memory, before the bulk copy reads it
  __syncthreads();
  if (t == 0 && w1 > w0) {
    Bulk::store(orow + w0 * V, sa + w0, (w1 - w0) * 16);
    Bulk::commit();
  }
#pragma unroll
  for (int e = 0; e < 2; ++e)
    if (lo[e] < hi[e] && t == e * (Threads - 1))
      store_row<true, V>(orow + edge[e] * V, sa[edge[e]], lo[e], hi[e], e == 0);
  if (t == 0) Bulk::store_wait<0>();  // shared memory stays until the copy has read it
}

// ------------------------------------------------------------------ host entry helpers
template <class T, int V, int TPR, int Threads, int Iters, int Cluster, bool IsLog, bool Window>
cudaError_t launch_fwd(T* y, const T* x, long long rows, int n, long long ldx, long long ldy,
                       cudaStream_t stream) {
  VITRAIL_TRY(require(n >= 1 && n + window_pad<V>(x, ldx) <= TPR * Iters * V * Cluster &&
                      rows_fit<V, Window>(x, ldx, y, ldy)));
  const long long ctas = (rows + Threads / TPR - 1) / (Threads / TPR) * Cluster;
  return launch(fwd_kernel<T, V, TPR, Threads, Iters, Cluster, IsLog, Window>, dim3((unsigned)ctas),
                dim3(Threads), 0, stream, Cluster, y, x, rows, n, ldx, ldy);
}

template <class T, int V, int TPR, int Threads, int Iters, int Cluster, bool IsLog, bool Window>
cudaError_t launch_bwd(T* dx, const T* y, const T* dy, long long rows, int n, long long ldy,
                       long long lddy, long long lddx, cudaStream_t stream) {
  VITRAIL_TRY(require(n >= 1 && n + window_pad<V>(y, ldy) <= TPR * Iters * V * Cluster &&
                      rows_fit<V, Window>(y, ldy, dy, lddy) &&
                      rows_fit<V, Window>(y, ldy, dx, lddx)));
  const long long ctas = (rows + Threads / TPR - 1) / (Threads / TPR) * Cluster;
  return launch(bwd_kernel<T, V, TPR, Threads, Iters, Cluster, IsLog, Window>, dim3((unsigned)ctas),
                dim3(Threads), 0, stream, Cluster, dx, y, dy, rows, n, ldy, lddy, lddx);
}

// Packed path: rows laid end to end (row stride n in every array; b and out coaligned with a),
// n <= TPR * Items; `run` rows per CTA (ceil(rows / run) CTAs, fewer than 2^31). Dynamic shared
// memory: packed_vecs(run, n) vectors per array (refused by the launch where they do not fit).
template <class T, int V, int Mode>
size_t packed_smem(int run, int n) {
  return size_t(packed_vecs<V>(run, n)) * 16 * packed_arrays<Mode>();
}

template <class T, int V, int Mode, bool IsLog, int Threads, int TPR, int Items>
cudaError_t launch_packed(T* out, const T* a, const T* b, long long rows, int n, int run,
                          cudaStream_t stream) {
  VITRAIL_TRY(require(n >= 1 && n <= TPR * Items && rows >= 1 && run >= 1 &&
                      (long long)run * n <= (1 << 24) && (rows + run - 1) / run < (1LL << 31) &&
                      coaligned<V>(a, 0, b, 0) && coaligned<V>(a, 0, out, 0)));
  constexpr auto kernel = packed_kernel<T, V, Mode, IsLog, Threads, TPR, Items>;
  return launch(kernel, dim3(ceil_div(rows, run)), dim3(Threads), packed_smem<T, V, Mode>(run, n),
                stream, 1, out, a, b, rows, n, run);
}

// Chunked path: stats holds rows * ceil((n + V - 1) / chunk) MaxSum (8 bytes each; chunks cut
// the rows' windows); chunk % V == 0.
template <class T, int V, int Mode, bool IsLog, int Threads, int U, bool Window>
cudaError_t launch_chunked(T* out, void* stats, const T* a, const T* b, long long rows, int n,
                           int chunk, long long lda, long long ldb, long long ldo,
                           cudaStream_t stream) {
  VITRAIL_TRY(require(n >= 1 && rows >= 1 && chunk >= V && chunk % V == 0 &&
                      rows_fit<V, Window>(a, lda, b, ldb) &&
                      rows_fit<V, Window>(a, lda, out, ldo)));
  const int chunks = (int)ceil_div(n + window_pad<V>(a, lda), chunk);
  VITRAIL_TRY(require(rows * chunks < (1LL << 31)));
  const unsigned ctas = (unsigned)(rows * chunks);
  chunk_stats<T, V, Mode, Threads, U, Window><<<ctas, Threads, 0, stream>>>(
      (MaxSum*)stats, a, b, n, chunk, chunks, lda, ldb);
  VITRAIL_TRY(cudaGetLastError());
  chunk_apply<T, V, Mode, IsLog, Threads, U, Window><<<ctas, Threads, 0, stream>>>(
      out, (const MaxSum*)stats, a, b, n, chunk, chunks, lda, ldb, ldo);
  return cudaGetLastError();
}

// Split path. ws: a workspace of `slots` unsigned counters (one per row, their low 31 bits zero
// when first used: see group_barrier.cuh) followed by `slots` MaxSum partials (8-byte aligned:
// slots even); rows <= slots and rows * groups <= slots. slice % V == 0, the slices cover the
// rows' windows: (groups - 1) * slice < n + pad <= groups * slice (a CTA past a row's window,
// where that row's head is under pad, publishes identity statistics). smem_vecs vectors per
// array in dynamic shared memory.
// Refused with cudaErrorCooperativeLaunchTooLarge when rows * groups CTAs cannot all be resident
// (the caller sizes groups with split_ctas_per_sm; a spin barrier would deadlock otherwise).
template <class T, int V, int Mode, bool IsLog, int Threads, int Iters, int U, int Ctas,
          bool Window>
size_t split_smem(int smem_vecs) {
  return size_t(smem_vecs) * sizeof(Frg<T, V>) * (Mode == 0 ? 1 : 2);
}

template <class T, int V, int Mode, bool IsLog, int Threads, int Iters, int U, int Ctas,
          bool Window>
int split_ctas_per_sm(int smem_vecs) {
  return ctas_per_sm(split_kernel<T, V, Mode, IsLog, Threads, Iters, U, Ctas, Window>, Threads,
                     split_smem<T, V, Mode, IsLog, Threads, Iters, U, Ctas, Window>(smem_vecs));
}

template <class T, int V, int Mode, bool IsLog, int Threads, int Iters, int U, int Ctas,
          bool Window>
cudaError_t launch_split(T* out, void* ws, int slots, const T* a, const T* b, long long rows,
                         int n, int slice, int groups, int smem_vecs, long long lda,
                         long long ldb, long long ldo, cudaStream_t stream) {
  const int window = n + window_pad<V>(a, lda);
  VITRAIL_TRY(require(n >= 1 && rows >= 1 && groups >= 1 && slice >= 1 && slice % V == 0 &&
                      (long long)(groups - 1) * slice < window &&
                      (long long)groups * slice >= window && slots % 2 == 0 && rows <= slots &&
                      rows * groups <= slots && smem_vecs >= 0 &&
                      rows_fit<V, Window>(a, lda, b, ldb) &&
                      rows_fit<V, Window>(a, lda, out, ldo)));
  unsigned* counters = static_cast<unsigned*>(ws);
  MaxSum* partials = reinterpret_cast<MaxSum*>(counters + slots);
  constexpr auto kernel = split_kernel<T, V, Mode, IsLog, Threads, Iters, U, Ctas, Window>;
  const size_t smem = split_smem<T, V, Mode, IsLog, Threads, Iters, U, Ctas, Window>(smem_vecs);
  return launch_cooperative(kernel, dim3(unsigned(rows * groups)), dim3(Threads), smem, stream,
                            out, counters, partials, a, b, n, slice, groups, smem_vecs, lda, ldb,
                            ldo);
}

// Tile path: one cluster of Cluster CTAs a row (rows * Cluster CTAs, fewer than 2^31); slice % V
// == 0 and slice * Cluster >= n + pad (V = 16 bytes / sizeof(T)). Dynamic shared memory: slice
// elements per array (refused by the launch where that exceeds a CTA's shared memory).
template <class T, int Mode>
size_t tile_smem(int slice) {
  return size_t(slice) * sizeof(T) * tile_arrays<Mode>();
}

template <class T, int V, int Mode, bool IsLog, int Threads, int Cluster, bool Window>
cudaError_t launch_tile(T* out, const T* a, const T* b, long long rows, int n, int slice,
                        long long lda, long long ldb, long long ldo, cudaStream_t stream) {
  VITRAIL_TRY(require(n >= 1 && rows >= 1 && slice >= V && slice % V == 0 &&
                      (long long)slice * Cluster >= n + window_pad<V>(a, lda) &&
                      rows * Cluster < (1LL << 31) && rows_fit<V, Window>(a, lda, b, ldb) &&
                      rows_fit<V, Window>(a, lda, out, ldo)));
  constexpr auto kernel = tile_kernel<T, V, Mode, IsLog, Threads, Cluster, Window>;
  return launch(kernel, dim3(unsigned(rows * Cluster)), dim3(Threads), tile_smem<T, Mode>(slice),
                stream, Cluster, out, a, b, n, slice, lda, ldb, ldo);
}

}  // namespace vitrail::softmax
