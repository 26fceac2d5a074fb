// Fused sympow matmuls: sympow_mma (expand K or M) and mma_sympow_bwd, never storing the
// expanded operand.
//
// Why: power attention multiplies by sympow(a), which is C(n+p-1,p) t^p / d times larger than
// a. Each CTA builds its 64 x 64 tile of the expanded operand in shared memory from the
// d-feature input tile it holds (or, backward, contracts a 64 x 64 tile of gradients against
// it), and feeds tensor cores: SM80 mma.sync m16n8k16 (HMMA) for half and bfloat16, fp32 FMA
// for float. (Not yet wgmma: the next step for sm_90a.)
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

// ---- global -> shared tile loads (64 x 64 elements of T) ----
// Rows [row0, row0 + 64) and columns [col0, col0 + 64) of a row-major matrix with `ld`
// elements per row, `rows` x `cols` valid; the rest is zero.
__device__ __forceinline__ void load_tile(T* s, int lds, const T* g, long long ld, long long row0,
                                          long long col0, long long rows, long long cols,
                                          bool vec) {
  if (vec) {
    constexpr int E = 16 / sizeof(T);
    for (int i = threadIdx.x; i < 64 * 64 / E; i += THREADS) {
      const int r = i / (64 / E), c = (i % (64 / E)) * E;
      const bool ok = row0 + r < rows && col0 + c < cols;
      const T* src = ok ? g + (row0 + r) * ld + col0 + c : g;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(s + r * lds + c)),
                   "l"(src), "r"(ok ? 16 : 0));
    }
    asm volatile("cp.async.commit_group;\n" ::);
  } else {
    for (int i = threadIdx.x; i < 64 * 64; i += THREADS) {
      const int r = i / 64, c = i % 64;
      const bool ok = row0 + r < rows && col0 + c < cols;
      s[r * lds + c] = ok ? g[(row0 + r) * ld + col0 + c] : from_f<T>(0.f);
    }
  }
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

// The group table entries of 64-feature tile `ft` (coefficient 0 past the last group).
__device__ __forceinline__ void load_groups(int* sGi, float* sGc, const int* gidx,
                                            const float* gcoef, long long ft, long long groups,
                                            float scale) {
  if (threadIdx.x < GPT) {
    const long long g = ft * GPT + threadIdx.x;
    sGi[threadIdx.x] = g < groups ? gidx[g] : 0;
    sGc[threadIdx.x] = g < groups ? gcoef[g] * scale : 0.f;
  }
}
__device__ __forceinline__ unsigned lead_index(unsigned packed, int l) {
  return (packed >> (8 * l)) & 255u;
}
}  // namespace smma

