// sympow forward and backward: the tiled symmetric power written to (read from) memory.
//
// Why: power attention's feature map; both kernels are bound by the expanded tensor's bytes,
// so each thread moves 16-byte vectors and the index arithmetic stays in 32 bits.
// Kernels: sympow_fwd; the backward as sympow_bwd_pipe (persistent, two cp.async stages, where a
// block of rows fits one stage), sympow_bwd_quarter (the same for p=4 d_tile=4's 512-byte blocks,
// 4 threads an item), sympow_bwd_gather (one block of rows a CTA), sympow_bwd (shared atomics,
// where a row's partial sums do not fit); configs.py and __init__.py choose.
//
// Statics (defines): T_ID (0 float, 1 half, 2 bfloat16), POW (1..4), TILE (d_tile: 1, 2, 4, 8,
// 16), VEC (features per vector, dividing TILE^POW; 16 bytes at most).
// Constraints (checked in vitrail/ops/sympow/configs.py): d <= 256 (indices are bytes),
// TILE divides d, TILE^POW <= 512; x, z rows contiguous with z's rows D features apart and
// z, dz aligned to VEC * sizeof(T) bytes.
// Layout: x [rows, d], z [rows, D]; group/tuple tables from configs.tables().
#pragma once
// (sympow_common.cuh comes first: T, to_f/from_f, Vec)

constexpr int BLOCK = vitrail::ipow<TILE, POW>::value;  // features of one tuple
static_assert(BLOCK % VEC == 0, "VEC must divide TILE^POW");

// One thread per VEC consecutive output features (a chunk) of rows r0, r0 + R, r0 + 2R, ...:
// threads g = r0 * chunks + chunk cover R rows at once (R * chunks threads in all), so a thread's
// chunk, and with it its groups' table entries, coefficients and x offsets, are fixed for the
// whole kernel; each row costs only the x loads, the products and one 16-byte store. (One
// thread per (row, chunk), with the division and the table lookups redone for every output
// vector, took 185 instructions a vector at p=4 d_tile=4 and was issue-bound: docs/perf-notes.md.)
// A group (one tuple, leading digits fixed) is TILE features that share the product of their
// leading factors; a vector holds VEC / TILE whole groups, or lies inside one (VEC <= TILE).
constexpr int FWD_GROUPS = VEC > TILE ? VEC / TILE : 1;
extern "C" __global__ void __launch_bounds__(256)
sympow_fwd(T* __restrict__ z, const T* __restrict__ x, const int* __restrict__ gidx,
           const float* __restrict__ gcoef, long long rows, int d, int D, float scale,
           int rows_at_once) {
  using namespace sympow_detail;
  const unsigned chunks = D / VEC;
  const unsigned g = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned r0 = g / chunks;
  if (r0 >= (unsigned)rows_at_once) return;
  const unsigned k0 = (g - r0 * chunks) * VEC;
  unsigned lead[FWD_GROUPS];  // the group's leading input features (bytes 0-2)
  int last[FWD_GROUPS];       // the input feature of the vector's first value in the group
  float coef[FWD_GROUPS];
#pragma unroll
  for (int j = 0; j < FWD_GROUPS; ++j) {
    const unsigned k = k0 + j * TILE, grp = k / TILE;
    const unsigned packed = (unsigned)__ldg(gidx + grp);
    lead[j] = packed;
    last[j] = (int)(packed >> 24) + (int)(k % TILE);
    coef[j] = __ldg(gcoef + grp) * scale;
  }
  const T* xr = x + (long long)r0 * d;
  T* zr = z + (long long)r0 * D + k0;
  const long long x_step = (long long)rows_at_once * d, z_step = (long long)rows_at_once * D;
  for (long long row = r0; row < rows; row += rows_at_once, xr += x_step, zr += z_step) {
    Vec<VEC> out;
#pragma unroll
    for (int j = 0; j < FWD_GROUPS; ++j) {
      float prefix = coef[j];
#pragma unroll
      for (int l = 0; l < POW - 1; ++l) prefix *= to_f(xr[(lead[j] >> (8 * l)) & 255u]);
      constexpr int n = VEC < TILE ? VEC : TILE;
#pragma unroll
      for (int b = 0; b < n; ++b) out.v[j * TILE + b] = from_f<T>(prefix * to_f(xr[last[j] + b]));
    }
    *reinterpret_cast<Vec<VEC>*>(zr) = out;
  }
}

