// Flash attention backward on Hopper, from vitrail's blocks, in two kernels that need no atomics
// (so the gradients are the same bits on every run):
//
//   attention_bwd_dq   a CTA per BM query rows of one head, over the blocks of keys it sees:
//                      S = Q K^T, P = exp2(S * scale_log2 - lse2), dP = dO V^T,
//                      dS = P (dP - delta), dQ += dS K;  dQ * scale stored.
//   attention_bwd_dkv  a CTA per BK keys of one key/value head, over the blocks of query rows of
//                      every query head of its group that see them:
//                      S^T = K Q^T, P^T, dP^T = V dO^T, dV += P^T dO, dS^T = P^T (dP^T - delta),
//                      dK += dS^T Q;  dK * scale and dV stored.
//
// S and dP are recomputed in both (FlashAttention-2's split of the backward: seven products of
// the forward's size instead of five, against an fp32 dQ summed with atomics across CTAs).
// ATOMIC_DQ (the fast backward, whose dQ's rounding varies from run to run): attention_bwd_dkv
// alone computes the products, five, dQ among them: dS = (dS^T)^T from a shared tile,
// dQ_partial = dS K a block of rows at a time, summed into an fp32 slab dq_accum by bulk
// reduce-adds (cp.reduce.async.bulk .add.f32: atomic per element in L2); then
// attention_bwd_dq_convert writes dq = T(dq_accum * scale). attention_bwd_dq is then empty.
// Both kernels: a producer warpgroup loads by TMA (the CTA's own rows once, the streamed blocks
// into a ring of STAGES stages), two consumer warpgroups compute with TileMMA: the two products
// of a block from shared memory (SS), the gradient's product with the fp32 result converted to
// T as its A operand in registers (RS, as_a). A K-major (rows, D) tile and an MN-major (D, rows)
// tile of the same box are the same bytes: K and Q are loaded once and read both ways.
//
// Config (constexpr before the include): T, D (head dim), BM and BN (attention_bwd_dq's query
// rows and keys per block), BK and BQ (attention_bwd_dkv's keys and query rows per block),
// STAGES, ATOMIC_DQ, CAUSAL, LOCAL (a window's left edge: key j visible to row i only where
// j >= i + local_offset), SOFTCAP (scores capped: c tanh(s * softcap_pre), whose derivative
// 1 - tanh^2 scales dS), VARLEN (sequences of their own lengths packed along the rows).
// Layouts: q, k, v, do (batch, seqlen, heads, D), D contiguous, read by TMA maps over (D, seqlen,
// heads, batch); dq, dk, dv written (batch, seqlen, heads, D) contiguous; lse2 and delta
// (batch, heads, seqlen_q_padded) fp32, seqlen_q_padded a multiple of BM and BQ, made by the
// Python side (vitrail.ops.attention): lse2 = lse * log2(e), +inf for a row that sees no key and
// past seqlen_q (P = 0 there); delta = rowsum(dO * O) - the lse's gradient, 0 past seqlen_q.
// VARLEN: the tensors are (1, total, heads, D); blockIdx.z is the sequence, cu_q / cu_k its
// first row and key (batch + 1 entries); lse2 and delta are (heads, seqlen_q_padded), where a
// sequence's rows start at cu_pad[z], a multiple of BM and BQ, and the rows between sequences
// hold +inf and 0 (so a block of rows that runs past its sequence reads no other's).
// ATOMIC_DQ: dq_accum (fp32, zeros before the launch) has lse2's rows, D wide: (batch, heads,
// seqlen_q_padded, D), VARLEN (heads, seqlen_q_padded, D); in each block of BQ rows, the
// 64-column chunks of D one after the other, each a (BQ, 64) tile of 8 (BQ, 8) blocks of
// columns, row-major (dQ's fragments land in shared memory without bank conflicts, and a
// block's chunk is one contiguous reduce-add); only attention_bwd_dq_convert reads it.
#pragma once
#include <vitrail/pipeline.cuh>
#include <vitrail/tile_copy.cuh>
#include <vitrail/tile_mma.cuh>

#include "sm90_attention_math.cuh"

