"""Depthwise convolution (groups = C, each input channel its own m = K / C filters): direct
kernels of our own, since a group of one channel is no GEMM (the implicit-GEMM kernels need 8).

Every kind reads and writes channels-last (NHWC-indexed views, any pixel strides, channels
packed) and is memory-bound: a thread owns V consecutive channels (16-byte vectors where m = 1
and the views allow, else one) of one pixel and walks the filter's R x S taps, which fprop and
dgrad read laid out as (R, S, K) by a launch of their own (_taps): a tap's V filters are one
vector load, a warp's loads one run of memory.

- fprop: y[n, p, q, k] = act(sum over taps x[n, h, w, k / m] * w[k, r, s] + bias[k]), with the
  GEMM epilogues' own activation math (vitrail.gemm.epilogue.ACTIVATION_MATH);
- dgrad: dx[n, h, w, c] = sum over its m outputs and the taps that reach (h, w) of
  dy[n, p, q, k] * w[k, r, s]: a gather (no atomics), any stride and dilation;
- wgrad: dw[k, r, s] = sum over pixels dy[n, p, q, k] * x[n, h, w, k / m]: each block of
  ``chunk`` pixels writes fp32 partial sums that one more launch adds in order and rounds once
  (the implicit-GEMM wgrad's own sum kernel): deterministic, no atomics.

The kernels are NVRTC RawKernels (vitrail.jit), launched on the current stream, so a plan
(vitrail.plan) records and replays them as it does the CUTLASS ones.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from vitrail.gemm.epilogue import ACT_IDS, ACTIVATION_MATH

THREADS = 256
# wgrad: blocks of partial sums to aim for (enough to fill an H100's 132 SMs a few times over),
# and the fewest pixels a block sums (fewer partials to add, once the GPU is full)
WGRAD_BLOCKS = 1024
WGRAD_MIN_PIXELS = 64

_SOURCE = ACTIVATION_MATH + r"""
namespace vitrail_dw {
template <int V> struct alignas(2 * V) Pack { unsigned short h[V]; };

template <int kBf16> __device__ __forceinline__ float load(unsigned short h) {
  if (kBf16) return __uint_as_float(static_cast<unsigned>(h) << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

template <int kBf16> __device__ __forceinline__ unsigned short store(float f) {
  unsigned short h;
  if (kBf16) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// The geometry: sizes, NHWC strides (in elements) of the pixel-major operands, the filter's
// k/r/s strides, stride, padding, dilation and the multiplier m = K / C. The kernels take it
// as scalars (GEOMETRY: a plan replays scalars, not structs) and gather it here.
struct Geometry {
  long long n, h, w, c, p, q, k, r, s;
  long long xs[3], ys[3];   // x (or dx) and y (or dy): n, h, w strides; channels packed
  long long ws[3];          // the filter: k, r, s strides
  int stride[2], pad[2], dil[2], m;
};
}  // namespace vitrail_dw

#define VITRAIL_DW_GEOMETRY                                                                  \
  long long n_, long long h_, long long w_, long long c_, long long p_, long long q_,        \
  long long k_, long long r_, long long s_, long long xs0, long long xs1, long long xs2,     \
  long long ys0, long long ys1, long long ys2, long long ws0, long long ws1, long long ws2, \
  int sh_, int sw_, int ph_, int pw_, int dh_, int dw_, int m_
#define VITRAIL_DW_G                                                                          \
  const vitrail_dw::Geometry g{n_, h_, w_, c_, p_, q_, k_, r_, s_, {xs0, xs1, xs2},          \
                               {ys0, ys1, ys2}, {ws0, ws1, ws2}, {sh_, sw_}, {ph_, pw_},     \
                               {dh_, dw_}, m_}

template <int kBf16, int V, int Act, int kBias>
__global__ void __launch_bounds__(256) vitrail_dw_fprop(
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ wt,
    const unsigned short* __restrict__ bias, unsigned short* __restrict__ y, float slope,
    VITRAIL_DW_GEOMETRY) {
  VITRAIL_DW_G;
  const long long kv = g.k / V, total = g.n * g.p * g.q * kv;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long k0 = (i % kv) * V, pix = i / kv;
    const long long q = pix % g.q, p = pix / g.q % g.p, n = pix / (g.q * g.p);
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.f;
    const long long c0 = k0 / g.m;
    for (int r = 0; r < g.r; ++r) {
      const long long h = p * g.stride[0] - g.pad[0] + r * g.dil[0];
      if (h < 0 || h >= g.h) continue;
      for (int s = 0; s < g.s; ++s) {
        const long long w = q * g.stride[1] - g.pad[1] + s * g.dil[1];
        if (w < 0 || w >= g.w) continue;
        const unsigned short* px = x + n * g.xs[0] + h * g.xs[1] + w * g.xs[2];
        const unsigned short* pw = wt + r * g.ws[1] + s * g.ws[2];
        if (V > 1) {  // m = 1: V channels in, V out; the taps' filters packed (ws[0] = 1)
          const vitrail_dw::Pack<V> v = *reinterpret_cast<const vitrail_dw::Pack<V>*>(px + c0);
          const vitrail_dw::Pack<V> f = *reinterpret_cast<const vitrail_dw::Pack<V>*>(pw + k0);
#pragma unroll
          for (int j = 0; j < V; ++j)
            acc[j] += vitrail_dw::load<kBf16>(v.h[j]) * vitrail_dw::load<kBf16>(f.h[j]);
        } else {
          acc[0] += vitrail_dw::load<kBf16>(px[c0]) * vitrail_dw::load<kBf16>(pw[k0 * g.ws[0]]);
        }
      }
    }
    vitrail_dw::Pack<V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      float v = acc[j];
      if (kBias) v += vitrail_dw::load<kBf16>(bias[k0 + j]);
      out.h[j] = vitrail_dw::store<kBf16>(vitrail_act::apply<Act>(v, slope));
    }
    *reinterpret_cast<vitrail_dw::Pack<V>*>(y + n * g.ys[0] + p * g.ys[1] + q * g.ys[2] + k0) =
        out;
  }
}

// The filter (K, R, S; any strides) as its taps: out[r][s][k], packed, so that a thread's V
// channels of a tap are one vector and a warp's loads one run of memory.
extern "C" __global__ void __launch_bounds__(256) vitrail_dw_taps(
    const unsigned short* __restrict__ wt, unsigned short* __restrict__ out, long long k,
    long long r, long long s, long long wk, long long wr, long long ws) {
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < k * r * s; i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long kk = i % k, tap = i / k;
    out[i] = wt[kk * wk + tap / s * wr + tap % s * ws];
  }
}

