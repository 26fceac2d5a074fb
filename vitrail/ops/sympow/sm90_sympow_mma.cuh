// sympow_mma on Hopper: the expanded operand built in registers and fed to wgmma (HGMMA).
//
// Why: at power attention's shapes (d 64, head 64) the fused matmul does 2 * rows * D * N
// FLOPs on a few bytes per output, so it is compute-bound; mma.sync (sm80_sympow_mma.cuh)
// cannot keep Hopper's tensor cores busy. Here each warpgroup multiplies a 64-row slice of
// the expansion, generated in registers in the wgmma A-fragment layout, by the other operand
// read by wgmma straight from shared memory (128-byte swizzle, 4 stages, filled by TMA on
// mbarriers: mma_k_wg<true>, and mma_m_tma where K % 64 == 0; the cp.async mainloops, with a CTA
// barrier a k-block, stay for the rest and for comparisons).
// wgmmas are asynchronous (wait_group 1): a warpgroup builds its next k-block's fragments while
// its last one runs, and the SM's other warpgroups keep the tensor cores fed meanwhile.
//
// The expansion is walked tuple by tuple: with B = TILE^POW a multiple of 64
// (configs.wgmma_supports; the others stay on sm80), every 64-feature k-block lies inside one
// tuple, so every factor's digit is a bit field of the feature index: bits the thread's place in
// the fragment fixes at compile time, bits of the lane, bits of the k-block. Each thread loads, per k-block
// and row, only the few input values its fragment touches into registers (vectorized where a
// field is whole), then every product has compile-time register indices.
//
// mma_sympow_bwd's expand-K side (mma_sympow_bwd_k_wg, at the end) runs the other way round:
// wgmma makes a 64 x 64 block of G = dY @ b (both operands from shared memory) and the threads
// contract it through sympow's derivative in registers.
//
// Statics: T_ID 1 (half) or 2 (bfloat16), POW, TILE (sympow_common.cuh), TILE^POW % 64 == 0.
// CTA: 256 threads (2 warpgroups); expand K: 128 x 64 output tile; expand M: 128 features x 64.
// Launch bounds hold registers to 80 (3 CTAs, 6 warpgroups per SM) without spills (expand M with
// p > 2: 2 CTAs).
// Constraints (configs.py): d <= 256, contiguous row-major operands whose rows are read by
// cp.async (b, and a for expand M) 16-byte aligned and a multiple of 16 bytes long (the caller
// pads others with zeros); a_vec says the same of a for expand K (else read element by element).
#pragma once
// (sympow_common.cuh comes first)

namespace s90 {
using namespace sympow_detail;
static_assert(T_ID == 1 || T_ID == 2, "wgmma path: half or bfloat16");
constexpr int BM = 128, BN = 64, BK = 64, THREADS = 256, STAGES = 4, PF = STAGES - 2;
constexpr int LOGT = TILE == 1 ? 0 : TILE == 2 ? 1 : TILE == 4 ? 2 : TILE == 8 ? 3 : 4;
constexpr int BLOCK = vitrail::ipow<TILE, POW>::value;
static_assert(POW >= 2 && BLOCK % 64 == 0, "wgmma path: TILE^POW must be a multiple of 64");
constexpr int TILE_BYTES = 64 * 64 * 2;  // one 64 x 64 operand tile, 128-byte rows

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}

// ---- wgmma (PTX ISA 8.0, sm_90a) ----
__device__ __forceinline__ void wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Descriptor of a 16 x 64 (K x N, N contiguous: "MN-major") slice of a 64 x 64 tile stored as
// 128-byte rows with the 128-byte swizzle, the tile 1024-byte aligned: 8-row groups 1024 bytes
// apart (stride offset); one 64-wide atom across N (leading offset: where a second would be).
__device__ __forceinline__ unsigned long long desc_mn_sw128(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) |
         ((unsigned long long)(TILE_BYTES >> 4) << 16) | ((unsigned long long)(1024 >> 4) << 32) |
         (1ull << 62);
}
// acc (64 x 64 fp32 per warpgroup) += A (64 x 16, registers) @ B (16 x 64, shared, MN-major).
struct Acc { float c[32]; };
// Zero through asm, so the compiler cannot merge the 32 zeros into one register and copy between
// accumulators inside the mainloop (which makes ptxas serialize the wgmmas).
__device__ __forceinline__ void zero(Acc& acc) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("mov.b32 %0, 0;\n" : "=f"(acc.c[i]));
}
// The pieces the two wgmma forms (wgmma_rs, wgmma_ss) share: the instruction for T, the 32
// accumulator registers in its text (%0 to %31), and the accumulators as read-write operands.
#if T_ID == 1
#define VT_WGMMA_M64N64K16 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
#else
#define VT_WGMMA_M64N64K16 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
#endif
#define VT_ACC_REGS                                                  \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"          \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "
#define VT_ACC4(acc, i) \
  "+f"(acc.c[i]), "+f"(acc.c[i + 1]), "+f"(acc.c[i + 2]), "+f"(acc.c[i + 3])
#define VT_ACC_OPERANDS(acc)                                                             \
  VT_ACC4(acc, 0), VT_ACC4(acc, 4), VT_ACC4(acc, 8), VT_ACC4(acc, 12), VT_ACC4(acc, 16), \
      VT_ACC4(acc, 20), VT_ACC4(acc, 24), VT_ACC4(acc, 28)
__device__ __forceinline__ void wgmma_rs(Acc& acc, const unsigned (&a)[4], unsigned long long b) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %37, 0;\n"
      VT_WGMMA_M64N64K16 VT_ACC_REGS
      "{%32,%33,%34,%35}, %36, p, 1, 1, 1;\n"
      "}\n"
      : VT_ACC_OPERANDS(acc)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
// Makes every fragment of a k-block exist before the block's first wgmma (asm volatile keeps its
// order against the wgmma asm), so each lives in its own registers: otherwise ptxas may give a
// later fragment the registers of one still in flight and wait for each wgmma (wait_group 0).
template <int N>
__device__ __forceinline__ void pin(unsigned (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i]));
}
// The same for the accumulators after wait_group: their reads stay below it.
__device__ __forceinline__ void pin(Acc& acc) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(acc.c[i]));
}
// The wait after k-step s of a k-block whose A fragments come from registers (wgmma_rs): one
// wgmma left in flight inside the block, none at its end. wgmma reads its A registers
// asynchronously, but the compiler sees them free once the asm is issued: with the block's last
// wgmma still in flight, it gave them to the next block's fragments, and a few outputs in a
// thousand problems (every problem at d = 64, M = 4096) came out wrong (H100).
__device__ __forceinline__ void block_wait(int s) {  // (s: an unrolled loop's constant)
  if (s == 3) wg_wait<0>();
  else wg_wait<1>();
}
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
#if T_ID == 1
  __half2 v = __floats2half2_rn(lo, hi);
