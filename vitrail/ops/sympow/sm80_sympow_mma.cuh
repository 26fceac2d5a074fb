// Fused sympow matmuls: sympow_mma (expand K or M) and mma_sympow_bwd, never storing the
// expanded operand.
//
// Why: power attention multiplies by sympow(a), which is C(n+p-1,p) t^p / d times larger than
// a. Each CTA builds its 64 x 64 tile of the expanded operand in shared memory from the
// d-feature input tile it holds (or, backward, contracts a 64 x 64 tile of gradients against
// it), and feeds tensor cores: SM80 mma.sync m16n8k16 (HMMA) for half and bfloat16, fp32 FMA
// for float. (On sm_90a, sympow_mma takes sm90_sympow_mma.cuh's wgmma kernels where they apply.)
//
// Statics: T_ID, POW, TILE (see sympow_common.cuh). CTA tile BM = BN = BK = 64, 256 threads
// (8 warps, 2 x 4, each 32 x 16 of the output tile).
// Constraints (configs.py): d <= 256, TILE divides d and 64; contiguous row-major operands;
// `*_vec` flags say a matrix may be read in 16-byte vectors (row length * sizeof(T) and its
// address multiples of 16), otherwise elements are read one by one.
#pragma once
// (sympow_common.cuh comes first)

namespace smma {
using namespace sympow_detail;
constexpr int BM = 64, BN = 64, BK = 64, THREADS = 256;
// CTAs an SM must hold, each kernel's __launch_bounds__' second argument: ptxas then allocates
// against 65536 / (256 x CTAs) registers a thread (3: 80, 2: 128, 1: 255) instead of an
// occupancy tier of its own choosing, which moved between NVRTC releases and spilled. 0 leaves
// the choice to ptxas: sympow_mma_m in 16-bit types spilled at 3 CTAs, ran 20% slower at 2, and
// its own choice spills on no NVRTC 13.0-13.5. The backward kernels use up to 94 registers in
// 16-bit types; fp32's spilled at 128.
constexpr bool F32 = sizeof(T) == 4;
constexpr int FWD_K_CTAS = F32 ? 2 : 3;  // sympow_mma_k
constexpr int FWD_M_CTAS = F32 ? 2 : 0;  // sympow_mma_m
constexpr int BWD_CTAS = F32 ? 1 : 2;    // mma_sympow_bwd_k, mma_sympow_bwd_m
constexpr int PAD = T_ID == 0 ? 4 : 8;
constexpr int LDA = BK + PAD;  // sA [BM][LDA]: row m, column k
constexpr int LDB = BN + PAD;  // sB [BK][LDB]: row k, column n
constexpr int LDG = BN + 1;    // sG [64][LDG] float
constexpr int GPT = BK / TILE; // groups per 64-feature tile
static_assert(BK % TILE == 0, "TILE must divide 64");

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ int align16(int bytes) { return (bytes + 15) & ~15; }

// ---- global -> shared tile loads (nrows x 64 elements of T) ----
// Rows [row0, row0 + nrows) and columns [col0, col0 + 64) of a row-major matrix with `ld`
// elements per row, `rows` x `cols` valid; the rest is zero. vec: 16-byte cp.async (the caller
// waits with wait_loads() and a barrier), else element by element.
__device__ __forceinline__ void load_tile(T* s, int lds, const T* g, long long ld, long long row0,
                                          long long col0, long long rows, long long cols,
                                          bool vec, int nrows = 64) {
  if (vec) {
    constexpr int E = 16 / sizeof(T);
    for (int i = threadIdx.x; i < nrows * (64 / E); i += THREADS) {
      const int r = i / (64 / E), c = (i % (64 / E)) * E;
      const bool ok = row0 + r < rows && col0 + c < cols;
      const T* src = ok ? g + (row0 + r) * ld + col0 + c : g;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(s + r * lds + c)),
                   "l"(src), "r"(ok ? 16 : 0));
    }
    asm volatile("cp.async.commit_group;\n" ::);
  } else {
    for (int i = threadIdx.x; i < nrows * 64; i += THREADS) {
      const int r = i / 64, c = i % 64;
      const bool ok = row0 + r < rows && col0 + c < cols;
      s[r * lds + c] = ok ? g[(row0 + r) * ld + col0 + c] : from_f<T>(0.f);
    }
  }
}
// Two neighbouring elements of shared memory as floats, and back.
__device__ __forceinline__ float2 load2(const T* p) {
#if T_ID == 0
  return *reinterpret_cast<const float2*>(p);
#elif T_ID == 1
  return __half22float2(*reinterpret_cast<const __half2*>(p));
#else
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
#endif
}
__device__ __forceinline__ void store2(T* p, float a, float b) {
#if T_ID == 0
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
#elif T_ID == 1
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
#else
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
#endif
}
__device__ __forceinline__ void wait_loads() { asm volatile("cp.async.wait_group 0;\n" ::); }