namespace attention_bwd {

constexpr int kChunk = 64;  // TMA boxes are 64 elements (128 bytes) of D wide
constexpr int kChunks = D / kChunk;
static_assert(D % kChunk == 0, "attention backward: D must be a multiple of 64");
using Storage = typename vitrail::Pipeline<STAGES>::Storage;
using T2 = cute::conditional_t<cute::is_same_v<T, __half>, __half2, __nv_bfloat162>;

struct Params {
  T* grad;    // dq (attention_bwd_dq) or dk (attention_bwd_dkv)
  T* grad_v;  // dv (attention_bwd_dkv)
  const float* lse2;
  const float* delta;
  int seqlen_q, seqlen_k, seqlen_q_padded, heads, heads_kv;
  float scale_log2;   // softmax scale * log2(e) (SOFTCAP: log2(e), the scale in softcap_pre)
  float scale;
  int causal_offset;  // key j is visible to query i where j <= i + causal_offset
  int local_offset;   // LOCAL: and where j >= i + local_offset
  float softcap, softcap_pre;
  const int* cu_q;    // VARLEN: each sequence's first row, first key, first row in lse2/delta
  const int* cu_k;
  const int* cu_pad;
  int bottom_right;   // VARLEN: the offsets above are relative to seqlen_k - seqlen_q
  float* dq_accum;    // ATOMIC_DQ: attention_bwd_dkv's sums of dQ (see the layouts above)
};

// Where a CTA's sequence lies: its first row and key in the TMA maps' seqlen coordinate and in
// the packed outputs, the maps' batch coordinate, VARLEN: its rows' start in lse2 and delta.
struct Seq {
  int tma_q, tma_k, tma_batch;
  long long out_q, out_k, rows;
};

// The first of a head's rows of the CTA's sequence in lse2 and delta.
__device__ __forceinline__ long long head_rows(const Params& p, const Seq& at, int head) {
  if constexpr (VARLEN) return at.rows + (long long)head * p.seqlen_q_padded;
  else return ((long long)at.tma_batch * p.heads + head) * p.seqlen_q_padded;
}

// blockIdx.z's sequence (VARLEN: p takes its lengths, and bottom_right's shift of the offsets),
// or batch entry.
__device__ __forceinline__ Seq sequence(Params& p) {
  const int z = blockIdx.z;
  if constexpr (VARLEN) {
    const int q_start = p.cu_q[z], k_start = p.cu_k[z];
    p.seqlen_q = p.cu_q[z + 1] - q_start;
    p.seqlen_k = p.cu_k[z + 1] - k_start;
    if (p.bottom_right) {
      p.causal_offset += p.seqlen_k - p.seqlen_q;
      p.local_offset += p.seqlen_k - p.seqlen_q;
    }
    return {q_start, k_start, 0, q_start, k_start, p.cu_pad[z]};
  } else {
    return {0, 0, z, (long long)z * p.seqlen_q, (long long)z * p.seqlen_k, 0};
  }
}

// One score's P from S and the row's lse2.
__device__ __forceinline__ float probability(const Params& p, float s, float lse2) {
  if constexpr (SOFTCAP) s = p.softcap * tanhf(s * p.softcap_pre);
  return attention_math::exp2_ftz(s * p.scale_log2 - lse2);  // +inf lse2: 0
}

// SOFTCAP: the cap's derivative 1 - tanh^2 at a score, recovered from its P (log2 P + lse2 =
// softcap * tanh * scale_log2): keeping each score's tanh across the products would take 32
// more registers a thread, which dK and dV at D 128 do not leave. 0 where P is 0 (a hidden key,
// a row that sees none), where dS is 0 anyway.
__device__ __forceinline__ float cap_slope(const Params& p, float pr, float lse2) {
  if (!(pr > 0.f)) return 0.f;
  const float t = (__log2f(pr) + lse2) / (p.softcap * p.scale_log2);
  return 1.f - t * t;
}

// Whether key j is hidden from row i (the diagonal, the window's left edge).
__device__ __forceinline__ bool hidden(const Params& p, int i, int j) {
  return (CAUSAL && j > i + p.causal_offset) || (LOCAL && j < i + p.local_offset);
}

// The 1024-byte aligned start of dynamic shared memory (swizzled tiles need it).
__device__ char* aligned_smem() {
  extern __shared__ char smem_raw[];
  unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  return smem_raw + ((1024 - raw % 1024) % 1024);
}

// Rows (r, c) of an accumulator fragment as (row, column) pairs: store rows * factor as T, pairs
// of columns at once, to out + row * row_stride + column, rows below `rows` only.
template <class Frag, class Where>
__device__ void store_rows(Frag const& acc_rows, Where const& where, int row0, int rows,
                           long long row_stride, T* out, float factor) {
  CUTE_UNROLL
  for (int r = 0; r < cute::size<0>(acc_rows); ++r) {
    const int row = row0 + cute::get<0>(where(r, 0));
    if (row >= rows) continue;
    T* dst = out + row * row_stride;
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(acc_rows); c += 2) {
      const int col = cute::get<1>(where(r, c));
      *reinterpret_cast<T2*>(dst + col) =
          T2(T(acc_rows(r, c) * factor), T(acc_rows(r, c + 1) * factor));
    }
  }
}