#else
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
#endif
  return *reinterpret_cast<unsigned*>(&v);
}

// ---- a 64 x 64 tile of a row-major matrix into the swizzled layout ----
// Tile row r holds the block's row rmap(r) (the matrix's row row0 + rmap(r); rows past `rows`
// are zero) and the columns [col0, col0 + 64) (past `cols`, zero). Row r's 16-byte chunk c lands
// at r * 128 + ((c ^ (r % 8)) * 16).
// TileStream: cp.async, each thread the same two chunks of every block (addresses computed once).
// Needs 16-byte rows and addresses (the caller pads other matrices).
struct TileStream {
  static_assert(THREADS * 2 == 512, "two chunks per thread");
  const T* src;   // the first chunk of the next block; the second is STEP rows on
  unsigned dst;   // its byte offset in the tile; the second's is 32 rows (4 KiB) on
  int row, step, advance;  // its row in the block; STEP rows and a block (64 rows), in elements
  bool col_ok;
  template <class RowMap>
  __device__ __forceinline__ TileStream(const T* g, int ld, int col0, int cols, RowMap rmap) {
    const int c = threadIdx.x & 7, r = threadIdx.x >> 3;
    col_ok = col0 + c * 8 < cols;
    row = rmap(r);
    step = RowMap::STEP * ld;
    advance = 64 * ld;
    src = g + (long long)row * ld + col0 + c * 8;
    dst = r * 128 + ((c ^ (r & 7)) << 4);  // row r + 32 has the same swizzle phase
  }
  // The next block (rows row0 ..., `rows` valid) into the tile at sdst; g: any valid address,
  // read by none of the zero-filled chunks.
  template <class RowMap>
  __device__ __forceinline__ void issue(unsigned sdst, const T* g, int row0, int rows) {
#pragma unroll
    for (int it = 0; it < 2; ++it) {
      const bool ok = col_ok && row0 + row + it * RowMap::STEP < rows;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sdst + dst + it * 4096),
                   "l"(ok ? src + it * step : g), "r"(ok ? 16 : 0));
    }
    src += advance;
  }
};
struct Identity {
  static constexpr int STEP = 32;  // rmap(r + 32) - rmap(r)
  __device__ __forceinline__ int operator()(int r) const { return r; }
};
// wgmma reads shared memory through the async proxy: this thread's cp.async and st.shared writes
// must be fenced before a barrier publishes them to the warpgroups' wgmma.
__device__ __forceinline__ void fence_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ---- the expansion's bit fields ----
// Inside a tuple's block, feature e's digit of factor l (0 = most significant) is the bit field
// [lo(l), lo(l) + LOGT) of e. A thread's fragment element sits at e = e0 + local, e0 a multiple
// of 64 (its k-block, uniform), local = CT | LANE: CT = 16 s + 8 h + j fixed at compile time
// (k-step s, half h, pair element j: bits 0, 3, 4, 5), LANE = 2 (lane % 4) (bits 1, 2).
__host__ __device__ constexpr int lo(int l) { return (POW - 1 - l) * LOGT; }
__host__ __device__ constexpr int ct_mask(int l) { return (0x39 >> lo(l)) & (TILE - 1); }
__host__ __device__ constexpr bool slot_used(int l, int c) { return (c & ~ct_mask(l)) == 0; }
__host__ __device__ constexpr int slot(int l, int ct) { return (ct >> lo(l)) & (TILE - 1); }

__host__ __device__ constexpr int popcount(int v) { return v ? (v & 1) + popcount(v >> 1) : 0; }
__host__ __device__ constexpr int fewest_slots(int l = 0, int best = 0) {
  return l == POW ? best
                  : fewest_slots(l + 1, popcount(ct_mask(l)) <= popcount(ct_mask(best)) ? l : best);
}
constexpr int COEF_FACTOR = fewest_slots();

// v[c] = p[c] for each slot c that factor l uses (p: the factor's first value for this thread).
template <int L>
__device__ __forceinline__ void load_factor(float (&v)[TILE], const float* p) {
  constexpr int run = ct_mask(L) + 1;  // slots 0 .. run-1 when the mask is a low run of bits
  if constexpr ((ct_mask(L) & run) == 0 && run >= 4) {  // a contiguous run: 16-byte loads
#pragma unroll
    for (int c = 0; c < run; c += 4) {
      const float4 f = *reinterpret_cast<const float4*>(p + c);
      v[c] = f.x; v[c + 1] = f.y; v[c + 2] = f.z; v[c + 3] = f.w;
    }
  } else if constexpr (ct_mask(L) & 1) {  // pairs (the last factor): 8-byte loads
#pragma unroll
    for (int c = 0; c < TILE; c += 2)
      if (slot_used(L, c)) {
        const float2 f = *reinterpret_cast<const float2*>(p + c);
        v[c] = f.x; v[c + 1] = f.y;
      }
  } else {
#pragma unroll
    for (int c = 0; c < TILE; ++c)
      if (slot_used(L, c)) v[c] = p[c];
  }
}

// Every factor's values for one row (row: the row's first input value).
template <int L>
__device__ __forceinline__ void load_factors(float (&xv)[POW][TILE], const float* row,
                                             unsigned packed, int e0, int lane_bits) {
  const int off = (int)((packed >> (8 * L)) & 255u) + ((e0 >> lo(L)) & (TILE - 1)) +
                  ((lane_bits >> lo(L)) & (TILE - 1));
  load_factor<L>(xv[L], row + off);
  if constexpr (L + 1 < POW) load_factors<L + 1>(xv, row, packed, e0, lane_bits);
}

// The 4 x 16-feature A fragments of one k-block for one row: xv[l][slot] are the row's factor
// values, one factor's (COEF_FACTOR) already scaled by the tuple's coefficient. out[s][h]
// packs the pair (j = 0, 1) at k-step s, half h.
__device__ __forceinline__ void expand_row(unsigned (&out)[4][2], const float (&xv)[POW][TILE]) {
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int ct = 16 * s + 8 * h;
      float lead = xv[0][slot(0, ct)];
#pragma unroll
      for (int l = 1; l < POW - 1; ++l) lead *= xv[l][slot(l, ct)];
      out[s][h] = pack2(lead * xv[POW - 1][slot(POW - 1, ct)],
                        lead * xv[POW - 1][slot(POW - 1, ct + 1)]);
    }
}
// ---- TMA (cp.async.bulk.tensor) and mbarriers (PTX ISA 8.0, sm_90) ----
// A CUtensorMap passed by value (__grid_constant__): 128 opaque bytes (vitrail.jit.tma).
struct alignas(64) TensorMap { unsigned long long opaque[16]; };
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Until the phase of parity `parity` completed (the barrier's (2 i + parity)-th).
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_load_3d(unsigned dst, const TensorMap& map, unsigned bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(bar), "r"(c0), "r"(c1),
      "r"(c2) : "memory");
}
__device__ __forceinline__ void tma_load_5d(unsigned dst, const TensorMap& map, unsigned bar,
                                            int c0, int c1, int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(bar), "r"(c0), "r"(c1),
      "r"(c2), "r"(c3), "r"(c4) : "memory");
}
}  // namespace s90