// dx from dy: x's roles (xs, h, w, c) are dx's, y's (ys, p, q, k) dy's
template <int kBf16, int V>
__global__ void __launch_bounds__(256) vitrail_dw_dgrad(
    const unsigned short* __restrict__ dy, const unsigned short* __restrict__ wt,
    unsigned short* __restrict__ dx, VITRAIL_DW_GEOMETRY) {
  VITRAIL_DW_G;
  const long long cv = g.c / V, total = g.n * g.h * g.w * cv;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const long long c0 = (i % cv) * V, pix = i / cv;
    const long long w = pix % g.w, h = pix / g.w % g.h, n = pix / (g.w * g.h);
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.f;
    for (int r = 0; r < g.r; ++r) {  // pixel coordinates in int: cheaper division
      const int ph = static_cast<int>(h) + g.pad[0] - r * g.dil[0];  // = p * stride
      if (ph < 0 || ph % g.stride[0]) continue;
      const int p = ph / g.stride[0];
      if (p >= g.p) continue;
      for (int s = 0; s < g.s; ++s) {
        const int qw = static_cast<int>(w) + g.pad[1] - s * g.dil[1];
        if (qw < 0 || qw % g.stride[1]) continue;
        const int q = qw / g.stride[1];
        if (q >= g.q) continue;
        const unsigned short* pd = dy + n * g.ys[0] + p * g.ys[1] + q * g.ys[2];
        const unsigned short* pw = wt + r * g.ws[1] + s * g.ws[2];
        if (V > 1) {  // m = 1; the taps' filters packed (ws[0] = 1)
          const vitrail_dw::Pack<V> v = *reinterpret_cast<const vitrail_dw::Pack<V>*>(pd + c0);
          const vitrail_dw::Pack<V> f = *reinterpret_cast<const vitrail_dw::Pack<V>*>(pw + c0);
#pragma unroll
          for (int j = 0; j < V; ++j)
            acc[j] += vitrail_dw::load<kBf16>(v.h[j]) * vitrail_dw::load<kBf16>(f.h[j]);
        } else {
          for (int j = 0; j < g.m; ++j) {
            const long long k = c0 * g.m + j;
            acc[0] += vitrail_dw::load<kBf16>(pd[k]) * vitrail_dw::load<kBf16>(pw[k * g.ws[0]]);
          }
        }
      }
    }
    vitrail_dw::Pack<V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) out.h[j] = vitrail_dw::store<kBf16>(acc[j]);
    *reinterpret_cast<vitrail_dw::Pack<V>*>(dx + n * g.xs[0] + h * g.xs[1] + w * g.xs[2] + c0) =
        out;
  }
}