// ------------------------------------------------------------------------ dQ: over the keys
namespace dq {
using QK = vitrail::TileMMA<T, BM, BN, D, 2>;  // S = Q K^T and dP = dO V^T
using SK = vitrail::TileMMA<T, BM, D, BN, 2, vitrail::Major::K, vitrail::Major::MN>;  // dS K
constexpr int kThreads = 128 + QK::kThreads;
constexpr int kBytesRows = QK::kBytesA<>;       // Q, and dO: BM x D each, loaded once
constexpr int kBytesKV = 2 * QK::kBytesB<>;     // one stage: a block of K and of V
constexpr int kSmemBytes = 1024 + 2 * kBytesRows + STAGES * kBytesKV + int(sizeof(Storage)) + 16;

// The blocks of keys the rows [m0, m0 + BM) see, and the first that needs a mask (past
// seqlen_k or, causal, past the diagonal of row m0).
__device__ int blocks(const Params& p, int m0) {
  int keys = p.seqlen_k;
  if (CAUSAL) keys = min(keys, max(0, m0 + BM + p.causal_offset));
  return (keys + BN - 1) / BN;
}
__device__ int first_masked(const Params& p, int m0) {
  int first = p.seqlen_k / BN;
  if (CAUSAL) first = min(first, max(0, m0 + p.causal_offset) / BN);
  return first;
}
// LOCAL: the first block some row sees, the first whose keys every row sees (as the forward's).
__device__ int first_block(const Params& p, int m0) {
  return LOCAL ? max(0, m0 + p.local_offset) / BN : 0;
}
__device__ int first_full_block(const Params& p, int m0) {
  const int lowest = m0 + BM - 1 + p.local_offset;
  return lowest <= 0 ? 0 : (lowest + BN - 1) / BN;
}
// The CTA's block of query rows: causal CTAs from the last (the most keys) to the first.
__device__ int m_block() {
  return CAUSAL ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
}

__device__ void run(Params p, const vitrail::TensorMap& mapQ, const vitrail::TensorMap& mapdO,
                    const vitrail::TensorMap& mapK, const vitrail::TensorMap& mapV) {
  const Seq at = sequence(p);
  const int m0 = m_block() * BM;
  if constexpr (VARLEN) {  // the grid fits the longest sequence
    if (m0 >= p.seqlen_q) return;
  }
  char* smem = aligned_smem();
  auto sQ = QK::tile_a(smem);
  auto sdO = QK::tile_a(smem + kBytesRows);
  char* ring = smem + 2 * kBytesRows;
  auto& bars = *reinterpret_cast<Storage*>(ring + STAGES * kBytesKV);
  uint64_t* rows_full = reinterpret_cast<uint64_t*>(&bars + 1);
  vitrail::Pipeline<STAGES> pipe(bars);
  auto sK = [&](int stage) { return QK::tile_b(ring + stage * kBytesKV); };
  auto sV = [&](int stage) { return QK::tile_b(ring + stage * kBytesKV + QK::kBytesB<>); };
  auto sKt = [&](int stage) { return SK::tile_b(ring + stage * kBytesKV); };  // K as (D, BN)

  const int head = blockIdx.y, batch = at.tma_batch;
  const int head_kv = head / (p.heads / p.heads_kv);
  const int n = blocks(p, m0);
  const int start = LOCAL ? min(n, first_block(p, m0)) : 0;
  if (threadIdx.x == 0) {
    vitrail::Tma::prefetch(mapQ);
    vitrail::Tma::prefetch(mapdO);
    vitrail::Tma::prefetch(mapK);
    vitrail::Tma::prefetch(mapV);
    pipe.init(/*producer arrivals=*/1, /*consumer arrivals: one per warp=*/QK::kThreads / 32);
    vitrail::Bulk::init(rows_full, 1);
  }
  __syncthreads();

  if (threadIdx.x / 128 == 0) {  // producer: slab -> tile
    vitrail::warpgroup_registers_down<40>();
    if (threadIdx.x == 0) {
      vitrail::Bulk::expect(rows_full, 2 * kBytesRows);
      for (int c = 0; c < kChunks; ++c) {
        vitrail::Tma::load(&sQ(0, c * kChunk, 0), mapQ, rows_full, c * kChunk, at.tma_q + m0,
                           head, batch);
        vitrail::Tma::load(&sdO(0, c * kChunk, 0), mapdO, rows_full, c * kChunk, at.tma_q + m0,
                           head, batch);
      }
      auto w = vitrail::PipeState<STAGES>::producer();
      for (int j = start; j < n; ++j, w.advance()) {
        pipe.acquire(w);
        pipe.expect(w, kBytesKV);
        auto k = sK(w.index);
        auto v = sV(w.index);
        for (int c = 0; c < kChunks; ++c) {
          vitrail::Tma::load(&k(0, c * kChunk, 0), mapK, pipe.full(w), c * kChunk,
                             at.tma_k + j * BN, head_kv, batch);
          vitrail::Tma::load(&v(0, c * kChunk, 0), mapV, pipe.full(w), c * kChunk,
                             at.tma_k + j * BN, head_kv, batch);
        }
      }
    }
    return;
  }

  // consumers: tile -> fragment
  vitrail::warpgroup_registers_up<232>();
  const int t = threadIdx.x - 128;
  QK qk(t);
  SK sk(t);
  auto s = qk.accumulators();
  auto dp = qk.accumulators();
  auto dq = sk.accumulators();
  SK::zero(dq);
  auto s_rows = QK::rows(s);
  auto dp_rows = QK::rows(dp);
  auto where = QK::rows(qk.coordinates());  // (row, key) in the tile of each element of S
  constexpr int kRows = decltype(cute::size<0>(s_rows))::value;
  float lse2[kRows], delta[kRows];
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {  // rows < seqlen_q_padded: padded to a multiple of BM
    const long long row = head_rows(p, at, head) + m0 + cute::get<0>(where(r, 0));
    lse2[r] = p.lse2[row];
    delta[r] = p.delta[row];
  }

  vitrail::PipeState<STAGES> rd;
  auto block = [&](int j, auto masked) {
    pipe.wait(rd);
    QK::zero(s);
    QK::zero(dp);
    qk.mma(sQ(cute::_, cute::_, 0), sK(rd.index)(cute::_, cute::_, 0), s);
    qk.mma(sdO(cute::_, cute::_, 0), sV(rd.index)(cute::_, cute::_, 0), dp);
    QK::wait<1>(s);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(s_rows); ++c) {
        float pr = probability(p, s_rows(r, c), lse2[r]);
        if constexpr (decltype(masked)::value) {
          const int row = m0 + cute::get<0>(where(r, c)), key = j * BN + cute::get<1>(where(r, c));
          if (key >= p.seqlen_k || hidden(p, row, key)) pr = 0.f;
        }
        s_rows(r, c) = pr;
      }
    }
    QK::wait<0>(dp);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(dp_rows); ++c) {
        float ds = s_rows(r, c) * (dp_rows(r, c) - delta[r]);
        if constexpr (SOFTCAP) ds *= cap_slope(p, s_rows(r, c), lse2[r]);
        dp_rows(r, c) = ds;
      }
    }
    auto ds = QK::as_a(dp);
    sk.mma_rs(ds, sKt(rd.index)(cute::_, cute::_, 0), dq);
    SK::wait<0>(dq, ds);
    if (threadIdx.x % 32 == 0) pipe.release(rd);
    rd.advance();
  };
  vitrail::Bulk::wait(rows_full, 0);
  const int tail = min(n, first_masked(p, m0));
  if constexpr (LOCAL) {  // masked at both ends: one loop (three call sites of block: out of line)
    const int full = max(start, first_full_block(p, m0));
    for (int j = start; j < n; ++j) {
      if (j >= full && j < tail) block(j, cute::false_type{});
      else block(j, cute::true_type{});
    }
  } else {
    for (int j = 0; j < tail; ++j) block(j, cute::false_type{});
    for (int j = tail; j < n; ++j) block(j, cute::true_type{});
  }

  // fragment -> slab: dQ * scale
  store_rows(SK::rows(dq), SK::rows(sk.coordinates()), m0, p.seqlen_q, (long long)p.heads * D,
             p.grad + (at.out_q * p.heads + head) * D, p.scale);
}
}  // namespace dq