// C[P, M, N] = (sympow(A[P, M, d] along its rows) * scale) @ B[P, D, N]   (expand K)
// tidx/tcoef: the tuple table (configs.tables): each factor's first feature (bytes 0-3), and the
// tuple's coefficient.
// TMA: b's k-blocks by TMA (a [Np, D, P] map, 64 x 64 boxes) on mbarriers, as mma_m_tma; else
// cp.async (TileStream) and a CTA barrier a k-block.
namespace s90 {
template <bool TMA>
__device__ __forceinline__ void mma_k_wg(T* __restrict__ C, const T* __restrict__ A,
                                         const T* __restrict__ B, const TensorMap* mapB,
                                         const int* __restrict__ tidx,
                                         const float* __restrict__ tcoef, int M, int N, int d,
                                         int D, float scale, int a_vec) {
  extern __shared__ __align__(16) char smem_raw[];
  // B stages first, 1024-byte aligned (the swizzle's period), then x's rows as floats
  char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  T* sB = reinterpret_cast<T*>(smem);
  const unsigned sB_addr = smem_addr(sB);
  const unsigned long long desc0 = desc_mn_sw128(sB_addr);
  float* sX = reinterpret_cast<float*>(smem + STAGES * TILE_BYTES);
  const int ldx = ((d + 31) & ~31) + 8;  // rows 8 banks apart: 8- and 16-byte loads conflict-free

  int tm, tn;
  const long long p = cta_tile((M + BM - 1) / BM, (N + BN - 1) / BN, tm, tn);
  const int m0 = tm * BM, n0 = tn * BN;
  const T* Bp = B + p * D * N;
  const int nK = D / BK;
  TileStream bs(Bp, N, n0, N, Identity{});
  // (TMA) full and empty mbarriers a stage, after x's rows
  const unsigned full0 = smem_addr(smem + STAGES * TILE_BYTES + BM * ldx * 4),
                 empty0 = full0 + 8 * STAGES;
  auto load_b = [&](int kt) {  // (kt in order: the stream steps a block a call)
    if constexpr (TMA) {  // (thread 0)
      const unsigned full = full0 + 8 * (kt % STAGES);
      mbar_expect_tx(full, TILE_BYTES);
      tma_load_3d(sB_addr + (kt % STAGES) * TILE_BYTES, *mapB, full, n0, kt * BK, (int)p);
    } else {
      if (kt < nK) bs.issue<Identity>(sB_addr + (kt % STAGES) * TILE_BYTES, Bp, kt * BK, D);
      async_commit();
    }
  };
  if constexpr (TMA) {
    if (threadIdx.x == 0) {
#pragma unroll
      for (int st = 0; st < STAGES; ++st) {
        mbar_init(full0 + 8 * st, 1);
        mbar_init(empty0 + 8 * st, THREADS / 32);  // every warp
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
      for (int kt = 0; kt < PF && kt < nK; ++kt) load_b(kt);
    }
  } else {
#pragma unroll
    for (int kt = 0; kt < PF; ++kt) load_b(kt);
  }
  const T* Ap = A + p * M * d;
  if (a_vec) {  // 16-byte loads, all of a thread's in flight together
    constexpr int E = 16 / sizeof(T);
    const int per_row = d / E;
    for (int i = threadIdx.x; i < BM * per_row; i += THREADS) {
      const int r = i / per_row, c = (i - r * per_row) * E;
      Vec<E> v;
      if (m0 + r < M)
        v = *reinterpret_cast<const Vec<E>*>(Ap + (long long)(m0 + r) * d + c);
      else
#pragma unroll
        for (int j = 0; j < E; ++j) v.v[j] = from_f<T>(0.f);
#pragma unroll
      for (int j = 0; j < E; j += 4)
        *reinterpret_cast<float4*>(sX + r * ldx + c + j) =
            make_float4(to_f(v.v[j]), to_f(v.v[j + 1]), to_f(v.v[j + 2]), to_f(v.v[j + 3]));
    }
  } else {
    for (int i = threadIdx.x; i < BM * d; i += THREADS) {
      const int r = i / d, c = i - r * d;
      sX[r * ldx + c] = m0 + r < M ? to_f(Ap[(long long)(m0 + r) * d + c]) : 0.f;
    }
  }

  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int lane_bits = 2 * (lane % 4);
  const int xrow = (wg * 64 + warp * 16 + lane / 4) * ldx;  // this thread's first row (+8: 2nd)
  Acc acc;
  zero(acc);
  unsigned frag[2][4];

  if constexpr (TMA) __syncthreads();  // x's rows and the barriers' initialization
  for (int kt = 0; kt < nK; ++kt) {
    if constexpr (TMA) {
      if (threadIdx.x == 0 && kt + PF < nK) {
        const int next = kt + PF;
        if (next >= STAGES)  // its stage's last use, block next - STAGES, retired everywhere
          mbar_wait(empty0 + 8 * (next % STAGES), (next / STAGES - 1) & 1);
        load_b(next);
      }
      mbar_wait(full0 + 8 * (kt % STAGES), (kt / STAGES) & 1);
    } else {
      async_wait<PF - 1>();
      fence_async_proxy();
      __syncthreads();  // stage kt landed everywhere; stage kt - 2's readers have retired
      load_b(kt + PF);
    }
    const int k0 = kt * BK, tu = k0 / BLOCK, e0 = k0 - tu * BLOCK;
    const unsigned packed = (unsigned)__ldg(tidx + tu);
    const float coef = __ldg(tcoef + tu) * scale;
    unsigned ex[2][4][2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float xv[POW][TILE];
      load_factors<0>(xv, sX + xrow + i * 8 * ldx, packed, e0, lane_bits);
#pragma unroll
      for (int c = 0; c < TILE; ++c)  // the coefficient goes to the factor with fewest values
        if (slot_used(COEF_FACTOR, c)) xv[COEF_FACTOR][c] *= coef;
      expand_row(ex[i], xv);
      pin(reinterpret_cast<unsigned(&)[8]>(ex[i]));
    }
    const unsigned long long b_desc = desc0 + (kt % STAGES) * (TILE_BYTES >> 4);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      unsigned (&a)[4] = frag[s & 1];
      a[0] = ex[0][s][0]; a[1] = ex[1][s][0]; a[2] = ex[0][s][1]; a[3] = ex[1][s][1];
      wg_fence();
      wgmma_rs(acc, a, b_desc + s * (16 * 128 >> 4));  // (start address field: 16-byte units)
      wg_commit();
      block_wait(s);
    }
    if constexpr (TMA)
      if (threadIdx.x % 32 == 0) mbar_arrive(empty0 + 8 * (kt % STAGES));  // (wgmmas retired)
  }
  wg_wait<0>();
  async_wait<0>();

  const long long pe = cta_tile((M + BM - 1) / BM, (N + BN - 1) / BN, tm, tn);  // (registers)
  T* Cp = C + pe * M * N;
  const int r0 = tm * BM + wg * 64 + warp * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int c = tn * BN + 8 * j + lane_bits;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h;
      if (r >= M) continue;
      T* out = Cp + (long long)r * N + c;
      const float v0 = acc.c[4 * j + 2 * h], v1 = acc.c[4 * j + 2 * h + 1];
      if (c + 1 < N && (N % 2) == 0 && (reinterpret_cast<size_t>(Cp) & 3) == 0) {
        *reinterpret_cast<unsigned*>(out) = pack2(v0, v1);
      } else {
        if (c < N) out[0] = from_f<T>(v0);
        if (c + 1 < N) out[1] = from_f<T>(v1);
      }
    }
  }
}
}  // namespace s90

