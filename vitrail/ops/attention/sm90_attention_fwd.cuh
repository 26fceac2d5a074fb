// Flash attention forward on Hopper, from vitrail's blocks: O = softmax(Q K^T * scale) V per
// (batch, head), with the log-sum-exp of each row. Q and K have D columns, V and O DV.
//
// Slab -> tile: a producer warpgroup, in which one thread loads the CTA's BM query rows once and
// each block of BN keys and values into a ring of STAGES stages by TMA (Tma on a Pipeline).
// Tile -> fragment: WG consumer warpgroups (2, or 3 at small head dims), 64 query rows each
// (BM = 64 WG): S = Q K^T by wgmma from shared memory (TileMMA, SS), the online softmax on S's
// fragments in registers (exp2, running max and sum per row across a quad), then O += P V with
// P taken from registers (TileMMA, RS, as_a).
// PINGPONG: the warpgroups take turns to issue Q K^T, in a ring (a named barrier each), so one's
// softmax runs while another's product is on the tensor cores (FlashAttention-3's ping-pong).
// Causal CTAs take blocks of query rows from the last (the most keys) to the first, so the
// grid's tail is the lightest work. LOCAL (a sliding window): key j is visible to row i only
// where j >= i + local_offset, and the blocks wholly left of every row's window are not loaded.
// SOFTCAP: scores become softcap * tanh(s * scale / softcap) before the softmax (Gemma 2's
// logit capping). VARLEN: sequences of their own lengths packed along the rows (q, k, v, o
// (total, heads, D or DV), lse (heads, total_q)); blockIdx.z is the sequence, cu_q / cu_k its rows'
// and keys' start (cumulative lengths, batch + 1 of them); keys past its end are masked like
// keys past seqlen_k.
// PAGED (VARLEN's packed outputs): the keys and values are a KV cache, (pages, page, heads, D or
// DV) with a block table, or (batch, capacity, heads, D or DV) without (TMA maps over its own
// dims: a page is a batch of the map); sequence z is chunk z % splits (chunk_keys keys each) of
// batch entry z / splits, whose kv_lens[entry] keys are its table row's pages in order (or its
// batch entry's first rows). q is (batch, rows, heads, D): every chunk of an entry reads the
// entry's rows; o and lse are packed by sequence as VARLEN's (cu_q). Rows of a page past the
// entry's keys may hold anything (NaN): the last block's are zeroed in shared memory before P V
// (a masked key's P is 0, and 0 * NaN is NaN).
// FP8 (T e4m3, TO the output's type): Q K^T and P V by e4m3 wgmma, which reads both operands
// K-major: v arrives transposed, (batch, heads, DV, keys) with the keys contiguous, and within
// each 32 keys in the order that makes P's accumulators, converted to e4m3, the A operand's
// registers as they lie (TileMMA::as_a: each 32-column group of P holds its columns 2q, 2q + 1,
// 8 + 2q, 9 + 2q in the registers wgmma reads as keys 4q .. 4q + 3; the pass that transposes v
// orders its keys so, vitrail.ops.attention.fp8). The descales (descale: q's per query head,
// then k's and v's per key head) multiply the scores' scale and O.
// Fragment -> slab: O / sum, converted to TO, and the log-sum-exp, stored where they land.
// PERSISTENT: a CTA per SM takes tiles (a block of query rows of one head) one after another
// from a counter; its producer loads the next tile's Q as soon as the consumers' last Q K^T of
// the tile is done, and its keys and values as the ring frees, so a tile's start and its
// epilogue overlap the neighbouring tiles' work (else one CTA per tile).
//
// Config (constexpr before the include): T (q's, k's and v's type), TO (o's), D (q's and k's
// head dim), DV (v's and o's), WG (consumer warpgroups, 2 or 3), BM (query rows, 64 WG), BN
// (keys per block), STAGES, CAUSAL, LOCAL, SOFTCAP, VARLEN, PAGED, PINGPONG, PERSISTENT, FP8
// (bool).
// Layouts: q, k (batch, seqlen, heads, D), v, o (batch, seqlen, heads, DV), the head dim
// contiguous; TMA maps over (head dim, seqlen, heads, batch) made by the Python side
// (vitrail.ops.attention); lse (batch, heads, seqlen_q) fp32.
#pragma once
#include <vitrail/pipeline.cuh>
#include <vitrail/tile_copy.cuh>
#include <vitrail/tile_mma.cuh>