// ---- the 64 x 64 x 64 tile product: acc += sA @ sB ----
#if T_ID != 0
struct Acc { float c[2][2][4]; };
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const T* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const T* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void hmma(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                    unsigned b1) {
#if T_ID == 1
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#else
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#endif
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void zero(Acc& acc) {
#pragma unroll
  for (int i = 0; i < 16; ++i) (&acc.c[0][0][0])[i] = 0.f;
}
__device__ __forceinline__ void mma_tile(Acc& acc, const T* sA, const T* sB) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = (warp / 4) * 32, wn = (warp % 4) * 16;
#pragma unroll
  for (int kk = 0; kk < BK; kk += 16) {
    unsigned a[2][4], b[4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
      ldsm_x4(a[mi], sA + (wm + mi * 16 + lane % 16) * LDA + kk + (lane / 16) * 8);
    ldsm_x4_t(b, sB + (kk + lane % 16) * LDB + wn + (lane / 16) * 8);
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 2; ++ni) hmma(acc.c[mi][ni], a[mi], b[2 * ni], b[2 * ni + 1]);
  }
}
// f(row, col, v): every accumulator with its place in the 64 x 64 tile.
template <class F>
__device__ __forceinline__ void for_each(const Acc& acc, F f) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = (warp / 4) * 32, wn = (warp % 4) * 16;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 2; ++ni) {
      const int r = wm + mi * 16 + lane / 4, c = wn + ni * 8 + 2 * (lane % 4);
      f(r, c, acc.c[mi][ni][0]);
      f(r, c + 1, acc.c[mi][ni][1]);
      f(r + 8, c, acc.c[mi][ni][2]);
      f(r + 8, c + 1, acc.c[mi][ni][3]);
    }
}
#else
struct Acc { float c[4][4]; };
__device__ __forceinline__ void zero(Acc& acc) {
#pragma unroll
  for (int i = 0; i < 16; ++i) (&acc.c[0][0])[i] = 0.f;
}
__device__ __forceinline__ void mma_tile(Acc& acc, const T* sA, const T* sB) {
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll 8
  for (int k = 0; k < BK; ++k) {
    float a[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = sA[(ty * 4 + i) * LDA + k];
    const float4 b = *reinterpret_cast<const float4*>(sB + k * LDB + tx * 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc.c[i][0] += a[i] * b.x; acc.c[i][1] += a[i] * b.y;
      acc.c[i][2] += a[i] * b.z; acc.c[i][3] += a[i] * b.w;
    }
  }
}
template <class F>
__device__ __forceinline__ void for_each(const Acc& acc, F f) {
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) f(ty * 4 + i, tx * 4 + j, acc.c[i][j]);
}
#endif

__device__ __forceinline__ unsigned lead_index(unsigned packed, int l) {
  return (packed >> (8 * l)) & 255u;
}
}  // namespace smma

// Each mainloop below is two-stage: the tiles of step s+1 are on their way (cp.async) while
// step s builds its expanded tile and multiplies. One barrier at the top of a step makes the
// step's tiles visible and retires the previous step's readers of the buffers refilled next.

