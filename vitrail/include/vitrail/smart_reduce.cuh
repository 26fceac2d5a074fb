// smart_reduce.cuh: reductions of fragments across a group of lanes, a warp, a CTA and (sm_90) a
// thread-block cluster, for any associative operator; every thread of the group gets the result.
//
//   float m = SmartReduce<GroupThreads, Cluster>::reduce(v, Max{}, scratch);
//
// A group is GroupThreads consecutive threads (a power of two: 1..32 lanes of a warp, or whole
// warps up to the CTA). Within a warp: xor shuffles (no shared memory). Across warps: each warp's
// lane 0 writes its value to `scratch` (GroupThreads/32 values per group, indexed by warp), one
// __syncthreads, then every thread combines its group's values. With Cluster > 1 (one group per
// CTA, sm_90), thread 0 of each CTA publishes the CTA's value in slot scratch[Warps], a cluster
// barrier, and every thread reads the Cluster values through distributed shared memory.
// A call's scratch must not be reused until every thread has finished the call (use a new
// scratch per reduction, or a barrier); with Cluster > 1 call cluster_done() before the CTA exits
// so no peer reads the shared memory of a CTA that has gone.
#pragma once
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cute/arch/cluster_sm90.hpp>

namespace vitrail {

struct Max {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
  static constexpr float identity = -__builtin_huge_valf();
};
struct Sum {
  template <class T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
  static constexpr float identity = 0.f;
};

// Xor shuffle of any trivially copyable value made of 4-byte words.
template <class T>
__device__ __forceinline__ T shfl_xor(const T& v, int mask) {
  static_assert(sizeof(T) % 4 == 0, "shfl_xor: the value's size must be a multiple of 4 bytes");
  if constexpr (sizeof(T) == 4) {
    return __shfl_xor_sync(0xffffffffu, v, mask);
  } else {
    T out;
    const int* in = reinterpret_cast<const int*>(&v);
    int* o = reinterpret_cast<int*>(&out);
#pragma unroll
    for (int i = 0; i < int(sizeof(T) / 4); ++i) o[i] = __shfl_xor_sync(0xffffffffu, in[i], mask);
    return out;
  }
}

// Reduce across aligned groups of Width lanes (Width a power of two <= 32); all lanes of the
// warp must call it (inactive rows too: give them the identity).
template <int Width, class T, class Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
  static_assert(Width >= 1 && Width <= 32 && (Width & (Width - 1)) == 0, "Width: power of 2 <= 32");
#pragma unroll
  for (int offset = Width / 2; offset > 0; offset /= 2) v = op(v, shfl_xor(v, offset));
  return v;
}

template <int GroupThreads, int Cluster = 1>
struct SmartReduce {
  static_assert((GroupThreads & (GroupThreads - 1)) == 0, "GroupThreads: a power of two");
  static_assert(Cluster == 1 || GroupThreads >= 32, "a cluster reduction takes whole CTAs");
  static constexpr int Warps = GroupThreads >= 32 ? GroupThreads / 32 : 1;
  // Values of scratch one reduction needs (per group: index with the group's first warp).
  static constexpr int scratch_size = Warps + (Cluster > 1 ? 1 : 0);

  template <class T, class Op>
  __device__ static T reduce(T v, Op op, T* scratch) {
    if constexpr (GroupThreads <= 32) {
      return warp_reduce<GroupThreads>(v, op);
    } else {
      v = warp_reduce<32>(v, op);
      const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
      const int first = warp / Warps * Warps;  // the group's first warp
      if (lane == 0) scratch[warp] = v;
      __syncthreads();
      v = scratch[first];
#pragma unroll
      for (int w = 1; w < Warps; ++w) v = op(v, scratch[first + w]);
      if constexpr (Cluster > 1) v = across_cluster(v, op, scratch + Warps * (blockDim.x / GroupThreads));
      return v;
    }
  }

  // v is the CTA's value in every thread; returns the cluster's.
  template <class T, class Op>
  __device__ static T across_cluster(T v, Op op, T* slot) {
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    if (threadIdx.x == 0) *slot = v;
    cluster.sync();
    T r = *cluster.map_shared_rank(slot, 0);
#pragma unroll
    for (int c = 1; c < Cluster; ++c) r = op(r, *cluster.map_shared_rank(slot, c));
    return r;
  }

  // With Cluster > 1: every CTA of the cluster has read its peers' slots (call before exit).
  __device__ static void cluster_done() {
    if constexpr (Cluster > 1) {
      cute::cluster_arrive_relaxed();
      cute::cluster_wait();
    }
  }
};

}  // namespace vitrail