extern "C" __global__ void __launch_bounds__(256, 3)
sympow_mma_k_wg(T* __restrict__ C, const T* __restrict__ A, const T* __restrict__ B,
                const int* __restrict__ tidx, const float* __restrict__ tcoef, int M, int N,
                int d, int D, float scale, int a_vec) {
  s90::mma_k_wg<false>(C, A, B, nullptr, tidx, tcoef, M, N, d, D, scale, a_vec);
}
// The TMA mainloop (b: a TensorMap made by _mma90_impl)
extern "C" __global__ void __launch_bounds__(256, 3)
sympow_mma_k_tma(T* __restrict__ C, const T* __restrict__ A,
                 const __grid_constant__ s90::TensorMap mapB, const int* __restrict__ tidx,
                 const float* __restrict__ tcoef, int M, int N, int d, int D, float scale,
                 int a_vec) {
  s90::mma_k_wg<true>(C, A, nullptr, &mapB, tidx, tcoef, M, N, d, D, scale, a_vec);
}

namespace s90 {
// Expand M: the k-block's 64 columns are fed to wgmma in a permuted order so that each thread's
// 16 columns are contiguous in `a` (two 16-byte loads per input row): wgmma position
// 16 s + 8 h + 2 q + j (k-step s, half h, lane q = lane % 4, element j) takes column
// 16 q + 4 s + 2 h + j of the block; b's tile rows are permuted the same way.
struct KPerm {
  static constexpr int STEP = 8;  // rmap(r + 32) - rmap(r)
  __device__ __forceinline__ int operator()(int pos) const {
    return 16 * ((pos >> 1) & 3) + 4 * (pos >> 4) + 2 * ((pos >> 3) & 1) + (pos & 1);
  }
};
// a's k-blocks: d rows of 64 columns, 128-byte rows whose 16-byte chunk c lands at c ^ (row % 2)
// (so that two rows' 16-byte loads by a quarter-warp fall in different banks). The block at
// column col0 into the stage at sdst (columns past `cols` zero), d rows `ld` elements apart:
// each thread copies chunk tid % 8 of rows tid / 8 + 32 i (same swizzle phase, 4 KiB apart) in
// a loop kept rolled (an unrolled one with its remainder cost ~90 instructions a k-block), its
// addresses rebuilt from threadIdx (registers held across the mainloop make 80-register builds
// spill).
__device__ __forceinline__ void load_a_block(unsigned sdst, const T* g, int ld, int d, int col0,
                                             int cols) {
  const int c = threadIdx.x & 7, r = threadIdx.x >> 3;
  const bool ok = col0 + c * 8 < cols;
  const T* p = g + (long long)r * ld + col0 + c * 8;
  unsigned s = sdst + r * 128 + ((c ^ (r & 1)) << 4);
#pragma unroll 1
  for (int row = r; row < d; row += 32, p += 32 * ld, s += 4096)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s),
                 "l"(ok ? p : g), "r"(ok ? 16 : 0));
}
// Thread q's 16 columns of input row `row` (8 packed pairs: word 2 s + h is k-step s, half h).
// SWZ: the row's 16-byte chunk c sits at c ^ (row & SWZ) (1: load_a_block's layout; 7: TMA's
// 128-byte swizzle).
template <int SWZ>
__device__ __forceinline__ void load_cols(unsigned (&w)[8], unsigned sbase, int row, int q) {
  const unsigned addr = sbase + row * 128;
  const int flip = row & SWZ;
  asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
               : "r"(addr + (((2 * q) ^ flip) << 4)));
  asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(w[4]), "=r"(w[5]), "=r"(w[6]), "=r"(w[7])
               : "r"(addr + (((2 * q + 1) ^ flip) << 4)));
}
__device__ __forceinline__ float2 unpack2(unsigned v) {
#if T_ID == 1
  return __half22float2(*reinterpret_cast<__half2*>(&v));
#else
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
#endif
}
__device__ __forceinline__ unsigned mul2(unsigned a, unsigned b) {  // one rounding, as fp32 would
#if T_ID == 1
  __half2 r = __hmul2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
#else
  __nv_bfloat162 r =
      __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
#endif
  return *reinterpret_cast<unsigned*>(&r);
}
// Field l of a feature offset contains bit 3 (the fragment's second row, 8 features on)?
__host__ __device__ constexpr bool has_bit3(int l) { return lo(l) <= 3 && 3 < lo(l) + LOGT; }
// The products of the factors' input rows over thread q's 16 columns, for the fragment's two
// rows. POW 2: one packed multiply (exactly the fp32 product rounded once); longer products in
// fp32, rounded once.
template <int SWZ>
__device__ __forceinline__ void expand_cols(unsigned (&prod)[2][8], unsigned abase,
                                            const int (&rows)[POW][2], int q) {
  unsigned w[POW][2][8];
#pragma unroll
  for (int l = 0; l < POW; ++l) {
    load_cols<SWZ>(w[l][0], abase, rows[l][0], q);
    if (has_bit3(l)) load_cols<SWZ>(w[l][1], abase, rows[l][1], q);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if constexpr (POW == 2) {
        prod[h][i] = mul2(w[0][has_bit3(0) ? h : 0][i], w[1][has_bit3(1) ? h : 0][i]);
      } else {
        float2 v = unpack2(w[0][has_bit3(0) ? h : 0][i]);
#pragma unroll
        for (int l = 1; l < POW; ++l) {
          const float2 x = unpack2(w[l][has_bit3(l) ? h : 0][i]);
          v.x *= x.x;
          v.y *= x.y;
        }
        prod[h][i] = pack2(v.x, v.y);
      }
    }
}
}  // namespace s90