// -------------------------------------------------------------- dK, dV: over the query rows
namespace dkv {
using KQ = vitrail::TileMMA<T, BK, BQ, D, 2>;  // S^T = K Q^T and dP^T = V dO^T
using PQ = vitrail::TileMMA<T, BK, D, BQ, 2, vitrail::Major::K, vitrail::Major::MN>;  // P^T dO
constexpr int kThreads = 128 + KQ::kThreads;
constexpr int kBytesKeys = KQ::kBytesA<>;  // K, and V: BK x D each, loaded once
constexpr int kBytesQ = KQ::kBytesB<>;     // a block of Q, and of dO: BQ x D each
constexpr int kStageBytes = (2 * kBytesQ + 2 * BQ * 4 + 1023) / 1024 * 1024;  // + lse2, delta
// ATOMIC_DQ: dQ = dS K. Each consumer warpgroup makes a (BQ, 64) fp32 tile of each block's:
// at D 128 the 64 columns of its chunk of D, over every key (dS from both warpgroups' dS^T); at
// D 64 all of D over its own 64 keys (the two tiles add into the same rows of dq_accum). dS^T
// is stored as T into a (BQ, BK) tile, query rows contiguous: dS's bytes as an MN-major A
// operand (two of them, alternate blocks: a warpgroup writes the next block's while the other
// may still read this one's). K is read as the MN-major (D, keys) B operand (the same bytes).
constexpr bool kSplitKeys = D == kChunk;
static_assert(!ATOMIC_DQ || D == kChunk || D == 2 * kChunk,
              "attention backward: ATOMIC_DQ takes D 64 or 128");
constexpr int kDqKeys = kSplitKeys ? BK / 2 : BK;
using DQ = vitrail::TileMMA<T, BQ, kChunk, kDqKeys, 1, vitrail::Major::MN, vitrail::Major::MN>;
using DsTile = vitrail::SmemTile<T, BQ, BK, vitrail::Major::MN>;
constexpr int kBytesDs = BQ * BK * int(sizeof(T));
constexpr int kBytesDq = BQ * kChunk * 4;
constexpr int kBytesAtomic = ATOMIC_DQ ? 2 * kBytesDs + 2 * kBytesDq : 0;
// Named barriers (the forward's ping-pong takes 1 and 2): both warpgroups' dS^T are in the
// tile (and each one's last reduce-add has read its dQ tile); a warpgroup's dQ tile is written.
constexpr int kDsReady = 3, kDqReady = 4;  // kDqReady + warpgroup
// Registers a thread: ATOMIC_DQ's consumers hold dQ's tile too (and, with a window and the
// softcap, 232 spilled), the producer issues its loads from 24.
constexpr int kProducerRegisters = ATOMIC_DQ ? 24 : 40;
constexpr int kConsumerRegisters = ATOMIC_DQ ? 240 : 232;
static_assert(128 * kProducerRegisters + KQ::kThreads * kConsumerRegisters <= 65536);
static_assert(!ATOMIC_DQ || STAGES % 2 == 0, "the dS tile of a block is its stage's index % 2");
constexpr int kSmemBytes = 1024 + 2 * kBytesKeys + STAGES * kStageBytes + kBytesAtomic +
                           int(sizeof(Storage)) + 16;

// The blocks of query rows that see a key of [n0, n0 + BK): [first, last); those of
// [unmasked, unmasked_end) see every one of them (causal: key <= row + causal_offset for all;
// LOCAL: key >= row + local_offset for all).
struct Range {
  int first, unmasked, unmasked_end, last;
};
__device__ Range rows_of(const Params& p, int n0) {
  int last = (p.seqlen_q + BQ - 1) / BQ;
  if (LOCAL) {  // the last row that sees key n0 + BK - 1: n0 + BK - 1 - local_offset
    const int top = n0 + BK - 1 - p.local_offset;
    last = top < 0 ? 0 : min(last, top / BQ + 1);
  }
  int first = 0, unmasked = 0;
  if (CAUSAL) {
    first = min(last, max(0, n0 - p.causal_offset) / BQ);
    const int lowest = n0 + BK - 1 - p.causal_offset;  // the lowest row that sees every key
    unmasked = min(last, max(first, lowest <= 0 ? 0 : (lowest + BQ - 1) / BQ));
  }
  int unmasked_end = last;
  if (LOCAL) {  // rows up to n0 - local_offset see every key; a block is whole below it
    const int top = n0 - p.local_offset + 1;
    unmasked_end = max(unmasked, min(last, top <= 0 ? 0 : top / BQ));
  }
  return {first, unmasked, unmasked_end, last};
}

// ATOMIC_DQ: this thread's dS^T (T; the accumulators' (key, row) view, `where` its
// coordinates, where0 thread 0's) into the dS tile: (BQ, BK), MN-major, the 128-byte swizzle
// (DsTile), (row, key) at byte (key / 8) 1024 + (key % 8) 128 + ((row / 8) ^ (key % 8)) 16 +
// (row % 8) 2. wgmma's accumulators give a thread keys key0 + 8 k and pairs of rows row0 + 8 j
// (+ 1), row0 < 8, so a pair's address is the thread's base + 1024 per 8 keys, xor 16 j: one
// add and one xor a store, and nothing the compiler keeps across blocks (a cute view of the tile
// had it hoist 16 addresses out of the loop, and spill them).
template <class Rows, class Where, class Where0>
__device__ void store_ds(Rows const& ds_rows, Where const& where, Where0 const& where0,
                         unsigned tile) {
  const int key0 = cute::get<0>(where(0, 0)), row0 = cute::get<1>(where(0, 0));
  const unsigned base = tile + key0 / 8 * 1024 + key0 % 8 * (128 + 16) + row0 * 2;
  CUTE_UNROLL
  for (int r = 0; r < cute::size<0>(ds_rows); ++r) {
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(ds_rows); c += 2) {
      const int dk = cute::get<0>(where0(r, c)), dr = cute::get<1>(where0(r, c));
      const unsigned at = (base + dk / 8 * 1024) ^ (dr / 8 * 16);
      const unsigned bits =
          unsigned(ds_rows(r, c).raw()) | unsigned(ds_rows(r, c + 1).raw()) << 16;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(bits));
    }
  }
}