// Staging: when one tuple's block is 32 to 128 bytes, neighbouring threads' blocks are that far
// apart, so the block's gradients first come into shared memory with 16-byte coalesced loads
// (one 16-byte pad per tuple keeps the threads' reads free of bank conflicts); larger blocks are
// read in place, smaller ones are already coalesced.
constexpr int BLOCK_BYTES = BLOCK * (int)sizeof(T);
constexpr bool STAGE = BLOCK_BYTES >= 32 && BLOCK_BYTES <= 128;
constexpr int STAGE_LD = BLOCK + 16 / (int)sizeof(T);  // elements per staged tuple
constexpr int STAGE_ITEMS = 256;                       // tuples per stage (one per thread)

// One thread per (row, tuple): the tuple's TILE^POW gradients stream in TILE at a time, the
// factors' gradients gather in registers (vitrail::tprod_pow_bwd_rows), then add into the
// block's rows in shared memory. A block owns `rows_per_block` whole rows.
extern "C" __global__ void __launch_bounds__(256)
sympow_bwd(T* __restrict__ dx, const T* __restrict__ x, const T* __restrict__ dz,
           const int* __restrict__ tidx, const float* __restrict__ tcoef, long long rows, int d,
           int D, int tuples, int rows_per_block, float scale) {
  using namespace sympow_detail;
  extern __shared__ __align__(16) float s_dx[];  // [rows_per_block][d], then the stage
  T* s_dz = reinterpret_cast<T*>(s_dx + ((rows_per_block * d + 3) & ~3));
  constexpr int LV = VEC < TILE ? VEC : TILE;  // elements per load
  const long long row0 = (long long)blockIdx.x * rows_per_block;
  const int nrows = (int)min((long long)rows_per_block, rows - row0);
  const int items = nrows * tuples;
  for (int i = threadIdx.x; i < nrows * d; i += blockDim.x) s_dx[i] = 0.f;
  __syncthreads();
  const int step = STAGE ? STAGE_ITEMS : blockDim.x;
  for (int seg = 0; seg < items; seg += step) {
    const int it = seg + threadIdx.x;
    const T* g = nullptr;
    if (STAGE) {  // the segment's gradients are contiguous in dz: copy them in, padded
      const int n = min(STAGE_ITEMS, items - seg);
      const T* src = dz + row0 * D + (long long)seg * BLOCK;
      for (int c = threadIdx.x; c < n * (BLOCK / VEC); c += blockDim.x) {
        const int e = c * VEC, item = e / BLOCK;
        *reinterpret_cast<Vec<VEC>*>(s_dz + item * STAGE_LD + e - item * BLOCK) =
            *reinterpret_cast<const Vec<VEC>*>(src + e);
      }
      __syncthreads();
      g = s_dz + threadIdx.x * STAGE_LD;
    }
    if (it < items) {
      const int r = it / tuples, tu = it - r * tuples;
      const long long row = row0 + r;
      const unsigned packed = (unsigned)__ldg(tidx + tu);
      const float coef = __ldg(tcoef + tu) * scale;
      const T* xr = x + row * d;
      float xf[POW][TILE], gx[POW][TILE];
#pragma unroll
      for (int l = 0; l < POW; ++l) {
        const unsigned start = (packed >> (8 * l)) & 255u;
#pragma unroll
        for (int a = 0; a < TILE; ++a) {
          xf[l][a] = to_f(xr[start + a]);
          gx[l][a] = 0.f;
        }
      }
      if (!STAGE) g = dz + row * D + (long long)tu * BLOCK;
      vitrail::tprod_pow_bwd_rows<POW, TILE>(gx, xf, [&](int lead, float (&grow)[TILE]) {
#pragma unroll
        for (int b = 0; b < TILE; b += LV) {
          const Vec<LV> v = *reinterpret_cast<const Vec<LV>*>(g + lead * TILE + b);
#pragma unroll
          for (int j = 0; j < LV; ++j) grow[b + j] = to_f(v.v[j]);
        }
      }, coef);
      float* acc = s_dx + r * d;
#pragma unroll
      for (int l = 0; l < POW; ++l) {
        const unsigned start = (packed >> (8 * l)) & 255u;
#pragma unroll
        for (int a = 0; a < TILE; ++a) atomicAdd(acc + start + a, gx[l][a]);
      }
    }
    if (STAGE) __syncthreads();
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nrows * d; i += blockDim.x)
    dx[row0 * d + i] = from_f<T>(s_dx[i]);
}