namespace s90 {
// C[P, D, N] = (sympow(A[P, d, K] along its columns) * scale) @ B[P, K, N]   (expand M)
// Each warpgroup's 64 features lie inside one tuple, so its coefficient is applied to the
// accumulators at the end, and each thread's two fragment rows are products of input rows fixed
// for the whole kernel. WGS warpgroups, WGS x 64 features a CTA: every k-block of a and b
// (8 + 8 KiB) brought into shared memory serves WGS x 64 x 64 x 64 x 2 FLOPs, so the L2 -> SM
// traffic per FLOP falls as 1 / WGS (at d = N = 64: 16 KiB per 1 (WGS 2) or 1.5 (WGS 3) MFLOP).
// Two mainloops share the rest: mma_m_wg (cp.async by the first two warpgroups, a CTA barrier a
// k-block) and mma_m_tma (TMA by one thread, mbarriers: no barrier between the warpgroups).

// This warpgroup's place in the expansion: its first feature fw (live: fw < D), the tuple's
// coefficient times scale, and the input rows of each factor for the fragment's two rows.
struct MRows {
  int fw;
  bool live;
  float coef;
  int rows[POW][2];
  __device__ __forceinline__ MRows(int f0, int D, const int* __restrict__ tidx,
                                   const float* __restrict__ tcoef, float scale) {
    const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    fw = f0 + wg * 64;
    live = fw < D;
    const int tu = live ? fw / BLOCK : 0;
    const unsigned packed = live ? (unsigned)__ldg(tidx + tu) : 0u;
    coef = live ? __ldg(tcoef + tu) * scale : 0.f;
    const int e = fw - tu * BLOCK + warp * 16 + lane / 4;  // the first row's offset in the tuple
#pragma unroll
    for (int l = 0; l < POW; ++l)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        rows[l][h] = (int)((packed >> (8 * l)) & 255u) + (((e + 8 * h) >> lo(l)) & (TILE - 1));
  }
};

// One k-block: the fragments from a's stage at abase (its rows swizzled as SWZ says), then 4
// wgmmas against b's stage (descriptor b_desc); returns with all of them retired (block_wait).
template <int SWZ>
__device__ __forceinline__ void m_block(Acc& acc, unsigned abase, unsigned long long b_desc,
                                        const MRows& mr) {
  unsigned prod[2][8];  // the fragment rows' 16 columns as packed pairs (word 2 s + h)
  expand_cols<SWZ>(prod, abase, mr.rows, threadIdx.x % 4);
  pin(prod[0]);
  pin(prod[1]);
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const unsigned a[4] = {prod[0][2 * s], prod[1][2 * s], prod[0][2 * s + 1],
                           prod[1][2 * s + 1]};
    wg_fence();
    wgmma_rs(acc, a, b_desc + s * (16 * 128 >> 4));  // (start address field: 16-byte units)
    wg_commit();
    block_wait(s);
  }
}

// The CTA's [FEAT x 64] tile of C: coef x acc, rows r0 + 8 h, columns n0 + 8 j + 2 q + (0, 1).
__device__ __forceinline__ void store_m(T* __restrict__ C, long long p, int D, int N, int n0,
                                        const MRows& mr, const Acc& acc) {
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, q = lane % 4;
  T* Cp = C + p * D * N;
  const int r0 = mr.fw + warp * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int c = n0 + 8 * j + 2 * q;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h;
      if (!mr.live || r >= D) continue;
      T* out = Cp + (long long)r * N + c;
      const float v0 = mr.coef * acc.c[4 * j + 2 * h], v1 = mr.coef * acc.c[4 * j + 2 * h + 1];
      if (c + 1 < N && (N % 2) == 0 && (reinterpret_cast<size_t>(Cp) & 3) == 0) {
        *reinterpret_cast<unsigned*>(out) = pack2(v0, v1);
      } else {
        if (c < N) out[0] = from_f<T>(v0);
        if (c + 1 < N) out[1] = from_f<T>(v1);
      }
    }
  }
}

// cp.async mainloop: the first two warpgroups issue the loads (a's rows with SWZ 1, b's rows
// permuted by KPerm); a CTA barrier a k-block publishes a stage and retires the one refilled.
template <int WGS>
__device__ __forceinline__ void mma_m_wg(T* __restrict__ C, const T* __restrict__ A,
                                         const T* __restrict__ B, const int* __restrict__ tidx,
                                         const float* __restrict__ tcoef, int K, int N, int d,
                                         int D, float scale) {
  constexpr int FEAT = WGS * 64;  // features a CTA
  extern __shared__ __align__(16) char smem_raw[];
  char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  T* sB = reinterpret_cast<T*>(smem);  // STAGES x 64 x 64, swizzled, rows permuted (KPerm)
  const unsigned sB_addr = smem_addr(sB);
  const unsigned long long desc0 = desc_mn_sw128(sB_addr);
  T* sA = sB + STAGES * 64 * 64;       // STAGES x d x 64
  const unsigned sA_addr = smem_addr(sA);
  const int a_stage = d * 64;

  int tf, tn;
  const long long p = cta_tile((D + FEAT - 1) / FEAT, (N + BN - 1) / BN, tf, tn);
  const int f0 = tf * FEAT, n0 = tn * BN;
  const T* Ap = A + p * d * K;
  const T* Bp = B + p * K * N;
  const int nK = (K + BK - 1) / BK;
  TileStream bs(Bp, N, n0, N, KPerm{});
  const bool loader = WGS == 2 || threadIdx.x < 256;  // (the streams' layout: 256 threads)
  auto load = [&](int kt) {  // (kt in order: the streams step a block a call)
    if (kt < nK && loader) {
      const int st = kt % STAGES;
      load_a_block(sA_addr + st * a_stage * 2, Ap, K, d, kt * BK, K);
      bs.issue<KPerm>(sB_addr + st * TILE_BYTES, Bp, kt * BK, K);
    }
    async_commit();
  };
#pragma unroll
  for (int kt = 0; kt < PF; ++kt) load(kt);

  const MRows mr(f0, D, tidx, tcoef, scale);
  Acc acc;
  zero(acc);
  for (int kt = 0; kt < nK; ++kt) {
    async_wait<PF - 1>();
    fence_async_proxy();
    __syncthreads();
    load(kt + PF);
    const int st = kt % STAGES;
    m_block<1>(acc, sA_addr + st * a_stage * 2, desc0 + st * (TILE_BYTES >> 4), mr);
  }
  wg_wait<0>();
  async_wait<0>();
  store_m(C, p, D, N, n0, mr, acc);
}