// ATOMIC_DQ: this thread's dQ fragment into the warpgroup's (BQ, 64) fp32 tile, laid out as in
// dq_accum: 8 blocks of (BQ, 8) columns, each row-major ((row, col) at (col / 8) 8 BQ + 8 row +
// col % 8), so that a warp's pairs for one 8-column block (8 rows of 8 columns) are 256
// contiguous bytes (no bank conflicts); addresses as store_ds's: the thread's base + constants.
template <class Acc, class Where, class Where0>
__device__ void store_dq(Acc const& dq, Where const& where, Where0 const& where0, unsigned tile) {
  auto dq_rows = DQ::rows(dq);
  const int row0 = cute::get<0>(where(0, 0)), col0 = cute::get<1>(where(0, 0));
  const unsigned base = tile + 4 * (row0 * 8 + col0);
  CUTE_UNROLL
  for (int r = 0; r < cute::size<0>(dq_rows); ++r) {
    CUTE_UNROLL
    for (int c = 0; c < cute::size<1>(dq_rows); c += 2) {
      const int dr = cute::get<0>(where0(r, c)), dc = cute::get<1>(where0(r, c));
      const unsigned at = base + 4 * (dc / 8 * 8 * BQ + dr * 8);
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at), "f"(dq_rows(r, c)),
                   "f"(dq_rows(r, c + 1)));
    }
  }
}

