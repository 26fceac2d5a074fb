"""Depthwise convolution (groups = C, each input channel its own m = K / C filters): direct
kernels of our own, since a group of one channel is no GEMM (the implicit-GEMM kernels need 8).

Every kind reads and writes channels-last (NHWC-indexed views, any pixel strides, channels
packed) and is memory-bound: a thread owns V consecutive channels (8, 4 or 2 packed where m = 1
and the views allow, else one) and sums in fp32. Where the filter is at most MAX_WIDTH wide,
its column dilation 1 and its column stride one of STRIDES, the kernels are compiled for that
width and stride (kS, kStride), and a thread loads the input pixels its outputs share once;
otherwise they walk the taps one by one (any geometry). fprop and dgrad read the filter as its
taps (R, S, K), laid out by a launch of their own (_taps): a tap's V filters are one vector load.

- fprop: y[n, p, q, k] = act(sum over taps x[n, h, w, k / m] * w[k, r, s] + bias[k]), with the
  GEMM epilogues' own activation math (vitrail.gemm.epilogue.ACTIVATION_MATH); a thread
  computes a run of OUTPUTS outputs of a row;
- dgrad: at stride 1 with m = 1, the fprop of dy with the flipped filter; else dx[n, h, w, c] =
  the sum over its m outputs and the taps that reach (h, w) of dy[n, p, q, k] * w[k, r, s], a
  gather (no atomics), any stride and dilation;
- wgrad: dw[k, r, s] = sum over pixels dy[n, p, q, k] * x[n, h, w, k / m]: a block sums runs of
  output rows for a filter row, its threads' sums added in shared memory into one fp32 partial
  of dw a block column, and one more launch adds the partials in one order and rounds once
  (vitrail.ops.conv.partials, the chunked implicit-GEMM wgrad's sum too): deterministic, no
  atomics.

The kernels are NVRTC RawKernels (vitrail.jit), launched on the current stream, so a plan
(vitrail.plan) records and replays them as it does the CUTLASS ones.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from vitrail.gemm.epilogue import ACT_IDS, ACTIVATION_MATH
from vitrail.ops.conv.partials import ROUNDING, sum_partials

THREADS = 256
MAX_WIDTH = 9  # the widest filter whose columns the kernels compile in
STRIDES = (1, 2)  # the column strides they compile in
# fprop, where the columns are compiled in: at most 4 channels a thread, and the outputs of a
# row it computes, by column stride
OUTPUTS = {1: 4, 2: 2}
NARROW_ABOVE = 5  # wgrad: wider filters compiled in take at most 4 channels a thread
MAX_IMAGES = 65535  # a launch's images (grid.y)
# wgrad: blocks to aim for (about two an SM: more blocks, more partials to add), the outputs
# of a row a thread sums in turn (a segment), and those whose pixels it loads at once (a run),
# by filter width: longer where a run's pixels are shared by more taps, shorter where 8
# channels a thread (filters 4 to NARROW_ABOVE wide) leave fewer registers
WGRAD_BLOCKS = 256
SEGMENT = 32
WGRAD_RUNS = {1: 4, 2: 4, 3: 4, 4: 2, 5: 2}
WIDE_RUN = 8

_SOURCE = ACTIVATION_MATH + ROUNDING + r"""
namespace vitrail_dw {
template <int V> struct alignas(2 * V) Pack { unsigned short h[V]; };

template <int kBf16> __device__ __forceinline__ float load(unsigned short h) {
  if (kBf16) return __uint_as_float(static_cast<unsigned>(h) << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// The V channels at row[w * stride], or zeros where column w is outside [0, width)
template <int V>
__device__ __forceinline__ Pack<V> fetch(const unsigned short* row, int w, long long width,
                                         long long stride) {
  Pack<V> v;
  if (w >= 0 && w < width) {
    v = *reinterpret_cast<const Pack<V>*>(row + w * stride);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) v.h[j] = 0;
  }
  return v;
}

// acc[j] += a[j] b[j] over V channels
template <int kBf16, int V>
__device__ __forceinline__ void fma(float* acc, const Pack<V>& a, const Pack<V>& b) {
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] += load<kBf16>(a.h[j]) * load<kBf16>(b.h[j]);
}

// The geometry: sizes, NHWC strides (in elements) of the pixel-major operands, the filter's
// k/r/s strides, stride, padding, dilation and the multiplier m = K / C. The kernels take it
// as scalars (DEPTHWISE_PARAMETERS: a plan replays scalars, not structs) and gather it
// here (DEPTHWISE_GEOMETRY).
struct Geometry {
  long long n, h, w, c, p, q, k, r, s;
  long long xs[3], ys[3];   // x (or dx) and y (or dy): n, h, w strides; channels packed
  long long ws[3];          // the filter: k, r, s strides
  int stride[2], pad[2], dil[2], m;
};
}  // namespace vitrail_dw