// dw's fp32 partial sums: block (blockIdx.y) b sums pixels [b chunk, (b + 1) chunk) of dy; a
// thread owns V channels of one tap. partials[b][k][r][s] (dw's packed K R S order).
template <int kBf16, int V>
__global__ void __launch_bounds__(256) vitrail_dw_wgrad(
    const unsigned short* __restrict__ dy, const unsigned short* __restrict__ x,
    float* __restrict__ partials, long long chunk, VITRAIL_DW_GEOMETRY) {
  VITRAIL_DW_G;
  const long long kv = g.k / V, work = kv * g.r * g.s;
  const long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= work) return;
  const long long k0 = (t % kv) * V, tap = t / kv;
  const int r = static_cast<int>(tap / g.s), s = static_cast<int>(tap % g.s);
  const long long c0 = k0 / g.m, pixels = g.n * g.p * g.q;
  const long long first = blockIdx.y * chunk;
  const long long last = first + chunk < pixels ? first + chunk : pixels;
  float acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0.f;
  // the first pixel's (n, p, q), then stepped along (no division a pixel)
  long long n = first / (g.q * g.p);
  int p = static_cast<int>(first / g.q % g.p), q = static_cast<int>(first % g.q);
  for (long long pix = first; pix < last; ++pix) {
    const long long h = static_cast<long long>(p) * g.stride[0] - g.pad[0] + r * g.dil[0];
    const long long w = static_cast<long long>(q) * g.stride[1] - g.pad[1] + s * g.dil[1];
    if (h >= 0 && h < g.h && w >= 0 && w < g.w) {
      const unsigned short* pd = dy + n * g.ys[0] + p * g.ys[1] + q * g.ys[2] + k0;
      const unsigned short* px = x + n * g.xs[0] + h * g.xs[1] + w * g.xs[2] + c0;
      if (V > 1) {  // m = 1
        const vitrail_dw::Pack<V> a = *reinterpret_cast<const vitrail_dw::Pack<V>*>(pd);
        const vitrail_dw::Pack<V> b = *reinterpret_cast<const vitrail_dw::Pack<V>*>(px);
#pragma unroll
        for (int j = 0; j < V; ++j)
          acc[j] += vitrail_dw::load<kBf16>(a.h[j]) * vitrail_dw::load<kBf16>(b.h[j]);
      } else {
        acc[0] += vitrail_dw::load<kBf16>(pd[0]) * vitrail_dw::load<kBf16>(px[0]);
      }
    }
    if (++q == g.q) {
      q = 0;
      if (++p == g.p) {
        p = 0;
        ++n;
      }
    }
  }
  float* out = partials + blockIdx.y * g.k * g.r * g.s;
#pragma unroll
  for (int j = 0; j < V; ++j) out[((k0 + j) * g.r + r) * g.s + s] = acc[j];
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


def _taps(weight: Tensor, buffer: Callable[[int, torch.dtype], Tensor]) -> Tensor:
    """The (K, 1, R, S) filter as its taps (R, S, K), packed in buffer(K R S, dtype): a launch
    of our own (a plan replays it), so a thread's channels of a tap are one vector load."""
    k, _, r, s = weight.shape
    out = buffer(k * r * s, weight.dtype)
    wk, _, wr, ws = weight.stride()
    _kernel("taps")[_grid(k * r * s), THREADS](weight.data_ptr(), out, k, r, s, wk, wr, ws)
    return out.view(r, s, k)