// TMA mainloop. Thread 0 keeps PF k-blocks in flight: a's block as a [d x 64] box of
// a [P, d, K] map (128-byte swizzle, SWZ 7), b's block as one box of a 5-d view of b's rows that
// lands them in KPerm's order (configs: row 16 c45 + 4 c23 + 2 c1 + c0 of b's [P K, N] rows at
// tile row c0 + 2 c45 + 8 c1 + 16 c23), both on the stage's `full` mbarrier. A stage is refilled
// once every warp has arrived on its `empty` mbarrier after its k-block's wgmmas retired.
// Needs K % 64 == 0 (b's view crosses problems at 16-row granularity; a k-block never does).
template <int WGS>
__device__ __forceinline__ void mma_m_tma(T* __restrict__ C, const TensorMap& mapA,
                                          const TensorMap& mapB, const int* __restrict__ tidx,
                                          const float* __restrict__ tcoef, int K, int N, int d,
                                          int D, float scale) {
  constexpr int FEAT = WGS * 64;
  extern __shared__ __align__(16) char smem_raw[];
  char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const unsigned sB_addr = smem_addr(smem);  // STAGES x 64 x 64, swizzled, rows in KPerm order
  const unsigned long long desc0 = desc_mn_sw128(sB_addr);
  const unsigned a_bytes = d * 128, a_stage = (a_bytes + 1023) & ~1023u;  // (swizzle period)
  const unsigned sA_addr = sB_addr + STAGES * TILE_BYTES;
  const unsigned full0 = sA_addr + STAGES * a_stage, empty0 = full0 + 8 * STAGES;

  int tf, tn;
  const long long p = cta_tile((D + FEAT - 1) / FEAT, (N + BN - 1) / BN, tf, tn);
  const int f0 = tf * FEAT, n0 = tn * BN;
  const int nK = K / BK;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < STAGES; ++st) {
      mbar_init(full0 + 8 * st, 1);
      mbar_init(empty0 + 8 * st, 4 * WGS);  // every warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int b_row0 = (int)(p * (K / 16));  // b's view: 16-row groups of [P K, N]
  auto load = [&](int kt) {  // (thread 0)
    const int st = kt % STAGES;
    const unsigned full = full0 + 8 * st;
    mbar_expect_tx(full, a_bytes + TILE_BYTES);
    tma_load_3d(sA_addr + st * a_stage, mapA, full, kt * BK, 0, (int)p);
    tma_load_5d(sB_addr + st * TILE_BYTES, mapB, full, n0, 0, b_row0 + kt * (BK / 16), 0, 0);
  };
  if (threadIdx.x == 0)
    for (int kt = 0; kt < PF && kt < nK; ++kt) load(kt);

  const MRows mr(f0, D, tidx, tcoef, scale);
  Acc acc;
  zero(acc);
  for (int kt = 0; kt < nK; ++kt) {
    const int st = kt % STAGES;
    if (threadIdx.x == 0 && kt + PF < nK) {
      const int next = kt + PF;
      if (next >= STAGES)  // its stage's last use, block next - STAGES, retired everywhere
        mbar_wait(empty0 + 8 * (next % STAGES), (next / STAGES - 1) & 1);
      load(next);
    }
    mbar_wait(full0 + 8 * st, (kt / STAGES) & 1);
    m_block<7>(acc, sA_addr + st * a_stage, desc0 + st * (TILE_BYTES >> 4), mr);
    if (threadIdx.x % 32 == 0) mbar_arrive(empty0 + 8 * st);  // (the warp's wgmmas retired)
  }
  store_m(C, p, D, N, n0, mr, acc);
}
}  // namespace s90

extern "C" __global__ void __launch_bounds__(256, POW > 2 ? 2 : 3)  // (p > 2 spills at 80)
sympow_mma_m_wg(T* __restrict__ C, const T* __restrict__ A, const T* __restrict__ B,
                const int* __restrict__ tidx, const float* __restrict__ tcoef, int K, int N,
                int d, int D, float scale) {
  s90::mma_m_wg<2>(C, A, B, tidx, tcoef, K, N, d, D, scale);
}
// 3 warpgroups, 192 features a CTA: 2 CTAs (6 warpgroups) per SM at 80 registers (p > 2: 1)
extern "C" __global__ void __launch_bounds__(384, POW > 2 ? 1 : 2)
sympow_mma_m_wg3(T* __restrict__ C, const T* __restrict__ A, const T* __restrict__ B,
                 const int* __restrict__ tidx, const float* __restrict__ tcoef, int K, int N,
                 int d, int D, float scale) {
  s90::mma_m_wg<3>(C, A, B, tidx, tcoef, K, N, d, D, scale);
}
// The TMA mainloop, 3 warpgroups (a and b: TensorMaps made by _mma90_impl; K % 64 == 0)
extern "C" __global__ void __launch_bounds__(384, POW > 2 ? 1 : 2)
sympow_mma_m_tma3(T* __restrict__ C, const __grid_constant__ s90::TensorMap mapA,
                  const __grid_constant__ s90::TensorMap mapB, const int* __restrict__ tidx,
                  const float* __restrict__ tcoef, int K, int N, int d, int D, float scale) {
  s90::mma_m_tma<3>(C, mapA, mapB, tidx, tcoef, K, N, d, D, scale);
}