// The backward without atomics (the choice wherever a row's partial sums fit in shared memory;
// sympow_bwd above is the fallback). Shared float atomics are compare-and-swap loops on sm_90,
// and a row's tuples all add into its d features, so they spin; here each (row, tuple) item
// writes the gradients of its POW factors to its own slot, and then each dx element sums its
// tile's slots (the `slots` table, E entries per tile: every (tuple, factor) whose tile it is).
// Phase 1 reads x from shared memory and its tuple's dz block from a cp.async stage (STAGE) or
// straight from global memory in 16-byte loads (the block's loads are independent, so they are
// all in flight at once); phase 2 writes dx coalesced. Deterministic: no order depends on timing.
// Needs dz's rows D features apart and 16-byte aligned (VEC == 16 / sizeof(T)) where STAGE.
constexpr int PART = POW * TILE;                      // one item's partial gradients
constexpr bool GSTAGE = STAGE && VEC * sizeof(T) == 16;  // staged by cp.async: 16-byte chunks
constexpr int PART_LD = PART + (PART % 8 == 0 ? 4 : 0);  // padded: items' 16-byte stores spread

namespace gather_detail {
using namespace sympow_detail;
// n items' dz blocks (contiguous in dz from src) into the stage s_dz, padded, by cp.async (16
// bytes a thread, all in flight at once); one commit group.
__device__ __forceinline__ void stage_items(T* s_dz, const T* src, int n) {
  constexpr int E = 16 / (int)sizeof(T);  // elements per 16-byte chunk
  for (int c = threadIdx.x; c < n * (BLOCK / E); c += blockDim.x) {
    const int e = c * E, item = e / BLOCK;
    const unsigned dst =
        (unsigned)__cvta_generic_to_shared(s_dz + item * STAGE_LD + e - item * BLOCK);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src + e));
  }
  asm volatile("cp.async.commit_group;\n" ::);
}
// One item's partial gradients (tuple tu of the row whose fp32 values are xr) from its dz block
// g (shared or global memory) into part.
__device__ __forceinline__ void item_partials(float* part, const float* xr, const T* g,
                                              const int* tidx, const float* tcoef, int tu,
                                              float scale) {
  constexpr int LV = VEC < TILE ? VEC : TILE;                    // elements per dz load
  constexpr int SV = TILE % 4 == 0 ? 4 : TILE % 2 == 0 ? 2 : 1;  // floats per partial store
  const unsigned packed = (unsigned)__ldg(tidx + tu);
  const float coef = __ldg(tcoef + tu) * scale;
  float xf[POW][TILE], gx[POW][TILE];
#pragma unroll
  for (int l = 0; l < POW; ++l) {
    const unsigned start = (packed >> (8 * l)) & 255u;
#pragma unroll
    for (int a = 0; a < TILE; ++a) {
      xf[l][a] = xr[start + a];
      gx[l][a] = 0.f;
    }
  }
  // 16-byte loads even where a tile row is shorter: a row pair's vector is kept for the odd row
  constexpr int PAIR = (2 * TILE <= VEC && BLOCK >= 2 * TILE) ? 2 : 1;
  Vec<LV * PAIR> held;
  vitrail::tprod_pow_bwd_rows<POW, TILE>(gx, xf, [&](int lead, float (&grow)[TILE]) {
    if (PAIR == 2) {
      if (lead % 2 == 0) held = *reinterpret_cast<const Vec<LV * PAIR>*>(g + lead * TILE);
#pragma unroll
      for (int j = 0; j < TILE; ++j) grow[j] = to_f(held.v[(lead % 2) * TILE + j]);
    } else {
#pragma unroll
      for (int b = 0; b < TILE; b += LV) {
        const Vec<LV> v = *reinterpret_cast<const Vec<LV>*>(g + lead * TILE + b);
#pragma unroll
        for (int j = 0; j < LV; ++j) grow[b + j] = to_f(v.v[j]);
      }
    }
  }, coef);
#pragma unroll
  for (int l = 0; l < POW; ++l)
#pragma unroll
    for (int a = 0; a < TILE; a += SV) {
      if constexpr (SV == 4)
        *reinterpret_cast<float4*>(part + l * TILE + a) =
            make_float4(gx[l][a], gx[l][a + 1], gx[l][a + 2], gx[l][a + 3]);
      else if constexpr (SV == 2)
        *reinterpret_cast<float2*>(part + l * TILE + a) = make_float2(gx[l][a], gx[l][a + 1]);
      else
        part[l * TILE + a] = gx[l][a];
    }
}
// Phase 2: each of the nrows rows' dx elements sums its tile's slots; written coalesced.
__device__ __forceinline__ void gather_dx(T* dx_rows, const float* s_part, const int* slots,
                                          int nrows, int d, int tuples, int entries) {
  for (int i = threadIdx.x; i < nrows * d; i += blockDim.x) {
    const int r = i / d, j = i - r * d, u = j / TILE, a = j - u * TILE;
    const float* part = s_part + r * tuples * PART_LD + a;
    const int* su = slots + u * entries;
    float sum = 0.f;
    for (int e = 0; e < entries; ++e) sum += part[__ldg(su + e)];
    dx_rows[i] = from_f<T>(sum);
  }
}
}  // namespace gather_detail