__device__ void run(Params p, const vitrail::TensorMap& mapK, const vitrail::TensorMap& mapV,
                    const vitrail::TensorMap& mapQ, const vitrail::TensorMap& mapdO) {
  const Seq at = sequence(p);
  const int n0 = int(blockIdx.x) * BK;
  if constexpr (VARLEN) {  // the grid fits the longest sequence
    if (n0 >= p.seqlen_k) return;
  }
  char* smem = aligned_smem();
  auto sK = KQ::tile_a(smem);
  auto sV = KQ::tile_a(smem + kBytesKeys);
  char* ring = smem + 2 * kBytesKeys;
  char* atomic = ring + STAGES * kStageBytes;  // ATOMIC_DQ: two dS tiles, two dQ tiles
  auto& bars = *reinterpret_cast<Storage*>(atomic + kBytesAtomic);
  uint64_t* keys_full = reinterpret_cast<uint64_t*>(&bars + 1);
  vitrail::Pipeline<STAGES> pipe(bars);
  auto sQ = [&](int stage) { return KQ::tile_b(ring + stage * kStageBytes); };
  auto sdO = [&](int stage) { return KQ::tile_b(ring + stage * kStageBytes + kBytesQ); };
  auto sQt = [&](int stage) { return PQ::tile_b(ring + stage * kStageBytes); };  // (D, BQ)
  auto sdOt = [&](int stage) { return PQ::tile_b(ring + stage * kStageBytes + kBytesQ); };
  auto sRows = [&](int stage) {  // lse2[BQ], then delta[BQ]
    return reinterpret_cast<float*>(ring + stage * kStageBytes + 2 * kBytesQ);
  };

  const int head_kv = blockIdx.y, batch = at.tma_batch;
  const int group = p.heads / p.heads_kv;
  Range range = rows_of(p, n0);
  // ATOMIC_DQ and VARLEN: keys past the sequence's end are the next sequence's, not TMA's zeros;
  // a row that sees every key of the sequence (no causal or window mask) would sum their dS K
  // into its dQ, so the block of keys that crosses the end masks every block of rows.
  if (ATOMIC_DQ && VARLEN && n0 + BK > p.seqlen_k) {
    range.unmasked = range.unmasked_end = range.last;
  }
  if (threadIdx.x == 0) {
    vitrail::Tma::prefetch(mapK);
    vitrail::Tma::prefetch(mapV);
    vitrail::Tma::prefetch(mapQ);
    vitrail::Tma::prefetch(mapdO);
    pipe.init(/*producer arrivals=*/1, /*consumer arrivals: one per warp=*/KQ::kThreads / 32);
    vitrail::Bulk::init(keys_full, 1);
  }
  __syncthreads();

  if (threadIdx.x / 128 == 0) {  // producer: slab -> tile
    vitrail::warpgroup_registers_down<kProducerRegisters>();
    if (threadIdx.x == 0) {
      vitrail::Bulk::expect(keys_full, 2 * kBytesKeys);
      for (int c = 0; c < kChunks; ++c) {
        vitrail::Tma::load(&sK(0, c * kChunk, 0), mapK, keys_full, c * kChunk, at.tma_k + n0,
                           head_kv, batch);
        vitrail::Tma::load(&sV(0, c * kChunk, 0), mapV, keys_full, c * kChunk, at.tma_k + n0,
                           head_kv, batch);
      }
      auto w = vitrail::PipeState<STAGES>::producer();
      for (int g = 0; g < group; ++g) {
        const int head = head_kv * group + g;
        const float* lse2 = p.lse2 + head_rows(p, at, head);
        const float* delta = p.delta + head_rows(p, at, head);
        for (int i = range.first; i < range.last; ++i, w.advance()) {
          pipe.acquire(w);
          pipe.expect(w, 2 * kBytesQ + 2 * BQ * 4);
          auto q = sQ(w.index);
          auto d = sdO(w.index);
          for (int c = 0; c < kChunks; ++c) {
            vitrail::Tma::load(&q(0, c * kChunk, 0), mapQ, pipe.full(w), c * kChunk,
                               at.tma_q + i * BQ, head, batch);
            vitrail::Tma::load(&d(0, c * kChunk, 0), mapdO, pipe.full(w), c * kChunk,
                               at.tma_q + i * BQ, head, batch);
          }
          vitrail::Bulk::load(sRows(w.index), lse2 + i * BQ, BQ * 4, pipe.full(w));
          vitrail::Bulk::load(sRows(w.index) + BQ, delta + i * BQ, BQ * 4, pipe.full(w));
        }
      }
    }
    return;
  }

  // consumers: tile -> fragment
  vitrail::warpgroup_registers_up<kConsumerRegisters>();
  const int t = threadIdx.x - 128;
  KQ kq(t);
  PQ pq(t);
  auto s = kq.accumulators();
  auto dp = kq.accumulators();
  auto dk = pq.accumulators();
  auto dv = pq.accumulators();
  PQ::zero(dk);
  PQ::zero(dv);
  auto s_rows = KQ::rows(s);
  auto dp_rows = KQ::rows(dp);
  auto where = KQ::rows(kq.coordinates());  // (key, row) in the tile of each element of S^T
  constexpr int kRows = decltype(cute::size<0>(s_rows))::value;
  // ATOMIC_DQ: this warpgroup's dQ product: its keys of the dS tile, its chunk of K's columns;
  // the thread that issues its reduce-adds; where its rows start in dq_accum (per query head)
  const int wg = t / 128;
  DQ dqm(t % 128);
  auto dq = dqm.accumulators();
  const int ds_offset = kSplitKeys ? wg * kDqKeys * BQ * int(sizeof(T)) : 0;
  const int k_offset = (kSplitKeys ? wg * kDqKeys : wg * BK) * kChunk * int(sizeof(T));
  const bool issuer = t % 128 == 0;
  float* dq_tile = reinterpret_cast<float*>(atomic + 2 * kBytesDs + wg * kBytesDq);
  const unsigned dq_tile_at = static_cast<unsigned>(__cvta_generic_to_shared(dq_tile));
  const auto kq0 = KQ(0).coordinates(), dq0 = DQ(0).coordinates(), dq_at = dqm.coordinates();
  auto where0 = KQ::rows(kq0);  // thread 0's: the part of a coordinate that is no thread's
  auto dq_where = DQ::rows(dq_at), dq_where0 = DQ::rows(dq0);
  float* accum = nullptr;

  vitrail::PipeState<STAGES> rd;
  auto block = [&](int i, auto masked) {
    pipe.wait(rd);
    const float* lse2 = sRows(rd.index);
    const float* delta = lse2 + BQ;
    KQ::zero(s);
    KQ::zero(dp);
    kq.mma(sK(cute::_, cute::_, 0), sQ(rd.index)(cute::_, cute::_, 0), s);
    kq.mma(sV(cute::_, cute::_, 0), sdO(rd.index)(cute::_, cute::_, 0), dp);
    KQ::wait<1>(s);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(s_rows); ++c) {
        const int col = cute::get<1>(where(r, c));
        float pr = probability(p, s_rows(r, c), lse2[col]);
        if constexpr (decltype(masked)::value) {
          const int key = n0 + cute::get<0>(where(r, c)), row = i * BQ + col;
          if (hidden(p, row, key) || (ATOMIC_DQ && VARLEN && key >= p.seqlen_k)) pr = 0.f;
        }
        s_rows(r, c) = pr;
      }
    }
    auto pt = KQ::as_a(s);
    pq.mma_rs(pt, sdOt(rd.index)(cute::_, cute::_, 0), dv);
    KQ::wait<1>(dp);  // dP^T retired; dV's batch may still be in flight
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(dp_rows); ++c) {
        const int col = cute::get<1>(where(r, c));
        float ds = s_rows(r, c) * (dp_rows(r, c) - delta[col]);
        if constexpr (SOFTCAP) ds *= cap_slope(p, s_rows(r, c), lse2[col]);
        dp_rows(r, c) = ds;
      }
    }
    auto dst = KQ::as_a(dp);
    pq.mma_rs(dst, sQt(rd.index)(cute::_, cute::_, 0), dk);
    if constexpr (ATOMIC_DQ) {
      PQ::wait<1>(dv, pt);  // dV's batch retired (P^T's registers free); dK's in flight
      char* ds_tile = atomic + rd.index % 2 * kBytesDs;  // blocks alternate
      store_ds(cute::make_tensor(dst.data(), dp_rows.layout()), where, where0,
               static_cast<unsigned>(__cvta_generic_to_shared(ds_tile)));
      vitrail::fence_tile_writes();  // generic writes, read by wgmma (the async proxy)
      if (issuer) vitrail::Bulk::store_wait<0>();  // the last reduce-add has read dq_tile
      vitrail::named_barrier_sync(kDsReady, KQ::kThreads);
      DQ::zero(dq);
      dqm.mma(DQ::tile_a(ds_tile + ds_offset)(cute::_, cute::_, 0),
              DQ::tile_b(smem + k_offset)(cute::_, cute::_, 0), dq);
      PQ::wait<1>(dk, dst);  // dQ's batch may still be in flight; the stage is read
      if (threadIdx.x % 32 == 0) pipe.release(rd);
      DQ::wait<0>(dq);
      store_dq(dq, dq_where, dq_where0, dq_tile_at);
      vitrail::fence_tile_writes();  // read by the bulk reduce-add (the async proxy)
      vitrail::named_barrier_sync(kDqReady + wg, 128);
      if (issuer) {
        const int chunk = kSplitKeys ? 0 : wg;
        vitrail::Bulk::reduce_add(accum + (long long)i * BQ * D + chunk * BQ * kChunk, dq_tile,
                                  kBytesDq);
        vitrail::Bulk::commit();
      }
    } else {
      PQ::wait<0>(dv, dk, pt, dst);
      if (threadIdx.x % 32 == 0) pipe.release(rd);
    }
    rd.advance();
  };
  vitrail::Bulk::wait(keys_full, 0);
  for (int g = 0; g < group; ++g) {
    if constexpr (ATOMIC_DQ) accum = p.dq_accum + head_rows(p, at, head_kv * group + g) * D;
    if constexpr (LOCAL) {  // masked at both ends: one loop (three call sites: out of line)
      for (int i = range.first; i < range.last; ++i) {
        if (i >= range.unmasked && i < range.unmasked_end) block(i, cute::false_type{});
        else block(i, cute::true_type{});
      }
    } else {
      for (int i = range.first; i < range.unmasked; ++i) block(i, cute::true_type{});
      for (int i = range.unmasked; i < range.last; ++i) block(i, cute::false_type{});
    }
  }

  if constexpr (ATOMIC_DQ) {
    if (issuer) vitrail::Bulk::wait_all();  // the reduce-adds done before the CTA ends
  }

  // fragment -> slab: dK * scale and dV, keys below seqlen_k
  const long long stride = (long long)p.heads_kv * D;
  const long long base = (at.out_k * p.heads_kv + head_kv) * D;
  auto out_where = PQ::rows(pq.coordinates());
  store_rows(PQ::rows(dk), out_where, n0, p.seqlen_k, stride, p.grad + base, p.scale);
  store_rows(PQ::rows(dv), out_where, n0, p.seqlen_k, stride, p.grad_v + base, 1.f);
}
}  // namespace dkv

