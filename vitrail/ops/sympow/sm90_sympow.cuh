// sympow forward and backward: the tiled symmetric power written to (read from) memory.
//
// Why: power attention's feature map; both kernels are bound by the expanded tensor's bytes,
// so each thread moves 16-byte vectors and the index arithmetic stays in 32 bits.
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

// One thread per VEC consecutive output features of one row; a group (one tuple, leading
// digits fixed) is TILE features that share the product of their leading factors.
extern "C" __global__ void __launch_bounds__(256)
sympow_fwd(T* __restrict__ z, const T* __restrict__ x, const int* __restrict__ gidx,
           const float* __restrict__ gcoef, long long rows, int d, int D, float scale) {
  using namespace sympow_detail;
  const unsigned chunks = D / VEC;
  const unsigned long long total = (unsigned long long)rows * chunks;
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
       i < total; i += stride) {
    unsigned long long row;
    unsigned k0;
    if (total < (1ull << 32)) {  // 32-bit division where it fits
      row = (unsigned)i / chunks;
      k0 = ((unsigned)i - (unsigned)row * chunks) * VEC;
    } else {
      row = i / chunks;
      k0 = (unsigned)(i - row * chunks) * VEC;
    }
    const T* xr = x + row * d;
    Vec<VEC> out;
    float prefix = 0.f;
    unsigned last = 0;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const unsigned k = k0 + e;
      if (e == 0 || k % TILE == 0) {
        const unsigned g = k / TILE;
        const unsigned packed = (unsigned)__ldg(gidx + g);
        prefix = __ldg(gcoef + g) * scale;
#pragma unroll
        for (int l = 0; l < POW - 1; ++l) prefix *= to_f(xr[(packed >> (8 * l)) & 255u]);
        last = packed >> 24;
      }
      out.v[e] = from_f<T>(prefix * to_f(xr[last + k % TILE]));
    }
    *reinterpret_cast<Vec<VEC>*>(z + row * D + k0) = out;
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