#define DEPTHWISE_PARAMETERS                                                                 \
  long long n_, long long h_, long long w_, long long c_, long long p_, long long q_,        \
  long long k_, long long r_, long long s_, long long xs0, long long xs1, long long xs2,     \
  long long ys0, long long ys1, long long ys2, long long ws0, long long ws1, long long ws2, \
  int sh_, int sw_, int ph_, int pw_, int dh_, int dw_, int m_
#define DEPTHWISE_GEOMETRY                                                                   \
  const vitrail_dw::Geometry g{n_, h_, w_, c_, p_, q_, k_, r_, s_, {xs0, xs1, xs2},          \
                               {ys0, ys1, ys2}, {ws0, ws1, ws2}, {sh_, sw_}, {ph_, pw_},     \
                               {dh_, dw_}, m_}

// y from x, image blockIdx.y: a thread computes TQ consecutive outputs of a row (q0 .. q0 +
// TQ - 1) for V channels. Where the filter's width kS and the column stride kStride are
// compile-time (dilation 1), it loads each of the (TQ - 1) kStride + kS input pixels those
// outputs share once a filter row and keeps the row's kS taps in registers; kS = 0 (TQ = 1)
// walks the taps of any geometry. The taps are the filter laid out (R, S, K) (_taps).
template <int kBf16, int V, int Act, int kBias, int kS, int kStride, int TQ>
__global__ void __launch_bounds__(256) vitrail_dw_fprop(
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ taps,
    const unsigned short* __restrict__ bias, unsigned short* __restrict__ y, float slope,
    DEPTHWISE_PARAMETERS) {
  DEPTHWISE_GEOMETRY;
  using vitrail_dw::Pack;
  const int kv = static_cast<int>(g.k / V), tiles = static_cast<int>((g.q + TQ - 1) / TQ);
  const int t = blockIdx.x * blockDim.x + threadIdx.x;  // (p, tile, channels): channels fastest
  if (t >= g.p * tiles * kv) return;
  const int k0 = t % kv * V, q0 = t / kv % tiles * TQ, p = t / kv / tiles;
  const long long n = blockIdx.y;
  const unsigned short* xn = x + n * g.xs[0] + k0 / g.m;
  float acc[TQ][V] = {};
  for (int r = 0; r < g.r; ++r) {
    const int h = p * g.stride[0] - g.pad[0] + r * g.dil[0];
    if (h < 0 || h >= g.h) continue;
    const unsigned short* row = xn + h * g.xs[1];
    const unsigned short* tap = taps + r * g.ws[1] + k0;
    if constexpr (kS > 0) {
      Pack<V> f[kS];
#pragma unroll
      for (int s = 0; s < kS; ++s) f[s] = *reinterpret_cast<const Pack<V>*>(tap + s * g.ws[2]);
      const int w0 = q0 * kStride - g.pad[1];
#pragma unroll
      for (int u = 0; u < (TQ - 1) * kStride + kS; ++u) {  // input column w0 + u
        const Pack<V> a = vitrail_dw::fetch<V>(row, w0 + u, g.w, g.xs[2]);
#pragma unroll
        for (int s = 0; s < kS; ++s)  // output j reads column j kStride + s
          if (u >= s && (u - s) % kStride == 0 && (u - s) / kStride < TQ)
            vitrail_dw::fma<kBf16, V>(acc[(u - s) / kStride], a, f[s]);
      }
    } else {
      for (int s = 0; s < g.s; ++s) {
        const int w = q0 * g.stride[1] - g.pad[1] + s * g.dil[1];
        if (w < 0 || w >= g.w) continue;
        vitrail_dw::fma<kBf16, V>(acc[0], *reinterpret_cast<const Pack<V>*>(row + w * g.xs[2]),
                                  *reinterpret_cast<const Pack<V>*>(tap + s * g.ws[2]));
      }
    }
  }
  unsigned short* out = y + n * g.ys[0] + p * g.ys[1] + k0;
#pragma unroll
  for (int j = 0; j < TQ; ++j) {
    if (q0 + j >= g.q) break;
    Pack<V> o;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      float v = acc[j][i];
      if (kBias) v += vitrail_dw::load<kBf16>(bias[k0 + i]);
      o.h[i] = vitrail_conv::store<kBf16>(vitrail_act::apply<Act>(v, slope));
    }
    *reinterpret_cast<Pack<V>*>(out + (q0 + j) * g.ys[2]) = o;
  }
}

