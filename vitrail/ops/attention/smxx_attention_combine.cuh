// Split-KV's second step: the partial results of a row's key chunks combined by their
// log-sum-exps, and the rows put back in the caller's (batch, seqlen_q, heads, Dv) order.
//
// The first step (attention_varlen's kernel) ran one sequence per (batch entry e, chunk c), its
// rows the entry's query rows with a GQA group's g query heads packed into them (row r = s g + j
// of KV head kv is query row s of head kv g + j; g = 1 without packing), so that the heads that
// share a KV head read it once. Its outputs, in the varlen layout:
//   part      (B splits rows, Hkv, Dv) in T, rows = seqlen_q g
//   part_lse  (Hkv, B splits rows) fp32
// This kernel writes, for each (e, s, head):
//   lse = log sum_c exp(lse_c)    o = sum_c exp(lse_c - lse) o_c    (fp32 sums, o rounded to T)
// Each output row is DV / 8 threads, 8 elements (16 bytes) each.
// Instantiated with: using T = <16-bit type>; constexpr int DV = <v head dim, a multiple of 8>;
#pragma once

#include <cuda/std/limits>

namespace attention_combine {

constexpr float kNoKey = -cuda::std::numeric_limits<float>::infinity();  // -inf: a row that saw no key
constexpr int kVec = 8;  // T elements a thread moves at once (16 bytes)
constexpr int kLanes = DV / kVec;  // threads an output row
static_assert(DV % kVec == 0 && kLanes <= 128, "DV: a multiple of 8 up to 1024");
constexpr int kRowsPerBlock = 128 / kLanes;
constexpr int kThreads = kRowsPerBlock * kLanes;

struct alignas(16) Vec {
  T x[kVec];
};

}  // namespace attention_combine

extern "C" __global__ void __launch_bounds__(attention_combine::kThreads)
attention_split_combine(T* o, float* lse, const T* part, const float* part_lse, int batch,
                        int splits, int seqlen_q, int heads, int group) {
  using namespace attention_combine;
  const int lane = threadIdx.x % kLanes;
  const long out_row = long(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  if (out_row >= long(batch) * seqlen_q * heads) return;
  // out_row = (e seqlen_q + s) heads + head; head = kv group + j
  const int head = int(out_row % heads);
  const long es = out_row / heads;
  const int s = int(es % seqlen_q), e = int(es / seqlen_q);
  const int kv = head / group, j = head % group, heads_kv = heads / group;
  const long rows = long(seqlen_q) * group;  // a sequence's rows
  const long total = long(batch) * splits * rows;
  const long first = long(e) * splits * rows + long(s) * group + j;  // chunk 0's row
  const float* lse_of = part_lse + long(kv) * total + first;  // chunk c at c rows
  float most = kNoKey;
  for (int c = 0; c < splits; ++c) most = fmaxf(most, lse_of[c * rows]);
  float sum = 0.f;
  if (most != kNoKey)
    for (int c = 0; c < splits; ++c) sum += __expf(lse_of[c * rows] - most);
  const float whole = most == kNoKey ? kNoKey : most + __logf(sum);
  float acc[kVec] = {};
  for (int c = 0; c < splits && whole != kNoKey; ++c) {
    const float w = __expf(lse_of[c * rows] - whole);
    const Vec v = reinterpret_cast<const Vec*>(
        part + ((first + c * rows) * heads_kv + kv) * DV)[lane];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] += w * static_cast<float>(v.x[i]);
  }
  Vec out;
#pragma unroll
  for (int i = 0; i < kVec; ++i) out.x[i] = T(acc[i]);
  reinterpret_cast<Vec*>(o + out_row * DV)[lane] = out;
  if (lane == 0) lse[(long(e) * heads + head) * seqlen_q + s] = whole;
}