// C[P, M, N] = (sympow(A[P, M, d] along its rows) * scale) @ B[P, D, N]   (expand K)
extern "C" __global__ void __launch_bounds__(256, smma::FWD_K_CTAS)
sympow_mma_k(T* __restrict__ C, const T* __restrict__ A, const T* __restrict__ B,
             const int* __restrict__ gidx, const float* __restrict__ gcoef, int M, int N, int d,
             int D, long long groups, float scale, int b_vec) {
  using namespace smma;
  extern __shared__ __align__(16) char smem[];
  const long long p = blockIdx.x;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.z * BN, ldx = d + 1;
  float* sX = reinterpret_cast<float*>(smem);  // [BM][d + 1]: the rows being expanded
  T* sA = reinterpret_cast<T*>(smem + align16(BM * ldx * 4));
  T* sB = sA + BM * LDA;  // two stages
  const T* Bp = B + p * D * N;
  const int nK = (D + BK - 1) / BK;
  load_tile(sB, LDB, Bp, N, 0, n0, D, N, b_vec);
  const T* Ap = A + p * M * d;
  for (int i = threadIdx.x; i < BM * d; i += THREADS) {
    const int r = i / d, c = i - r * d;
    sX[r * ldx + c] = m0 + r < M ? to_f(Ap[(long long)(m0 + r) * d + c]) : 0.f;
  }
  Acc acc;
  zero(acc);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int m = (warp & 1) * 32 + lane;
  const float* xr = sX + m * ldx;
  constexpr int SV = (TILE * sizeof(T) >= 16) ? 16 / sizeof(T) : TILE;  // elements per store
  for (int kt = 0; kt < nK; ++kt) {
    const int cur = kt & 1;
    wait_loads();
    __syncthreads();
    if (kt + 1 < nK)
      load_tile(sB + (cur ^ 1) * BK * LDB, LDB, Bp, N, (long long)(kt + 1) * BK, n0, D, N, b_vec);
    for (int gl = warp >> 1; gl < GPT; gl += THREADS / 64) {  // lanes: rows; warps: groups
      const long long g = (long long)kt * GPT + gl;
      const bool ok = g < groups;
      const unsigned packed = ok ? (unsigned)__ldg(gidx + g) : 0u;
      float prefix = ok ? __ldg(gcoef + g) * scale : 0.f;
#pragma unroll
      for (int l = 0; l < POW - 1; ++l) prefix *= xr[lead_index(packed, l)];
      const float* xl = xr + (packed >> 24);
#pragma unroll
      for (int b = 0; b < TILE; b += SV) {
        Vec<SV> v;
#pragma unroll
        for (int j = 0; j < SV; ++j) v.v[j] = from_f<T>(prefix * xl[b + j]);
        *reinterpret_cast<Vec<SV>*>(sA + m * LDA + gl * TILE + b) = v;
      }
    }
    __syncthreads();
    mma_tile(acc, sA, sB + cur * BK * LDB);
  }
  T* Cp = C + p * M * N;
  for_each(acc, [&](int r, int c, float v) {
    if (m0 + r < M && n0 + c < N) Cp[(long long)(m0 + r) * N + n0 + c] = from_f<T>(v);
  });
}