// C[P, M, N] = (sympow(A[P, M, d] along its rows) * scale) @ B[P, D, N]   (expand K)
extern "C" __global__ void __launch_bounds__(256)
sympow_mma_k(T* __restrict__ C, const T* __restrict__ A, const T* __restrict__ B,
             const int* __restrict__ gidx, const float* __restrict__ gcoef, int M, int N, int d,
             int D, long long groups, float scale, int b_vec) {
  using namespace smma;
  extern __shared__ __align__(16) char smem[];
  const long long p = blockIdx.x;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.z * BN, ldx = d + 1;
  float* sX = reinterpret_cast<float*>(smem);
  T* sA = reinterpret_cast<T*>(smem + align16(BM * ldx * 4));
  T* sB = sA + BM * LDA;
  int* sGi = reinterpret_cast<int*>(sB + BK * LDB);
  float* sGc = reinterpret_cast<float*>(sGi + BK);
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
  for (int kt = 0; kt * BK < D; ++kt) {
    load_tile(sB, LDB, B + p * D * N, N, (long long)kt * BK, n0, D, N, b_vec);
    load_groups(sGi, sGc, gidx, gcoef, kt, groups, scale);
    __syncthreads();
    for (int gl = warp >> 1; gl < GPT; gl += THREADS / 64) {  // lanes: rows; warps: groups
      const unsigned packed = (unsigned)sGi[gl];
      float prefix = sGc[gl];
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
    wait_loads();
    __syncthreads();
    mma_tile(acc, sA, sB);
    __syncthreads();
  }
  T* Cp = C + p * M * N;
  for_each(acc, [&](int r, int c, float v) {
    if (m0 + r < M && n0 + c < N) Cp[(long long)(m0 + r) * N + n0 + c] = from_f<T>(v);
  });
}

// C[P, D, N] = (sympow(A[P, d, K] along its columns) * scale) @ B[P, K, N]   (expand M)
extern "C" __global__ void __launch_bounds__(256)
sympow_mma_m(T* __restrict__ C, const T* __restrict__ A, const T* __restrict__ B,
             const int* __restrict__ gidx, const float* __restrict__ gcoef, int K, int N, int d,
             int D, long long groups, float scale, int b_vec) {
  using namespace smma;
  extern __shared__ __align__(16) char smem[];
  const long long p = blockIdx.x;
  const int f0 = blockIdx.y * BM, n0 = blockIdx.z * BN;
  float* sX = reinterpret_cast<float*>(smem);  // [d][BK]
  T* sA = reinterpret_cast<T*>(smem + align16(d * BK * 4));
  T* sB = sA + BM * LDA;
  int* sGi = reinterpret_cast<int*>(sB + BK * LDB);
  float* sGc = reinterpret_cast<float*>(sGi + BK);
  load_groups(sGi, sGc, gidx, gcoef, blockIdx.y, groups, scale);
  const T* Ap = A + p * d * K;
  Acc acc;
  zero(acc);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int kt = 0; kt * BK < K; ++kt) {
    const int k0 = kt * BK;
    load_tile(sB, LDB, B + p * K * N, N, k0, n0, K, N, b_vec);
    for (int i = threadIdx.x; i < d * BK; i += THREADS) {
      const int r = i / BK, c = i % BK;
      sX[i] = k0 + c < K ? to_f(Ap[(long long)r * K + k0 + c]) : 0.f;
    }
    __syncthreads();
    for (int gl = warp; gl < GPT; gl += THREADS / 32) {  // lanes: column pairs; warps: groups
      const unsigned packed = (unsigned)sGi[gl];
      float2 prefix = make_float2(sGc[gl], sGc[gl]);
#pragma unroll
      for (int l = 0; l < POW - 1; ++l) {
        const float2 x = *reinterpret_cast<const float2*>(sX + lead_index(packed, l) * BK + 2 * lane);
        prefix.x *= x.x;
        prefix.y *= x.y;
      }
      const float* xl = sX + (packed >> 24) * BK + 2 * lane;
#pragma unroll
      for (int b = 0; b < TILE; ++b) {
        const float2 x = *reinterpret_cast<const float2*>(xl + b * BK);
        T* dst = sA + (gl * TILE + b) * LDA + 2 * lane;
        dst[0] = from_f<T>(prefix.x * x.x);
        dst[1] = from_f<T>(prefix.y * x.y);
      }
    }
    wait_loads();
    __syncthreads();
    mma_tile(acc, sA, sB);
    __syncthreads();
  }
  T* Cp = C + p * D * N;
  for_each(acc, [&](int r, int c, float v) {
    if (f0 + r < D && n0 + c < N) Cp[(long long)(f0 + r) * N + n0 + c] = from_f<T>(v);
  });
}

