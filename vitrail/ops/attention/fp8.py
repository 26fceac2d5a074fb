"""The FP8 (e4m3) forward of attention: q, k and v in float8_e4m3fn with their descales, o in
bf16 (or fp16), on the forward kernel's FP8 instantiation (sm90_attention_fwd.cuh).

    o = attention_fp8(q8, k8, v8, causal=True, descale_q=sq, descale_k=sk, descale_v=sv)

Each of q, k and v is its real values divided by its descale: a number (per tensor) or a
tensor of one per head (q's H, k's and v's Hkv). Scores are q k^T * descale_q * descale_k *
scale; O is P v * descale_v, with P (in [0, 1]) rounded to e4m3 for the tensor cores, as
FlashAttention-3's FP8 forward does. No gradient: an inference forward, a custom op
(vitrail::attention_fp8_fwd) with a fake impl, so torch.compile traces it.

e4m3 wgmma reads both operands K-major, so the pass before the kernel writes v transposed,
(batch, Hkv, Dv, keys) with the keys padded to a block and, within each 32, in the order in
which P's accumulators lie in the registers the product reads (TileMMA::as_a's key_of): the
kernel then converts P in place, with no shuffle.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Union

import torch
from torch import Tensor

from vitrail.jit.errors import ArgumentError
from vitrail.ops.attention import KERNELS as A_KERNELS, HERE, block_n, check_call, fwd_into
from vitrail.ops.attention import kernel_mask, reference as _reference

NAME = "vitrail.ops.attention_fp8"
DTYPES = (torch.float8_e4m3fn,)
OUT_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = tuple(range(32, 257, 32))  # e4m3 wgmma's k-step is 32
Descale = Union[None, float, Tensor]


def key_order(keys: int) -> Tensor:
    """The key each position of a 32-key group of V^T holds (keys a multiple of 32): position
    16 h + 4 q + 2 i + j holds key 16 h + 8 i + 2 q + j (TileMMA::as_a for 8-bit A)."""
    pos = torch.arange(keys)
    g, r = pos // 32, pos % 32
    h, q, i, j = r // 16, r % 16 // 4, r % 4 // 2, r % 2
    return 32 * g + 16 * h + 8 * i + 2 * q + j


VT_SIGNATURE = ("void* vt, const void* v, int keys, int padded, int heads, long long stride_b, "
                "long long stride_s, long long stride_h")
VT_KEYS, VT_WARPS = 32, 4  # smxx_attention_fp8_vt.cuh: keys padded to 32, warps a CTA


def vt_kernel(dv: int):
    """The compiled smxx_attention_fp8_vt.cuh for v's head dim."""
    key = ("fp8_vt", dv)
    k = A_KERNELS.get(key)
    if k is None:
        from vitrail import jit
        module = jit.compile(f"constexpr int DV = {dv};\n#include \"smxx_attention_fp8_vt.cuh\"\n",
                             name="attention_fp8_vt", backend="nvrtc", include_dirs=[HERE])
        k = A_KERNELS[key] = module.kernel("attention_fp8_vt", VT_SIGNATURE)
    return k