// C[P, D, N] = (sympow(A[P, d, K] along its columns) * scale) @ B[P, K, N]   (expand M)
extern "C" __global__ void __launch_bounds__(256, smma::FWD_M_CTAS)
sympow_mma_m(T* __restrict__ C, const T* __restrict__ A, const T* __restrict__ B,
             const int* __restrict__ gidx, const float* __restrict__ gcoef, int K, int N, int d,
             int D, long long groups, float scale, int a_vec, int b_vec) {
  using namespace smma;
  extern __shared__ __align__(16) char smem[];
  const long long p = blockIdx.x;
  const int f0 = blockIdx.y * BM, n0 = blockIdx.z * BN;
  T* sX = reinterpret_cast<T*>(smem);  // two stages of [d][BK]: the columns being expanded
  T* sA = sX + 2 * d * BK;
  T* sB = sA + BM * LDA;               // two stages
  int* sGi = reinterpret_cast<int*>(sB + 2 * BK * LDB);
  float* sGc = reinterpret_cast<float*>(sGi + BK);
  if (threadIdx.x < GPT) {  // this CTA's groups, the same for every step
    const long long g = (long long)blockIdx.y * GPT + threadIdx.x;
    sGi[threadIdx.x] = g < groups ? gidx[g] : 0;
    sGc[threadIdx.x] = g < groups ? gcoef[g] * scale : 0.f;
  }
  const T* Ap = A + p * d * K;
  const T* Bp = B + p * K * N;
  const int nK = (K + BK - 1) / BK;
  load_tile(sX, BK, Ap, K, 0, 0, d, K, a_vec, d);
  load_tile(sB, LDB, Bp, N, 0, n0, K, N, b_vec);
  Acc acc;
  zero(acc);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int kt = 0; kt < nK; ++kt) {
    const int cur = kt & 1;
    wait_loads();
    __syncthreads();
    if (kt + 1 < nK) {
      const long long k1 = (long long)(kt + 1) * BK;
      load_tile(sX + (cur ^ 1) * d * BK, BK, Ap, K, 0, k1, d, K, a_vec, d);
      load_tile(sB + (cur ^ 1) * BK * LDB, LDB, Bp, N, k1, n0, K, N, b_vec);
    }
    const T* xs = sX + cur * d * BK + 2 * lane;
    for (int gl = warp; gl < GPT; gl += THREADS / 32) {  // lanes: column pairs; warps: groups
      const unsigned packed = (unsigned)sGi[gl];
      float2 prefix = make_float2(sGc[gl], sGc[gl]);
#pragma unroll
      for (int l = 0; l < POW - 1; ++l) {
        const float2 x = load2(xs + lead_index(packed, l) * BK);
        prefix.x *= x.x;
        prefix.y *= x.y;
      }
      const T* xl = xs + (packed >> 24) * BK;
#pragma unroll
      for (int b = 0; b < TILE; ++b) {
        const float2 x = load2(xl + b * BK);
        store2(sA + (gl * TILE + b) * LDA + 2 * lane, prefix.x * x.x, prefix.y * x.y);
      }
    }
    __syncthreads();
    mma_tile(acc, sA, sB + cur * BK * LDB);
  }
  T* Cp = C + p * D * N;
  for_each(acc, [&](int r, int c, float v) {
    if (f0 + r < D && n0 + c < N) Cp[(long long)(f0 + r) * N + n0 + c] = from_f<T>(v);
  });
}

namespace smma {
// Adds TILE values to acc[last + b] (stride `step` apart) and clears them.
__device__ __forceinline__ void flush(float* acc, int step, unsigned last, float (&v)[TILE]) {
#pragma unroll
  for (int b = 0; b < TILE; ++b) {
    atomicAdd(acc + (last + b) * step, v[b]);
    v[b] = 0.f;
  }
}
}  // namespace smma

