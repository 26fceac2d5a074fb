// tile_copy.cuh: moving data between slabs (global), tiles (shared) and fragments (registers).
//
// - Frg<T, N>: N elements of T in registers, moved as one vector (16 bytes when N*sizeof(T) is 16).
// - load_frg / store_frg (store_frg_v4: one st.global.v4 that NVVM cannot split): global <->
//   registers, one vector per call; the predicated overloads
//   touch only the first `valid` elements (the edge of a row), or those in [lo, hi) (the edges
//   of a row that does not start on a vector boundary), and fill the rest; load_frg_if: a
//   vector load or nothing, one predicated instruction (loads of an unrolled loop stay in flight);
//   Reuse::LastUse makes 16-byte loads evict-first in L1 and L2 (data read for the last time).
// - copy_async / async_commit / async_wait<K>: cp.async 16-byte global -> shared copies with zero
//   fill for out-of-range chunks (sm_80+), for multistage pipelines (K groups left in flight).
// - TileCopy<T, Threads>: a CTA copies a rows x cols tile (cols contiguous, row stride ld) between
//   a slab and a tile in 16-byte chunks, predicated at the slab's edges.
// - Bulk: sm_90 TMA bulk copies (cp.async.bulk) global -> shared completing on an mbarrier, and
//   shared -> global committed as bulk groups (see pipeline.cuh for staged use).
// - TensorMap / Tma: sm_90 TMA tensor copies of a box of a slab (a CUtensorMap made on the host
//   by vitrail.jit.tma) into a tile, swizzled for wgmma (tile_mma.cuh), on an mbarrier.
// Built on CuTe's arch layer (cute/arch/copy_sm80.hpp, copy_sm90_*.hpp).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#if defined(__CUDACC_RTC__)  // NVRTC has no C++ standard library headers
#include <cuda/std/cstdint>
#else
#include <cuda_runtime.h>
#include <cstdint>
#endif

#include <cuda/std/type_traits>

#include <cuda/std/bit>

#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>