# the kernels' parameters (GEOMETRY is a macro, so their signatures are spelled here)
_GEOMETRY = ", ".join(["long long"] * 18 + ["int"] * 7)
_SIGNATURES = {
    "fprop": "const unsigned short*, const unsigned short*, const unsigned short*, "
             "unsigned short*, float, " + _GEOMETRY,
    "dgrad": "const unsigned short*, const unsigned short*, unsigned short*, " + _GEOMETRY,
    "wgrad": "const unsigned short*, const unsigned short*, float*, long long, " + _GEOMETRY,
    "taps": "const unsigned short*, unsigned short*, " + ", ".join(["long long"] * 6),
}


def _bf16(t: Tensor) -> int:
    return int(t.dtype is torch.bfloat16)


def _grid(total: int) -> int:
    """Blocks of a grid-stride loop over total threads' work."""
    return max(1, min(-(-total // THREADS), 65535 * 8))


def fprop(x: Tensor, weight: Tensor, bias: Optional[Tensor], y: Tensor, stride, pad, dilation,
          activation: Optional[str], buffer: Callable[[int, torch.dtype], Tensor],
          slope: float = 0.01) -> None:
    """y (NHWC view) = act(depthwise conv of x (NHWC view) + bias); buffer(n, dtype): scratch
    for the filter's taps."""
    m = weight.shape[0] // x.shape[3]
    v = _vector(m, y.shape[3], x, y)
    act = ACT_IDS[activation] if activation else 0
    taps = _taps(weight, buffer)
    g = _geometry(x, y, taps, stride, pad, dilation)
    total = y.shape[0] * y.shape[1] * y.shape[2] * (y.shape[3] // v)
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()  # the kernel reads K packed values
    _kernel("fprop", _bf16(x), v, act, int(bias is not None))[_grid(total), THREADS](
        x.data_ptr(), taps, bias.data_ptr() if bias is not None else None,
        y.data_ptr(), float(slope), *g)


def dgrad(dy: Tensor, weight: Tensor, dx: Tensor, stride, pad, dilation,
          buffer: Callable[[int, torch.dtype], Tensor]) -> None:
    """dx (NHWC view) of a depthwise convolution from dy (NHWC view), every pixel written;
    buffer(n, dtype): scratch for the filter's taps."""
    m = weight.shape[0] // dx.shape[3]
    v = _vector(m, dx.shape[3], dy, dx)
    taps = _taps(weight, buffer)
    g = _geometry(dx, dy, taps, stride, pad, dilation)
    total = dx.shape[0] * dx.shape[1] * dx.shape[2] * (dx.shape[3] // v)
    _kernel("dgrad", _bf16(dx), v)[_grid(total), THREADS](
        dy.data_ptr(), taps, dx.data_ptr(), *g)


def wgrad(dy: Tensor, x: Tensor, dw: Tensor, stride, pad, dilation,
          partials: Callable[[int], Tensor]) -> tuple[Tensor, int]:
    """The partial sums of dw (K, 1, R, S) of a depthwise convolution from dy and x (NHWC
    views), and how many blocks of dw's size they are: fp32 values from partials(n), which the
    caller adds into dw (the chunked wgrad's sum kernel)."""
    m = dw.shape[0] // x.shape[3]
    v = _vector(m, dy.shape[3], dy, x)
    k, r, s = dw.shape[0], dw.shape[2], dw.shape[3]
    pixels = dy.shape[0] * dy.shape[1] * dy.shape[2]
    tiles = -(-(k // v * r * s) // THREADS)
    blocks = max(1, min(-(-WGRAD_BLOCKS // tiles), -(-pixels // WGRAD_MIN_PIXELS), 65535))
    chunk = max(1, -(-pixels // blocks))
    blocks = max(1, -(-pixels // chunk))  # none empty (but the one of an empty batch: zeros)
    out = partials(blocks * k * r * s)
    _kernel("wgrad", _bf16(x), v)[(tiles, blocks), THREADS](
        dy.data_ptr(), x.data_ptr(), out, chunk,
        *_geometry(x, dy, dw.permute(2, 3, 0, 1)[..., 0], stride, pad, dilation))
    return out, blocks