// The filter's taps (r0 + rstep i, s0 + sstep j) for i < r, j < s (K of them each; the
// filter's strides wk, wr, ws) as out[i][j][k], packed, so that a thread's V channels of a tap
// are one vector and a warp's loads one run of memory; flipped (out[i][j] = tap (r - 1 - i,
// s - 1 - j)) for a dgrad that runs as an fprop.
extern "C" __global__ void __launch_bounds__(256) vitrail_dw_taps(
    const unsigned short* __restrict__ wt, unsigned short* __restrict__ out, long long k,
    long long r, long long s, long long wk, long long wr, long long ws, int flip, int r0,
    int rstep, int s0, int sstep) {
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < k * r * s; i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long kk = i % k, tap = flip ? r * s - 1 - i / k : i / k;
    out[i] = wt[kk * wk + (r0 + tap / s * rstep) * wr + (s0 + tap % s * sstep) * ws];
  }
}

// dx from dy, image blockIdx.y, as a gather (any stride, dilation and m): x's roles (xs, h, w,
// c) are dx's, y's (ys, p, q, k) dy's; a thread owns V channels of one pixel
template <int kBf16, int V>
__global__ void __launch_bounds__(256) vitrail_dw_dgrad(
    const unsigned short* __restrict__ dy, const unsigned short* __restrict__ taps,
    unsigned short* __restrict__ dx, DEPTHWISE_PARAMETERS) {
  DEPTHWISE_GEOMETRY;
  using vitrail_dw::Pack;
  const int cv = static_cast<int>(g.c / V);
  const int t = blockIdx.x * blockDim.x + threadIdx.x;  // (h, w, channels): channels fastest
  if (t >= g.h * g.w * cv) return;
  const int c0 = t % cv * V, w = t / cv % g.w, h = t / cv / g.w;
  const long long n = blockIdx.y;
  float acc[V] = {};
  for (int r = 0; r < g.r; ++r) {
    const int ph = h + g.pad[0] - r * g.dil[0];  // = p * stride
    if (ph < 0 || ph % g.stride[0]) continue;
    const int p = ph / g.stride[0];
    if (p >= g.p) continue;
    for (int s = 0; s < g.s; ++s) {
      const int qw = w + g.pad[1] - s * g.dil[1];
      if (qw < 0 || qw % g.stride[1]) continue;
      const int q = qw / g.stride[1];
      if (q >= g.q) continue;
      const unsigned short* d = dy + n * g.ys[0] + p * g.ys[1] + q * g.ys[2];
      const unsigned short* tap = taps + r * g.ws[1] + s * g.ws[2];
      if (V > 1) {  // m = 1
        vitrail_dw::fma<kBf16, V>(acc, *reinterpret_cast<const Pack<V>*>(d + c0),
                                  *reinterpret_cast<const Pack<V>*>(tap + c0));
      } else {
        for (int j = 0; j < g.m; ++j) {
          const long long k = c0 * g.m + j;
          acc[0] += vitrail_dw::load<kBf16>(d[k]) * vitrail_dw::load<kBf16>(tap[k]);
        }
      }
    }
  }
  Pack<V> o;
#pragma unroll
  for (int j = 0; j < V; ++j) o.h[j] = vitrail_conv::store<kBf16>(acc[j]);
  *reinterpret_cast<Pack<V>*>(dx + n * g.xs[0] + h * g.xs[1] + w * g.xs[2] + c0) = o;
}

