// vitrail/tprod.cuh: the tensor product of register fragments, and its gradient.
//
// Why it exists: the symmetric-power kernels (vitrail/ops/sympow) build each block of their
// expanded operand as x[i1] (x) x[i2] (x) ... (x) x[ip] of small register fragments, and their
// backward passes contract a block of gradients against the same product. Written once here,
// fully unrolled at compile time, so every index is a constant and every fragment stays in
// registers.
//
// Order: the first factor's index is the most significant (row-major), so for fragments of N
// values, out[((a1 * N) + a2) * N + ... + ap] = x[0][a1] * x[1][a2] * ... * x[p-1][ap].
// Plain arrays (no CuTe dependency) so the header compiles under NVRTC as well as nvcc.
#pragma once

namespace vitrail {

// N^P at compile time.
template <int N, int P>
struct ipow { static constexpr int value = N * ipow<N, P - 1>::value; };
template <int N>
struct ipow<N, 0> { static constexpr int value = 1; };

// Digit l (0 = most significant) of e written in base N with P digits.
// (Loop-free, so that it folds to a constant wherever e and l are constants after unrolling.)
__host__ __device__ constexpr int ipow_c(int n, int k) { return k <= 0 ? 1 : n * ipow_c(n, k - 1); }
template <int N, int P>
__host__ __device__ __forceinline__ constexpr int tprod_digit(int e, int l) {
  return (e / ipow_c(N, P - 1 - l)) % N;
}

// out = scale * x (x) y  (out[i * N2 + j] = scale * x[i] * y[j]).
template <int N1, int N2, class T>
__device__ __forceinline__ void tprod(T (&out)[N1 * N2], const T (&x)[N1], const T (&y)[N2],
                                      T scale = T(1)) {
#pragma unroll
  for (int i = 0; i < N1; ++i) {
    T xi = scale * x[i];
#pragma unroll
    for (int j = 0; j < N2; ++j) out[i * N2 + j] = xi * y[j];
  }
}

// out = scale * x[0] (x) x[1] (x) ... (x) x[P-1], each fragment N values: N^P outputs.
template <int P, int N, class T>
__device__ __forceinline__ void tprod_pow(T (&out)[ipow<N, P>::value], const T (&x)[P][N],
                                          T scale = T(1)) {
#pragma unroll
  for (int e = 0; e < ipow<N, P>::value; ++e) {
    T v = scale;
#pragma unroll
    for (int l = 0; l < P; ++l) v *= x[l][tprod_digit<N, P>(e, l)];
    out[e] = v;
  }
}

// The gradient of out = scale * x[0] (x) ... (x) x[P-1] with respect to each fragment, added to
// dx: dx[l][a] += scale * sum over e with digit l == a of dout[e] * prod_{l' != l} x[l'][digit l'].
// (Fragments are independent variables here; a caller whose factors alias one tensor adds the
// dx rows into the same place.)
template <int P, int N, class T>
__device__ __forceinline__ void tprod_pow_bwd(T (&dx)[P][N], const T (&x)[P][N],
                                              const T (&dout)[ipow<N, P>::value],
                                              T scale = T(1)) {
#pragma unroll
  for (int e = 0; e < ipow<N, P>::value; ++e) {
    T g = scale * dout[e];
#pragma unroll
    for (int l = 0; l < P; ++l) {
      T v = g;
#pragma unroll
      for (int m = 0; m < P; ++m)
        if (m != l) v *= x[m][tprod_digit<N, P>(e, m)];
      dx[l][tprod_digit<N, P>(e, l)] += v;
    }
  }
}

// The same gradient with the block streamed a row at a time (P <= 4): load_row(lead, row)
// fills the N outputs whose leading P-1 digits spell `lead` (out[lead * N + b], b < N), so a
// large block never sits in registers whole. The leading digits are loop counters of nested
// unrolled loops, so every fragment index is a compile-time constant (a digit computed from
// `lead` by division is not reliably folded, and the fragments would spill to local memory).
template <int P, int N, class T, class LoadRow>
__device__ __forceinline__ void tprod_pow_bwd_rows(T (&dx)[P][N], const T (&x)[P][N],
                                                   LoadRow&& load_row, T scale = T(1)) {
  static_assert(P >= 1 && P <= 4, "tprod_pow_bwd_rows: P from 1 to 4");
  constexpr int L0 = P > 1 ? N : 1, L1 = P > 2 ? N : 1, L2 = P > 3 ? N : 1;
#pragma unroll
  for (int a0 = 0; a0 < L0; ++a0)
#pragma unroll
    for (int a1 = 0; a1 < L1; ++a1)
#pragma unroll
      for (int a2 = 0; a2 < L2; ++a2) {
        T row[N];
        load_row((a0 * L1 + a1) * L2 + a2, row);
        const T f0 = P > 1 ? x[0][a0] : T(1);
        const T f1 = P > 2 ? x[P > 2 ? 1 : 0][a1] : T(1);
        const T f2 = P > 3 ? x[P > 3 ? 2 : 0][a2] : T(1);
        const T lead = scale * f0 * f1 * f2;
        T dot = T(0);
#pragma unroll
        for (int b = 0; b < N; ++b) {
          dx[P - 1][b] += row[b] * lead;
          dot += row[b] * x[P - 1][b];
        }
        dot *= scale;
        if (P > 1) dx[0][a0] += dot * f1 * f2;
        if (P > 2) dx[P > 2 ? 1 : 0][a1] += dot * f0 * f2;
        if (P > 3) dx[P > 3 ? 2 : 0][a2] += dot * f0 * f1;
      }
}

}  // namespace vitrail
