// tile_mma.cuh: matrix multiply-accumulate of a CTA's tiles into register fragments, on CuTe's
// MMA atoms.
//
//   using Mma = vitrail::TileMMA<T, 128, 256, 64, 2>;  // a 128 x 256 x 64 step, 2 warpgroups
//   Mma mma(thread);                                 // thread: 0 .. Mma::kThreads - 1
//   auto acc = mma.accumulators();                   // fp32, this thread's part of 128 x 256
//   Mma::zero(acc);
//   auto sA = Mma::tile_a(smem_a), sB = Mma::tile_b(smem_b);   // (rows, K, stages) views
//   mma.mma(sA(_, _, stage), sB(_, _, stage), acc);             // acc += A B^T, asynchronous
//   Mma::wait<1>(acc);                               // all but the last batch retired
//
// - TileMMA<T, M, N, K, WarpGroups, MajorA, MajorB> (sm_90a): Hopper's wgmma. A and B are tiles
//   in shared memory (SS) laid out as tile_a / tile_b say (the widest swizzle their contiguous
//   extent allows; what TMA writes with the same swizzle); or A comes from registers (RS,
//   `mma_rs`), e.g. the previous product converted to T with `as_a` (attention's P V).
//   WarpGroups split M (M / WarpGroups a multiple of 64). wgmma is asynchronous: `mma` fences
//   and commits one batch (a group in PTX); `wait<N>` leaves N batches in flight and fences the
//   accumulators, so that no read of them moves above the wait. An RS batch reads its A
//   registers while in flight: keep the fragment alive and untouched until a wait retires it
//   (`wait<N>(acc, a)` fences it too), or the compiler may reuse its registers early.
// - TileMMA80<T, M, N, K, Warps> (sm_80+): mma.sync over the same kind of tiles; operands move
//   from shared memory to registers with ldmatrix. Synchronous.
// T: __nv_bfloat16 or __half (or CuTe's bfloat16_t / half_t), or for TileMMA __nv_fp8_e4m3 /
// __nv_fp8_e5m2 (both operands K-major, K a multiple of 32); accumulators are fp32.
//
// NVRTC: compile with -default-device (CuTe's constexpr helpers carry no __device__).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/arch/mma_sm80.hpp>
#include <cute/arch/copy_sm75.hpp>
#include <cute/atom/mma_traits_sm80.hpp>
#include <cute/atom/copy_traits_sm75.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