namespace s90 {
// ---- mma_sympow_bwd, expand K: G = dY @ b by wgmma, contracted by the CUDA cores ----
constexpr int BW_STAGES = 2;  // b's tiles; a stage is refilled once both warpgroups waited for it
static_assert(BW_STAGES == 2, "load_b and the mainloop flip between two stages");
// Descriptor of a 64 x 16 (M x K, K contiguous: "K-major") slice of 128-byte rows with the
// 128-byte swizzle, 8-row groups 1024 bytes apart (the leading offset is unused).
__device__ __forceinline__ unsigned long long desc_k_sw128(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) |
         ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
// acc (64 x 64 fp32) = (accumulate ? acc : 0) + A (64 x 16, shared, K-major) @ B (16 x 64,
// shared, MN-major).
__device__ __forceinline__ void wgmma_ss(Acc& acc, unsigned long long a, unsigned long long b,
                                         int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      VT_WGMMA_M64N64K16 VT_ACC_REGS
      "%32, %33, p, 1, 1, 0, 1;\n"
      "}\n"
      : VT_ACC_OPERANDS(acc)
      : "l"(a), "l"(b), "r"(accumulate));
}
// The accumulator's column 8 j + 2 q + jj is feature e0 + (8 j + jj) + 2 q: the same bit split
// as expand K's fragments (ct bits 0, 3-5; lane bits 1-2), so slot(l, ct) and load_factors
// carry over. Factor l's digit holds lane bits (col bits 1, 2) only where its field covers
// them; the lanes of a quad that differ in the other lane bits hold partial sums of the same
// digits and add them by shuffles. Then digit u of every factor is added into dx by one lane,
// owner(u), the same for all factors (a tuple whose factors share a tile adds twice into the
// same features, from one thread): the lane whose bits equal u's bits at the places where a
// field holds col bit 1 (bit 1 of the field starting at 0) and col bit 2 (bit 0 of the field at
// 2 when TILE is 4, else bit 2 of the field at 0).
__host__ __device__ constexpr bool covers(int l, int bit) {
  return lo(l) <= bit && bit < lo(l) + LOGT;
}
__device__ __forceinline__ int owner(int u) {
  return TILE == 4 ? ((u >> 1) & 1) | ((u & 1) << 1) : (u >> 1) & 3;
}
// One fragment row h's contribution to its row of dx (s_dx) for the k-block at e0 of tuple
// `packed` (coefficient coef): dx[l][u] += coef * sum over the row's features with digit l == u
// of G * prod_{o != l} x[o][digit o].
// DEFER: factor 0's sums go to pend (times coef) instead of s_dx; flush_lead adds them into dx
// when factor 0's features change (its digit field starts at bit 3 or higher, so they are the
// same for the whole CTA: runs of consecutive k-blocks share them, e.g. p 2, d_tile 8, d 64:
// 8 runs over 36 k-blocks).
template <int H, bool DEFER>
__device__ __forceinline__ void contract_row(float* s_dx, const float* xrow, const Acc& acc,
                                             unsigned packed, int e0, int lane_bits, int q,
                                             float coef, float (&pend)[TILE]) {
  float xv[POW][TILE], gr[POW][TILE];
  load_factors<0>(xv, xrow, packed, e0, lane_bits);
#pragma unroll
  for (int l = 0; l < POW; ++l)
#pragma unroll
    for (int c = 0; c < TILE; ++c) gr[l][c] = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
      const int ct = 8 * j + jj;
      float pre[POW];  // prod_{o < l} x[o]
      pre[0] = 1.f;
#pragma unroll
      for (int l = 1; l < POW; ++l)
        pre[l] = l == 1 ? xv[0][slot(0, ct)] : pre[l - 1] * xv[l - 1][slot(l - 1, ct)];
      float s = acc.c[4 * j + 2 * H + jj];  // times prod_{o > l} x[o], walking l down
#pragma unroll
      for (int l = POW - 1; l >= 1; --l) {
        gr[l][slot(l, ct)] += s * pre[l];
        s *= xv[l][slot(l, ct)];
      }
      gr[0][slot(0, ct)] += s;
    }
  if constexpr (DEFER) {
#pragma unroll
    for (int c = 0; c < TILE; ++c)
      if (slot_used(0, c)) pend[c] = fmaf(coef, gr[0][c], pend[c]);
  }
#pragma unroll
  for (int l = DEFER ? 1 : 0; l < POW; ++l) {
    const int base = (e0 + lane_bits) >> lo(l) & (TILE - 1);  // the digit's non-slot bits
    float* dst = s_dx + ((packed >> (8 * l)) & 255u) + base;
#pragma unroll
    for (int c = 0; c < TILE; ++c) {
      if (!slot_used(l, c)) continue;
      float v = gr[l][c];
      if (!covers(l, 1)) v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
      if (!covers(l, 2)) v += __shfl_xor_sync(0xFFFFFFFFu, v, 2);
      if (owner(base + c) == q) dst[c] += coef * v;
    }
  }
}
// Factor 0's deferred sums (pend, for the features at s_dx + lead: lead = its tile's first
// feature + its digit's fixed bits) into dx, as contract_row adds them; pend zeroed.
__device__ __forceinline__ void flush_lead(float* s_dx, int lead, int q, float (&pend)[TILE]) {
  static_assert(lo(0) >= 3, "factor 0's features are the same for all lanes");
#pragma unroll
  for (int c = 0; c < TILE; ++c) {
    if (!slot_used(0, c)) continue;
    float v = pend[c];
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 2);
    if (owner((lead & (TILE - 1)) + c) == q) s_dx[lead + c] += v;
    pend[c] = 0.f;
  }
}
}  // namespace s90