namespace vitrail {

// Elements of T in one 16-byte vector.
template <class T> inline constexpr int kVec = 16 / int(sizeof(T));

// Unsigned integer type of a given byte size (the register type a vector moves as).
template <int Bytes> struct Bits;
template <> struct Bits<1> { using type = uint8_t; };
template <> struct Bits<2> { using type = uint16_t; };
template <> struct Bits<4> { using type = uint32_t; };
template <> struct Bits<8> { using type = uint2; };
template <> struct Bits<16> { using type = uint4; };

// N elements of T held in registers; moves as one vector of N*sizeof(T) bytes.
template <class T, int N>
struct alignas(N * sizeof(T)) Frg {
  using Raw = typename Bits<N * sizeof(T)>::type;
  static constexpr int size = N;
  union {
    T v[N];
    Raw raw;
  };
  __device__ __forceinline__ T& operator[](int i) { return v[i]; }
  __device__ __forceinline__ const T& operator[](int i) const { return v[i]; }
  // A fragment of N copies of x.
  __device__ __forceinline__ static Frg filled(T x) {
    Frg f;
#pragma unroll
    for (int i = 0; i < N; ++i) f.v[i] = x;
    return f;
  }
};

// ---------------------------------------------------------------- conversions to/from float
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
// Any of the three float types to any other (through float; exact where the target can hold it).
template <class To, class From> __device__ __forceinline__ To convert(From x) {
  if constexpr (cuda::std::is_same_v<To, From>)
    return x;  // a plain move (a round trip through float would cost two conversions)
  else
    return from_float<To>(to_float(x));
}

// ---------------------------------------------------------------- global <-> registers
// One vector load; p must be aligned to the vector's size.
template <int N, class T>
__device__ __forceinline__ Frg<T, N> load_frg(const T* __restrict__ p) {
  Frg<T, N> f;
  f.raw = *reinterpret_cast<const typename Frg<T, N>::Raw*>(p);
  return f;
}
// Whether a load's data is read again later: LastUse loads 16-byte vectors with the streaming
// cache operator (ld.cs: evict-first in L1 and L2), so that lines still to be read stay in L2.
enum class Reuse { Normal, LastUse };

// One vector load into f when pred, else f unchanged; p must not be written while the kernel runs
// (a read-only load). 16-byte vectors load in one predicated instruction with no branch, so the
// loads of an unrolled loop all issue before any result is waited for: a branch around each load
// (what `if (pred) f = load_frg(p)` compiles to beside a fill) makes ptxas copy the result at the
// join, and that copy waits for the load before the next one issues.
template <int N, Reuse R = Reuse::Normal, class T>
__device__ __forceinline__ void load_frg_if(Frg<T, N>& f, const T* __restrict__ p, bool pred) {
  if constexpr (sizeof(typename Frg<T, N>::Raw) == 16) {
    uint4& r = f.raw;
    if constexpr (R == Reuse::LastUse) {
      asm("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %5, 0;\n\t"
          "@q ld.global.cs.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
          : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w)
          : "l"(p), "r"(int(pred)));
    } else {
      asm("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %5, 0;\n\t"
          "@q ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
          : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w)
          : "l"(p), "r"(int(pred)));
    }
  } else {
    if (pred) f = load_frg<N>(p);
  }
}
// The first `valid` elements from p (a full vector load when valid >= N), the rest `fill`
// (a row's edge: valid may be <= 0 or >= N). Read-only, as load_frg_if.
template <int N, Reuse R = Reuse::Normal, class T>
__device__ __forceinline__ Frg<T, N> load_frg(const T* __restrict__ p, int valid, T fill) {
  Frg<T, N> f = Frg<T, N>::filled(fill);
  load_frg_if<N, R>(f, p, valid >= N);
  if (valid > 0 && valid < N) {
#pragma unroll
    for (int i = 0; i < N - 1; ++i)
      if (i < valid) f.v[i] = p[i];
  }
  return f;
}
// Elements [lo, hi) of the vector at p, the rest `fill` (lo may be <= 0, hi >= N): the edge
// vectors of a row read through the aligned window that holds it, where the row starts lo
// elements into its first vector and ends hi into its last. One vector load when the whole vector
// is in range; an edge touches only its elements in range. Read-only, as load_frg_if.
template <int N, Reuse R = Reuse::Normal, class T>
__device__ __forceinline__ Frg<T, N> load_frg(const T* __restrict__ p, int lo, int hi, T fill) {
  Frg<T, N> f = Frg<T, N>::filled(fill);
  load_frg_if<N, R>(f, p, lo <= 0 && hi >= N);
  if ((lo > 0 || hi < N) && lo < hi && hi > 0 && lo < N) {
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (i >= lo && i < hi) f.v[i] = p[i];
  }
  return f;
}
template <int N, class T>
__device__ __forceinline__ void store_frg(T* __restrict__ p, const Frg<T, N>& f) {
  *reinterpret_cast<typename Frg<T, N>::Raw*>(p) = f.raw;
}
// A 16-byte vector stored with one st.global.v4.b32 of words packed from the elements. Where a
// kernel fills a fragment element by element from other fragments (copy's transpose), NVVM can
// split the plain store above into 32-bit or 2 x 16-bit stores; this one it cannot. As CUTLASS's
// global_store, the asm has no memory clobber: it stays in order with other asm (barriers,
// fences) but not with plain loads of the same address. Not the default: the asm also limits
// how ptxas schedules around it (the log_softmax forward kernel took 16 more registers with it).
template <class T, int N>
__device__ __forceinline__ void store_frg_v4(T* __restrict__ p, const Frg<T, N>& f) {
  static_assert(N * sizeof(T) == 16 && (sizeof(T) == 2 || sizeof(T) == 4),
                "a 16-byte vector of 2- or 4-byte elements");
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (sizeof(T) == 4)
      w[i] = cuda::std::bit_cast<uint32_t>(f.v[i]);
    else
      w[i] = uint32_t(cuda::std::bit_cast<uint16_t>(f.v[2 * i])) |
             uint32_t(cuda::std::bit_cast<uint16_t>(f.v[2 * i + 1])) << 16;
  }
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]),
               "r"(w[2]), "r"(w[3]));
}
template <int N, class T>
__device__ __forceinline__ void store_frg(T* __restrict__ p, const Frg<T, N>& f, int valid) {
  if (valid >= N) {
    store_frg<N>(p, f);
    return;
  }
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (i < valid) p[i] = f.v[i];
}
// Elements [lo, hi) of f to p (as the windowed load_frg): one vector store when all are in range.
template <int N, class T>
__device__ __forceinline__ void store_frg(T* __restrict__ p, const Frg<T, N>& f, int lo, int hi) {
  if (lo <= 0 && hi >= N) {
    store_frg<N>(p, f);
    return;
  }
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (i >= lo && i < hi) p[i] = f.v[i];
}

// ---------------------------------------------------------------- cp.async (sm_80+)
// 16 bytes global -> shared; zero-filled when !pred (the source is then not read).
__device__ __forceinline__ void copy_async(void* smem, const void* gmem, bool pred) {
  cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
      *reinterpret_cast<const cute::uint128_t*>(gmem), *reinterpret_cast<cute::uint128_t*>(smem),
      pred);
}
__device__ __forceinline__ void async_commit() { cute::cp_async_fence(); }
template <int InFlight> __device__ __forceinline__ void async_wait() {
  cute::cp_async_wait<InFlight>();
}

// A CTA of Threads threads copies rows x cols tiles of T, cols contiguous, in 16-byte chunks.
// cols must be a multiple of kVec<T>; global rows start 16-byte aligned (ld multiple of kVec).
template <class T, int Threads>
struct TileCopy {
  static constexpr int V = kVec<T>;