def transposed_v(v: Tensor, keys: int) -> Tensor:
    """v (B, Sk, Hkv, Dv) as the kernel reads it: (B, Dv, Hkv, keys) over storage (B, Hkv, Dv,
    keys), keys >= Sk a multiple of VT_KEYS (zeros past Sk), each 32 in key_order's order: one
    pass of smxx_attention_fp8_vt.cuh (off the GPU: transposed_v_reference)."""
    if v.device.type != "cuda":
        return transposed_v_reference(v, keys)
    b, sk, hk, dv = v.shape
    if keys % VT_KEYS or keys < sk:
        raise ValueError(f"transposed_v: keys must be a multiple of {VT_KEYS} and at least "
                         f"{sk}, got {keys}")
    if not (v.stride(3) == 1 and v.data_ptr() % 4 == 0 and
            all(st % 4 == 0 for st in v.stride()[:3])):
        v = v.contiguous()
    vt = torch.empty((b, hk, dv, keys), dtype=v.dtype, device=v.device)
    if vt.numel():
        with torch.cuda.device(v.device):
            warps = -(-keys // 64) * (dv // 32)  # 64 keys by 32 bytes each
            vt_kernel(dv)[(-(-warps // VT_WARPS), b * hk, 1), 32 * VT_WARPS](
                vt, v.data_ptr(), sk, keys, hk, v.stride(0), v.stride(1), v.stride(2))
    return vt.permute(0, 2, 1, 3)


def transposed_v_reference(v: Tensor, keys: int) -> Tensor:
    """transposed_v by torch's copies (keys a multiple of 32)."""
    b, sk, hk, dv = v.shape
    padded = v.new_zeros((b, keys, hk, dv))
    padded[:, :sk] = v
    # (B, groups, h, i, q, j, Hkv, Dv) in the keys' order -> (B, Hkv, Dv, groups, h, q, i, j)
    groups = padded.view(b, keys // 32, 2, 2, 4, 2, hk, dv)
    vt = groups.permute(0, 6, 7, 1, 2, 4, 3, 5).reshape(b, hk, dv, keys)
    return vt.permute(0, 2, 1, 3)


def _number(name: str, value: Descale) -> bool:
    """Whether a descale is None or a number (checked: positive and finite)."""
    if value is None:
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not (math.isfinite(value) and value > 0):
            raise ArgumentError(f"{NAME}: {name} must be positive and finite, got {value!r}")
        return True
    return False


def _all_descales(named, device: torch.device) -> Tensor:
    """q's, k's and v's descales of (name, value, heads) triples, one fp32 per head each, in the
    kernel's order."""
    return torch.cat([_descales(name, value, heads, device) for name, value, heads in named])


# the descales of None or numbers, made once (not three fills and a cat a call)
_constant_descales = functools.lru_cache(maxsize=64)(_all_descales)


def _descales(name: str, value: Descale, heads: int, device: torch.device) -> Tensor:
    """A descale as the kernel reads it: one fp32 per head."""
    if _number(name, value):
        return torch.full((heads,), 1.0 if value is None else float(value), dtype=torch.float32,
                          device=device)
    if not isinstance(value, Tensor):
        raise ArgumentError(f"{NAME}: {name} must be None, a number or a tensor, got "
                            f"{type(value).__name__}")
    if value.numel() not in (1, heads) or value.dim() > 1:
        raise ArgumentError(f"{NAME}: {name} must hold one value (per tensor) or one per head "
                            f"({heads}), got shape {tuple(value.shape)}")
    if not value.is_floating_point() or value.device != device:
        raise ArgumentError(f"{NAME}: {name} must be a floating tensor on {device}, got "
                            f"{value.dtype} on {value.device}")
    return value.reshape(-1).float().expand(heads).contiguous()


def attention_fp8(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                  scale: Optional[float] = None, alignment: str = "top_left",
                  window: Optional[tuple[Optional[int], Optional[int]]] = None,
                  softcap: Optional[float] = None, descale_q: Descale = None,
                  descale_k: Descale = None, descale_v: Descale = None,
                  return_lse: bool = False, out_dtype: torch.dtype = torch.bfloat16):
    """softmax(q k^T * scale) v per batch and head from e4m3 q (B, Sq, H, D), k (B, Sk, Hkv,
    D) and v (B, Sk, Hkv, Dv), D and Dv multiples of 32 to 256; o (B, Sq, H, Dv) of out_dtype;
    causal, alignment, window and softcap as attention's (see the module docstring for the
    descales)."""
    check_call(q, k, v, scale, alignment, causal, window, softcap, op=NAME, dtypes=DTYPES,
               head_dims=HEAD_DIMS)
    if out_dtype not in OUT_DTYPES:
        raise ArgumentError(f"{NAME}: out_dtype must be torch.bfloat16 or torch.float16, got "
                            f"{out_dtype}")
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    named = (("descale_q", descale_q, h), ("descale_k", descale_k, hk),
             ("descale_v", descale_v, hk))
    # kept from call to call, so not made while a graph is captured (its fills would not run)
    if (all(_number(n, x) for n, x, _ in named) and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing()):
        descale = _constant_descales(named, q.device)
    else:
        descale = _all_descales(named, q.device)
    scale = d ** -0.5 if scale is None else float(scale)
    mask = kernel_mask(sq, sk, bool(causal), alignment, window)
    o, lse = _fp8_fwd(q, k, v, descale, scale, *mask, float(softcap or 0.0), out_dtype)
    return (o, lse) if return_lse else o


@torch.library.custom_op("vitrail::attention_fp8_fwd", mutates_args=())
def _fp8_fwd(q: Tensor, k: Tensor, v: Tensor, descale: Tensor, scale: float, causal: bool,
             causal_offset: int, local: bool, local_offset: int, softcap: float,
             out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(o, lse) of checked e4m3 q, k and v: the V^T pass, then the forward's FP8 kernel
    (descale: the kernel's fp32 descales; the mask as attention's kernel_mask gives it)."""
    b, sq, h, d = q.shape
    sk, dv = k.shape[1], v.shape[3]
    o = q.new_empty((b, sq, h, dv), dtype=out_dtype)
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    bn = block_n(d, dv)
    vt = transposed_v(v, -(-sk // bn) * bn) if o.numel() and sk else v  # else no launch
    fwd_into(q, k, vt, o, lse, scale, causal, causal_offset, local, local_offset, softcap,
             descale=descale)
    return o, lse


@_fp8_fwd.register_fake
def _fp8_fwd_fake(q, k, v, descale, scale, causal, causal_offset, local, local_offset, softcap,
                  out_dtype):
    b, sq, h, _ = q.shape
    return (q.new_empty((b, sq, h, v.shape[3]), dtype=out_dtype),
            q.new_empty((b, h, sq), dtype=torch.float32))


def reference(q: Tensor, k: Tensor, v: Tensor, *, descale_q: Descale = None,
              descale_k: Descale = None, descale_v: Descale = None, **options):
    """attention_fp8's result in fp64 from the same e4m3 values and descales (attention's
    reference on the descaled tensors); P is not rounded to e4m3 here."""
    def real(t, d, heads):
        scales = _descales("descale", d, heads, t.device).double().view(1, 1, heads, 1)
        return t.double() * scales
    h, hk = q.shape[2], k.shape[2]
    return _reference(real(q, descale_q, h), real(k, descale_k, hk), real(v, descale_v, hk),
                       **options)