extern "C" __global__ void __launch_bounds__(256)
sympow_bwd_gather(T* __restrict__ dx, const T* __restrict__ x, const T* __restrict__ dz,
                  const int* __restrict__ tidx, const float* __restrict__ tcoef,
                  const int* __restrict__ slots, long long rows, int d, int D, int tuples,
                  int entries, int rows_per_block, float scale) {
  using namespace gather_detail;
  extern __shared__ __align__(16) float smem[];
  float* s_x = smem;                                          // [rows_per_block][d]
  float* s_part = smem + ((rows_per_block * d + 3) & ~3);     // [items][PART_LD], then the stage
  const long long row0 = (long long)blockIdx.x * rows_per_block;
  const int nrows = (int)min((long long)rows_per_block, rows - row0);
  const int items = nrows * tuples;
  // STAGE (as in sympow_bwd): each round's blocks come in by cp.async, 16 bytes a thread, all in
  // flight at once; they are contiguous in dz (a row's D features are its tuples' blocks).
  T* s_dz = reinterpret_cast<T*>(s_part + ((items * PART_LD + 3) & ~3));  // [STAGE_ITEMS][STAGE_LD]
  const T* dz_block = dz + row0 * D;
  for (int seg = 0; seg < items; seg += STAGE_ITEMS) {
    if (GSTAGE) stage_items(s_dz, dz_block + (long long)seg * BLOCK, min(STAGE_ITEMS, items - seg));
    if (seg == 0)  // (after the first stage is on its way)
      for (int i = threadIdx.x; i < nrows * d; i += blockDim.x) s_x[i] = to_f(x[row0 * d + i]);
    if (GSTAGE) asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    __syncthreads();  // the stage and x are in
    const int it = seg + threadIdx.x;
    if (it < items) {
      const int r = it / tuples, tu = it - r * tuples;
      const T* g = GSTAGE ? s_dz + threadIdx.x * STAGE_LD : dz_block + (long long)it * BLOCK;
      item_partials(s_part + it * PART_LD, s_x + r * d, g, tidx, tcoef, tu, scale);
    }
    if (GSTAGE) __syncthreads();  // the stage is refilled next round
  }
  __syncthreads();
  gather_dx(dx + row0 * d, s_part, slots, nrows, d, tuples, entries);
}