// dc[P, M, d] = gradient wrt c of <sympow(c[P, M, d] along rows) * scale, a[P, M, n] @ b[P, n, D]>
extern "C" __global__ void __launch_bounds__(256)
mma_sympow_bwd_k(T* __restrict__ dc, const T* __restrict__ c, const T* __restrict__ a,
                 const T* __restrict__ b, const int* __restrict__ gidx,
                 const float* __restrict__ gcoef, int M, int n, int d, int D, long long groups,
                 float scale, int a_vec, int b_vec) {
  using namespace smma;
  extern __shared__ __align__(16) char smem[];
  const long long p = blockIdx.x;
  const int m0 = blockIdx.y * BM, ldx = d + 1;
  float* sX = reinterpret_cast<float*>(smem);
  float* sAcc = sX + BM * ldx;
  float* sG = reinterpret_cast<float*>(smem + align16(2 * BM * ldx * 4));
  T* sA = reinterpret_cast<T*>(sG + 64 * LDG + 4);
  sA = reinterpret_cast<T*>((reinterpret_cast<size_t>(sA) + 15) & ~size_t(15));
  T* sB = sA + BM * LDA;
  int* sGi = reinterpret_cast<int*>(sB + BK * LDB);
  float* sGc = reinterpret_cast<float*>(sGi + BK);
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
  for (int ft = 0; ft * BK < D; ++ft) {
    Acc acc;
    zero(acc);
    for (int nt = 0; nt * BK < n; ++nt) {
      load_tile(sA, LDA, a + p * M * n, n, m0, (long long)nt * BK, M, n, a_vec);
      load_tile(sB, LDB, b + p * n * D, D, (long long)nt * BK, (long long)ft * BK, n, D, b_vec);
      wait_loads();
      __syncthreads();
      mma_tile(acc, sA, sB);
      __syncthreads();
    }
    for_each(acc, [&](int r, int col, float v) { sG[r * LDG + col] = v; });
    load_groups(sGi, sGc, gidx, gcoef, ft, groups, scale);
    __syncthreads();
    for (int gl = warp >> 1; gl < GPT; gl += THREADS / 64) {  // lanes: rows; warps: groups
      const float coef = sGc[gl];
      if (coef == 0.f) continue;
      const unsigned packed = (unsigned)sGi[gl];
      float xs[POW > 1 ? POW - 1 : 1];
      float lead = coef;
#pragma unroll
      for (int l = 0; l < POW - 1; ++l) {
        xs[l] = xr[lead_index(packed, l)];
        lead *= xs[l];
      }
      const unsigned last = packed >> 24;
      const float* g = sG + m * LDG + gl * TILE;
      float dot = 0.f;
#pragma unroll
      for (int bb = 0; bb < TILE; ++bb) {
        atomicAdd(accr + last + bb, g[bb] * lead);
        dot += g[bb] * xr[last + bb];
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
    __syncthreads();
  }
  T* out = dc + p * M * d;
  for (int i = threadIdx.x; i < BM * d; i += THREADS) {
    const int r = i / d, col = i - r * d;
    if (m0 + r < M) out[(long long)(m0 + r) * d + col] = from_f<T>(sAcc[r * ldx + col]);
  }
}

// dc[P, d, K] = gradient wrt c of <sympow(c[P, d, K] along columns) * scale, a[P, D, n] @ b[P, n, K]>
extern "C" __global__ void __launch_bounds__(256)
mma_sympow_bwd_m(T* __restrict__ dc, const T* __restrict__ c, const T* __restrict__ a,
                 const T* __restrict__ b, const int* __restrict__ gidx,
                 const float* __restrict__ gcoef, int K, int n, int d, int D, long long groups,
                 float scale, int a_vec, int b_vec) {
  using namespace smma;
  extern __shared__ __align__(16) char smem[];
  const long long p = blockIdx.x;
  const int k0 = blockIdx.y * BK;
  float* sX = reinterpret_cast<float*>(smem);  // [d][BK]
  float* sAcc = sX + d * BK;
  float* sG = sAcc + d * BK;  // [64][LDG]
  T* sA = reinterpret_cast<T*>(sG + 64 * LDG + 4);
  sA = reinterpret_cast<T*>((reinterpret_cast<size_t>(sA) + 15) & ~size_t(15));
  T* sB = sA + BM * LDA;
  int* sGi = reinterpret_cast<int*>(sB + BK * LDB);
  float* sGc = reinterpret_cast<float*>(sGi + BK);
  const T* cp = c + p * d * K;
  for (int i = threadIdx.x; i < d * BK; i += THREADS) {
    const int r = i / BK, col = i % BK;
    sX[i] = k0 + col < K ? to_f(cp[(long long)r * K + k0 + col]) : 0.f;
    sAcc[i] = 0.f;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int ft = 0; ft * BM < D; ++ft) {
    Acc acc;
    zero(acc);
    for (int nt = 0; nt * BK < n; ++nt) {
      load_tile(sA, LDA, a + p * D * n, n, (long long)ft * BM, (long long)nt * BK, D, n, a_vec);
      load_tile(sB, LDB, b + p * n * K, K, (long long)nt * BK, k0, n, K, b_vec);
      wait_loads();
      __syncthreads();
      mma_tile(acc, sA, sB);
      __syncthreads();
    }
    for_each(acc, [&](int r, int col, float v) { sG[r * LDG + col] = v; });
    load_groups(sGi, sGc, gidx, gcoef, ft, groups, scale);
    __syncthreads();
    for (int gl = warp; gl < GPT; gl += THREADS / 32) {  // lanes: column pairs; warps: groups
      const float coef = sGc[gl];
      if (coef == 0.f) continue;
      const unsigned packed = (unsigned)sGi[gl];
      const unsigned last = packed >> 24;
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        const int col = 2 * lane + cc;
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
          const float g = sG[(gl * TILE + bb) * LDG + col];
          atomicAdd(sAcc + (last + bb) * BK + col, g * lead);
          dot += g * sX[(last + bb) * BK + col];
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
    }
    __syncthreads();
  }
  T* out = dc + p * d * K;
  for (int i = threadIdx.x; i < d * BK; i += THREADS) {
    const int r = i / BK, col = i % BK;
    if (k0 + col < K) out[(long long)r * K + k0 + col] = from_f<T>(sAcc[i]);
  }
}