namespace vitrail {

// CuTe's element type for T.
template <class T> struct CuteType { using type = T; };
template <> struct CuteType<__nv_bfloat16> { using type = cute::bfloat16_t; };
template <> struct CuteType<__half> { using type = cute::half_t; };
template <> struct CuteType<__nv_fp8_e4m3> { using type = cute::float_e4m3_t; };
template <> struct CuteType<__nv_fp8_e5m2> { using type = cute::float_e5m2_t; };
template <class T> using cute_t = typename CuteType<T>::type;

// Which extent of an operand tile is contiguous in shared memory: K (a row of A or of B^T) or
// M / N (a column).
enum class Major { K, MN };

namespace detail {
// The widest wgmma swizzle atom whose contiguous extent divides `extent` elements.
template <class T, Major major, int extent>
constexpr auto smem_atom() {
  using namespace cute;
  constexpr int bytes = extent * int(sizeof(T));
  if constexpr (major == Major::K) {
    if constexpr (bytes % 128 == 0) return GMMA::Layout_K_SW128_Atom<T>{};
    else if constexpr (bytes % 64 == 0) return GMMA::Layout_K_SW64_Atom<T>{};
    else if constexpr (bytes % 32 == 0) return GMMA::Layout_K_SW32_Atom<T>{};
    else return GMMA::Layout_K_INTER_Atom<T>{};
  } else {
    if constexpr (bytes % 128 == 0) return GMMA::Layout_MN_SW128_Atom<T>{};
    else if constexpr (bytes % 64 == 0) return GMMA::Layout_MN_SW64_Atom<T>{};
    else if constexpr (bytes % 32 == 0) return GMMA::Layout_MN_SW32_Atom<T>{};
    else return GMMA::Layout_MN_INTER_Atom<T>{};
  }
}
constexpr cute::GMMA::Major gmma_major(Major m) {
  return m == Major::K ? cute::GMMA::Major::K : cute::GMMA::Major::MN;
}
// Whether a tensor engine holds its elements (a register fragment) rather than pointing at them.
template <class Engine> constexpr bool owns_registers = false;
template <class T, auto N> constexpr bool owns_registers<cute::ArrayEngine<T, N>> = true;
}  // namespace detail

// The shared-memory layout of a Rows x Cols (x Stages) operand tile that wgmma reads: Rows is M
// (A) or N (B), Cols is K. Its swizzle atoms are stacked along the contiguous extent last, so a
// K-major tile with K * sizeof(T) == 128 is Rows rows of 128 bytes, 1024-byte swizzle periods in
// a row: what one TMA box of (K, Rows) with the 128-byte swizzle writes. Align each tile to 1024
// bytes.
template <class T, int Rows, int Cols, Major major = Major::K, int Stages = 1>
using SmemTile = decltype(cute::tile_to_shape(
    detail::smem_atom<cute_t<T>, major, major == Major::K ? Cols : Rows>(),
    cute::Shape<cute::Int<Rows>, cute::Int<Cols>, cute::Int<Stages>>{},
    cute::conditional_t<major == Major::K, cute::Step<cute::_1, cute::_2, cute::_3>,
                        cute::Step<cute::_2, cute::_1, cute::_3>>{}));

template <class T_, int M, int N, int K, int WarpGroups = 1, Major MajorA = Major::K,
          Major MajorB = Major::K>
struct TileMMA {
  using T = cute_t<T_>;
  static constexpr int kThreads = 128 * WarpGroups;
  static_assert(M % (64 * WarpGroups) == 0, "TileMMA: M must be a multiple of 64 x WarpGroups");
  static_assert(K * int(sizeof(T)) % 32 == 0,
                "TileMMA: K must be a multiple of 16 (of 32 for 8-bit T)");
  // One wgmma instruction: 64 rows of a warpgroup, as much of N as one instruction takes.
  using AtomShape = cute::Shape<cute::_64, cute::Int<N>, cute::Int<K>>;
  using OpSS = decltype(cute::SM90::GMMA::ss_op_selector<T, T, float, AtomShape,
                                                           detail::gmma_major(MajorA),
                                                           detail::gmma_major(MajorB)>());
  using OpRS = decltype(cute::SM90::GMMA::rs_op_selector<T, T, float, AtomShape,
                                                           cute::GMMA::Major::K,
                                                           detail::gmma_major(MajorB)>());
  using WarpGroupLayout = cute::Layout<cute::Shape<cute::Int<WarpGroups>, cute::_1, cute::_1>>;
  using TiledSS = decltype(cute::make_tiled_mma(OpSS{}, WarpGroupLayout{}));
  using TiledRS = decltype(cute::make_tiled_mma(OpRS{}, WarpGroupLayout{}));
  template <int Stages = 1> using LayoutA = SmemTile<T, M, K, MajorA, Stages>;
  template <int Stages = 1> using LayoutB = SmemTile<T, N, K, MajorB, Stages>;

  int thread;
  __device__ explicit TileMMA(int thread_in_mma) : thread(thread_in_mma) {}

  // (M, K, Stages) and (N, K, Stages) views of shared memory at p (1024-byte aligned).
  template <int Stages = 1>
  __device__ static auto tile_a(void* p) {
    return cute::make_tensor(cute::make_smem_ptr(static_cast<T*>(p)), LayoutA<Stages>{});
  }
  template <int Stages = 1>
  __device__ static auto tile_b(void* p) {
    return cute::make_tensor(cute::make_smem_ptr(static_cast<T*>(p)), LayoutB<Stages>{});
  }
  template <int Stages = 1> static constexpr int kBytesA = M * K * Stages * int(sizeof(T));
  template <int Stages = 1> static constexpr int kBytesB = N * K * Stages * int(sizeof(T));

