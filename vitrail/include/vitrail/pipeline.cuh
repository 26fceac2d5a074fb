// pipeline.cuh: a ring of Stages shared-memory buffers between producers and consumers, on
// mbarriers (sm_90).
//
//   __shared__ Pipeline<Stages>::Storage bars;       // full[] and empty[] barriers
//   Pipeline<Stages> pipe(bars);
//   if (threadIdx.x == 0) pipe.init(producer_arrivals, consumer_arrivals);  __syncthreads();
//   PipeState<Stages> w = PipeState<Stages>::producer(), r{};  // producer starts one phase ahead
//   producer: pipe.acquire(w); fill stage w.index (TMA: Bulk::load(..., pipe.full(w)) after
//             pipe.expect(w, bytes); ordinary stores: pipe.commit(w)); w.advance();
//   consumer: pipe.wait(r); read stage r.index; pipe.release(r); r.advance();
//
// full[s] completes when the producer's arrivals (and the bytes it announced) are in; empty[s]
// when every consumer has released the stage. Phases alternate 0/1 on each pass of the ring.
#pragma once
#if defined(__CUDACC_RTC__)  // NVRTC has no C++ standard library headers
#include <cuda/std/cstdint>
#else
#include <cstdint>
#endif

#include <cute/arch/copy_sm90_desc.hpp>

namespace vitrail {

template <int Stages>
struct PipeState {
  int index = 0;
  int phase = 0;
  // The producer waits on empty barriers one phase ahead: a fresh barrier passes at once.
  __device__ static PipeState producer() { return PipeState{0, 1}; }
  __device__ void advance() {
    if (++index == Stages) {
      index = 0;
      phase ^= 1;
    }
  }
};

template <int Stages>
struct Pipeline {
  struct Storage {
    uint64_t full[Stages];
    uint64_t empty[Stages];
  };
  Storage& bars;
  __device__ explicit Pipeline(Storage& s) : bars(s) {}

  // One thread, then a barrier before use.
  __device__ void init(int producer_arrivals, int consumer_arrivals) {
#pragma unroll
    for (int s = 0; s < Stages; ++s) {
      cute::initialize_barrier(bars.full[s], producer_arrivals);
      cute::initialize_barrier(bars.empty[s], consumer_arrivals);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // Producer: wait until the stage is free.
  __device__ void acquire(PipeState<Stages> st) { cute::wait_barrier(bars.empty[st.index], st.phase); }
  // Producer (one thread): arrive on the full barrier announcing `bytes` of async copies.
  __device__ void expect(PipeState<Stages> st, int bytes) {
    cute::set_barrier_transaction_bytes(bars.full[st.index], bytes);
  }
  __device__ uint64_t* full(PipeState<Stages> st) { return &bars.full[st.index]; }
  // Producer threads that wrote the stage with ordinary stores: arrive.
  __device__ void commit(PipeState<Stages> st) { cute::arrive_barrier(bars.full[st.index]); }
  // Consumer: wait until the stage is full.
  __device__ void wait(PipeState<Stages> st) { cute::wait_barrier(bars.full[st.index], st.phase); }
  // Consumer: done reading the stage.
  __device__ void release(PipeState<Stages> st) { cute::arrive_barrier(bars.empty[st.index]); }
};

// Named hardware barriers of a CTA (bar.sync, bar.arrive; ids 1 to 15: 0 is __syncthreads).
// `threads` counts every thread that takes part, those that wait and those that only arrive
// (a multiple of 32). Two warpgroups taking turns (A waits on its id, B arrives on it) is
// attention's ping-pong.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace vitrail