// dw's fp32 partial sums, partials[blockIdx.x][k][r][s] (dw's packed K R S order). The work
// units are the segments of `segment` outputs of each output row (n, p); block (b, y, z) sums
// units [b per_block, (b + 1) per_block) for the channel vectors [z lanes_k, (z + 1) lanes_k)
// and filter row y (kS > 0: all kS taps of it, a thread loading the dy and input pixels of
// kRun outputs at once, then summing them; kS = 0: tap y = (r, s) alone, any stride and
// dilation). A thread owns V channels of one unit at a time (lanes_k threads a unit, 256 /
// lanes_k units at once); the block adds its threads' sums in shared memory.
template <int kBf16, int V, int kS, int kStride, int kRun>
__global__ void __launch_bounds__(256) vitrail_dw_wgrad(
    const unsigned short* __restrict__ dy, const unsigned short* __restrict__ x,
    float* __restrict__ partials, long long per_block, int lanes_k, int segment,
    DEPTHWISE_PARAMETERS) {
  DEPTHWISE_GEOMETRY;
  using vitrail_dw::Pack;
  constexpr int T = kS > 0 ? kS : 1;  // taps a thread sums
  __shared__ float sums[256 * V];
  const int lanes = blockDim.x / lanes_k, unit_lane = threadIdx.x / lanes_k;
  const int kvi = blockIdx.z * lanes_k + threadIdx.x % lanes_k;
  const bool active = unit_lane < lanes && kvi < g.k / V;
  const int r = kS > 0 ? blockIdx.y : blockIdx.y / g.s, s0 = kS > 0 ? 0 : blockIdx.y % g.s;
  const int k0 = kvi * V, segments = static_cast<int>((g.q + segment - 1) / segment);
  const long long first = blockIdx.x * per_block, units = g.n * g.p * segments;
  const long long last = first + per_block < units ? first + per_block : units;
  float acc[T][V] = {};
  for (long long u = first + unit_lane; active && u < last; u += lanes) {
    const long long row = u / segments, n = row / g.p;
    const int p = static_cast<int>(row - n * g.p);
    const int h = p * g.stride[0] - g.pad[0] + r * g.dil[0];
    if (h < 0 || h >= g.h) continue;
    const int qa = static_cast<int>(u - row * segments) * segment;
    const int qb = qa + segment < g.q ? qa + segment : static_cast<int>(g.q);
    const unsigned short* xr = x + n * g.xs[0] + h * g.xs[1] + k0 / g.m;
    const unsigned short* dr = dy + n * g.ys[0] + p * g.ys[1] + k0;
    if constexpr (kS > 0) {
      constexpr int kColumns = (kRun - 1) * kStride + kS;  // the input pixels of kRun outputs
      for (int q = qa; q < qb; q += kRun) {  // every load of a run issued before its sums
        Pack<V> d[kRun], a[kColumns];
#pragma unroll
        for (int j = 0; j < kRun; ++j) d[j] = vitrail_dw::fetch<V>(dr, q + j, qb, g.ys[2]);
        const int w0 = q * kStride - g.pad[1];
#pragma unroll
        for (int u = 0; u < kColumns; ++u)
          a[u] = vitrail_dw::fetch<V>(xr, w0 + u, g.w, g.xs[2]);
#pragma unroll
        for (int j = 0; j < kRun; ++j)
#pragma unroll
          for (int s = 0; s < kS; ++s) vitrail_dw::fma<kBf16, V>(acc[s], d[j], a[j * kStride + s]);
      }
    } else {
      for (int q = qa; q < qb; ++q) {
        const int w = q * g.stride[1] - g.pad[1] + s0 * g.dil[1];
        if (w < 0 || w >= g.w) continue;
        vitrail_dw::fma<kBf16, V>(acc[0], *reinterpret_cast<const Pack<V>*>(dr + q * g.ys[2]),
                                  *reinterpret_cast<const Pack<V>*>(xr + w * g.xs[2]));
      }
    }
  }
  float* out = partials + blockIdx.x * g.k * g.r * g.s;
  const int width = lanes_k * V;  // the block's channels
#pragma unroll
  for (int s = 0; s < T; ++s) {
    __syncthreads();
#pragma unroll
    for (int j = 0; j < V; ++j) sums[threadIdx.x * V + j] = acc[s][j];
    __syncthreads();
    if (threadIdx.x < width) {
      float sum = 0.f;
      for (int l = 0; l < lanes; ++l) sum += sums[l * width + threadIdx.x];
      const long long k = static_cast<long long>(blockIdx.z) * width + threadIdx.x;
      if (k < g.k) out[(k * g.r + r) * g.s + s0 + s] = sum;
    }
  }
}
"""
_KERNELS: dict[str, object] = {}


def _kernel(kind: str, *template: int):
    """The RawKernel vitrail_dw_<kind><template...> (built on its first launch)."""
    name = f"vitrail_dw_{kind}" + (f"<{', '.join(map(str, template))}>" if template else "")
    kernel = _KERNELS.get(name)
    if kernel is None:
        from vitrail import jit
        kernel = _KERNELS.setdefault(name, jit.RawKernel(_SOURCE, name,
                                                         signature=_SIGNATURES[kind]))
    return kernel


def is_depthwise(c: int, weight_shape, groups: int) -> bool:
    """Whether a convolution of c input channels is depthwise: a group a channel (groups = c,
    one input channel a filter), m = K / C filters each (groups = 1 with c = 1 is a plain
    convolution)."""
    return groups == c and c > 1 and weight_shape[1] == 1


def _vector(m: int, channels: int, *views: Tensor) -> int:
    """The channels a thread owns: 8, 4 or 2 where m = 1 and every view's channels are packed
    and its pointer and pixel strides are multiples of that many elements, else 1."""
    if m != 1:
        return 1
    for v in (8, 4, 2):
        if channels % v == 0 and all(t.data_ptr() % (2 * v) == 0 and
                                     all(st % v == 0 for st in t.stride()[:3])
                                     for t in views):
            return v
    return 1


def _geometry(xs: Tensor, ys: Tensor, taps: Tensor, stride, pad, dilation) -> tuple:
    """The kernels' geometry (their last 25 parameters) of NHWC-indexed views x-like (x or dx)
    and y-like (y or dy), and the filter's taps (R, S, K: _taps)."""
    for t, name in ((xs, "x"), (ys, "y")):
        if t.stride(3) != 1:
            raise AssertionError(f"depthwise: {name}'s channels are not packed: {t.stride()}")
    n, h, w, c = xs.shape
    _, p, q, k = ys.shape
    r, s, _ = taps.shape
    wr, ws, wk = taps.stride()
    return (n, h, w, c, p, q, k, r, s, *xs.stride()[:3], *ys.stride()[:3], wk, wr, ws,
            *stride, *pad, *dilation, k // c)


def _taps(weight: Tensor, buffer: Callable[[int, torch.dtype], Tensor],
          flip: bool = False) -> Tensor:
    """The (K, 1, R, S) filter as its taps (R, S, K), packed in buffer(K R S, dtype), flipped
    for a dgrad run as an fprop: a launch of our own (a plan replays it), so a thread's channels
    of a tap are one vector load."""
    k, _, r, s = weight.shape
    out = buffer(k * r * s, weight.dtype)
    _lay_out(weight, out, (0, 1, r), (0, 1, s), flip)
    return out.view(r, s, k)


def _lay_out(weight: Tensor, out: Tensor, rows: tuple, columns: tuple, flip: bool) -> None:
    """out (packed) = the filter's taps at rows r0 + rstep i (i < count) and columns s0 +
    sstep j, (rows, columns) = ((r0, rstep, count), (s0, sstep, count)), as (i, j, K)."""
    (r0, rstep, rc), (s0, sstep, sc), k = rows, columns, weight.shape[0]
    wk, _, wr, ws = weight.stride()
    _kernel("taps")[_grid(k * rc * sc), THREADS](weight.data_ptr(), out, k, rc, sc, wk, wr, ws,
                                                  int(flip), r0, rstep, s0, sstep)


# the kernels' parameters (DEPTHWISE_PARAMETERS is a macro: their signatures are spelled here)
_GEOMETRY = ", ".join(["long long"] * 18 + ["int"] * 7)
_SIGNATURES = {
    "fprop": "const unsigned short*, const unsigned short*, const unsigned short*, "
             "unsigned short*, float, " + _GEOMETRY,
    "dgrad": "const unsigned short*, const unsigned short*, unsigned short*, " + _GEOMETRY,
    "wgrad": "const unsigned short*, const unsigned short*, float*, long long, int, int, "
             + _GEOMETRY,
    "taps": "const unsigned short*, unsigned short*, " + ", ".join(["long long"] * 6)
            + ", int, int, int, int, int",
}


def _bf16(t: Tensor) -> int:
    return int(t.dtype is torch.bfloat16)


def _grid(total: int) -> int:
    """Blocks of a grid-stride loop over total threads' work."""
    return max(1, min(-(-total // THREADS), 65535 * 8))


def _compiled(s: int, stride: int, dilation: int) -> tuple[int, int]:
    """(kS, kStride): the filter width and column stride the kernels compile in, where they
    can (dilation 1, the widths and strides below), else (0, 0): any geometry, tap by tap."""
    if dilation == 1 and s <= MAX_WIDTH and stride in STRIDES:
        return s, stride
    return 0, 0


def _images(launch: Callable[[int, int], None], n: int) -> None:
    """launch(first, count) over the batch in runs of at most MAX_IMAGES (grid.y: an image)."""
    for first in range(0, n, MAX_IMAGES):
        launch(first, min(MAX_IMAGES, n - first))


def _per_image(threads: int, what: str) -> int:
    """Blocks of one image's threads (the kernels index them in 32 bits)."""
    if threads >= 2 ** 31:
        raise ValueError(f"depthwise {what}: {threads} threads an image, over the 2^31 the "
                         f"kernels index")
    return -(-threads // THREADS)


def _forward(x: Tensor, taps: Tensor, bias: Optional[Tensor], y: Tensor, stride, pad,
             dilation, act: int, v: int, slope: float, what: str) -> None:
    """y = act(depthwise conv of x with the taps (R, S, K) + bias): NHWC-indexed views."""
    n, p, q, k = y.shape
    ks, kstride = _compiled(taps.shape[1], stride[1], dilation[1])
    tq = OUTPUTS[kstride] if ks else 1
    v = min(v, 4) if ks else v
    blocks = _per_image(p * -(-q // tq) * (k // v), what)
    kernel = _kernel("fprop", _bf16(x), v, act, int(bias is not None), ks, kstride, tq)
    bias_ptr = bias.data_ptr() if bias is not None else None

    def launch(first: int, count: int) -> None:
        xs, ys = x[first:first + count], y[first:first + count]
        kernel[(blocks, count), THREADS](xs.data_ptr(), taps, bias_ptr, ys.data_ptr(), slope,
                                         *_geometry(xs, ys, taps, stride, pad, dilation))
    _images(launch, n)


def fprop(x: Tensor, weight: Tensor, bias: Optional[Tensor], y: Tensor, stride, pad, dilation,
          activation: Optional[str], buffer: Callable[[int, torch.dtype], Tensor],
          slope: float = 0.01) -> None:
    """y (NHWC view) = act(depthwise conv of x (NHWC view) + bias); buffer(n, dtype): scratch
    for the filter's taps."""
    m = weight.shape[0] // x.shape[3]
    v = _vector(m, y.shape[3], x, y)
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()  # the kernel reads K packed values
    _forward(x, _taps(weight, buffer), bias, y, stride, pad, dilation,
             ACT_IDS[activation] if activation else 0, v, float(slope), "fprop")


def dgrad(dy: Tensor, weight: Tensor, dx: Tensor, stride, pad, dilation,
          buffer: Callable[[int, torch.dtype], Tensor]) -> None:
    """dx (NHWC view) of a depthwise convolution from dy (NHWC view), every pixel written;
    buffer(n, dtype): scratch for the filter's taps. With one filter a channel it is the
    forward convolution of dy with the flipped filter (the fprop kernel, its columns compiled
    in where they can be) at stride 1, and one such convolution a stride phase without
    dilation (_phased); else a gather, pixel by pixel."""
    k, _, r, s = weight.shape
    m = k // dx.shape[3]
    v = _vector(m, dx.shape[3], dy, dx)
    if m == 1 and tuple(stride) == (1, 1) and _compiled(s, 1, dilation[1])[0]:
        flipped = (dilation[0] * (r - 1) - pad[0], dilation[1] * (s - 1) - pad[1])
        _forward(dy, _taps(weight, buffer, flip=True), None, dx, (1, 1), flipped, dilation, 0,
                 v, 0.01, "dgrad")
        return
    if m == 1 and tuple(dilation) == (1, 1):
        _phased(dy, weight, dx, stride, pad, v, buffer)
        return
    taps = _taps(weight, buffer)
    n, h, w, c = dx.shape
    blocks = _per_image(h * w * (c // v), "dgrad")
    kernel = _kernel("dgrad", _bf16(dx), v)

    def launch(first: int, count: int) -> None:
        dys, dxs = dy[first:first + count], dx[first:first + count]
        kernel[(blocks, count), THREADS](dys.data_ptr(), taps, dxs.data_ptr(),
                                         *_geometry(dxs, dys, taps, stride, pad, dilation))
    _images(launch, n)


def _phase(a: int, stride: int, pad: int, taps: int) -> tuple[int, int, int]:
    """Of the dx pixels a + stride i along one axis: the first filter tap that reaches them, r0
    (the taps r0 + stride j do), their count, and the flipped taps' padding over dy."""
    r0 = (a + pad) % stride
    count = max(0, -(-(taps - r0) // stride))
    return r0, count, count - 1 - (a + pad - r0) // stride


def _phased(dy: Tensor, weight: Tensor, dx: Tensor, stride, pad, v: int,
            buffer: Callable[[int, torch.dtype], Tensor]) -> None:
    """A strided dx (m = 1, no dilation) as its stride phases: the pixels dx[a + sh i, b + sw
    j] are the unit-stride fprop of dy with the filter taps that reach them, flipped (taps r
    = r0 + sh j' for row phase a); a phase no tap reaches is written as zeros (the fprop of no
    taps). The phases' taps share one buffer of the filter's size."""
    (sh, sw), (k, _, r, s) = stride, weight.shape
    taps = buffer(k * r * s, weight.dtype)
    used = 0
    for a in range(min(sh, dx.shape[1])):
        r0, rc, pad_h = _phase(a, sh, pad[0], r)
        for b in range(min(sw, dx.shape[2])):
            s0, sc, pad_w = _phase(b, sw, pad[1], s)
            t = taps[used:used + k * rc * sc].view(rc, sc, k) if rc * sc else taps[:0].view(
                0, 0, k)
            if rc * sc:
                _lay_out(weight, t, (r0, sh, rc), (s0, sw, sc), flip=True)
                used += k * rc * sc
            _forward(dy, t, None, dx[:, a::sh, b::sw], (1, 1), (pad_h, pad_w), (1, 1), 0, v,
                     0.01, "dgrad")


def wgrad(dy: Tensor, x: Tensor, dw: Tensor, stride, pad, dilation,
          partials: Callable[[int], Tensor]) -> None:
    """dw (K, 1, R, S; its elements packed) of a depthwise convolution from dy and x (NHWC
    views): blocks of fp32 partial sums in partials(n), then their sum in one order."""
    if not dw.is_contiguous():
        raise AssertionError(f"depthwise wgrad: dw's elements are not packed: {dw.stride()}")
    m = dw.shape[0] // x.shape[3]
    k, r, s = dw.shape[0], dw.shape[2], dw.shape[3]
    ks, kstride = _compiled(s, stride[1], dilation[1])
    v = _vector(m, dy.shape[3], dy, x)
    v = min(v, 4) if ks > NARROW_ABOVE else v
    n, p, q, _ = dy.shape
    lanes_k = min(k // v, 32)  # threads a unit: a warp's channel vectors at most
    segment = q if q <= 2 * SEGMENT else SEGMENT
    units = n * p * -(-q // segment)
    taps_y, vectors_z = r if ks else r * s, -(-(k // v) // lanes_k)
    blocks = max(1, min(-(-WGRAD_BLOCKS // (taps_y * vectors_z)),
                        -(-units // (THREADS // lanes_k))))
    per_block = max(1, -(-units // blocks))
    blocks = max(1, -(-units // per_block))  # none empty (but the one of an empty batch: zeros)
    out = partials(blocks * k * r * s)
    run = WGRAD_RUNS.get(ks, WIDE_RUN) if ks else 1
    kernel = _kernel("wgrad", _bf16(x), v, ks, kstride, run)
    kernel[(blocks, taps_y, vectors_z), THREADS](
        dy.data_ptr(), x.data_ptr(), out, per_block, lanes_k, segment,
        *_geometry(x, dy, dw.permute(2, 3, 0, 1)[..., 0], stride, pad, dilation))
    sum_partials(out, dw, blocks)