  // This thread's fp32 accumulators of the M x N tile, and which (row, column) each one is.
  __device__ auto accumulators() const {
    return cute::partition_fragment_C(TiledSS{}, cute::Shape<cute::Int<M>, cute::Int<N>>{});
  }
  __device__ auto coordinates() const {
    auto id = cute::make_identity_tensor(cute::Shape<cute::Int<M>, cute::Int<N>>{});
    return TiledSS{}.get_thread_slice(thread).partition_C(id);
  }

  // Zeros in every accumulator, each set by its own instruction: zeros the compiler merges into
  // one register are copied into the accumulators later, inside the pipeline, and ptxas then
  // serializes the wgmmas (warning C7515).
  template <class Acc>
  __device__ static void zero(Acc& acc) {
    CUTE_UNROLL
    for (int i = 0; i < cute::size(acc); ++i) asm volatile("mov.b32 %0, 0;\n" : "=f"(acc(i)));
  }

  // acc = A B^T (overwrite) or acc += A B^T over the tiles' K: one asynchronous batch.
  template <class SA, class SB, class Acc>
  __device__ void mma(SA const& sA, SB const& sB, Acc& acc, bool overwrite = false) const {
    TiledSS tiled;
    auto slice = tiled.get_thread_slice(thread);
    issue(tiled, slice.make_fragment_A(slice.partition_A(sA)),  // wgmma descriptors
          slice.make_fragment_B(slice.partition_B(sB)), acc, overwrite);
  }

  // acc (+)= A B^T with A from registers (a fragment made by a_fragment or as_a).
  template <class RA, class SB, class Acc>
  __device__ void mma_rs(RA& rA, SB const& sB, Acc& acc, bool overwrite = false) const {
    TiledRS tiled;
    auto slice = tiled.get_thread_slice(thread);
    cute::warpgroup_fence_operand(rA);
    issue(tiled, rA, slice.make_fragment_B(slice.partition_B(sB)), acc, overwrite);
  }

  // One asynchronous batch of wgmma over K for mma and mma_rs: the k-th slices of a and b.
  template <class Tiled, class FA, class FB, class Acc>
  __device__ static void issue(Tiled& tiled, FA const& a, FB const& b, Acc& acc,
                               bool overwrite) {
    using namespace cute;
    tiled.accumulate_ = overwrite ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int k = 0; k < size<2>(a); ++k) {
      cute::gemm(tiled, a(_, _, k), b(_, _, k), acc);
      tiled.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(acc);
  }

  // This thread's register fragment of an M x K A operand for mma_rs.
  __device__ auto a_fragment() const {
    auto shape = cute::make_layout(cute::Shape<cute::Int<M>, cute::Int<K>>{});
    return TiledRS{}.get_thread_slice(thread).partition_fragment_A(shape);
  }