// dc[P, M, d] = gradient wrt c of <sympow(c[P, M, d] along rows) * scale, a[P, M, n] @ b[P, n, D]>
// Each warpgroup's 64 rows of G = a @ b, one 64-feature k-block (inside one tuple) at a time,
// come from wgmma (a's rows resident in shared memory, b's tiles streamed); its threads contract
// the block in registers against c's rows and add into the rows of dx kept in shared memory
// (each (row, feature) by one thread: no atomics), written once at the end.
// lda: a's row length (a multiple of 8, at most 64 * NC_MAX; columns past n are zero).
namespace s90 {
template <bool DEFER>
__device__ __forceinline__ void mma_bwd_k_wg(T* __restrict__ dc, const T* __restrict__ c,
                                             const T* __restrict__ a, const T* __restrict__ b,
                                             const int* __restrict__ tidx,
                                             const float* __restrict__ tcoef, int M, int lda,
                                             int n, int d, int D, float scale, int c_vec) {
  extern __shared__ __align__(16) char smem_raw[];
  char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const unsigned sB_addr = smem_addr(smem);                       // BW_STAGES x 64 x 64
  const unsigned sA_addr = sB_addr + BW_STAGES * TILE_BYTES;      // NC x 128 rows x 64
  const int NC = (lda + 63) / 64;
  float* sX = reinterpret_cast<float*>(smem + BW_STAGES * TILE_BYTES + NC * 2 * TILE_BYTES);
  const int ldx = ((d + 31) & ~31) + 8;
  float* sD = sX + BM * ldx;  // dx's rows, fp32

  int tm, t1;
  const long long p = cta_tile((M + BM - 1) / BM, 1, tm, t1);
  const int m0 = tm * BM;
  const T* Ap = a + p * M * lda;
  const T* Bp = b + p * n * D;
  {  // a's 128 rows, resident: chunk cc of row r in tile cc / 8 (128-byte swizzle)
    const int per_row = NC * 8;
    for (int i = threadIdx.x; i < BM * per_row; i += THREADS) {
      const int r = i / per_row, cc = i - r * per_row, ch = cc & 7;
      const bool ok = m0 + r < M && cc * 8 < lda;
      const unsigned dst =
          sA_addr + (cc >> 3) * 2 * TILE_BYTES + r * 128 + ((ch ^ (r & 7)) << 4);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
                   "l"(ok ? Ap + (long long)(m0 + r) * lda + cc * 8 : Ap), "r"(ok ? 16 : 0));
    }
  }
  const int nF = D / BK;
  // b's tiles in order (f, nc): rows [64 nc, + 64) x features [64 f, + 64); the stream steps
  // a pointer a tile (no divisions or address rebuilds in the mainloop)
  const int bc = threadIdx.x & 7, br = threadIdx.x >> 3;
  const unsigned b_dst = sB_addr + br * 128 + ((bc ^ (br & 7)) << 4);
  const T* b_src = Bp + (long long)br * D + bc * 8;
  const long long b_down = 64ll * D, b_next = 64 - (long long)(NC - 1) * 64 * D;
  int b_left = nF * NC, b_row = br, b_nc = 0, b_stage = 0;
  auto load_b = [&]() {
    if (b_left > 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool ok = b_row + 32 * h < n;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                         b_dst + b_stage * TILE_BYTES + h * 4096),
                     "l"(ok ? b_src + h * 32 * D : Bp), "r"(ok ? 16 : 0));
      }
      --b_left;
      b_stage ^= 1;  // (BW_STAGES == 2)
      if (++b_nc == NC) {
        b_nc = 0, b_row = br, b_src += b_next;
      } else {
        b_row += 64, b_src += b_down;
      }
    }
    async_commit();
  };
  load_b();
  const T* Cp = c + p * M * d;
  if (c_vec) {
    constexpr int E = 16 / sizeof(T);
    const int per_row = d / E;
    for (int i = threadIdx.x; i < BM * per_row; i += THREADS) {
      const int r = i / per_row, col = (i - r * per_row) * E;
      Vec<E> v;
      if (m0 + r < M)
        v = *reinterpret_cast<const Vec<E>*>(Cp + (long long)(m0 + r) * d + col);
      else
#pragma unroll
        for (int j = 0; j < E; ++j) v.v[j] = from_f<T>(0.f);
#pragma unroll
      for (int j = 0; j < E; j += 4) {
        *reinterpret_cast<float4*>(sX + r * ldx + col + j) =
            make_float4(to_f(v.v[j]), to_f(v.v[j + 1]), to_f(v.v[j + 2]), to_f(v.v[j + 3]));
        *reinterpret_cast<float4*>(sD + r * ldx + col + j) = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  } else {
    for (int i = threadIdx.x; i < BM * d; i += THREADS) {
      const int r = i / d, col = i - r * d;
      sX[r * ldx + col] = m0 + r < M ? to_f(Cp[(long long)(m0 + r) * d + col]) : 0.f;
      sD[r * ldx + col] = 0.f;
    }
  }

  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int q = lane % 4, lane_bits = 2 * q;
  const int row0 = (wg * 64 + warp * 16 + lane / 4) * ldx;  // this thread's first row (+8: 2nd)
  const unsigned long long a_desc0 = desc_k_sw128(sA_addr + wg * 64 * 128);
  const unsigned long long b_desc0 = desc_mn_sw128(sB_addr);
  Acc acc;
  zero(acc);
  int stage = 0;
  float pend[2][TILE];  // (DEFER) factor 0's sums for the features at lead
#pragma unroll
  for (int c = 0; c < TILE; ++c) pend[0][c] = pend[1][c] = 0.f;
  int lead = -1;
#pragma unroll 1
  for (int f = 0; f < nF; ++f) {
    const int k0 = f * BK, tu = k0 / BLOCK, e0 = k0 - tu * BLOCK;
    const unsigned packed = (unsigned)__ldg(tidx + tu);
    const float coef = __ldg(tcoef + tu) * scale;
    if constexpr (DEFER) {  // (uniform: the same branch for the whole CTA)
      const int now = (int)(packed & 255u) + ((e0 >> lo(0)) & (TILE - 1));
      if (now != lead) {
        if (lead >= 0) {
          flush_lead(sD + row0, lead, q, pend[0]);
          flush_lead(sD + row0 + 8 * ldx, lead, q, pend[1]);
        }
        lead = now;
      }
    }
#pragma unroll 1
    for (int nc = 0; nc < NC; ++nc) {
      async_wait<0>();
      fence_async_proxy();
      __syncthreads();  // this stage (and a, c) landed everywhere; the last one's wgmmas retired
      load_b();
      const unsigned long long a_desc = a_desc0 + nc * (2 * TILE_BYTES >> 4);
      const unsigned long long b_desc = b_desc0 + stage * (TILE_BYTES >> 4);
      stage ^= 1;
      wg_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s)  // (start address fields: 16-byte units)
        wgmma_ss(acc, a_desc + s * (32 >> 4), b_desc + s * (16 * 128 >> 4), nc | s);
      wg_commit();
      wg_wait<0>();
    }
    pin(acc);  // no read of the accumulators moves above the wait
    contract_row<0, DEFER>(sD + row0, sX + row0, acc, packed, e0, lane_bits, q, coef,
                           pend[0]);
    contract_row<1, DEFER>(sD + row0 + 8 * ldx, sX + row0 + 8 * ldx, acc, packed, e0, lane_bits,
                           q, coef, pend[1]);
  }
  if (DEFER && lead >= 0) {
    flush_lead(sD + row0, lead, q, pend[0]);
    flush_lead(sD + row0 + 8 * ldx, lead, q, pend[1]);
  }
  async_wait<0>();
  __syncthreads();
  T* out = dc + p * M * d;
  for (int i = threadIdx.x; i < BM * d; i += THREADS) {
    const int r = i / d, col = i - r * d;
    if (m0 + r < M) out[(long long)(m0 + r) * d + col] = from_f<T>(sD[r * ldx + col]);
  }
}
}  // namespace s90

extern "C" __global__ void __launch_bounds__(256, 2)
mma_sympow_bwd_k_wg(T* __restrict__ dc, const T* __restrict__ c, const T* __restrict__ a,
                    const T* __restrict__ b, const int* __restrict__ tidx,
                    const float* __restrict__ tcoef, int M, int lda, int n, int d, int D,
                    float scale, int c_vec) {
  s90::mma_bwd_k_wg<false>(dc, c, a, b, tidx, tcoef, M, lda, n, d, D, scale, c_vec);
}
// Factor 0's sums held in registers over runs of k-blocks (contract_row's DEFER): per k-block
// and warp, p 2 d_tile 8, the old kernel's 16 single-lane loads and stores of dx and 32
// shuffles for factor 0 happen once a run (8 times over 36 k-blocks at d 64).
extern "C" __global__ void __launch_bounds__(256, 2)
mma_sympow_bwd_k_wg2(T* __restrict__ dc, const T* __restrict__ c, const T* __restrict__ a,
                     const T* __restrict__ b, const int* __restrict__ tidx,
                     const float* __restrict__ tcoef, int M, int lda, int n, int d, int D,
                     float scale, int c_vec) {
  s90::mma_bwd_k_wg<true>(dc, c, a, b, tidx, tcoef, M, lda, n, d, D, scale, c_vec);
}