  // slab (row stride ld, valid_rows x valid_cols in range) -> tile (row stride tile_ld),
  // asynchronously; chunks outside the slab's valid region are zero-filled.
  __device__ static void g2s_async(T* tile, int tile_ld, const T* slab, long long ld, int rows,
                                   int cols, int valid_rows, int valid_cols) {
    const int chunks_per_row = cols / V;
    for (int c = threadIdx.x; c < rows * chunks_per_row; c += Threads) {
      int r = c / chunks_per_row, k = (c % chunks_per_row) * V;
      bool ok = r < valid_rows && k + V <= valid_cols;
      const T* src = ok ? slab + r * ld + k : slab;  // never form an out-of-range address
      copy_async(tile + r * tile_ld + k, src, ok);
    }
  }
  // tile -> slab with ordinary 16-byte stores, elementwise at a ragged right edge.
  __device__ static void s2g(T* slab, long long ld, const T* tile, int tile_ld, int rows, int cols,
                             int valid_rows, int valid_cols) {
    const int chunks_per_row = cols / V;
    for (int c = threadIdx.x; c < rows * chunks_per_row; c += Threads) {
      int r = c / chunks_per_row, k = (c % chunks_per_row) * V;
      if (r >= valid_rows || k >= valid_cols) continue;
      Frg<T, V> f = *reinterpret_cast<const Frg<T, V>*>(tile + r * tile_ld + k);
      store_frg<V>(slab + r * ld + k, f, valid_cols - k);
    }
  }
};

// ---------------------------------------------------------------- TMA bulk copies (sm_90)
struct Bulk {
  // One thread: make the barrier expect `count` arrivals.
  __device__ static void init(uint64_t* mbar, int count) {
    cute::initialize_barrier(*mbar, count);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // One thread: arrive on mbar, announcing `bytes` more bytes of copies in this phase (the phase
  // completes when the arrivals are in and the announced bytes have landed). Announce each copy
  // once: here, or through Pipeline::expect.
  __device__ static void expect(uint64_t* mbar, int bytes) {
    cute::set_barrier_transaction_bytes(*mbar, bytes);
  }
  // One thread: start the copy of `bytes` bytes (a multiple of 16, both addresses 16-byte
  // aligned) from gmem into smem, completing on mbar, whose phase must expect them.
  __device__ static void load(void* smem, const void* gmem, int bytes, uint64_t* mbar) {
    cute::SM90_BULK_COPY_G2S::copy(gmem, mbar, smem, bytes);
  }
  // One thread: arrive on mbar announcing no copies (a phase with nothing to load; its writes
  // to shared memory before the arrival are visible to the threads that wait on the phase).
  __device__ static void arrive(uint64_t* mbar) {
    const unsigned bar = static_cast<unsigned>(__cvta_generic_to_shared(mbar));
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
  }
  // Any thread: wait until the barrier's phase `phase` completes (the bytes have landed).
  __device__ static void wait(uint64_t* mbar, int phase) { cute::wait_barrier(*mbar, phase); }
  // One thread, after a barrier over the threads that wrote smem: start smem -> gmem.
  // Writers must call fence_shared() before that barrier.
  __device__ static void store(void* gmem, const void* smem, int bytes) {
    cute::SM90_BULK_COPY_S2G::copy(smem, gmem, bytes);
  }
  // One thread, as store: gmem[i] += smem[i] over `bytes` bytes of fp32 (a multiple of 16,
  // both addresses 16-byte aligned), each element's add atomic in L2 (other CTAs may add to
  // the same elements; the order of their adds, hence the rounding, varies from run to run).
  __device__ static void reduce_add(float* gmem, const float* smem, int bytes) {
    const unsigned src = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 ::"l"(gmem), "r"(src), "r"(bytes) : "memory");
  }
  __device__ static void fence_shared() { cute::tma_store_fence(); }
  // The issuing thread: close a group of its stores and reduce_adds (groups are per thread).
  __device__ static void commit() { cute::tma_store_arrive(); }
  // Wait until at most InFlight committed store groups are still reading shared memory.
  template <int InFlight> __device__ static void store_wait() { cute::tma_store_wait<InFlight>(); }
  // Wait until every committed group is complete, its writes to global memory included.
  __device__ static void wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
};

// A CUtensorMap, passed to a kernel by value (`const __grid_constant__ vitrail::TensorMap map`):
// the 128 bytes that vitrail.jit.tma.tensor_map encodes on the host.
struct alignas(64) TensorMap {
  uint64_t opaque[16];
};

// Tma: sm_90 tensor copies (cp.async.bulk.tensor) of one box of a TensorMap's view of a slab
// into a tile, completing on an mbarrier (as Bulk::load; announce the box's bytes with
// Bulk::expect or Pipeline::expect). Coordinates are elements, innermost dimension first; what
// lies outside the slab lands as zeros. The map's swizzle decides the tile's layout (vitrail's
// SmemTile for the 128-byte swizzle and 64 two-byte elements innermost).
struct Tma {
  template <class... Coords>
  __device__ static void load(void* smem, const TensorMap& map, uint64_t* mbar, Coords... c) {
    static_assert(sizeof...(Coords) >= 1 && sizeof...(Coords) <= 5, "Tma::load: 1 to 5 coords");
    cute::SM90_TMA_LOAD::copy(&map, mbar,
                              static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL),
                              smem, static_cast<int32_t>(c)...);
  }
  // Any thread, before the first load: fetch the map into the descriptor cache.
  __device__ static void prefetch(const TensorMap& map) {
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(&map));
  }
};

}  // namespace vitrail
