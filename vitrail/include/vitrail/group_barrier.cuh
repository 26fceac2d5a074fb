// group_barrier.cuh: a barrier across a group of CTAs of one grid (e.g. the G CTAs that split one
// row), through a counter in global memory.
//
//   group_sync(&counters[group], ctas_in_group, rank_in_group == 0);
//
// Every CTA of the group calls it (all its threads); it returns once all of them have arrived,
// and what any of them wrote to global memory before arriving is visible to all of them after.
// Read such data with loads that go to L2 (ld_relaxed_gpu, __ldcg), never the non-coherent path
// (__ldg / ld.global.nc, which load_frg uses for read-only inputs).
//
// REQUIREMENT: the group's CTAs are resident at the same time (launch_cooperative in launch.cuh
// guarantees it for the whole grid, and refuses a grid that cannot be resident): a CTA that spins
// here while a peer waits for its SM never finishes.
//
// The counter (one unsigned per group) is the grid-sync counter of cooperative_groups: each
// barrier adds exactly 2^31 to it (the leader adds 2^31 - (ctas - 1), the others 1), so bit 31
// flips exactly when the last CTA arrives, and the low 31 bits return to 0. Hence:
//   - the counter must start with its low 31 bits zero (allocate it zeroed once), and needs no
//     reset between launches: it is reused as it is, by any later launch and any group size;
//   - wrap-around is part of the design (bit 31 flips; nothing else is compared);
//   - two grids must not use one counter at the same time (give each CUDA stream its own);
//   - a grid that dies inside a barrier (a trap, a kill) leaves it unusable (the context is
//     lost then anyway).
// One group may pass through several barriers in one launch (each flips bit 31 once).
#pragma once
#include <cuda_runtime.h>

namespace vitrail {

__device__ __forceinline__ unsigned atomic_add_release_gpu(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.add.release.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v)
               : "memory");
  return old;
}
__device__ __forceinline__ unsigned load_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// A load from L2 (coherent at GPU scope): data that peers published before a group_sync.
__device__ __forceinline__ float2 ld_relaxed_gpu(const float2* p) {
  float2 v;
  asm volatile("ld.relaxed.gpu.global.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p)
               : "memory");
  return v;
}

// All threads of each CTA of the group call it; leader: exactly one CTA of the group (rank 0).
__device__ __forceinline__ void group_sync(unsigned* counter, unsigned ctas, bool leader) {
  __syncthreads();  // the CTA's writes happen before thread 0's release (bar.sync, cumulativity)
  if (threadIdx.x == 0) {
    const unsigned old = atomic_add_release_gpu(counter, leader ? 0x80000000u - (ctas - 1) : 1u);
    while (((load_acquire_gpu(counter) ^ old) & 0x80000000u) == 0) __nanosleep(20);
  }
  __syncthreads();  // the other threads are ordered after thread 0's acquire
}

}  // namespace vitrail