#include <cuda/std/limits>

#include "sm90_attention_math.cuh"

namespace attention {

static_assert((WG == 2 || WG == 3) && BM == 64 * WG, "attention: BM is 64 rows a consumer");
using QK = vitrail::TileMMA<T, BM, BN, D, WG>;                                   // S = Q K^T
// O += P V: V's tile (keys, DV) with DV contiguous, or FP8 V^T's (DV, keys) with keys contiguous
using PV = vitrail::TileMMA<T, BM, DV, BN, WG, vitrail::Major::K,
                            FP8 ? vitrail::Major::K : vitrail::Major::MN>;
constexpr int kThreads = 128 + QK::kThreads;
// setmaxnreg: the producer's registers go to the consumers, within what a thread of the CTA has
// at launch (65536 / kThreads rounded down to a multiple of 8: 168 at WG 2, 128 at WG 3).
// PERSISTENT's producer loop over tiles spills at 40 (ptxas moves a TMA coordinate to the stack
// around each load), so it keeps 48. The consumers get the rest (WG 2: 232, or 224 PERSISTENT;
// WG 3: 152); the producer keeps its floor (it spills at none, and what the consumers' multiple
// of 8 leaves over would only reallocate its code).
constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
constexpr int kProducerRegisters = PERSISTENT ? 48 : 40;
constexpr int kConsumerRegisters =
    cute::min(256, (kLaunchRegisters * kThreads - 128 * kProducerRegisters) / QK::kThreads / 8 * 8);
static_assert(128 * kProducerRegisters + QK::kThreads * kConsumerRegisters <=
              kLaunchRegisters * kThreads);
static_assert(kProducerRegisters % 8 == 0 && kConsumerRegisters % 8 == 0 &&
              kProducerRegisters >= 24 && kConsumerRegisters <= 256);
static_assert(VARLEN || !PAGED, "attention: PAGED takes VARLEN's packed outputs");
static_assert(!FP8 || (!VARLEN && D % 32 == 0 && BN % 32 == 0),
              "attention: FP8 takes dense batches, D a multiple of 32 and blocks of 32 keys");
constexpr float kInf = cuda::std::numeric_limits<float>::infinity();
// Of each 8 columns of a row, how many exponentials go to the FMA pipe (attention_math::
// exp2_fma) in a block with no mask: at small head dims the bf16 products are short and the
// SFU's exp2 is what the tensor cores wait on. FP8's softmax is the longer path already (its
// conversions), so more FMA work slows it (docs/perf-notes.md).
constexpr int kPolyOf8 = !FP8 && D <= 64 ? 2 : 0;
static_assert(D % 16 == 0 && D >= 16 && D <= 256, "attention: D must be a multiple of 16 to 256");
static_assert(DV % 16 == 0 && DV >= 16 && DV <= 256,
              "attention: DV must be a multiple of 16 to 256");
// A TMA box is a slice of the head dim as wide as the tiles' swizzle atom: the widest of 128-,
// 64- and 32-byte rows that divides it (vitrail.ops.attention.chunk).
constexpr int chunk(int d) {
  constexpr int e = int(sizeof(T));
  return d * e % 128 == 0 ? 128 / e : d * e % 64 == 0 ? 64 / e : 32 / e;
}
constexpr int kChunk = chunk(D), kChunks = D / kChunk;       // Q and K
// V: slices of DV (FP8: V^T's rows are keys, a block's BN of them one slice)
constexpr int kChunkV = FP8 ? BN : chunk(DV), kChunksV = FP8 ? 1 : DV / kChunkV;
template <int Extent>
using Atom = decltype(vitrail::detail::smem_atom<QK::T, vitrail::Major::K, Extent>());
static_assert(cute::is_same_v<Atom<D>, Atom<kChunk>> &&
                  cute::is_same_v<Atom<FP8 ? BN : DV>, Atom<kChunkV>>,
              "attention: a chunk is not the atom's width");
constexpr int kBytesQ = QK::kBytesA<>;
constexpr int kBytesKV = QK::kBytesB<> + PV::kBytesB<>;  // one stage: a block of K and of V
// Q, STAGES blocks of K and V, the ring's barriers, Q's two barriers and the two scheduled tiles
constexpr int kSmemBytes = 1024 + kBytesQ + STAGES * kBytesKV +
                           int(sizeof(typename vitrail::Pipeline<STAGES>::Storage)) + 24;

struct Params {
  TO* o;
  float* lse;
  int seqlen_q, seqlen_k, heads, heads_kv;
  float scale_log2;  // softmax scale * log2(e) (SOFTCAP: log2(e), the scale is in softcap_pre)
  int causal_offset; // CAUSAL: key j is visible to query i where j <= i + causal_offset
  int local_offset;  // LOCAL: key j is visible to query i where j >= i + local_offset
  float softcap;     // SOFTCAP: s -> softcap * tanh(s * softcap_pre)
  float softcap_pre; // scale / softcap
  const int* cu_q;   // VARLEN: the sequences' first rows (batch + 1 cumulative lengths)
  const int* cu_k;   // VARLEN: the sequences' first keys
  int total_q;       // VARLEN: q's rows in all (lse's row stride)
  int bottom_right;  // VARLEN: the offsets above are relative to seqlen_k - seqlen_q
  const int* kv_lens;  // PAGED: each batch entry's keys
  const int* table;    // PAGED: each entry's pages (table_stride ints a row), or null: entry e's
  int table_stride;    //   keys are the first kv_lens[e] rows of the cache's batch entry e
  int page;            // PAGED: rows a page with a table (a multiple of BN, or of 8 dividing
                       //   BN: then a block is BN / page loads), else the capacity
  int splits;          // PAGED: sequence z is chunk z % splits of entry z / splits
  int chunk_keys;      // PAGED: keys a chunk (a multiple of BN)
  const float* descale;  // FP8: q's per query head, then k's and v's per key head
};

// PAGED: where the TMA box of an entry's keys from key on (min(page, BN) rows, in one page) is in
// the cache's map (row, batch): its page's rows and the page from the table, or without one the
// entry's own batch. A box past the entry's keys reads its last page (its table row may end
// there): those keys are masked, and V's rows zeroed.
__device__ void cache_at(const Params& p, int entry, int kv_len, int key, int& row, int& batch) {
  if (p.table == nullptr) {
    row = key, batch = entry;
    return;
  }
  row = key % p.page;
  batch = p.table[entry * p.table_stride + min(key, kv_len - 1) / p.page];
}

// The blocks of keys a query block sees: all, or those up to the causal diagonal.
__device__ int kv_blocks(const Params& p, int m0) {
  int keys = p.seqlen_k;
  if (CAUSAL) keys = min(keys, max(0, m0 + BM + p.causal_offset));
  return (keys + BN - 1) / BN;
}

// The first block with a key to mask: past seqlen_k, or (causal) past the diagonal of the CTA's
// first row m0. Block j holds keys [j * BN, (j + 1) * BN).
__device__ int first_masked_block(const Params& p, int m0) {
  int first = p.seqlen_k / BN;
  if (CAUSAL) first = min(first, max(0, m0 + p.causal_offset) / BN);
  return first;
}

// LOCAL: the first block with a key in some row's window (the first row's), and the first whose
// keys are all in every row's window (the last row's bound).
__device__ int first_block(const Params& p, int m0) {
  return LOCAL ? max(0, m0 + p.local_offset) / BN : 0;
}
__device__ int first_full_block(const Params& p, int m0) {
  if (!LOCAL) return 0;
  const int lowest = m0 + BM - 1 + p.local_offset;  // the last row's first visible key
  return lowest <= 0 ? 0 : (lowest + BN - 1) / BN;
}

// A tile: one block of BM query rows of one (sequence, head); p holds its sequence's lengths
// and offsets (VARLEN: read from cu_q and cu_k), q_start and k_start its first row and key in
// the packed tensors (VARLEN; else 0).
struct Tile {
  Params p;
  int m0, head, batch, q_start, k_start;
  int entry, kv_len;  // PAGED: the batch entry and its keys (k_start: the chunk's first)
};

// Tile ti of the launch's row_blocks x heads x batch: the row block fastest, so the CTAs that
// run together share a head's keys and values in L2; causal row blocks from the last (the most
// keys) to the first, so the tail is the lightest work. False for a tile past its sequence's
// rows (VARLEN: the grid fits the longest sequence).
__device__ bool tile_of(const Params& base, int row_blocks, int ti, Tile& tile) {
  // unsigned: the division's code is shorter (the producer has few registers)
  const unsigned rb = unsigned(ti) % unsigned(row_blocks);
  const unsigned hb = unsigned(ti) / unsigned(row_blocks);
  tile.p = base;
  tile.m0 = int(CAUSAL ? row_blocks - 1 - rb : rb) * BM;
  tile.head = int(hb % unsigned(base.heads));
  tile.batch = int(hb / unsigned(base.heads));
  tile.q_start = tile.k_start = 0;
  if constexpr (VARLEN) {  // the sequence's lengths, and the offsets from them
    Params& p = tile.p;
    tile.q_start = base.cu_q[tile.batch];
    p.seqlen_q = base.cu_q[tile.batch + 1] - tile.q_start;
    if constexpr (PAGED) {  // lengths past the cache's capacity are cut to it
      tile.entry = int(unsigned(tile.batch) / unsigned(base.splits));
      const int capacity = base.table ? base.table_stride * base.page : base.page;
      tile.kv_len = min(base.kv_lens[tile.entry], capacity);
      tile.k_start = (tile.batch - tile.entry * base.splits) * base.chunk_keys;
      p.seqlen_k = max(0, min(base.chunk_keys, tile.kv_len - tile.k_start));
    } else {
      tile.k_start = base.cu_k[tile.batch];
      p.seqlen_k = base.cu_k[tile.batch + 1] - tile.k_start;
    }
    if (base.bottom_right) {
      p.causal_offset += p.seqlen_k - p.seqlen_q;
      p.local_offset += p.seqlen_k - p.seqlen_q;
    }
    return tile.m0 < p.seqlen_q;
  }
  return true;
}

// The key blocks a tile loads and computes: [start, blocks).
__device__ int tile_blocks(const Tile& t) { return kv_blocks(t.p, t.m0); }
__device__ int tile_start(const Tile& t) {
  return LOCAL ? min(tile_blocks(t), first_block(t.p, t.m0)) : 0;
}

// The CTA's tiles. One per CTA (grid row_blocks x heads x batch), or PERSISTENT: a CTA per SM
// takes blockIdx.x first, then the next untaken one from a counter in global memory (tile
// gridDim.x + the count), so a CTA's producer loads the next tile's Q, K and V while its
// consumers finish the last one and store it. counter[0] is that count and counter[1] the CTAs
// done taking tiles: both zero at the launch, and the last CTA done sets them to zero again
// (done_with_tiles), so the next launch needs no fill.
__device__ int first_tile() {
  return PERSISTENT ? int(blockIdx.x)
                    : int(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
}
__device__ int next_tile(int* counter, int total) {
  return PERSISTENT ? int(gridDim.x) + atomicAdd(counter, 1) : total;
}
__device__ void done_with_tiles(int* counter) {
  if (!PERSISTENT) return;
  __threadfence();  // this CTA's last atomicAdd on counter[0] before its count on counter[1]
  if (atomicAdd(counter + 1, 1) == int(gridDim.x) - 1) {  // every CTA is past its last tile
    counter[0] = 0;
    counter[1] = 0;
  }
}

// p: the launch's lengths (VARLEN: the longest sequence's rows as seqlen_q); total: row_blocks
// x p.heads x batch tiles (a kernel parameter, read where needed);
// counter: PERSISTENT's two counters (next_tile, done_with_tiles).
__device__ void forward(const Params& base, int row_blocks, int total, int* counter,
                        const vitrail::TensorMap& mapQ, const vitrail::TensorMap& mapK,
                        const vitrail::TensorMap& mapV) {
  extern __shared__ char smem_raw[];
  unsigned raw = static_cast<unsigned>(__cvta_generic_to_shared(smem_raw));
  char* smem = smem_raw + ((1024 - raw % 1024) % 1024);
  auto sQ = QK::tile_a(smem);
  char* ring = smem + kBytesQ;
  auto& bars = *reinterpret_cast<typename vitrail::Pipeline<STAGES>::Storage*>(
      ring + STAGES * kBytesKV);
  uint64_t* q_full = reinterpret_cast<uint64_t*>(&bars + 1);  // Q (and the tile) has landed
  uint64_t* q_empty = q_full + 1;  // the consumers' last Q K^T of the tile is done
  int* scheduled = reinterpret_cast<int*>(q_empty + 1);  // the tile of each Q phase (-1: none)
  vitrail::Pipeline<STAGES> pipe(bars);
  auto sK = [&](int stage) { return QK::tile_b(ring + stage * kBytesKV); };
  auto sV = [&](int stage) { return PV::tile_b(ring + stage * kBytesKV + QK::kBytesB<>); };
  if (threadIdx.x == 0) {
    vitrail::Tma::prefetch(mapQ);
    vitrail::Tma::prefetch(mapK);
    vitrail::Tma::prefetch(mapV);
    pipe.init(/*producer arrivals=*/1, /*consumer arrivals: one per warp=*/QK::kThreads / 32);
    vitrail::Bulk::init(q_full, 1);
    vitrail::Bulk::init(q_empty, QK::kThreads / 32);
  }
  __syncthreads();

  if (threadIdx.x / 128 == 0) {  // producer: slab -> tile
    vitrail::warpgroup_registers_down<kProducerRegisters>();
    // One thread schedules and loads; PAGED with pages shorter than a block (box < BN), the
    // first warp's lanes load a box each (its page read from the table and its loads issued
    // side by side, not one box after another), lane 0 scheduling for them. Each way is its
    // own instantiation, so one thread's loop carries none of the lanes' work.
    auto produce = [&](auto lanes) {
      constexpr bool kLanes = decltype(lanes)::value;
      const int lane = kLanes ? int(threadIdx.x % 32) : 0;
      auto w = vitrail::PipeState<STAGES>::producer();
      Tile tile;
      auto next = [&] {  // lane 0's next tile, for every lane
        if constexpr (kLanes)
          return __shfl_sync(0xffffffffu, lane == 0 ? next_tile(counter, total) : 0, 0);
        else
          return next_tile(counter, total);
      };
      for (int i = 0, ti = first_tile();; ++i, ti = next()) {
        while (ti < total && !tile_of(base, row_blocks, ti, tile)) ti = next();
        if (i > 0) vitrail::Bulk::wait(q_empty, (i - 1) & 1);  // sQ is free again
        if (lane == 0) scheduled[i & 1] = ti < total ? ti : -1;
        if (ti >= total) {  // the consumers' last phase: no tile
          if (lane == 0) {
            vitrail::Bulk::arrive(q_full);
            done_with_tiles(counter);
          }
          break;
        }
        asm volatile("" ::: "memory");  // the tile's index before the phase's arrival
        const int tma_batch = VARLEN ? 0 : tile.batch;
        const int head_kv = int(unsigned(tile.head) / unsigned(base.heads / base.heads_kv));
        // PAGED: the entry's own rows of q (batch, rows, heads, D), which its chunks share
        const int q_row = PAGED ? tile.m0 : tile.q_start + tile.m0;
        const int q_batch = PAGED ? tile.entry : tma_batch;
        if (lane == 0) {
          vitrail::Bulk::expect(q_full, kBytesQ);
          for (int c = 0; c < kChunks; ++c)  // Q's kChunk-wide slices of D, BM rows each
            vitrail::Tma::load(&sQ(0, c * kChunk, 0), mapQ, q_full, c * kChunk, q_row,
                               tile.head, q_batch);
        }
        for (int j = tile_start(tile), blocks = tile_blocks(tile); j < blocks; ++j, w.advance()) {
          pipe.acquire(w);
          if (lane == 0) pipe.expect(w, kBytesKV);
          if constexpr (kLanes) __syncwarp();  // the stage's bytes expected before any loads
          auto k = sK(w.index);
          auto v = sV(w.index);
          // boxes of BN rows, or with the lanes a page each, lane l's pages l, l + 32, ...
          const int box = kLanes ? base.page : BN;
          for (int r = lane * box; r < BN; r += (kLanes ? 32 : 1) * box) {
            const int key = tile.k_start + j * BN + r;
            int row = key, kv_batch = tma_batch;
            if constexpr (PAGED) cache_at(base, tile.entry, tile.kv_len, key, row, kv_batch);
            for (int c = 0; c < cute::max(kChunks, kChunksV); ++c) {
              if (c < kChunks)
                vitrail::Tma::load(&k(r, c * kChunk, 0), mapK, pipe.full(w), c * kChunk, row,
                                   head_kv, kv_batch);
              if constexpr (FP8) {  // V^T's block: (BN keys, DV rows) of (keys, DV, heads)
                if (c == 0)
                  vitrail::Tma::load(&v(0, 0, 0), mapV, pipe.full(w), row, 0, head_kv,
                                     kv_batch);
              } else if (c < kChunksV) {
                vitrail::Tma::load(&v(c * kChunkV, r, 0), mapV, pipe.full(w), c * kChunkV, row,
                                   head_kv, kv_batch);
              }
            }
          }
        }
      }
    };
    if constexpr (PAGED) {
      if (base.table != nullptr && base.page < BN) {
        if (threadIdx.x < 32) produce(cute::true_type{});
        return;
      }
    }
    if (threadIdx.x == 0) produce(cute::false_type{});
    return;
  }

  // consumers: tile -> fragment
  vitrail::warpgroup_registers_up<kConsumerRegisters>();
  const int t = threadIdx.x - 128;
  QK qk(t);
  PV pv(t);
  auto s = qk.accumulators();
  auto o = pv.accumulators();
  auto s_rows = QK::rows(s);
  auto o_rows = PV::rows(o);
  auto where = QK::rows(qk.coordinates());  // (row, key) in the tile of each element of S
  constexpr int kRows = decltype(cute::size<0>(s_rows))::value;
  float row_max[kRows], row_sum[kRows];

  // Ping-pong, a ring: warpgroup w issues its Q K^T after warpgroup w - 1 (mod WG) has issued
  // its own (barrier kTurn + w: w's 128 threads wait, w - 1's arrive, 256 in all), then lets
  // w + 1 go; warpgroup 0 goes first (the last one's arrival on kTurn up front). All run every
  // block of every tile, so the turns carry across tiles. The last arrival is never waited on.
  constexpr int kTurn = 1, kTurnThreads = 256;
  constexpr int kZeroed = kTurn + WG;  // PAGED: a warpgroup's zeros in a block of V are written
  static_assert(kZeroed + WG <= 16, "attention: the CTA has 16 named barriers");
  const int wg = t / 128;
  if (PINGPONG && wg == WG - 1) vitrail::named_barrier_arrive(kTurn, kTurnThreads);

  vitrail::PipeState<STAGES> rd;
  for (int i = 0;; ++i) {
    vitrail::Bulk::wait(q_full, i & 1);
    const int ti = scheduled[i & 1];
    if (ti < 0) break;
    Tile tile;
    tile_of(base, row_blocks, ti, tile);
    float descale_v = 1.f;
    if constexpr (FP8) {  // the scores' scale times q's and k's descales; O's times v's
      const int head_kv = int(unsigned(tile.head) / unsigned(base.heads / base.heads_kv));
      const float qk = base.descale[tile.head] * base.descale[base.heads + head_kv];
      if constexpr (SOFTCAP) tile.p.softcap_pre *= qk;
      else tile.p.scale_log2 *= qk;
      descale_v = base.descale[base.heads + base.heads_kv + head_kv];
    }
    const Params& p = tile.p;
    const int m0 = tile.m0, head = tile.head, batch = tile.batch;
    const int blocks = tile_blocks(tile), start = tile_start(tile);
    PV::zero(o);
    for (int r = 0; r < kRows; ++r) row_max[r] = -kInf, row_sum[r] = 0.f;
    // Each warp's arrival once its warpgroup's last Q K^T of the tile is done (or at once,
    // with no block): sQ may then take the next tile's Q.
    auto release_q = [&] {
      if (threadIdx.x % 32 == 0) vitrail::Bulk::arrive(q_empty);
    };

    // One block of keys: S = Q K^T, the online softmax, O += P V. Masked (a constant): keys
    // past seqlen_k (TMA filled them with zeros), past the causal diagonal or left of the window
    // become -inf. Only the blocks at the ends need it, and they get loops of their own: with
    // one loop, ptxas computed every element's mask predicates in every block, ahead of the
    // block's first wgmma.
    auto block = [&](int j, auto masked) {
      pipe.wait(rd);
      if constexpr (PAGED && decltype(masked)::value) {
        // V's rows past the entry's keys to 0 (each warpgroup writes the same zeros, then
        // fences its writes for wgmma's reads and waits for its own threads)
        const int keys = tile.kv_len - (tile.k_start + j * BN);
        if (keys < BN) {
          auto vt = sV(rd.index);
          for (int i = t % 128; i < (BN - keys) * DV; i += 128)
            vt(i % DV, keys + i / DV, 0) = PV::T(0.f);
          vitrail::fence_tile_writes();
          vitrail::named_barrier_sync(kZeroed + wg, 128);
        }
      }
      if (PINGPONG) vitrail::named_barrier_sync(kTurn + wg, kTurnThreads);
      QK::zero(s);
      qk.mma(sQ(cute::_, cute::_, 0), sK(rd.index)(cute::_, cute::_, 0), s);
      // the next warpgroup's turn (WG 2 written 1 - wg: the two-way kernel's instructions)
      if (PINGPONG)
        vitrail::named_barrier_arrive(kTurn + (WG == 2 ? 1 - wg : (wg + 1) % WG), kTurnThreads);
      QK::wait<0>(s);
      if (j == blocks - 1) release_q();
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        float m = row_max[r];
        CUTE_UNROLL
        for (int c = 0; c < cute::size<1>(s_rows); ++c) {
          if constexpr (SOFTCAP) s_rows(r, c) = p.softcap * tanhf(s_rows(r, c) * p.softcap_pre);
          if constexpr (decltype(masked)::value) {
            const int row = m0 + cute::get<0>(where(r, c));
            const int key = j * BN + cute::get<1>(where(r, c));
            if (key >= p.seqlen_k || (CAUSAL && key > row + p.causal_offset) ||
                (LOCAL && key < row + p.local_offset))
              s_rows(r, c) = -kInf;
          }
          m = fmaxf(m, s_rows(r, c));
        }
        m = vitrail::quad_reduce(m, [](float a, float b) { return fmaxf(a, b); });
        // A row with every key masked so far keeps m = -inf: use 0 so exp2 gives 0, not NaN.
        const float m_scaled = m == -kInf ? 0.f : m * p.scale_log2;
        const float correction = attention_math::exp2_ftz(row_max[r] * p.scale_log2 - m_scaled);
        row_max[r] = m;
        float sum = 0.f;
        CUTE_UNROLL
        for (int c = 0; c < cute::size<1>(s_rows); ++c) {
          const float x = s_rows(r, c) * p.scale_log2 - m_scaled;
          if (!decltype(masked)::value && c % 8 < kPolyOf8) {  // finite: no score is masked
            s_rows(r, c) = attention_math::exp2_fma(x);
          } else {
            s_rows(r, c) = attention_math::exp2_ftz(x);
          }
          sum += s_rows(r, c);
        }
        row_sum[r] = row_sum[r] * correction + sum;
        CUTE_UNROLL
        for (int c = 0; c < cute::size<1>(o_rows); ++c) o_rows(r, c) *= correction;
      }
      auto pfrag = QK::as_a(s);
      pv.mma_rs(pfrag, sV(rd.index)(cute::_, cute::_, 0), o);
      PV::wait<0>(o, pfrag);
      if (threadIdx.x % 32 == 0) pipe.release(rd);
      rd.advance();
    };
    if (blocks == start) release_q();
    // [0, tail): no mask; [tail, blocks): the diagonal and seqlen_k's edge. LOCAL: [start,
    // full) masked too, the window's left edge (one loop: three call sites of block made ptxas
    // keep it out of line, its state on the stack)
    const int tail = min(blocks, first_masked_block(p, m0));
    if constexpr (LOCAL) {
      const int full = max(start, first_full_block(p, m0));
      for (int j = start; j < blocks; ++j) {
        if (j >= full && j < tail) block(j, cute::false_type{});
        else block(j, cute::true_type{});
      }
    } else {
      for (int j = 0; j < tail; ++j) block(j, cute::false_type{});
      for (int j = tail; j < blocks; ++j) block(j, cute::true_type{});
    }

    // fragment -> slab: O / sum and the log-sum-exp (natural log) of each row
    auto o_where = PV::rows(pv.coordinates());
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = vitrail::quad_reduce(row_sum[r], [](float a, float b) { return a + b; });
      const int row = m0 + cute::get<0>(o_where(r, 0));
      if (row >= p.seqlen_q) continue;
      // a fully masked row: O = 0, lse = -inf
      const float inv = sum > 0.f ? descale_v / sum : 0.f;
      const long long o_row =
          VARLEN ? (long long)tile.q_start + row : (long long)(batch * p.seqlen_q + row);
      TO* out = p.o + (o_row * p.heads + head) * DV;
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(o_rows); c += 2) {
        using T2 = cute::conditional_t<cute::is_same_v<TO, __half>, __half2, __nv_bfloat162>;
        const int col = cute::get<1>(o_where(r, c));
        *reinterpret_cast<T2*>(out + col) =
            T2(TO(o_rows(r, c) * inv), TO(o_rows(r, c + 1) * inv));
      }
      if (t % 4 == 0) {
        const float lse = sum > 0.f ? row_max[r] * (p.scale_log2 / 1.4426950408889634f) +
                                          logf(sum)
                                    : -kInf;
        p.lse[VARLEN ? (long long)head * p.total_q + tile.q_start + row
                     : ((long long)batch * p.heads + head) * p.seqlen_q + row] = lse;
      }
    }
  }
}

}  // namespace attention

extern "C" __global__ void __launch_bounds__(attention::kThreads, 1)
attention_fwd(TO* o, float* lse, const __grid_constant__ vitrail::TensorMap mapQ,
              const __grid_constant__ vitrail::TensorMap mapK,
              const __grid_constant__ vitrail::TensorMap mapV, int seqlen_q, int seqlen_k,
              int heads, int heads_kv, float scale_log2, int causal_offset, int local_offset,
              float softcap, float softcap_pre, const int* cu_q, const int* cu_k, int total_q,
              int bottom_right, const int* kv_lens, const int* table, int table_stride,
              int page, int splits, int chunk_keys, int row_blocks, int tiles,
              int* tile_counter, const float* descale) {
  attention::forward({o, lse, seqlen_q, seqlen_k, heads, heads_kv, scale_log2, causal_offset,
                      local_offset, softcap, softcap_pre, cu_q, cu_k, total_q, bottom_right,
                      kv_lens, table, table_stride, page, splits, chunk_keys, descale},
                     row_blocks, tiles, tile_counter, mapQ, mapK, mapV);
}