// sympow_bwd_gather made persistent where one stage holds a whole block of rows (GSTAGE, rows
// per block x tuples <= 256): each CTA walks blocks blockIdx.x, + gridDim.x, ... with two
// stages, the next block's dz on its way (cp.async) while this block's items and gather run, so
// the SM always has loads in flight (the one-block kernel waits for its whole stage, then
// computes with nothing in flight). Shared memory: x's rows, the partials, two stages.
// CTAs an SM holds (its registers: 64 a thread in 16-bit types, 80 in fp32), stated so that
// ptxas allocates against that budget rather than a tier of its own (NVRTC 13.5 chose 48 for
// bf16 p=2 d_tile=8 and spilled); configs.PIPE_CTAS launches no more.
constexpr int PIPE_CTAS = sizeof(T) == 4 ? 3 : 4;
extern "C" __global__ void __launch_bounds__(256, PIPE_CTAS)
sympow_bwd_pipe(T* __restrict__ dx, const T* __restrict__ x, const T* __restrict__ dz,
                const int* __restrict__ tidx, const float* __restrict__ tcoef,
                const int* __restrict__ slots, long long rows, int d, int D, int tuples,
                int entries, int rows_per_block, float scale) {
  using namespace gather_detail;
  extern __shared__ __align__(16) float smem[];
  const int items_max = rows_per_block * tuples;  // <= STAGE_ITEMS
  float* s_x = smem;
  float* s_part = smem + ((rows_per_block * d + 3) & ~3);
  T* s_dz0 = reinterpret_cast<T*>(s_part + ((items_max * PART_LD + 3) & ~3));
  const long long blocks = (rows + rows_per_block - 1) / rows_per_block;
  auto issue = [&](long long blk, int buf) {  // (always one commit group)
    if (GSTAGE && blk < blocks) {
      const long long row0 = blk * rows_per_block;
      const int nrows = (int)min((long long)rows_per_block, rows - row0);
      stage_items(s_dz0 + buf * items_max * STAGE_LD, dz + row0 * D, nrows * tuples);
      // x's rows of the block into L1 meanwhile (read by plain loads when the block's turn comes)
      const char* xb = reinterpret_cast<const char*>(x + row0 * d);
      const int bytes = nrows * d * (int)sizeof(T);
      const int lines = (int)(((size_t)xb + bytes + 127) / 128 - (size_t)xb / 128);
      if ((int)threadIdx.x < lines) {  // (an address inside x in each line)
        const char* line = xb + min((int)threadIdx.x * 128, bytes - 1);
        asm volatile("prefetch.global.L1 [%0];\n" ::"l"(line));
      }
    } else {
      asm volatile("cp.async.commit_group;\n" ::);
    }
  };
  int buf = 0;
  issue(blockIdx.x, 0);
  for (long long blk = blockIdx.x; blk < blocks; blk += gridDim.x, buf ^= 1) {
    issue(blk + gridDim.x, buf ^ 1);  // its stage's last readers passed the loop's last barrier
    const long long row0 = blk * rows_per_block;
    const int nrows = (int)min((long long)rows_per_block, rows - row0);
    const int items = nrows * tuples;
    for (int i = threadIdx.x; i < nrows * d; i += blockDim.x) s_x[i] = to_f(x[row0 * d + i]);
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");  // this block's stage (not the next)
    __syncthreads();
    const int it = threadIdx.x;
    if (it < items) {
      const int r = it / tuples, tu = it - r * tuples;
      item_partials(s_part + it * PART_LD, s_x + r * d, s_dz0 + (buf * items_max + it) * STAGE_LD,
                    tidx, tcoef, tu, scale);
    }
    __syncthreads();
    gather_dx(dx + row0 * d, s_part, slots, nrows, d, tuples, entries);
    __syncthreads();  // s_x, s_part and this stage are rewritten next
  }
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// The backward for POW = 4, TILE = 4 in 16-bit types (512-byte tuple blocks, too large for the
// stage above, and read in place 16 bytes a thread with 512-byte strides between lanes: 32 L1
// lines a warp load). Here a round's 64 items come in by cp.async in 16-byte chunks (a warp's
// load: 4 lines), each padded quarter (the 64 features with one first digit a0) 16 bytes apart
// so that the 8 threads of a 16-byte shared load hit distinct banks, and 4 threads share an
// item: thread k takes the quarter a0 = k as a 3-factor block (tprod_pow_bwd_rows<3, 4> scaled
// by the tuple's coefficient), then dx0[k] = <that block's gradient of factor 3, x3>, factors
// 1-3 scale by x0[k] and add over the 4 threads by shuffles. Persistent, one row a block (its
// 330 items' partials), two stages: the next round loads while one computes.
constexpr bool QUARTER = POW == 4 && TILE == 4 && sizeof(T) == 2;
constexpr int Q_ITEMS = 64;                           // items a round (4 threads each)
constexpr int Q_LD = BLOCK / 4 + 16 / (int)sizeof(T);  // elements between quarters (padded)
constexpr int Q_ITEM_LD = 4 * Q_LD;                    // elements between staged items
extern "C" __global__ void __launch_bounds__(256)
sympow_bwd_quarter(T* __restrict__ dx, const T* __restrict__ x, const T* __restrict__ dz,
                   const int* __restrict__ tidx, const float* __restrict__ tcoef,
                   const int* __restrict__ slots, long long rows, int d, int D, int tuples,
                   int entries, float scale) {
  if constexpr (QUARTER) {
    using namespace gather_detail;
    extern __shared__ __align__(16) float smem[];
    float* s_x = smem;                                         // [d]
    float* s_part = smem + ((d + 3) & ~3);                     // [tuples][PART_LD]
    T* s_dz0 = reinterpret_cast<T*>(s_part + ((tuples * PART_LD + 3) & ~3));  // 2 stages
    const int rounds = (tuples + Q_ITEMS - 1) / Q_ITEMS;       // a row's
    constexpr int E = 16 / (int)sizeof(T);                     // elements per 16-byte chunk
    constexpr int QC = BLOCK / 4 / E;                          // chunks per quarter
    // Round rr of row `row` into stage buf (always one commit group).
    auto issue = [&](long long row, int rr, int buf) {
      if (row < rows) {
        const int n = min(Q_ITEMS, tuples - rr * Q_ITEMS);
        const T* src = dz + row * D + (long long)rr * Q_ITEMS * BLOCK;
        T* dst0 = s_dz0 + buf * Q_ITEMS * Q_ITEM_LD;
        for (int c = threadIdx.x; c < n * 4 * QC; c += blockDim.x) {
          const int q = c / QC, item = q / 4;  // quarter q of the round (item, its quarter)
          const unsigned dst = (unsigned)__cvta_generic_to_shared(
              dst0 + item * Q_ITEM_LD + (q - item * 4) * Q_LD + (c - q * QC) * E);
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src + c * E));
        }
      }
      asm volatile("cp.async.commit_group;\n" ::);
    };
    long long row = blockIdx.x, next_row = row;
    int rr = 0, next_rr = 0, buf = 0;
    auto step = [&](long long& r0, int& r1) {
      if (++r1 == rounds) r1 = 0, r0 += gridDim.x;
    };
    issue(next_row, next_rr, 0);
    step(next_row, next_rr);
    const int i = threadIdx.x / 4, k = threadIdx.x % 4;  // this thread's item and quarter
    while (row < rows) {
      if (rr == 0)  // the row's x (the last row's gather has passed its barrier)
        for (int j = threadIdx.x; j < d; j += blockDim.x) s_x[j] = to_f(x[row * d + j]);
      issue(next_row, next_rr, buf ^ 1);
      step(next_row, next_rr);
      asm volatile("cp.async.wait_group 1;\n" ::: "memory");
      __syncthreads();  // this round's stage and x are in
      const int n = min(Q_ITEMS, tuples - rr * Q_ITEMS);
      const int tu = rr * Q_ITEMS + min(i, n - 1);  // (threads past the round's end: a copy)
      const unsigned packed = (unsigned)__ldg(tidx + tu);
      const float coef = __ldg(tcoef + tu) * scale;
      float xf[3][TILE], gx[3][TILE];
#pragma unroll
      for (int l = 0; l < 3; ++l) {
        const unsigned start = (packed >> (8 * (l + 1))) & 255u;
#pragma unroll
        for (int a = 0; a < TILE; ++a) {
          xf[l][a] = s_x[start + a];
          gx[l][a] = 0.f;
        }
      }
      const float x0 = s_x[(packed & 255u) + k];
      const T* g = s_dz0 + (buf * Q_ITEMS + min(i, n - 1)) * Q_ITEM_LD + k * Q_LD;
      Vec<8> held;  // two 4-feature rows a 16-byte load
      vitrail::tprod_pow_bwd_rows<3, TILE>(gx, xf, [&](int lead, float (&grow)[TILE]) {
        if (lead % 2 == 0) held = *reinterpret_cast<const Vec<8>*>(g + lead * TILE);
#pragma unroll
        for (int j = 0; j < TILE; ++j) grow[j] = to_f(held.v[(lead % 2) * TILE + j]);
      }, coef);
      float g0 = 0.f;  // factor 0's digit k: the quarter's block against x1 x2 x3
#pragma unroll
      for (int a = 0; a < TILE; ++a) g0 += gx[2][a] * xf[2][a];
#pragma unroll
      for (int l = 0; l < 3; ++l)
#pragma unroll
        for (int a = 0; a < TILE; ++a) {
          float v = gx[l][a] * x0;
          v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
          v += __shfl_xor_sync(0xFFFFFFFFu, v, 2);
          gx[l][a] = v;
        }
      if (i < n) {
        float* part = s_part + (rr * Q_ITEMS + i) * PART_LD;
        part[k] = g0;
#pragma unroll
        for (int l = 0; l < 3; ++l)
#pragma unroll
          for (int a = 0; a < TILE; ++a)
            if (a == k) part[(l + 1) * TILE + a] = gx[l][a];
      }
      __syncthreads();  // the stage is refilled next; the partials are complete at the row's end
      if (rr == rounds - 1) {
        gather_dx(dx + row * d, s_part, slots, 1, d, tuples, entries);
        __syncthreads();  // s_x and s_part are rewritten next
      }
      step(row, rr);
      buf ^= 1;
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  }
}