// dc[P, M, d] = gradient wrt c of <sympow(c[P, M, d] along rows) * scale, a[P, M, n] @ b[P, n, D]>
extern "C" __global__ void __launch_bounds__(256, smma::BWD_CTAS)
mma_sympow_bwd_k(T* __restrict__ dc, const T* __restrict__ c, const T* __restrict__ a,
                 const T* __restrict__ b, const int* __restrict__ gidx,
                 const float* __restrict__ gcoef, int M, int n, int d, int D, long long groups,
                 float scale, int a_vec, int b_vec) {
  using namespace smma;
  extern __shared__ __align__(16) char smem[];
  const long long p = blockIdx.x;
  const int m0 = blockIdx.y * BM, ldx = d + 1;
  float* sX = reinterpret_cast<float*>(smem);  // [BM][d + 1]: c's rows
  float* sAcc = sX + BM * ldx;                 // [BM][d + 1]: their gradient
  float* sG = reinterpret_cast<float*>(smem + align16(2 * BM * ldx * 4));  // [64][LDG]
  T* sA = reinterpret_cast<T*>(sG + 64 * LDG + 4);
  sA = reinterpret_cast<T*>((reinterpret_cast<size_t>(sA) + 15) & ~size_t(15));  // two stages
  T* sB = sA + 2 * BM * LDA;                                                      // two stages
  const T* Ap = a + p * M * n;
  const T* Bp = b + p * n * D;
  const int nF = (D + BK - 1) / BK, nN = (n + BK - 1) / BK, steps = nF * nN;
  const bool a_resident = nN == 1;  // a's tile is the same for every feature tile
  load_tile(sA, LDA, Ap, n, m0, 0, M, n, a_vec);
  load_tile(sB, LDB, Bp, D, 0, 0, n, D, b_vec);
  const T* cp = c + p * M * d;
  for (int i = threadIdx.x; i < BM * d; i += THREADS) {
    const int r = i / d, col = i - r * d;
    sX[r * ldx + col] = m0 + r < M ? to_f(cp[(long long)(m0 + r) * d + col]) : 0.f;
    sAcc[r * ldx + col] = 0.f;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int m = (warp & 1) * 32 + lane;
  const float* xr = sX + m * ldx;
  float* accr = sAcc + m * ldx;
  constexpr int PER = GPT / 4;  // groups per warp pair: consecutive, so a tuple's last-factor
                                // gradients gather in registers before one flush
  Acc acc;
  for (int s = 0; s < steps; ++s) {
    const int ft = s / nN, nt = s - ft * nN, cur = s & 1;
    wait_loads();
    __syncthreads();
    if (s + 1 < steps) {
      const int ft1 = (s + 1) / nN, nt1 = (s + 1) - ft1 * nN;
      if (!a_resident)
        load_tile(sA + (cur ^ 1) * BM * LDA, LDA, Ap, n, m0, (long long)nt1 * BK, M, n, a_vec);
      load_tile(sB + (cur ^ 1) * BK * LDB, LDB, Bp, D, (long long)nt1 * BK, (long long)ft1 * BK,
                n, D, b_vec);
    }
    if (nt == 0) zero(acc);
    mma_tile(acc, sA + (a_resident ? 0 : cur) * BM * LDA, sB + cur * BK * LDB);
    if (nt != nN - 1) continue;
    for_each(acc, [&](int r, int col, float v) { sG[r * LDG + col] = v; });
    __syncthreads();
    float lastg[TILE];
#pragma unroll
    for (int bb = 0; bb < TILE; ++bb) lastg[bb] = 0.f;
    unsigned held = 0xFFFFFFFFu;  // the last-factor tile whose gradients lastg holds
    for (int gl = (warp >> 1) * PER; gl < (warp >> 1) * PER + PER; ++gl) {  // lanes: rows
      const long long g = (long long)ft * GPT + gl;
      if (g >= groups) break;
      const unsigned packed = (unsigned)__ldg(gidx + g);
      const float coef = __ldg(gcoef + g) * scale;
      const unsigned last = packed >> 24;
      if (last != held) {
        if (held != 0xFFFFFFFFu) flush(accr, 1, held, lastg);
        held = last;
      }
      float xs[POW > 1 ? POW - 1 : 1];
      float lead = coef;
#pragma unroll
      for (int l = 0; l < POW - 1; ++l) {
        xs[l] = xr[lead_index(packed, l)];
        lead *= xs[l];
      }
      const float* gr = sG + m * LDG + gl * TILE;
      float dot = 0.f;
#pragma unroll
      for (int bb = 0; bb < TILE; ++bb) {
        lastg[bb] += gr[bb] * lead;
        dot += gr[bb] * xr[last + bb];
      }
#pragma unroll
      for (int l = 0; l < POW - 1; ++l) {
        float v = coef * dot;
#pragma unroll
        for (int o = 0; o < POW - 1; ++o)
          if (o != l) v *= xs[o];
        atomicAdd(accr + lead_index(packed, l), v);
      }
    }
    if (held != 0xFFFFFFFFu) flush(accr, 1, held, lastg);
  }
  __syncthreads();
  T* out = dc + p * M * d;
  for (int i = threadIdx.x; i < BM * d; i += THREADS) {
    const int r = i / d, col = i - r * d;
    if (m0 + r < M) out[(long long)(m0 + r) * d + col] = from_f<T>(sAcc[r * ldx + col]);
  }
}

// dc[P, d, K] = gradient wrt c of <sympow(c[P, d, K] along columns) * scale, a[P, D, n] @ b[P, n, K]>
extern "C" __global__ void __launch_bounds__(256, smma::BWD_CTAS)
mma_sympow_bwd_m(T* __restrict__ dc, const T* __restrict__ c, const T* __restrict__ a,
                 const T* __restrict__ b, const int* __restrict__ gidx,
                 const float* __restrict__ gcoef, int K, int n, int d, int D, long long groups,
                 float scale, int a_vec, int b_vec) {
  using namespace smma;
  extern __shared__ __align__(16) char smem[];
  const long long p = blockIdx.x;
  const int k0 = blockIdx.y * BK;
  float* sX = reinterpret_cast<float*>(smem);  // [d][BK]: c's columns
  float* sAcc = sX + d * BK;                   // [d][BK]: their gradient
  float* sG = sAcc + d * BK;                   // [64][LDG]
  T* sA = reinterpret_cast<T*>(sG + 64 * LDG + 4);
  sA = reinterpret_cast<T*>((reinterpret_cast<size_t>(sA) + 15) & ~size_t(15));  // two stages
  T* sB = sA + 2 * BM * LDA;                                                      // two stages
  const T* Ap = a + p * D * n;
  const T* Bp = b + p * n * K;
  const int nF = (D + BM - 1) / BM, nN = (n + BK - 1) / BK, steps = nF * nN;
  const bool b_resident = nN == 1;  // b's tile is the same for every feature tile
  load_tile(sA, LDA, Ap, n, 0, 0, D, n, a_vec);
  load_tile(sB, LDB, Bp, K, 0, k0, n, K, b_vec);
  const T* cp = c + p * d * K;
  for (int i = threadIdx.x; i < d * BK; i += THREADS) {
    const int r = i / BK, col = i % BK;
    sX[i] = k0 + col < K ? to_f(cp[(long long)r * K + k0 + col]) : 0.f;
    sAcc[i] = 0.f;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int PER = GPT >= 8 ? GPT / 8 : 1;  // consecutive groups per warp
  Acc acc;
  for (int s = 0; s < steps; ++s) {
    const int ft = s / nN, nt = s - ft * nN, cur = s & 1;
    wait_loads();
    __syncthreads();
    if (s + 1 < steps) {
      const int ft1 = (s + 1) / nN, nt1 = (s + 1) - ft1 * nN;
      load_tile(sA + (cur ^ 1) * BM * LDA, LDA, Ap, n, (long long)ft1 * BM, (long long)nt1 * BK,
                D, n, a_vec);
      if (!b_resident)
        load_tile(sB + (cur ^ 1) * BK * LDB, LDB, Bp, K, (long long)nt1 * BK, k0, n, K, b_vec);
    }
    if (nt == 0) zero(acc);
    mma_tile(acc, sA + cur * BM * LDA, sB + (b_resident ? 0 : cur) * BK * LDB);
    if (nt != nN - 1) continue;
    for_each(acc, [&](int r, int col, float v) { sG[r * LDG + col] = v; });
    __syncthreads();
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {  // lanes: columns 2 * lane + cc; warps: groups
      const int col = 2 * lane + cc;
      float lastg[TILE];
#pragma unroll
      for (int bb = 0; bb < TILE; ++bb) lastg[bb] = 0.f;
      unsigned held = 0xFFFFFFFFu;
      for (int gl = warp * PER; gl < warp * PER + PER && gl < GPT; ++gl) {
        const long long g = (long long)ft * GPT + gl;
        if (g >= groups) break;
        const unsigned packed = (unsigned)__ldg(gidx + g);
        const float coef = __ldg(gcoef + g) * scale;
        const unsigned last = packed >> 24;
        if (last != held) {
          if (held != 0xFFFFFFFFu) flush(sAcc + col, BK, held, lastg);
          held = last;
        }
        float xs[POW > 1 ? POW - 1 : 1];
        float lead = coef;
#pragma unroll
        for (int l = 0; l < POW - 1; ++l) {
          xs[l] = sX[lead_index(packed, l) * BK + col];
          lead *= xs[l];
        }
        float dot = 0.f;
#pragma unroll
        for (int bb = 0; bb < TILE; ++bb) {
          const float gv = sG[(gl * TILE + bb) * LDG + col];
          lastg[bb] += gv * lead;
          dot += gv * sX[(last + bb) * BK + col];
        }
#pragma unroll
        for (int l = 0; l < POW - 1; ++l) {
          float v = coef * dot;
#pragma unroll
          for (int o = 0; o < POW - 1; ++o)
            if (o != l) v *= xs[o];
          atomicAdd(sAcc + lead_index(packed, l) * BK + col, v);
        }
      }
      if (held != 0xFFFFFFFFu) flush(sAcc + col, BK, held, lastg);
    }
  }
  __syncthreads();
  T* out = dc + p * d * K;
  for (int i = threadIdx.x; i < d * BK; i += THREADS) {
    const int r = i / BK, col = i % BK;
    if (k0 + col < K) out[(long long)r * K + k0 + col] = from_f<T>(sAcc[i]);
  }
}
