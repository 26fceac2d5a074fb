"""Attention of new query rows over a KV cache (decoding), paged or not: the forward kernel's PAGED
variant (sm90_attention_fwd.cuh), with split-KV and GQA packing as attention's decoding path.

    o = attention_kvcache(q, k_cache, v_cache, cache_seqlens)                # (B, capacity, Hkv, D)
    o = attention_kvcache(q, k_cache, v_cache, cache_seqlens, block_table)   # (pages, page, Hkv, D)

Each batch entry's keys are the first cache_seqlens[e] rows of its cache: its own batch entry
of k_cache and v_cache, or with a block table (B, pages a row) int32, its pages in the table's
order, page after page (vLLM's and FlashAttention's layout). The lengths stay on the device, so a
decoding step makes no synchronization and is captured in a CUDA graph; a length past the
cache's capacity (capacity rows, or a table row's pages) is cut to it, as the op cannot see it
without one. The query rows are the last ones of each entry's sequence: ``causal`` and
``window`` are aligned bottom-right (query i of Sq sees key j where j <= i + len - Sq).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from vitrail.jit.errors import ArgumentError
from vitrail.ops.attention import (MAX_GRID_YZ, PLAN_OUTPUTS, PLANS, block_m, block_n,
                                   check_options, check_qkv, decode_route, frozen, generals,
                                   kernel_mask, new_outputs, on_device, paged_dispatch,
                                   paged_into, planned)
from vitrail.ops.common import EAGER, call_mode, check_same_device, check_tensor
from vitrail.plan import GENERAL, signature
from vitrail.plan.native import front

NAME = "vitrail.ops.attention_kvcache"


def _lengths_on_device(q, k_cache, v_cache, cache_seqlens, *args, **kwargs) -> bool:
    """Whether a call may have a C++ plan: its lengths a tensor (an int is in the key, new at
    every decoding step, and each call makes its tensor)."""
    return isinstance(cache_seqlens, Tensor)


@front(PLANS, when=_lengths_on_device)
def attention_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens,
                      block_table: Optional[Tensor] = None, *, causal: bool = False,
                      scale: Optional[float] = None,
                      window: Optional[tuple[Optional[int], Optional[int]]] = None,
                      softcap: Optional[float] = None, return_lse: bool = False,
                      num_splits: Optional[int] = None):
    """softmax(q k^T * scale) v of q (B, Sq, H, D) over each batch entry's cached keys and values
    (see the module docstring); o (B, Sq, H, Dv) and, with return_lse, lse (B, H, Sq) fp32
    (strided where the call is one chunk without packing).

    k_cache (B, capacity, Hkv, D) and v_cache (B, capacity, Hkv, Dv), or with block_table (B,
    max pages) int32: (pages, page, Hkv, D) and (pages, page, Hkv, Dv), page a multiple of 8
    dividing the kernel's block of keys (64 at Dv > 128, else 128) or a multiple of it;
    cache_seqlens: an int32 tensor (B,) on q's device, or an int for every entry. H a multiple of
    Hkv; bf16 or fp16; D and Dv multiples of 16 to 256; the head dim contiguous. causal, window
    and softcap as attention's (aligned bottom-right). num_splits: where no key is masked, each
    entry's keys in that many chunks computed side by side and combined (None: chosen from the
    capacity, as attention's decoding path does; 1: none). No gradient: a forward for decoding.
    An eager call with its lengths a tensor runs its signature's plan (vitrail.plan)."""
    on_gpu = isinstance(cache_seqlens, Tensor)
    mode = call_mode(q, k_cache, v_cache, block_table, cache_seqlens if on_gpu else None)
    if mode == EAGER and on_gpu:
        key = ("kvcache", signature(q), signature(k_cache), signature(v_cache),
               signature(cache_seqlens), None if block_table is None else signature(block_table),
               causal, scale, frozen(window), softcap, return_lse, num_splits)
        hit = planned(key)
        if hit is not None and hit is not GENERAL:  # a signature that passed the checks
            out = hit(q, k_cache, v_cache, cache_seqlens, block_table)
            return out if return_lse else out[0]
    b, sq, h, d, hk, dv, page, capacity = _check(q, k_cache, v_cache, block_table, scale)
    lens = _lengths(cache_seqlens, b, q.device)
    check_options(causal, window, softcap)
    if num_splits is not None and not (isinstance(num_splits, int) and
                                       not isinstance(num_splits, bool) and num_splits >= 1):
        raise ArgumentError(f"{NAME}: num_splits must be None or an integer >= 1, got "
                            f"{num_splits!r}")
    scale = d ** -0.5 if scale is None else float(scale)
    # offsets from the bottom-right diagonal: the kernel adds each sequence's len - Sq
    upper, hi, local, lo = kernel_mask(sq, sq, bool(causal), "top_left", window)
    unmasked = not local and (not upper or hi >= sq - 1)  # every row sees every cached key
    if unmasked:
        upper = local = False
    pack = unmasked and h > hk and sq * (h // hk) <= block_m(d, dv, q.dtype, paged=True)
    route = decode_route(b, sq, h, hk, capacity, block_n(d, dv), pack, unmasked, num_splits,
                         q.device)
    mask = (upper, hi, local, lo)
    if mode != EAGER:
        o, lse = paged_dispatch(q, k_cache, v_cache, lens, block_table, capacity, *route, scale,
                                *mask, float(softcap or 0.0))
        return (o, lse) if return_lse else o
    params = (capacity, *route, scale, *mask, float(softcap or 0.0))
    by_head = route[0] == 1 and route[1] == 1  # the kernel's lse layout
    general = _GENERAL[2 if return_lse else 1]
    if not on_gpu:  # the lengths made here: no plan
        out = new_outputs(q, dv, return_lse, by_head)
        on_device(q, general, q, k_cache, v_cache, lens, block_table, *out, *params)
    else:
        out = on_device(q, PLANS.run, key, (q, k_cache, v_cache, lens, block_table),
                        PLAN_OUTPUTS[return_lse, by_head], general, params)
    return out if return_lse else out[0]


def _paged(q, k_cache, v_cache, lens, table, o, lse, capacity, *route):
    """A plan's general path: paged_into (the capacity first of the params)."""
    paged_into(q, k_cache, v_cache, lens, table, capacity, o, lse, *route)


_GENERAL = generals(_paged, inputs=5)


def _check(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Optional[Tensor], scale):
    """(b, sq, h, d, hk, dv, page, capacity), or an ArgumentError naming what is wrong."""
    check_qkv(NAME, q, k_cache, v_cache, "k_cache", "v_cache",
              dims="pages (or batch), rows and heads")
    (b, sq, h, d), (nk, page, hk, _), dv = q.shape, k_cache.shape, v_cache.shape[3]
    if h > MAX_GRID_YZ or b > MAX_GRID_YZ:
        raise ArgumentError(f"{NAME}: at most {MAX_GRID_YZ} heads and batch entries a call, got "
                            f"{h} heads and batch {b}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ArgumentError(f"{NAME}: scale must be a finite number or None, got {scale!r}")
    if page < 1:
        raise ArgumentError(f"{NAME}: the caches have no rows (dim 1 of k_cache is 0)")
    if block_table is None:
        if nk != b:
            raise ArgumentError(f"{NAME}: without a block_table, k_cache's batch (dim 0, {nk}) "
                                f"must be q's ({b})")
        return b, sq, h, d, hk, dv, page, page
    check_tensor(NAME, "block_table", block_table, dtypes=(torch.int32,), ndim=2)
    check_same_device(NAME, q=q, block_table=block_table)
    if block_table.shape[0] != b or block_table.shape[1] < 1 or block_table.stride(1) != 1:
        raise ArgumentError(f"{NAME}: block_table must be (batch {b}, pages a row >= 1) with "
                            f"its rows contiguous, got {tuple(block_table.shape)} with strides "
                            f"{block_table.stride()}")
    bn = block_n(d, dv)
    if not ((page % bn == 0) or (bn % page == 0 and page % 8 == 0)):
        raise ArgumentError(f"{NAME}: a page of {page} rows (k_cache's dim 1) is not supported "
                            f"at head dims {d}/{dv}: a multiple of {bn}, or a multiple of 8 "
                            f"dividing {bn}")
    capacity = block_table.shape[1] * page
    if capacity >= 2 ** 31:
        raise ArgumentError(f"{NAME}: a table row addresses {capacity} keys; at most 2^31 - 1")
    return b, sq, h, d, hk, dv, page, capacity


def _lengths(cache_seqlens, b: int, device: torch.device) -> Tensor:
    """cache_seqlens as an int32 (b,) tensor on device (an int: every entry's)."""
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        if cache_seqlens < 0:
            raise ArgumentError(f"{NAME}: cache_seqlens must be >= 0, got {cache_seqlens}")
        return torch.full((b,), cache_seqlens, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, Tensor):
        raise ArgumentError(f"{NAME}: cache_seqlens must be an int32 tensor (batch,) or an int, "
                            f"got {type(cache_seqlens).__name__}")
    check_tensor(NAME, "cache_seqlens", cache_seqlens, dtypes=(torch.int32,), ndim=1)
    if cache_seqlens.shape[0] != b or cache_seqlens.device != device:
        raise ArgumentError(f"{NAME}: cache_seqlens must be ({b},) on {device}, got "
                            f"{tuple(cache_seqlens.shape)} on {cache_seqlens.device}")
    return cache_seqlens.contiguous()


def reference_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens,
                      block_table: Optional[Tensor] = None, *, causal: bool = False,
                      scale: Optional[float] = None, window=None, softcap=None):
    """attention_kvcache's (o, lse) in fp64 by gathering each entry's keys and values and calling
    attention's reference with bottom-right alignment (for tests; reads the lengths)."""
    from vitrail.ops.attention import reference
    b = q.shape[0]
    lens = _lengths(cache_seqlens, b, q.device).tolist()
    os, lses = [], []
    for e in range(b):
        if block_table is None:
            k, v = k_cache[e, :lens[e]], v_cache[e, :lens[e]]
        else:
            page = k_cache.shape[1]
            pages = block_table[e, :-(-lens[e] // page)].long()
            k = k_cache[pages].flatten(0, 1)[:lens[e]]
            v = v_cache[pages].flatten(0, 1)[:lens[e]]
        o, lse = reference(q[e:e + 1].double(), k[None].double(), v[None].double(),
                           causal=causal, scale=scale, alignment="bottom_right", window=window,
                           softcap=softcap)
        os.append(o)
        lses.append(lse)
    return torch.cat(os), torch.cat(lses)