// ------------------------------------------------- ATOMIC_DQ: dq = T(dq_accum * scale)
namespace dq_convert {
constexpr int kThreads = 256;
constexpr int kVec = 8;  // elements a thread converts at once: 32 bytes read, 16 written

// A CTA per BQ rows of one head of one sequence (VARLEN) or batch entry: the rows below its
// length, from dq_accum's layout (see the top) to dq's (batch, seqlen, heads, D).
__device__ void run(Params p) {
  const Seq at = sequence(p);
  const int head = blockIdx.y, m0 = int(blockIdx.x) * BQ;
  if (m0 >= p.seqlen_q) return;
  const float* src = p.dq_accum + (head_rows(p, at, head) + m0) * D;
  T* dst = p.grad + ((at.out_q + m0) * p.heads + head) * D;
  for (int e = threadIdx.x; e < BQ * D / kVec; e += kThreads) {
    const int row = e / (D / kVec), col = e % (D / kVec) * kVec;
    if (m0 + row >= p.seqlen_q) break;  // rows ascend with e
    const float* s = src + (col / kChunk * BQ * kChunk + col % kChunk / 8 * BQ * 8 + row * 8);
    const float4 a = *reinterpret_cast<const float4*>(s);
    const float4 b = *reinterpret_cast<const float4*>(s + 4);
    const float x = p.scale;
    const T2 out[4] = {T2(T(a.x * x), T(a.y * x)), T2(T(a.z * x), T(a.w * x)),
                       T2(T(b.x * x), T(b.y * x)), T2(T(b.z * x), T(b.w * x))};
    *reinterpret_cast<uint4*>(dst + (long long)row * p.heads * D + col) =
        *reinterpret_cast<const uint4*>(out);
  }
}
}  // namespace dq_convert

}  // namespace attention_bwd