  // The accumulators of an M x K product, converted to T, as the A fragment of the next
  // product (K = that product's N): wgmma's C and RS-A layouts hold the same elements in each
  // thread, (pairs of columns, rows r / r + 8, 8-column blocks), two 8-column blocks to a
  // k-step of 16. The fragment owns its registers (a view of a local array would dangle once
  // this returns, and the compiler may then drop the conversion and the product reading it).
  // 8-bit T: a k-step of 32 reads, in each thread, keys 4q .. 4q + 3 and 16 + 4q .. 19 + 4q
  // (q = thread % 4) of rows r and r + 8, where the accumulators hold columns 2q, 2q + 1, 8 + 2q,
  // 9 + 2q and those plus 16: the fragment takes them as they lie, so A's k-th column is P's
  // column key_of(k) = 16 (k / 16) + 8 (k % 4 / 2) + 2 (k % 16 / 4) + k % 2 of each 32, and the
  // next product's B must hold its rows in that order (attention's FP8 V^T).
  template <class Acc>
  __device__ static auto as_a(Acc const& acc) {
    using namespace cute;
    auto l = acc.layout();  // ((2, 2, N / 8), MMA_M, MMA_N)
    if constexpr (sizeof(T) == 1) {
      static_assert(decltype(size<2>(l))::value == 1 && decltype(size<0, 2>(l))::value % 4 == 0,
                    "TileMMA::as_a: 8-bit A takes one atom's N, a multiple of 32");
      constexpr int kMmaM = decltype(size<1>(l))::value;
      constexpr int kSteps = decltype(size<0, 2>(l))::value / 4;  // k-steps of 32
      // ALayout_64x32's values: 4 consecutive k (one register), rows r / r + 8, k and k + 16;
      // each register two conversions of a column pair (an 8-column block's), low bytes first
      auto a = make_tensor<T>(Shape<Shape<_4, _2, _2>, Int<kMmaM>, Int<kSteps>>{});
      auto regs = recast<uint32_t>(a);  // ((1, 2, 2), MMA_M, k-steps)
      constexpr auto kind = cute::is_same_v<T, cute::float_e4m3_t> ? __NV_E4M3 : __NV_E5M2;
      auto pair = [&](int half, int block, int m) {  // columns 2q, 2q + 1 of an 8-column block
        const float2 x = make_float2(acc(make_coord(make_coord(0, half, block), m, 0)),
                                     acc(make_coord(make_coord(1, half, block), m, 0)));
        return uint32_t(__nv_cvt_float2_to_fp8x2(x, __NV_SATFINITE, kind));
      };
      CUTE_UNROLL
      for (int m = 0; m < kMmaM; ++m) {
        CUTE_UNROLL
        for (int ks = 0; ks < kSteps; ++ks) {
          CUTE_UNROLL
          for (int i = 0; i < 4; ++i) {  // (row half, k half)
            const int half = i % 2, kh = i / 2, block = 4 * ks + 2 * kh;
            regs(make_coord(make_coord(0, half, kh), m, ks)) =
                pair(half, block, m) | (pair(half, block + 1, m) << 16);
          }
        }
      }
      return a;
    } else {
      return as_a_16(acc);
    }
  }
  template <class Acc>
  __device__ static auto as_a_16(Acc const& acc) {
    using namespace cute;
    auto l = acc.layout();  // ((2, 2, N / 8), MMA_M, MMA_N)
    auto blocks = logical_divide(get<0, 2>(l), Int<2>{});  // (2, N / 16)
    auto a_layout = make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0>(blocks)),
                                get<1>(l), make_layout(get<1>(blocks), get<2>(l)));
    auto a = make_tensor<T>(a_layout);  // acc's modes regrouped: each element at acc's offset
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) a.data()[l(i)] = T(acc(i));
    return a;
  }

  // A (rows, columns) view of an accumulator fragment (of mma's or mma_rs's tile): the elements
  // this thread holds of each of its rows. A row's elements are spread over the 4 threads of a
  // quad (lanes 4i .. 4i + 3): combine them with quad_reduce. Works on coordinates() too. A view:
  // a fragment that owns its registers must outlive it (a temporary one is refused).
  template <class Frag>
  __device__ static auto rows(Frag&& frag) {
    using namespace cute;
    static_assert(cute::is_lvalue_reference_v<Frag> ||
                      !detail::owns_registers<typename cute::remove_cvref_t<Frag>::engine_type>,
                  "TileMMA::rows: a view of a temporary fragment would dangle; name it first");
    auto l = frag.layout();  // ((2 columns, 2 row halves, N / 8), MMA_M, MMA_N)
    auto rc = make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                          make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
    return make_tensor(frag.data(), rc);
  }

  // Leave at most Pending batches in flight; the fragments given stay fenced below the wait.
  template <int Pending, class... Frags>
  __device__ static void wait(Frags&... frags) {
    cute::warpgroup_wait<Pending>();
    (cute::warpgroup_fence_operand(frags), ...);
  }
};

// op over the 4 threads of a quad (the threads that share an accumulator row).
template <class V, class Op>
__device__ __forceinline__ V quad_reduce(V v, Op op) {
  v = op(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return op(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// Tiles written with ordinary stores (st.shared) are read by wgmma through the async proxy: each
// writer fences, then a barrier publishes the tile (TMA-written tiles need neither).
__device__ __forceinline__ void fence_tile_writes() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Warp specialization (sm_90): every thread of a warpgroup lowers (a producer: TMA issue needs
// few) or raises (consumers: accumulators) its register budget; the CTA's total must fit.
template <int Registers>
__device__ __forceinline__ void warpgroup_registers_down() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Registers));
}
template <int Registers>
__device__ __forceinline__ void warpgroup_registers_up() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Registers));
}

// mma.sync (sm_80+): Warps warps split M; A and B are K-major shared-memory tiles (any layout
// ldmatrix reads: SmemTile<T, Rows, K, Major::K> for K * sizeof(T) a multiple of 16 bytes).
template <class T_, int M, int N, int K, int Warps = 4>
struct TileMMA80 {
  using T = cute_t<T_>;
  static constexpr int kThreads = 32 * Warps;
  static_assert(M % (16 * Warps) == 0 && N % 16 == 0 && K % 16 == 0,
                "TileMMA80: M a multiple of 16 x Warps, N and K of 16");
  using Op = cute::conditional_t<cute::is_same_v<T, cute::half_t>,
                                 cute::SM80_16x8x16_F32F16F16F32_TN,
                                 cute::SM80_16x8x16_F32BF16BF16F32_TN>;
  // Warps along M; each warp's atom repeated to 16 columns (two 8-column atoms: one ldmatrix.x4
  // of B feeds both).
  using Tiled = decltype(cute::make_tiled_mma(
      Op{}, cute::Layout<cute::Shape<cute::Int<Warps>, cute::_1, cute::_1>>{},
      cute::Tile<cute::Int<16 * Warps>, cute::_16, cute::_16>{}));
  using CopyA = decltype(cute::make_tiled_copy_A(cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, T>{},
                                                 Tiled{}));
  using CopyB = decltype(cute::make_tiled_copy_B(cute::Copy_Atom<cute::SM75_U32x4_LDSM_N, T>{},
                                                 Tiled{}));

  int thread;
  __device__ explicit TileMMA80(int thread_in_mma) : thread(thread_in_mma) {}

  __device__ auto accumulators() const {
    return cute::partition_fragment_C(Tiled{}, cute::Shape<cute::Int<M>, cute::Int<N>>{});
  }
  __device__ auto coordinates() const {
    auto id = cute::make_identity_tensor(cute::Shape<cute::Int<M>, cute::Int<N>>{});
    return Tiled{}.get_thread_slice(thread).partition_C(id);
  }
  // acc (+)= A B^T over the tiles' K (sA: M x K, sB: N x K shared-memory tensors).
  template <class SA, class SB, class Acc>
  __device__ void mma(SA const& sA, SB const& sB, Acc& acc, bool overwrite = false) const {
    using namespace cute;
    Tiled tiled;
    auto slice = tiled.get_thread_slice(thread);
    Tensor rA = slice.partition_fragment_A(sA);
    Tensor rB = slice.partition_fragment_B(sB);
    auto copy_a = CopyA{}.get_thread_slice(thread);
    auto copy_b = CopyB{}.get_thread_slice(thread);
    Tensor sA_ = copy_a.partition_S(sA);
    Tensor sB_ = copy_b.partition_S(sB);
    Tensor rA_ = copy_a.retile_D(rA);
    Tensor rB_ = copy_b.retile_D(rB);
    if (overwrite) clear(acc);
    CUTE_UNROLL
    for (int k = 0; k < size<2>(rA); ++k) {
      copy(CopyA{}, sA_(_, _, k), rA_(_, _, k));
      copy(CopyB{}, sB_(_, _, k), rB_(_, _, k));
      cute::gemm(tiled, rA(_, _, k), rB(_, _, k), acc);
    }
  }
};

}  // namespace vitrail