extern "C" __global__ void __launch_bounds__(attention_bwd::dq::kThreads, 1)
attention_bwd_dq(T* dq, float* lse2, float* delta, const __grid_constant__ vitrail::TensorMap mapQ,
                 const __grid_constant__ vitrail::TensorMap mapdO,
                 const __grid_constant__ vitrail::TensorMap mapK,
                 const __grid_constant__ vitrail::TensorMap mapV, int seqlen_q, int seqlen_k,
                 int seqlen_q_padded, int heads, int heads_kv, float scale_log2, float scale,
                 int causal_offset, int local_offset, float softcap, float softcap_pre,
                 const int* cu_q, const int* cu_k, const int* cu_pad, int bottom_right) {
  if constexpr (!ATOMIC_DQ) {  // empty in the fast backward's build (attention_bwd_dkv's dQ)
    attention_bwd::dq::run({dq, nullptr, lse2, delta, seqlen_q, seqlen_k, seqlen_q_padded,
                            heads, heads_kv, scale_log2, scale, causal_offset, local_offset,
                            softcap, softcap_pre, cu_q, cu_k, cu_pad, bottom_right},
                           mapQ, mapdO, mapK, mapV);
  }
}

extern "C" __global__ void __launch_bounds__(attention_bwd::dkv::kThreads, 1)
attention_bwd_dkv(T* dk, T* dv, float* lse2, float* delta,
                  const __grid_constant__ vitrail::TensorMap mapK,
                  const __grid_constant__ vitrail::TensorMap mapV,
                  const __grid_constant__ vitrail::TensorMap mapQ,
                  const __grid_constant__ vitrail::TensorMap mapdO, int seqlen_q, int seqlen_k,
                  int seqlen_q_padded, int heads, int heads_kv, float scale_log2, float scale,
                  int causal_offset, int local_offset, float softcap, float softcap_pre,
                  const int* cu_q, const int* cu_k, const int* cu_pad, int bottom_right,
                  float* dq_accum) {
  attention_bwd::dkv::run({dk, dv, lse2, delta, seqlen_q, seqlen_k, seqlen_q_padded, heads,
                           heads_kv, scale_log2, scale, causal_offset, local_offset, softcap,
                           softcap_pre, cu_q, cu_k, cu_pad, bottom_right, dq_accum},
                          mapK, mapV, mapQ, mapdO);
}

extern "C" __global__ void __launch_bounds__(attention_bwd::dq_convert::kThreads)
attention_bwd_dq_convert(T* dq, const float* dq_accum, int seqlen_q, int seqlen_q_padded,
                         int heads, float scale, const int* cu_q, const int* cu_pad) {
  if constexpr (ATOMIC_DQ) {  // empty in the deterministic backward's build
    attention_bwd::Params p{};
    p.grad = dq;
    p.dq_accum = const_cast<float*>(dq_accum);
    p.seqlen_q = seqlen_q;
    p.seqlen_q_padded = seqlen_q_padded;
    p.heads = heads;
    p.scale = scale;
    p.cu_q = cu_q;
    p.cu_k = cu_q;  // sequence() reads it; unused here
    p.cu_pad = cu_pad;
    attention_bwd::dq_convert::run(p);
  }
}
