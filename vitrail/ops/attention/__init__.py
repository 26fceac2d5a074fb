"""vitrail.ops.attention: flash attention's forward on Hopper, written with vitrail's blocks
(TileMMA, Tma, Pipeline; the kernel is sm90_attention_fwd.cuh).

    o = attention(q, k, v, causal=True)                    # (batch, seqlen, heads, v's head_dim)
    o, lse = attention(q, k, v, return_lse=True)           # lse: (batch, heads, seqlen_q) fp32

q (B, Sq, H, D), k (B, Sk, Hkv, D) and v (B, Sk, Hkv, Dv) with H a multiple of Hkv (GQA, MQA),
bf16 or fp16, D and Dv multiples of 16 from 16 to 256 (Dv = D, or another: o is (B, Sq, H, Dv)),
the last dim contiguous (SDPA's (B, H, S, D) tensors pass as ``x.transpose(1, 2)`` without a
copy). ``scale`` defaults to D ** -0.5. ``causal``: key j is visible to query i where j <= i
(``alignment="top_left"``, as torch SDPA) or j <= i + Sk - Sq (``"bottom_right"``, as
FlashAttention >= 2.1); ``window=(left, right)`` (a sliding window, each side a number of keys
or None for unbounded) makes key j visible to query i only where i + offset - left <= j <= i +
offset + right, with the same offset (causal=True is right = 0); ``softcap`` caps the scaled
scores to softcap * tanh(s / softcap) (Gemma 2). A row that sees no key gives zeros and an lse
of -inf. Every refusal names the argument. The backward (q, k and v, and through the lse too)
runs fused kernels at D = Dv of 64 and 128 (sm90_attention_bwd.cuh), else torch's batched
matmuls a block of query rows at a time (``backward.py``). The fused backward is by default the
fast one: a kernel per block of keys makes dK, dV and dQ, summing dQ over the blocks of keys
with atomics (its rounding, so dq's last bits, vary from run to run); ``deterministic=True`` (or
``torch.use_deterministic_algorithms(True)``) runs two kernels without atomics (dQ over the
keys, dK and dV over the query rows: the same bits every run, S and dP computed twice).
``attention_varlen`` takes sequences of their own lengths packed along the rows
(FlashAttention's cu_seqlens); ``attention_fp8`` (fp8.py) the FP8 (e4m3) forward.

Kernels compile with NVRTC in seconds, one per (dtype, D, Dv, causal); a new sequence length or
batch compiles nothing. Where no key is masked (decoding: few query rows, many keys), the keys
of each batch entry are split into chunks computed side by side and combined where one pass
would leave SMs idle (split-KV; ``num_splits=n`` sets the chunks, 1 none), and a GQA group's
query heads share their K and V's reads (packed into one tile's rows), from DECODE_MIN_KEYS keys:
without gradients through attention_kvcache's PAGED forward over k and v in place (paged_into),
with them through the varlen kernel and its backward (_split_keys). An eager call without
gradients replays its signature's plan from the signature's second call (vitrail.plan).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from vitrail.device import ctype, is_hopper, sm_count, target_limits
from vitrail.jit.errors import ArgumentError
from vitrail.jit.tma import tensor_map
from vitrail.ops.attention.backward import attention_backward
from vitrail.ops.common import EAGER, call_mode, check_same_device, check_tensor
from vitrail.ops.common import persistent as made_aside
from vitrail.ops.copy import copy
from vitrail.plan import GENERAL, Plans, keep, scratch, setup, signature
from vitrail.plan.native import front

HERE = Path(__file__).resolve().parent
NAME = "vitrail.ops.attention"
DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = tuple(range(16, 257, 16))
ALIGNMENTS = ("top_left", "bottom_right")
STAGES = 2
# The forward's grid: a CTA per SM taking tiles from a counter up to this many keys a sequence,
# a CTA per tile beyond (chosen on the attention benchmark's grid: the persistent grid gains most
# where a tile has few blocks of keys; past this its consumers' 8 fewer registers cost more than
# its overlap gains)
PERSISTENT_MAX_KEYS = 4096


def persistent_for(seqlen_k: int, tiles: int, sms: int) -> bool:
    """Whether the forward of `tiles` tiles over seqlen_k keys (varlen: the longest sequence's)
    runs the persistent grid: not where every tile has an SM of its own (the grid would be the
    same, plus the counters' atomics)."""
    return seqlen_k <= PERSISTENT_MAX_KEYS and tiles > sms

MAX_GRID_YZ = 65535  # heads on the grid's y, batch on its z
SMEM_LIMIT = 227 * 1024  # dynamic shared memory a CTA may take on Hopper
KERNELS: dict[tuple, object] = {}


# query rows of a sequence from which D <= 64 takes three consumer warpgroups (measured: docs/
# perf-notes.md#three-consumer-warpgroups-at-small-head-dims)
WG3_MIN_ROWS = 2048


def warpgroups(d: int, dv: Optional[int] = None, dtype: torch.dtype = torch.bfloat16,
               paged: bool = False, rows: Optional[int] = None) -> int:
    """The forward's consumer warpgroups (64 query rows each): 3 for bf16 and fp16 at D and Dv
    of 64 or less (each one's products are short there, the softmax long: a third keeps the
    tensor cores busy; FlashAttention-3's choice) where a sequence has at least WG3_MIN_ROWS
    query rows (rows; None: the largest tile a call may take), else 2 (shorter sequences lose
    more to 192-row tiles' partial last tile and causal diagonal than they gain; PAGED; FP8, an
    8-bit dtype)."""
    dv = d if dv is None else dv
    small = dtype in DTYPES and d <= 64 and dv <= 64 and not paged
    return 3 if small and (rows is None or rows >= WG3_MIN_ROWS) else 2


def block_m(d: int, dv: Optional[int] = None, dtype: torch.dtype = torch.bfloat16,
            paged: bool = False, rows: Optional[int] = None) -> int:
    """Query rows a CTA's tile: 64 a consumer warpgroup (warpgroups)."""
    return 64 * warpgroups(d, dv, dtype, paged, rows)


def block_n(d: int, dv: Optional[int] = None) -> int:
    """Keys per block: 128 where S's and O's (Dv wide) fragments fit the consumers' registers
    with it and two stages of K and V fit shared memory, else 64."""
    dv = d if dv is None else dv
    return 128 if dv <= 128 and _smem(d, dv, 128, 2, block_m(d, dv)) <= SMEM_LIMIT else 64


def chunk(d: int, size: int = 2) -> int:
    """A head dim's slice in one TMA box, in elements of size bytes: the widest of 128-, 64- and
    32-byte rows that divides d's, the swizzle of the kernel's shared-memory tiles (tile_mma's
    SmemTile picks its atom by the same rule)."""
    return next(c for c in (128, 64, 32) if d * size % c == 0) // size


# wgmma widths (N) CuTe's selectors take without CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
STOCK_MMA_N = (8, 16, 32, 64, 96, 128, 192, 256)


def _smem(d: int, dv: int, bn: int, e: int, bm: int) -> int:
    """The forward's shared memory (the .cuh's kSmemBytes): Q (bm rows), STAGES blocks of K and
    V, the barriers and the scheduled tiles, 1024 bytes to align."""
    return 1024 + bm * d * e + STAGES * bn * (d + dv) * e + 16 * STAGES + 24


def smem_bytes(d: int, dtype: torch.dtype = torch.bfloat16, dv: Optional[int] = None,
               paged: bool = False, wg: Optional[int] = None) -> int:
    """The forward's shared memory (wg: its consumer warpgroups; None: warpgroups')."""
    dv = d if dv is None else dv
    return _smem(d, dv, block_n(d, dv), torch.finfo(dtype).bits // 8,
                 64 * wg if wg else block_m(d, dv, dtype, paged))


def source(dtype: torch.dtype, d: int, causal: bool, pingpong: bool = True, local: bool = False,
           softcap: bool = False, varlen: bool = False, dv: Optional[int] = None,
           persistent: bool = True, paged: bool = False,
           out_dtype: Optional[torch.dtype] = None, wg: Optional[int] = None) -> str:
    """The forward's instantiation; an 8-bit dtype (e4m3) is the FP8 forward, its output
    out_dtype (bf16 or fp16; else o is q's dtype); wg: its consumer warpgroups (None:
    warpgroups' for any length)."""
    dv = d if dv is None else dv
    fp8 = dtype.itemsize == 1
    wg = wg or warpgroups(d, dv, dtype, paged)
    config = {"D": d, "DV": dv, "WG": wg, "BM": 64 * wg, "BN": block_n(d, dv), "STAGES": STAGES}
    flags = {"CAUSAL": causal, "LOCAL": local, "SOFTCAP": softcap, "VARLEN": varlen or paged,
             "PAGED": paged, "PINGPONG": pingpong, "PERSISTENT": persistent, "FP8": fp8}
    # P V is one wgmma Dv wide per 16 keys; Dv of 80, 112, 160... is among CuTe's extended
    # shapes (their headers cost compile time, so only where needed)
    extended = dv not in STOCK_MMA_N
    return (("#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED\n" if extended else "") +
            "#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n" +
            ("#include <cuda_fp8.h>\n" if fp8 else "") +
            f"using T = {ctype(dtype)};\nusing TO = {ctype(out_dtype or dtype)};\n" +
            "".join(f"constexpr int {k} = {v};\n" for k, v in config.items()) +
            "".join(f"constexpr bool {k} = {'true' if v else 'false'};\n"
                    for k, v in flags.items()) +
            '#include "sm90_attention_fwd.cuh"\n')


SIGNATURE = ("void* o, float* lse, const vitrail::TensorMap mapQ, const vitrail::TensorMap mapK, "
             "const vitrail::TensorMap mapV, int seqlen_q, int seqlen_k, int heads, "
             "int heads_kv, float scale_log2, int causal_offset, int local_offset, float softcap, "
             "float softcap_pre, const int* cu_q, const int* cu_k, int total_q, int bottom_right, "
             "const int* kv_lens, const int* table, int table_stride, int page, int splits, "
             "int chunk_keys, int row_blocks, int tiles, int* tile_counter, "
             "const float* descale")


def kernel(dtype: torch.dtype, d: int, causal: bool, pingpong: bool = True, local: bool = False,
           softcap: bool = False, varlen: bool = False, dv: Optional[int] = None,
           persistent: bool = True, paged: bool = False,
           out_dtype: Optional[torch.dtype] = None, wg: Optional[int] = None):
    """The compiled forward (pingpong=False: the warpgroups in lockstep; persistent=False: a CTA
    per tile; both kept to measure the defaults against, which the op always runs). causal:
    keys right of the diagonal (shifted by a window's right size) masked; local: keys left of a
    window masked; softcap: the scores capped with tanh; varlen: sequences packed along the
    rows; paged: varlen's query rows over a KV cache (kvcache.py); dv: v's head dim (default
    d); an 8-bit dtype: the FP8 forward (fp8.py), o of out_dtype; wg: the consumer warpgroups
    (warpgroups' for the call's rows; None: for any length). Launch it with :func:`launch`,
    given the same wg."""
    dv = d if dv is None else dv
    out_dtype = out_dtype or dtype
    wg = wg or warpgroups(d, dv, dtype, paged)
    key = (dtype, d, dv, causal, pingpong, local, softcap, varlen or paged, persistent, paged,
           out_dtype, wg)
    k = KERNELS.get(key)
    if k is None:
        from vitrail import jit
        # CuTe's constexpr helpers carry no __device__: NVRTC needs -default-device
        module = jit.compile(source(dtype, d, causal, pingpong, local, softcap, varlen, dv,
                                    persistent, paged, out_dtype, wg),
                             name="attention_fwd",
                             backend="nvrtc", include_dirs=[HERE], flags=["-default-device"])
        k = KERNELS[key] = module.kernel("attention_fwd", SIGNATURE)
    return k


_COUNTERS: dict[tuple[int, int], Tensor] = {}


def tile_counters(device: torch.device) -> Tensor:
    """The persistent forward's two int32 counters for a launch on device's current stream:
    kept per (device, stream), as the kernel leaves them zero at its end (launches on one stream
    run one after another). While a CUDA graph is being captured, a fresh pair (zeroed by a
    captured fill, owned by the graph): a graph may replay on another stream beside that
    stream's eager launches."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(2, dtype=torch.int32, device=device)
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    found = _COUNTERS.get(key)
    if found is None:
        with setup():  # kept: no reason to refuse a plan of the call
            found = _COUNTERS[key] = made_aside(
                lambda: torch.zeros(2, dtype=torch.int32, device=device), device)
    keep(found)  # a plan passes them as constants (plans hold on their own stream only)
    return found


def launch(fwd, o: Tensor, lse: Tensor, q4: Tensor, k4: Tensor, v4: Tensor, seqlen_q: int,
           seqlen_k: int, batch: int, scale: float, causal_offset: int, local_offset: int,
           softcap: float, cu_q: Optional[Tensor] = None, cu_k: Optional[Tensor] = None,
           bottom_right: bool = False, persistent: bool = True,
           paged: Optional[tuple] = None, descale: Optional[Tensor] = None,
           wg: Optional[int] = None) -> None:
    """Run a forward kernel (:func:`kernel`'s, built with the same persistent) over q4, k4 and v4
    as (batch, seqlen, heads, head dim) tensors TMA can read (varlen: one batch of every row,
    seqlen_q the longest sequence's rows, cu_q and cu_k the offsets, o packed; paged: q4 (batch,
    rows, heads, D), k4 and v4 the cache, its pages or its batch entries as the batch, and
    paged = (kv_lens, table or None, table_stride, page, splits, chunk_keys), the kernel's PAGED
    parameters): a CTA per tile, or per SM with tile counters (tile_counters: zero at the
    launch, and zero again at its end). FP8 (descale: the kernel's descales, fp32): v4 is V^T,
    (batch, DV, heads, keys) with the keys contiguous (fp8.transposed_v)."""
    h, hk, d = q4.shape[2], k4.shape[2], q4.shape[3]
    dv = v4.shape[3] if descale is None else v4.shape[1]
    wg = wg or warpgroups(d, dv, q4.dtype, paged is not None)  # the kernel's (its source's WG)
    bm = 64 * wg
    row_blocks = -(-seqlen_q // bm)
    if persistent:
        counter = tile_counters(q4.device)
        grid = (min(row_blocks * h * batch, sm_count(q4.device.index)), 1, 1)
    else:
        counter, grid = None, (row_blocks, h, batch)
    bn = block_n(d, dv)
    varlen = cu_q is not None
    kv_lens, table, table_stride, page, splits, chunk_keys = paged or (None, None, 0, 0, 1, 0)
    box = min(page, bn) if table is not None else bn  # a box of keys in one page
    map_v = _map(v4, box) if descale is None else _map(v4, dv, width=bn)
    with torch.cuda.device(q4.device):
        fwd[grid, 128 * (1 + wg)](
            o, lse, _map(q4, bm), _map(k4, box), map_v, seqlen_q, seqlen_k, h, hk,
            (1.0 if softcap > 0 else scale) * math.log2(math.e), causal_offset, local_offset,
            softcap, scale / softcap if softcap > 0 else 0.0, cu_q, cu_k,
            o.shape[0] if varlen else 0, int(bottom_right), kv_lens, table, table_stride,
            page, splits, chunk_keys, row_blocks, row_blocks * h * batch, counter, descale,
            shared_mem=smem_bytes(d, q4.dtype, dv, paged is not None, wg))


# The backward's kernels (sm90_attention_bwd.cuh): dQ over the keys, dK and dV over the rows.
BWD_HEAD_DIMS = (64, 128)  # larger: dK and dV's fp32 sums do not fit a thread's registers
BWD = {"BM": 128, "BN": 64, "BK": 128, "BQ": 64, "STAGES": 2}
BWD_THREADS = 384
ROWS_PADDED = 128  # lse2 and delta are padded to a multiple of BM and BQ


def bwd_source(dtype: torch.dtype, d: int, causal: bool, local: bool = False,
               softcap: bool = False, varlen: bool = False, deterministic: bool = False) -> str:
    """The backward's instantiation: the fast one (attention_bwd_dkv sums dQ into an fp32 slab
    with atomics, attention_bwd_dq_convert writes it as dq) or, deterministic, the two kernels
    without atomics."""
    flags = {"ATOMIC_DQ": not deterministic, "CAUSAL": causal, "LOCAL": local,
             "SOFTCAP": softcap, "VARLEN": varlen}
    return ("#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n"
            f"using T = {ctype(dtype)};\nconstexpr int D = {d};\n" +
            "".join(f"constexpr int {k} = {v};\n" for k, v in BWD.items()) +
            "".join(f"constexpr bool {k} = {'true' if v else 'false'};\n"
                    for k, v in flags.items()) +
            '#include "sm90_attention_bwd.cuh"\n')


_BWD_INTS = ("int seqlen_q, int seqlen_k, int seqlen_q_padded, int heads, int heads_kv, "
             "float scale_log2, float scale, int causal_offset, int local_offset, float softcap, "
             "float softcap_pre, const int* cu_q, const int* cu_k, const int* cu_pad, "
             "int bottom_right")
BWD_SIGNATURES = {
    "attention_bwd_dq": "void* dq, float* lse2, float* delta, const vitrail::TensorMap mapQ, "
                        "const vitrail::TensorMap mapdO, const vitrail::TensorMap mapK, "
                        "const vitrail::TensorMap mapV, " + _BWD_INTS,
    "attention_bwd_dkv": "void* dk, void* dv, float* lse2, float* delta, "
                         "const vitrail::TensorMap mapK, const vitrail::TensorMap mapV, "
                         "const vitrail::TensorMap mapQ, const vitrail::TensorMap mapdO, " +
                         _BWD_INTS + ", float* dq_accum",
    "attention_bwd_dq_convert": "void* dq, const float* dq_accum, int seqlen_q, "
                                "int seqlen_q_padded, int heads, float scale, const int* cu_q, "
                                "const int* cu_pad"}
DQ_CONVERT_THREADS = 256


def bwd_kernel_names(deterministic: bool) -> tuple[str, str]:
    """The kernels a backward launches, in order: dQ's, then dK and dV's (deterministic); dK,
    dV and dQ's sums, then dq from them (the fast one). Each build holds all three entry
    points; the one a backward does not launch is empty."""
    return (("attention_bwd_dq", "attention_bwd_dkv") if deterministic else
            ("attention_bwd_dkv", "attention_bwd_dq_convert"))


def bwd_kernels(dtype: torch.dtype, d: int, causal: bool, local: bool = False,
                softcap: bool = False, varlen: bool = False, deterministic: bool = False) -> dict:
    """The compiled backward: {name: kernel} for bwd_kernel_names(deterministic)."""
    key = ("bwd", dtype, d, causal, local, softcap, varlen, deterministic)
    k = KERNELS.get(key)
    if k is None:
        from vitrail import jit
        module = jit.compile(bwd_source(dtype, d, causal, local, softcap, varlen, deterministic),
                             name="attention_bwd",
                             backend="nvrtc", include_dirs=[HERE], flags=["-default-device"])
        k = KERNELS[key] = {name: module.kernel(name, BWD_SIGNATURES[name])
                             for name in bwd_kernel_names(deterministic)}
    return k


def bwd_smem_bytes(d: int, dtype: torch.dtype = torch.bfloat16,
                   deterministic: bool = True) -> dict:
    """Dynamic shared memory of each backward kernel (the .cuh's kSmemBytes); the fast
    backward's attention_bwd_dkv adds two dS tiles (T) and two warpgroups' dQ tiles (fp32)."""
    e = torch.finfo(dtype).bits // 8
    c = BWD
    barriers = 16 * c["STAGES"] + 16
    stage = -(-(2 * c["BQ"] * d * e + 2 * c["BQ"] * 4) // 1024) * 1024
    atomic = 0 if deterministic else 2 * c["BQ"] * c["BK"] * e + 2 * c["BQ"] * 64 * 4
    return {"attention_bwd_dq": 1024 + 2 * c["BM"] * d * e + c["STAGES"] * 2 * c["BN"] * d * e +
            barriers,
            "attention_bwd_dkv": 1024 + 2 * c["BK"] * d * e + c["STAGES"] * stage + atomic +
            barriers,
            "attention_bwd_dq_convert": 0}


def _rows_of(grad_o: Tensor, grad_lse: Optional[Tensor], o: Tensor,
             lse: Tensor) -> tuple[Tensor, Tensor]:
    """What the backward's kernels read per query row, in lse's layout: lse2 = lse * log2(e)
    (+inf where a row sees no key: P = 0) and delta = rowsum(dO * O) - the lse's gradient."""
    lse2 = torch.where(torch.isinf(lse), math.inf, lse * math.log2(math.e))
    delta = (grad_o.float() * o.float()).sum(-1).transpose(-1, -2)
    return lse2, delta if grad_lse is None else delta - grad_lse


def _run_backward(kernels: dict, dq: Tensor, dk: Tensor, dv: Tensor, lse2: Tensor,
                  delta: Tensor, q4: Tensor, k4: Tensor, v4: Tensor, do4: Tensor, rows: int,
                  keys: int, batch: int, ints: tuple, varlen: tuple) -> None:
    """Launch bwd_kernels' kernels on (batch, seqlen, heads, D) tensors TMA can read: the
    deterministic ones (dQ over rows of each of batch sequences; dK and dV over keys) or the
    fast ones (dK and dV over keys, dQ summed into fp32 zeros with lse2's rows; then dq from
    them); ints: the lengths, heads and scales (_BWD_INTS' order up to softcap_pre); varlen:
    cu_q, cu_k, cu_pad, bottom_right (Nones and 0 without)."""
    h, hk, d = q4.shape[2], k4.shape[2], q4.shape[3]
    deterministic = "attention_bwd_dq" in kernels
    smem, c = bwd_smem_bytes(d, q4.dtype, deterministic), BWD
    with torch.cuda.device(q4.device):
        accum = None
        if deterministic:
            kernels["attention_bwd_dq"][(-(-rows // c["BM"]), h, batch), BWD_THREADS](
                dq, lse2, delta, _map(q4, c["BM"]), _map(do4, c["BM"]), _map(k4, c["BN"]),
                _map(v4, c["BN"]), *ints, *varlen, shared_mem=smem["attention_bwd_dq"])
        else:  # a fill on the stream (no synchronization; captured with a CUDA graph's)
            accum = torch.zeros(lse2.shape + (d,), dtype=torch.float32, device=lse2.device)
        kernels["attention_bwd_dkv"][(-(-keys // c["BK"]), hk, batch), BWD_THREADS](
            dk, dv, lse2, delta, _map(k4, c["BK"]), _map(v4, c["BK"]), _map(q4, c["BQ"]),
            _map(do4, c["BQ"]), *ints, *varlen, accum, shared_mem=smem["attention_bwd_dkv"])
        if not deterministic:
            seqlen_q, padded, scale = ints[0], ints[2], ints[6]
            kernels["attention_bwd_dq_convert"][(-(-rows // c["BQ"]), h, batch),
                                                DQ_CONVERT_THREADS](
                dq, accum, seqlen_q, padded, h, scale, varlen[0], varlen[2])


def _bwd_ints(seqlen_q: int, seqlen_k: int, padded: int, h: int, hk: int, scale: float,
              causal_offset: int, local_offset: int, softcap: float) -> tuple:
    """The backward kernels' scalar arguments, _BWD_INTS' order up to softcap_pre."""
    return (seqlen_q, seqlen_k, padded, h, hk,
            (1.0 if softcap > 0 else scale) * math.log2(math.e), scale, causal_offset,
            local_offset, softcap, scale / softcap if softcap > 0 else 0.0)


def _fused_backward(grad_o, grad_lse, q, k, v, o, lse, scale, causal, causal_offset,
                    local=False, local_offset=0, softcap=0.0, deterministic=False):
    """The backward's kernels on a Hopper GPU: the fast ones (dQ summed with atomics) or,
    deterministic, the two without atomics."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    padded = -(-sq // ROWS_PADDED) * ROWS_PADDED
    lse2 = lse.new_full((b, h, padded), math.inf)
    delta = lse.new_zeros((b, h, padded))
    lse2[..., :sq], delta[..., :sq] = _rows_of(grad_o, grad_lse, o, lse)
    q, k, v, grad_o = (_tma_ready(t) for t in (q, k, v, grad_o))
    dq = q.new_empty((b, sq, h, d))
    dk, dv = k.new_empty((b, sk, hk, d)), v.new_empty((b, sk, hk, d))
    _run_backward(bwd_kernels(q.dtype, d, causal, local, softcap > 0,
                              deterministic=deterministic), dq, dk, dv, lse2, delta,
                  q, k, v, grad_o, sq, sk, b,
                  _bwd_ints(sq, sk, padded, h, hk, scale, causal_offset, local_offset, softcap),
                  (None, None, None, 0))
    return dq, dk, dv


def _varlen_rows(grad_o: Tensor, grad_lse: Optional[Tensor], o: Tensor, lse: Tensor,
                 cu_seqlens_q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(lse2, delta, cu_pad) of a packed backward, on the device with no synchronization:
    lse2 and delta (H, padded) hold each sequence's rows from cu_pad[i], a multiple of
    ROWS_PADDED, with +inf and 0 between sequences (a block of rows past its sequence's end
    gets P = 0 and adds nothing)."""
    h, total = lse.shape
    batch = cu_seqlens_q.shape[0] - 1
    cu = cu_seqlens_q.long()
    lengths = cu[1:] - cu[:-1]
    cu_pad = torch.zeros_like(cu)
    cu_pad[1:] = torch.cumsum(-(-lengths // ROWS_PADDED) * ROWS_PADDED, 0)
    padded = -(-total // ROWS_PADDED) * ROWS_PADDED + ROWS_PADDED * batch  # >= cu_pad[-1]
    row = torch.arange(total, device=lse.device)
    seq = torch.searchsorted(cu[1:], row, right=True)  # each packed row's sequence
    dest = cu_pad[seq] + row - cu[seq]
    lse2 = lse.new_full((h, padded), math.inf)
    delta = lse.new_zeros((h, padded))
    lse2[:, dest], delta[:, dest] = _rows_of(grad_o, grad_lse, o, lse)
    return lse2, delta, cu_pad.int()


def fused_varlen_backward(grad_o: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor,
                          v: Tensor, o: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                          cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                          scale: float, causal: bool, causal_offset: int, local: bool,
                          local_offset: int, softcap: float, bottom_right: bool,
                          deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The fused kernels' backward of attention_varlen (D = Dv of 64 or 128, Hopper; the fast
    ones or, deterministic, the two without atomics): one launch each for every sequence, no
    host synchronization; the grids cover max_seqlen_q rows and max_seqlen_k keys of each
    sequence, which must be at least its lengths."""
    total_q, h, d = q.shape
    total_k, hk = k.shape[0], k.shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    lse2, delta, cu_pad = _varlen_rows(grad_o, grad_lse, o, lse, cu_seqlens_q)
    q4, k4, v4, do4 = (_tma_ready(t.unsqueeze(0)) for t in (q, k, v, grad_o))  # one "batch"
    if min(total_q, total_k, batch, max_seqlen_q, max_seqlen_k) == 0:  # no row sees a key
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    # every row and key is written: a sequence's CTAs cover its rows (dQ) and keys (dK, dV)
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    _run_backward(bwd_kernels(q.dtype, d, causal, local, softcap > 0, varlen=True,
                              deterministic=deterministic), dq, dk, dv,
                  lse2, delta, q4, k4, v4, do4, max_seqlen_q, max_seqlen_k, batch,
                  _bwd_ints(0, 0, lse2.shape[1], h, hk, scale, causal_offset, local_offset,
                            softcap),
                  (cu_seqlens_q.int(), cu_seqlens_k.int(), cu_pad, int(bottom_right)))
    return dq, dk, dv


def check_options(causal: bool, window, softcap) -> None:
    """The window and the softcap: ArgumentError naming the one that is wrong."""
    if window is not None:
        if not (isinstance(window, (tuple, list)) and len(window) == 2 and
                all(w is None or (isinstance(w, int) and not isinstance(w, bool) and w >= 0)
                    for w in window)):
            raise ArgumentError(f"{NAME}: window must be (left, right), each a number of keys "
                                f">= 0 or None (unbounded), got {window!r}")
        if causal and window[1] not in (None, 0):
            raise ArgumentError(f"{NAME}: causal=True is a window's right size of 0; got "
                                f"causal=True and window={tuple(window)}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and
                                    not isinstance(softcap, bool) and
                                    math.isfinite(softcap) and softcap > 0):
        raise ArgumentError(f"{NAME}: softcap must be a positive finite number or None, got "
                            f"{softcap!r}")


def check_qkv(op: str, q: Tensor, k: Tensor, v: Tensor, k_name: str = "k", v_name: str = "v",
              dims: str = "batch, seqlen and heads", dtypes: tuple = DTYPES,
              head_dims: tuple = HEAD_DIMS) -> None:
    """What every attention call asks of q (.., .., H, D), k (.., .., Hkv, D) and v (.., ..,
    Hkv, Dv): 4-D CUDA tensors of one of dtypes and one device, k and v alike but for the head
    dim, H a multiple of Hkv, head dims among head_dims (an arithmetic range); an error naming
    the tensor otherwise."""
    for name, t in (("q", q), (k_name, k), (v_name, v)):
        check_tensor(op, name, t, dtypes=dtypes, ndim=4)
    check_same_device(op, **{"q": q, k_name: k, v_name: v})
    if not (q.dtype == k.dtype == v.dtype):
        raise ArgumentError(f"{op}: q, {k_name} and {v_name} must have one dtype, got {q.dtype}, "
                            f"{k.dtype} and {v.dtype}")
    h, d, hk, dk, dv = q.shape[2], q.shape[3], k.shape[2], k.shape[3], v.shape[3]
    if v.shape[:3] != k.shape[:3]:
        raise ArgumentError(f"{op}: {v_name} {tuple(v.shape)} does not match {k_name} "
                            f"{tuple(k.shape)}: {dims} (dims 0 to 2) must agree (the head dim "
                            f"may differ)")
    if dk != d:
        raise ArgumentError(f"{op}: {k_name}'s head_dim (dim 3) must be q's {d}, got {dk} "
                            f"({k_name} {tuple(k.shape)}, q {tuple(q.shape)}); {v_name}'s may "
                            f"differ")
    if hk < 1 or h % hk:
        raise ArgumentError(f"{op}: q's heads ({h}) must be a multiple of {k_name}'s and "
                            f"{v_name}'s ({hk})")
    for name, n in ((f"q's and {k_name}'s", d), (f"{v_name}'s", dv)):
        if n not in head_dims:
            raise NotImplementedError(f"{op}: {name} head_dim {n} is not supported; "
                                      f"supported: a multiple of {head_dims[1] - head_dims[0]} "
                                      f"from {head_dims[0]} to {head_dims[-1]}")


def check_call(q: Tensor, k: Tensor, v: Tensor, scale, alignment: str, causal: bool = False,
               window=None, softcap=None, op: str = NAME, dtypes: tuple = DTYPES,
               head_dims: tuple = HEAD_DIMS) -> None:
    """What a dense forward's call asks (check_qkv's tensors, one batch, the grid's y and z, the
    alignment, the scale, the window and the softcap): an error naming the argument."""
    check_qkv(op, q, k, v, dtypes=dtypes, head_dims=head_dims)
    b, h, bk = q.shape[0], q.shape[2], k.shape[0]
    if bk != b:
        raise ArgumentError(f"{op}: k {tuple(k.shape)} does not match q {tuple(q.shape)}: "
                            f"batch (dim 0) must agree")
    if h > MAX_GRID_YZ or b > MAX_GRID_YZ:
        raise ArgumentError(f"{op}: at most {MAX_GRID_YZ} heads and {MAX_GRID_YZ} batch "
                            f"entries in one call (the launch grid's y and z), got {h} heads and "
                            f"batch {b}; split the call along the batch")
    if alignment not in ALIGNMENTS:
        raise ArgumentError(f"{op}: alignment must be one of {', '.join(ALIGNMENTS)}, got "
                            f"{alignment!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ArgumentError(f"{op}: scale must be a finite number or None, got {scale!r}")
    check_options(causal, window, softcap)


def _tma_ready(t: Tensor) -> Tensor:
    """t where TMA can read it in place (D contiguous, other strides positive 16-byte
    multiples, a 16-byte aligned start), else a contiguous copy (an expanded tensor, stride 0
    along the batch or the keys, is copied too: TMA takes no zero stride)."""
    e = t.element_size()
    ok = (t.stride(3) == 1 and t.data_ptr() % 16 == 0 and
          all(s > 0 and s * e % 16 == 0 for s, n in zip(t.stride()[:3], t.shape[:3]) if n > 1))
    return t if ok else t.contiguous()


def _map(t: Tensor, rows: int, width: Optional[int] = None) -> bytes:
    """A TMA map over t's (D, seqlen, heads, batch) with boxes of chunk(D) (or width) x rows,
    swizzled as the kernels' tiles (a box's width a row)."""
    b, s, h, d = t.shape
    strides = [t.stride(1), t.stride(2), t.stride(0)]
    packed = [d, s * d, s * h * d]  # size-1 dims: any stride is legal; TMA checks them all
    strides = [st if n > 1 else p for st, n, p in zip(strides, (s, h, b), packed)]
    c = chunk(d, t.element_size()) if width is None else width
    return tensor_map(t, dims=(d, s, h, b), strides=strides, box=(c, rows, 1, 1),
                      swizzle=c * t.element_size())


@torch.library.custom_op("vitrail::attention_fwd", mutates_args=())
def _attention_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool,
                   causal_offset: int, local: bool = False, local_offset: int = 0,
                   softcap: float = 0.0, deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """causal: key j visible to row i where j <= i + causal_offset; local: where
    j >= i + local_offset; softcap > 0: scores capped to softcap * tanh(s * scale / softcap);
    deterministic: for the backward only (its kernels without atomics)."""
    b, sq, h, _ = q.shape
    o = q.new_empty((b, sq, h, v.shape[3]))
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    fwd_into(q, k, v, o, lse, scale, causal, causal_offset, local, local_offset, softcap)
    return o, lse


def fwd_into(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, scale: float,
             causal: bool, causal_offset: int, local: bool, local_offset: int,
             softcap: float, descale: Optional[Tensor] = None) -> None:
    """_attention_fwd's o (B, Sq, H, Dv) and lse (B, H, Sq), both contiguous, filled: one
    pass of the forward kernel. FP8 (descale: the kernel's descales; fp8.py): v is V^T as
    launch takes it, and o's dtype the output's."""
    b, sq, h, d = q.shape
    sk, dv = k.shape[1], o.shape[3]
    if o.numel() == 0:
        return
    if sk == 0:
        o.zero_()
        lse.fill_(-math.inf)
        return
    if not is_hopper(q.device):
        raise NotImplementedError(f"{NAME}: the kernel is sm_90a (Hopper); "
                                  f"{torch.cuda.get_device_name(q.device)} is not one: use "
                                  f"torch.nn.functional.scaled_dot_product_attention there")
    q, k = _tma_ready(q), _tma_ready(k)
    v = _tma_ready(v) if descale is None else v
    wg = warpgroups(d, dv, q.dtype, rows=sq)
    tiles = -(-sq // (64 * wg)) * h * b
    persistent = persistent_for(sk, tiles, sm_count(q.device.index))
    launch(kernel(q.dtype, d, causal, local=local, softcap=softcap > 0, dv=dv,
                  persistent=persistent, out_dtype=o.dtype, wg=wg), o, lse, q, k, v, sq, sk, b,
           scale, causal_offset, local_offset, softcap, persistent=persistent, descale=descale,
           wg=wg)


@_attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, scale, causal, causal_offset, local=False, local_offset=0,
                        softcap=0.0, deterministic=False):
    b, sq, h, _ = q.shape
    return q.new_empty((b, sq, h, v.shape[3])), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op("vitrail::attention_bwd", mutates_args=())
def _attention_bwd(grad_o: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                   o: Tensor, lse: Tensor, scale: float, causal: bool, causal_offset: int,
                   local: bool = False, local_offset: int = 0, softcap: float = 0.0,
                   deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    if fused_backward_runs(q, k, v):
        return _fused_backward(grad_o, grad_lse, q, k, v, o, lse, scale, causal, causal_offset,
                               local, local_offset, softcap, _deterministic(deterministic))
    return attention_backward(grad_o, grad_lse, q, k, v, o, lse, scale, causal, causal_offset,
                              local, local_offset, softcap)


def fused_backward_runs(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the backward of these q, k and v runs the fused kernels (a Hopper GPU, D of 64 or
    128 and v's head dim the same, something to compute); else torch's matmuls (backward.py)."""
    return (q.is_cuda and q.shape[3] in BWD_HEAD_DIMS and v.shape[3] == q.shape[3] and
            min(q.numel(), k.numel()) > 0 and
            is_hopper(q.device))


@_attention_bwd.register_fake
def _attention_bwd_fake(grad_o, grad_lse, q, k, v, o, lse, scale, causal, causal_offset,
                        local=False, local_offset=0, softcap=0.0, deterministic=False):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _backward(ctx, grad_o, grad_lse):
    q, k, v, o, lse = ctx.saved_tensors
    if grad_o is None:  # only the lse took part in the loss
        grad_o = torch.zeros_like(o)
    dq, dk, dv = _attention_bwd(grad_o, grad_lse, q, k, v, o, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


def _deterministic(asked: bool) -> bool:
    """Whether a backward runs the kernels without atomics: asked for, or torch's deterministic
    algorithms turned on (torch.use_deterministic_algorithms) when the backward runs."""
    return bool(asked) or torch.are_deterministic_algorithms_enabled()


def _setup(ctx, inputs, output):
    q, k, v, *args = inputs  # scale, causal, causal_offset, local, local_offset, softcap,
    # deterministic
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = tuple(args)


_attention_fwd.register_autograd(_backward, setup_context=_setup)


def kernel_mask(sq: int, sk: int, causal: bool, alignment: str,
                window) -> tuple[bool, int, bool, int]:
    """(causal, causal_offset, local, local_offset) of the kernels: key j visible to query i
    where j <= i + causal_offset (if causal) and j >= i + local_offset (if local)."""
    offset = 0 if alignment == "top_left" else sk - sq
    left, right = window if window is not None else (None, None)
    upper = causal or right is not None
    return (upper, offset + (right or 0) if upper else 0, left is not None,
            offset - left if left is not None else 0)


# Plans (vitrail.plan): an eager call's route, kernels and launch arguments, fixed at the second
# call of its signature (attention's and attention_kvcache's): a decoding loop over keys that grow
# is a new signature every step, which would pay a recording each time
PLANS = Plans("attention", record_from=2)


def frozen(window):
    """window as a key holds it (a list becomes a tuple)."""
    return tuple(window) if type(window) is list else window


def planned(key: tuple):
    """PLANS' plan of key, GENERAL or None; None where an option cannot be hashed (the checks
    refuse it)."""
    try:
        return PLANS.get(key)
    except TypeError:
        return None


def new_outputs(q: Tensor, dv: int, return_lse: bool, lse_by_head: bool = False) -> tuple:
    """(o,) or (o, lse): o (B, Sq, H, Dv) and lse (B, H, Sq) fp32, new; lse_by_head: lse's
    storage (H, B, Sq), the layout the PAGED kernel writes unpacked and unsplit."""
    b, sq, h, _ = q.shape
    o = q.new_empty((b, sq, h, dv))
    if not return_lse:
        return (o,)
    if lse_by_head:
        return o, q.new_empty((h, b, sq), dtype=torch.float32).permute(1, 0, 2)
    return o, q.new_empty((b, h, sq), dtype=torch.float32)


def _scratch_lse(q: Tensor, by_head: bool = False) -> Tensor:
    """An lse the call does not return, laid out as new_outputs' (a plan allocates it each call)."""
    b, sq, h, _ = q.shape
    lse = scratch(b * h * sq, torch.float32, q.device)
    return lse.view(h, b, sq).permute(1, 0, 2) if by_head else lse.view(b, h, sq)


def _one_pass(q, k, v, o, lse, scale, causal, causal_offset, local, local_offset, softcap):
    """A plan's general path: one pass of the forward into o (and lse, or a scratch one)."""
    lse = _scratch_lse(q) if lse is None else lse
    fwd_into(q, k, v, o, lse, scale, causal, causal_offset, local, local_offset, softcap)


def _decoding(q, k, v, o, lse, g, n, chunk, scale, softcap):
    """A plan's general path: decoding's route (paged_into over k and v as an unpaged cache
    every entry of which holds all its keys)."""
    b, sk = k.shape[0], k.shape[1]
    paged_into(q, k, v, full_lengths(b, sk, q.device), None, sk, o, lse, g, n, chunk, scale,
               False, 0, False, 0, softcap)


def generals(run, inputs: int = 3) -> dict:
    """{outputs: general} of a route run(*inputs, o, lse or None, *params) for Plans.run, which
    passes general(*inputs, *outputs, *params): one output (o) or two (o, lse)."""
    return {1: lambda *a: run(*a[:inputs + 1], None, *a[inputs + 1:]), 2: run}


_ONE_PASS, _DECODING = generals(_one_pass), generals(_decoding)
# Plans.run's make_outputs(q, k, v, ...) by (return_lse, lse_by_head): o, and the lse returned
PLAN_OUTPUTS = {(r, by_head): (lambda q, k, v, *_, r=r, by_head=by_head: new_outputs(
    q, v.shape[3], r, by_head)) for r in (False, True) for by_head in (False, True)}


@front(PLANS)
def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
              scale: Optional[float] = None, alignment: str = "top_left",
              window: Optional[tuple[Optional[int], Optional[int]]] = None,
              softcap: Optional[float] = None, return_lse: bool = False,
              deterministic: bool = False, num_splits: Optional[int] = None):
    """softmax(q k^T * scale) v per batch and head (see the module docstring); deterministic:
    the backward's kernels without atomics (the same gradient bits on every run); num_splits:
    where no key is masked, each batch entry's keys in that many chunks computed side by side
    and combined (split-KV, for decoding: few query rows, many keys); None chooses where a
    head's query rows fit one tile and there are DECODE_MIN_KEYS keys or more (splits_for),
    else one pass; 1 never splits. Where no gradient is recorded, decoding runs the PAGED
    forward over k and v as a cache (paged_into), else _split_keys; an eager call without
    gradients runs its signature's plan (vitrail.plan; an lse it returns may be strided)."""
    mode = call_mode(q, k, v)
    if mode == EAGER:
        key = (signature(q), signature(k), signature(v), causal, scale, alignment,
               frozen(window), softcap, return_lse, num_splits)
        hit = planned(key)
        if hit is not None and hit is not GENERAL:  # a signature that passed the checks
            out = hit(q, k, v)
            return out if return_lse else out[0]
    check_call(q, k, v, scale, alignment, causal, window, softcap)
    if num_splits is not None and not (isinstance(num_splits, int) and
                                       not isinstance(num_splits, bool) and num_splits >= 1):
        raise ArgumentError(f"{NAME}: num_splits must be None or an integer >= 1, got "
                            f"{num_splits!r}")
    b, sq, h, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = d ** -0.5 if scale is None else float(scale)
    mask = kernel_mask(sq, sk, bool(causal), alignment, window)
    upper, hi, local, _ = mask
    softcap, deterministic = float(softcap or 0.0), bool(deterministic)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    route = None  # one pass
    if b * sq > 0 and sk > 0 and not local and (not upper or hi >= sk - 1):  # no key masked
        long = sk >= DECODE_MIN_KEYS
        # the packed rows a tile: the PAGED kernel's without gradients, else the varlen one's
        bm = block_m(d, dv, q.dtype, paged=not grad, rows=sq * (h // hk))
        pack = long and h > hk and sq * (h // hk) <= bm
        if not grad:  # the PAGED forward over k and v, their rows where they are
            g, n, size = decode_route(b, sq, h, hk, sk, block_n(d, dv), pack, True, num_splits,
                                      q.device)
            route = (g, n, size) if g > 1 or n > 1 else None
        elif _rows_of_one_stride(k) and _rows_of_one_stride(v):
            heads, rows = (hk, sq * (h // hk)) if pack else (h, sq)
            splits = decode_splits(num_splits, b * heads, rows, sk, block_n(d, dv), q.device,
                                   bm)
            splits = min(splits, sk, MAX_GRID_YZ // b)
            if pack or splits > 1:
                o, lse = _split_keys(q, k, v, splits, pack, scale, softcap, deterministic)
                return (o, lse) if return_lse else o
    if mode == EAGER:
        params = (*route, scale, softcap) if route else (scale, *mask, softcap)
        n_out = 2 if return_lse else 1
        general = (_DECODING if route else _ONE_PASS)[n_out]
        out = on_device(q, PLANS.run, key, (q, k, v), PLAN_OUTPUTS[return_lse, False], general,
                        params)
        return out if return_lse else out[0]
    if route:
        o, lse = paged_dispatch(q, k, v, full_lengths(b, sk, q.device), None, sk, *route,
                                scale, False, 0, False, 0, softcap)
    else:
        o, lse = _attention_fwd(q, k, v, scale, *mask, softcap, deterministic)
    return (o, lse) if return_lse else o


def on_device(t: Tensor, fn, *args):
    """fn(*args) with t's device current (a plan's key holds the current device, and its
    launches go to it)."""
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        with torch.cuda.device(t.device):
            return fn(*args)
    return fn(*args)


def _rows_of_one_stride(t: Tensor) -> bool:
    """Whether t's (batch, seqlen) rows are one run of equal strides, as the varlen kernel reads
    them (a view, not a copy of a KV cache in SDPA's layout with batch > 1)."""
    return t.shape[0] == 1 or t.shape[1] == 1 or t.stride(0) == t.shape[1] * t.stride(1)


# Packing and the automatic split apply from this many keys: below, the launches they add (a copy
# of q's rows, the combination) cost more than the reads they save (on the H100: 16 keys took
# twice one pass's time, 2048 keys two thirds of it)
DECODE_MIN_KEYS = 1024
# The automatic split's model of a pass: its time is its waves of CTAs, each as long as a CTA
# takes over its blocks of keys plus SPLIT_CTA_BLOCKS blocks' worth of fixed cost (launch, Q's
# load, the epilogue, the combination's reads), but no less than its blocks read at the memory
# bandwidth that SPLIT_BANDWIDTH_SMS of the SMs busy already reach
SPLIT_CTA_BLOCKS = 2
SPLIT_BANDWIDTH_SMS = 0.8
MAX_SPLITS = 64
SPLIT_MIN_BLOCKS = 2  # blocks of keys a chunk holds at least


def decode_splits(num_splits: Optional[int], tiles: int, rows: int, keys: int, bn: int,
                  device: torch.device, bm: int) -> int:
    """The chunks a pass of `tiles` CTAs of `rows` query rows each over `keys` keys is cut into:
    num_splits where given; where decoding (one tile of rows a head, bm the kernel's, and
    DECODE_MIN_KEYS keys or more) splits_for's choice for this GPU; else 1 (a copy of many rows
    a chunk and their combination would cost more than it gains)."""
    if num_splits is not None:
        return num_splits
    if keys >= DECODE_MIN_KEYS and rows <= bm:
        sms = sm_count(device.index) if device.type == "cuda" else target_limits().sm_count
        return splits_for(tiles, keys, bn, sms)
    return 1


def splits_for(tiles: int, keys: int, bn: int, sms: int) -> int:
    """The chunks to cut each sequence's keys into, given the CTAs (tiles) of one pass over
    them: the fewest (1 to MAX_SPLITS, chunks of SPLIT_MIN_BLOCKS blocks of bn keys or more)
    whose modeled time is the least's within 2%, where one pass leaves SMs idle (fewer tiles
    than SPLIT_BANDWIDTH_SMS of them): few CTAs over many keys are split."""
    if tiles >= SPLIT_BANDWIDTH_SMS * sms:  # busy already; and many rows would be copied
        return 1
    blocks = -(-keys // bn)
    floor = tiles * blocks / (SPLIT_BANDWIDTH_SMS * sms)

    def time(n: int) -> float:
        return max(-(-tiles * n // sms) * (-(-blocks // n) + SPLIT_CTA_BLOCKS), floor)
    counts = range(1, max(1, min(MAX_SPLITS, blocks // SPLIT_MIN_BLOCKS)) + 1)
    best = min(time(n) for n in counts)
    return next(n for n in counts if time(n) <= 1.02 * best)  # within the model's noise


def _split_keys(q: Tensor, k: Tensor, v: Tensor, splits: int, pack: bool, scale: float,
                softcap: float, deterministic: bool) -> tuple[Tensor, Tensor]:
    """(o, lse) of attention with no mask through attention_varlen's kernel: each batch entry's
    keys cut into `splits` chunks (the last shorter), each (entry, chunk) a sequence whose rows
    are a copy of the entry's query rows, and where `pack`, a GQA group's query heads packed
    into the rows (row s g + j of KV head kv is head kv g + j's row s: the group's heads read
    their K and V once, not g times). The chunks' outputs are then combined by their
    log-sum-exps (smxx_attention_combine.cuh; FlashAttention's split-KV): b * splits * heads
    CTAs where b * heads alone leave the GPU idle. Differentiable: the varlen op's backward and
    the combination's. The chunks' outputs are rounded to q's dtype before they are combined."""
    b, sq, h, d = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[3]
    g = h // hk if pack else 1
    size = -(-sk // splits)
    n = -(-sk // size)  # chunks, none empty
    rows = sq * g
    cu_q, cu_k = _split_offsets(b, n, rows, sk, size, q.device)
    packed = q.view(b, sq, h // g, g, d).transpose(2, 3)  # (b, sq, g, h / g, d)
    qs = packed.unsqueeze(1).expand(b, n, sq, g, h // g, d).reshape(b * n * rows, h // g, d)
    part, part_lse = _attention_varlen_fwd(qs, k.reshape(b * sk, hk, d),
                                           v.reshape(b * sk, hk, dv), cu_q, cu_k, rows, size,
                                           scale, False, 0, False, 0, softcap, False,
                                           deterministic)
    return _split_combine(part, part_lse, b, n, sq, g)


_SPLIT_OFFSETS: dict[tuple, tuple[Tensor, Tensor]] = {}


def _split_offsets(b: int, n: int, sq: int, sk: int, size: int,
                   device: torch.device) -> tuple[Tensor, Tensor]:
    """cu_seqlens_q and cu_seqlens_k (int32, on device) of _split_keys' sequences, (entry,
    chunk) in that order: sq rows each; keys [e sk + c size, e sk + min((c + 1) size, sk)) of
    the packed (b sk) keys (consecutive sequences' keys are contiguous). Made on the device (no
    copy from the host: a decoding step's sk is new) and kept per shape, so a decoding loop
    makes them once; traced by torch.compile, ops of its graph."""
    key = (b, n, sq, sk, size, device)
    compiling = torch.compiler.is_compiling()
    found = None if compiling else _SPLIT_OFFSETS.get(key)
    if found is None:
        with setup():  # kept: no reason to refuse a plan of the call
            i = torch.arange(b * n + 1, dtype=torch.int32, device=device)  # chunk c of entry e:
            found = (i * sq, (i // n) * sk + (i % n) * size)  # i = e n + c; i = b n: the end
        if not compiling:
            if len(_SPLIT_OFFSETS) > 64:
                _SPLIT_OFFSETS.clear()
            _SPLIT_OFFSETS[key] = found
    keep(*found)  # a plan holds them
    return found


# ------------------------------------------------------------------ decoding over a KV cache
# The PAGED forward (attention_kvcache's, and attention's decoding where no gradient is recorded):
# query rows over each batch entry's cached keys, cut into chunks side by side and combined.

def decode_route(b: int, sq: int, h: int, hk: int, capacity: int, bn: int, pack: bool,
                 unmasked: bool, num_splits: Optional[int],
                 device: torch.device) -> tuple[int, int, int]:
    """(group, chunks, chunk_keys) of the PAGED forward over caches of `capacity` keys: a GQA
    group's query heads packed into one tile's rows where pack (group 1 otherwise); where no key
    is masked, each entry's keys in chunks of whole blocks of bn keys (decode_splits' count, at
    most one a block and MAX_GRID_YZ sequences), else one chunk."""
    g = h // hk if pack else 1
    bm = 128  # the PAGED kernel's rows a tile (block_m's at every head dim)
    splits = decode_splits(num_splits, b * (h // g), sq * g, capacity, bn, device, bm) \
        if unmasked else 1
    splits = max(1, min(splits, -(-capacity // bn), MAX_GRID_YZ // max(b, 1)))
    size = -(-(-(-capacity // splits)) // bn) * bn  # keys a chunk: whole blocks
    return g, -(-capacity // size), size  # chunks, none past the capacity


def _packed_rows(q: Tensor, g: int, planned: bool = False) -> Tensor:
    """q (B, Sq, H, D) as (B, Sq g, H / g, D): a GQA group's heads packed into rows (row s g + j
    of KV head kv is head kv g + j's row s); a view where Sq is 1 or g is 1, else a copy: where
    planned (a plan's general path, on a GPU), by vitrail's copy into a scratch buffer, launches
    a plan repeats; else by torch (which torch.compile traces)."""
    if g == 1:
        return q
    b, sq, h, d = q.shape
    if sq == 1:
        return q[:, 0].unflatten(1, (h // g, g)).transpose(1, 2)
    grouped = q.unflatten(2, (h // g, g)).transpose(2, 3)  # (B, Sq, g, H / g, D)
    if not (planned and q.is_cuda):
        return grouped.reshape(b, sq * g, h // g, d)
    packed = scratch(q.numel(), q.dtype, q.device).view(grouped.shape)
    copy(grouped, out=packed)
    return packed.view(b, sq * g, h // g, d)


_FULL_LENGTHS: dict[tuple, Tensor] = {}


def full_lengths(b: int, sk: int, device: torch.device) -> Tensor:
    """int32 (b,) of sk each: the lengths of caches that hold all their keys (attention's k and
    v), kept per (b, sk, device) so that a plan passes them as constants."""
    if torch.compiler.is_compiling():
        return torch.full((b,), sk, dtype=torch.int32, device=device)
    key = (b, sk, device)
    found = _FULL_LENGTHS.get(key)
    if found is None:
        with setup():
            found = torch.full((b,), sk, dtype=torch.int32, device=device)
        if len(_FULL_LENGTHS) > 64:
            _FULL_LENGTHS.clear()
        _FULL_LENGTHS[key] = found
    keep(found)
    return found


def paged_into(q: Tensor, k_cache: Tensor, v_cache: Tensor, lens: Tensor,
               table: Optional[Tensor], capacity: int, o: Tensor, lse: Optional[Tensor], g: int,
               n: int, size: int, scale: float, causal: bool, causal_offset: int, local: bool,
               local_offset: int, softcap: float) -> None:
    """o (B, Sq, H, Dv), contiguous, and lse (B, H, Sq; None: not returned) of q over the caches
    (attention_kvcache's arguments; lens int32 on the device) by decode_route's (g, n, size):
    with one chunk and no packing the kernel writes o in place and lse in its own layout (lse's
    storage (H, B, Sq), as new_outputs(lse_by_head=True)); else the chunks' partial results
    (scratch) combined into o and lse (B, H, Sq) contiguous."""
    b, sq, h, d = q.shape
    dv = v_cache.shape[3]
    if o.numel() == 0:
        return
    one = n == 1 and g == 1
    lse = _scratch_lse(q, by_head=one) if lse is None else lse
    rows = sq * g
    cu_q = _split_offsets(b, n, rows, capacity, size, q.device)[0]
    run = (_packed_rows(q, g, planned=True), k_cache, v_cache, lens, table, cu_q, rows, n, size,
           scale, causal, causal_offset, local, local_offset, softcap)
    if one:
        _paged_run(*run, o.view(b * sq, h, dv), lse.permute(1, 0, 2).view(h, b * sq))
        return
    tq, heads = n * b * rows, h // g
    part = scratch(tq * heads * dv, q.dtype, q.device).view(tq, heads, dv)
    part_lse = scratch(heads * tq, torch.float32, q.device).view(heads, tq)
    _paged_run(*run, part, part_lse)
    _combine_into(part, part_lse, o, lse, b, n, sq, g)


def paged_dispatch(q: Tensor, k_cache: Tensor, v_cache: Tensor, lens: Tensor,
                   table: Optional[Tensor], capacity: int, g: int, n: int, size: int,
                   scale: float, causal: bool, causal_offset: int, local: bool,
                   local_offset: int, softcap: float) -> tuple[Tensor, Tensor]:
    """paged_into's (o, lse contiguous) through the custom ops (torch.compile traces them)."""
    b, sq, h, _ = q.shape
    cu_q = _split_offsets(b, n, sq * g, capacity, size, q.device)[0]
    part, part_lse = _paged_fwd(_packed_rows(q, g), k_cache, v_cache, lens, table, cu_q, sq * g,
                                n, size, scale, causal, causal_offset, local, local_offset,
                                softcap)
    if n == 1 and g == 1:
        return (part.view(b, sq, h, part.shape[2]),
                part_lse.view(h, b, sq).transpose(0, 1).contiguous())
    return _split_combine(part, part_lse, b, n, sq, g)


@torch.library.custom_op("vitrail::attention_kvcache_fwd", mutates_args=())
def _paged_fwd(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
               block_table: Optional[Tensor], cu_q: Tensor, rows: int, splits: int,
               chunk_keys: int, scale: float, causal: bool, causal_offset: int, local: bool,
               local_offset: int, softcap: float) -> tuple[Tensor, Tensor]:
    """The PAGED forward: q (batch, rows, heads, D); sequence z is chunk z % splits (chunk_keys
    keys) of entry z / splits, its rows q's of the entry; o (sequences rows, heads, Dv) and lse
    (heads, sequences rows) packed by sequence (cu_q)."""
    tq, heads = (cu_q.shape[0] - 1) * rows, q.shape[2]
    o = q.new_empty((tq, heads, v_cache.shape[3]))
    lse = q.new_empty((heads, tq), dtype=torch.float32)
    _paged_run(q, k_cache, v_cache, cache_seqlens, block_table, cu_q, rows, splits, chunk_keys,
               scale, causal, causal_offset, local, local_offset, softcap, o, lse)
    return o, lse


@_paged_fwd.register_fake
def _paged_fwd_fake(q, k_cache, v_cache, cache_seqlens, block_table, cu_q, rows, splits,
                    chunk_keys, scale, causal, causal_offset, local, local_offset, softcap):
    tq, heads = (cu_q.shape[0] - 1) * rows, q.shape[2]
    return (q.new_empty((tq, heads, v_cache.shape[3])),
            q.new_empty((heads, tq), dtype=torch.float32))


def _paged_run(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
               block_table: Optional[Tensor], cu_q: Tensor, rows: int, splits: int,
               chunk_keys: int, scale: float, causal: bool, causal_offset: int, local: bool,
               local_offset: int, softcap: float, o: Tensor, lse: Tensor) -> None:
    """_paged_fwd's o and lse (their views) filled by the kernel."""
    _, _, heads, d = q.shape
    dv = v_cache.shape[3]
    sequences = cu_q.shape[0] - 1
    if sequences * rows == 0:
        return
    if not is_hopper(q.device):
        raise NotImplementedError(f"{NAME}: the kernel is sm_90a (Hopper); "
                                  f"{torch.cuda.get_device_name(q.device)} is not one")
    q4, k4, v4 = _tma_ready(q), _tma_ready(k_cache), _tma_ready(v_cache)
    page = k_cache.shape[1]
    table_stride = 0 if block_table is None else block_table.stride(0)
    tiles = -(-rows // block_m(d, dv, q.dtype, paged=True)) * heads * sequences
    persistent = persistent_for(chunk_keys, tiles, sm_count(q.device.index))
    launch(kernel(q.dtype, d, causal, local=local, softcap=softcap > 0, dv=dv,
                  persistent=persistent, paged=True), o, lse, q4, k4, v4, rows, 0, sequences,
           scale, causal_offset, local_offset, softcap, cu_q, None, True, persistent,
           (cache_seqlens, block_table, table_stride, page, splits, chunk_keys))


def combine_reference(part: Tensor, part_lse: Tensor, batch: int, splits: int, seqlen_q: int,
                      group: int) -> tuple[Tensor, Tensor]:
    """smxx_attention_combine.cuh's (o, lse) by torch's ops (differentiable): part (batch splits
    seqlen_q group, Hkv, Dv) and part_lse (Hkv, batch splits seqlen_q group) as _split_keys'
    varlen call makes them; o (batch, seqlen_q, Hkv group, Dv) in part's dtype, lse (batch,
    heads, seqlen_q) fp32."""
    hk, dv = part.shape[1], part.shape[2]
    b, n, sq, g, h = batch, splits, seqlen_q, group, hk * group
    lse = part_lse.view(hk, b, n, sq, g).permute(1, 2, 3, 0, 4).reshape(b, n, sq, h)
    whole = torch.logsumexp(lse, dim=1)  # (b, sq, h); -inf where no chunk has a key
    weight = torch.exp(lse - whole.unsqueeze(1)).nan_to_num(0.0)
    parts = part.view(b, n, sq, g, hk, dv).transpose(3, 4).reshape(b, n, sq, h, dv)
    wide = torch.float64 if part.dtype == torch.float64 else torch.float32
    o = (parts.to(wide) * weight.unsqueeze(-1).to(wide)).sum(1)
    return o.to(part.dtype), whole.transpose(1, 2).contiguous()


COMBINE_SIGNATURE = ("void* o, float* lse, const void* part, const float* part_lse, int batch, "
                     "int splits, int seqlen_q, int heads, int group")


def combine_source(dtype: torch.dtype, dv: int) -> str:
    """smxx_attention_combine.cuh's instantiation for a dtype and v head dim."""
    return (f"#include <cuda_bf16.h>\n#include <cuda_fp16.h>\nusing T = {ctype(dtype)};\n"
            f"constexpr int DV = {dv};\n#include \"smxx_attention_combine.cuh\"\n")


def combine_kernel(dtype: torch.dtype, dv: int):
    """The compiled smxx_attention_combine.cuh for a dtype and v head dim."""
    key = ("combine", dtype, dv)
    k = KERNELS.get(key)
    if k is None:
        from vitrail import jit
        module = jit.compile(combine_source(dtype, dv), name="attention_split_combine",
                             backend="nvrtc", include_dirs=[HERE])
        k = KERNELS[key] = module.kernel("attention_split_combine", COMBINE_SIGNATURE)
    return k


@torch.library.custom_op("vitrail::attention_split_combine", mutates_args=())
def _split_combine(part: Tensor, part_lse: Tensor, batch: int, splits: int, seqlen_q: int,
                   group: int) -> tuple[Tensor, Tensor]:
    """combine_reference's (o, lse): one kernel on a GPU, torch's ops elsewhere."""
    if not part.is_cuda:
        o, lse = combine_reference(part, part_lse, batch, splits, seqlen_q, group)
        return o, lse
    h, dv = part.shape[1] * group, part.shape[2]
    o = part.new_empty((batch, seqlen_q, h, dv))
    lse = part_lse.new_empty((batch, h, seqlen_q))
    _combine_into(part, part_lse, o, lse, batch, splits, seqlen_q, group)
    return o, lse


def _combine_into(part: Tensor, part_lse: Tensor, o: Tensor, lse: Tensor, batch: int,
                  splits: int, seqlen_q: int, group: int) -> None:
    """_split_combine's o (batch, seqlen_q, H, Dv) and lse (batch, H, seqlen_q), contiguous,
    filled by the combine kernel (combine_reference's values copied on the CPU)."""
    if not part.is_cuda:
        o_ref, lse_ref = combine_reference(part, part_lse, batch, splits, seqlen_q, group)
        o.copy_(o_ref)
        lse.copy_(lse_ref)
        return
    h, dv = part.shape[1] * group, part.shape[2]
    rows = batch * seqlen_q * h
    if rows:
        per_block = 128 // (dv // 8)
        with torch.cuda.device(part.device):
            combine_kernel(part.dtype, dv)[(-(-rows // per_block), 1, 1), per_block * (dv // 8)](
                o, lse, part, part_lse, batch, splits, seqlen_q, h, group)


@_split_combine.register_fake
def _split_combine_fake(part, part_lse, batch, splits, seqlen_q, group):
    h, dv = part.shape[1] * group, part.shape[2]
    return (part.new_empty((batch, seqlen_q, h, dv)),
            part_lse.new_empty((batch, h, seqlen_q)))


def _split_combine_backward(ctx, grad_o, grad_lse):
    """Through combine_reference's ops, recomputed (the combination is cheap next to the
    chunks' attention)."""
    part, part_lse = ctx.saved_tensors
    with torch.enable_grad():
        ins = (part.detach().requires_grad_(), part_lse.detach().requires_grad_())
        outs = combine_reference(*ins, *ctx.args)
        used = [(t, gt) for t, gt in zip(outs, (grad_o, grad_lse)) if gt is not None]
        grads = torch.autograd.grad([t for t, _ in used], ins, [gt for _, gt in used],
                                    allow_unused=True)
    return (*grads, None, None, None, None)


def _split_combine_setup(ctx, inputs, output):
    part, part_lse, *args = inputs
    ctx.save_for_backward(part, part_lse)
    ctx.args = tuple(args)


_split_combine.register_autograd(_split_combine_backward, setup_context=_split_combine_setup)


def reference(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
              scale: Optional[float] = None, alignment: str = "top_left", window=None,
              softcap: Optional[float] = None) -> tuple[Tensor, Tensor]:
    """(o, lse) computed by plain torch in q's dtype's precision or better (pass float64); v's
    head dim may differ from q's and k's (o takes v's)."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    kk = k.repeat_interleave(h // hk, dim=2)
    vv = v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    upper, hi, local, lo = kernel_mask(sq, sk, causal, alignment, window)
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    if upper:
        s = s.masked_fill(j > i + hi, -math.inf)
    if local:
        s = s.masked_fill(j < i + lo, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vv), lse


# --------------------------------------------------------------------------- variable lengths
def _lengths(cu: Tensor, total: int, max_seqlen: int, name: str) -> list[int]:
    """cu's values (one synchronization), checked against the packed tensor's rows and the
    maximum given: what the kernel's grid and the backward rely on."""
    c = cu.tolist()
    lengths = [b - a for a, b in zip(c, c[1:])]
    if c[0] != 0 or c[-1] != total or any(n < 0 for n in lengths):
        raise ArgumentError(f"{NAME}: cu_seqlens_{name} must rise from 0 to the {total} rows of "
                            f"{name} (a sequence's rows are cu[i]:cu[i + 1]), got {c[:8]}"
                            f"{' ...' if len(c) > 8 else ''}")
    if lengths and max(lengths) > max_seqlen:
        raise ArgumentError(f"{NAME}: max_seqlen_{name}={max_seqlen} is below the longest "
                            f"sequence's {max(lengths)} rows")
    return c


@torch.library.custom_op("vitrail::attention_varlen_fwd", mutates_args=())
def _attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                          cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                          scale: float, causal: bool, causal_offset: int, local: bool,
                          local_offset: int, softcap: float, bottom_right: bool,
                          deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """The forward over packed sequences: q (total_q, H, D), k (total_k, Hkv, D), v (total_k,
    Hkv, Dv); o (total_q, H, Dv), lse (H, total_q). Offsets as _attention_fwd's, plus seqlen_k -
    seqlen_q per sequence where bottom_right. max_seqlen_k picks the grid (persistent_for) and
    is the backward's (its dK/dV grid)."""
    tq, h, d = q.shape
    tk, dv = k.shape[0], v.shape[2]
    batch = cu_seqlens_q.shape[0] - 1
    o = q.new_empty((tq, h, dv))
    lse = q.new_empty((h, tq), dtype=torch.float32)
    if tq == 0 or batch == 0:
        return o, lse
    if tk == 0:
        o.zero_()
        lse.fill_(-math.inf)
        return o, lse
    if not is_hopper(q.device):
        raise NotImplementedError(f"{NAME}: the kernel is sm_90a (Hopper); "
                                  f"{torch.cuda.get_device_name(q.device)} is not one")
    q4, k4, v4 = (_tma_ready(t.unsqueeze(0)) for t in (q, k, v))  # one "batch" of all rows
    wg = warpgroups(d, dv, q.dtype, rows=max_seqlen_q)
    tiles = -(-max_seqlen_q // (64 * wg)) * h * batch
    persistent = persistent_for(max_seqlen_k, tiles, sm_count(q.device.index))
    launch(kernel(q.dtype, d, causal, local=local, softcap=softcap > 0, varlen=True, dv=dv,
                  persistent=persistent, wg=wg), o, lse, q4, k4, v4, max_seqlen_q, 0, batch,
           scale, causal_offset, local_offset, softcap, cu_seqlens_q, cu_seqlens_k,
           bottom_right, persistent, wg=wg)
    return o, lse


@_attention_varlen_fwd.register_fake
def _attention_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               scale, causal, causal_offset, local, local_offset, softcap,
                               bottom_right, deterministic=False):
    tq, h, _ = q.shape
    return q.new_empty((tq, h, v.shape[2])), q.new_empty((h, tq), dtype=torch.float32)


@torch.library.custom_op("vitrail::attention_varlen_bwd", mutates_args=())
def _attention_varlen_bwd(grad_o: Tensor, grad_lse: Optional[Tensor], q: Tensor, k: Tensor,
                          v: Tensor, o: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                          cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                          scale: float, causal: bool, causal_offset: int, local: bool,
                          local_offset: int, softcap: float, bottom_right: bool,
                          deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The fused kernels' backward where they run (one launch each), else each sequence's."""
    args = (grad_o, grad_lse, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
    options = (scale, causal, causal_offset, local, local_offset, softcap, bottom_right)
    if fused_backward_runs(q[None], k[None], v[None]):
        return fused_varlen_backward(*args, max_seqlen_q, max_seqlen_k, *options,
                                     _deterministic(deterministic))
    return sequence_by_sequence_backward(*args, *options)


def sequence_by_sequence_backward(grad_o: Tensor, grad_lse: Optional[Tensor], q: Tensor,
                                  k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                                  cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, scale: float,
                                  causal: bool, causal_offset: int, local: bool,
                                  local_offset: int, softcap: float,
                                  bottom_right: bool) -> tuple[Tensor, Tensor, Tensor]:
    """attention_varlen's backward one sequence at a time through backward.py's matmuls (a
    batch of one each): any head dims and devices; reads the offsets (a synchronization)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    dq, dk, dv = q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
        if q1 == q0 or k1 == k0:
            continue  # no rows, or no keys (o = 0, lse = -inf): no gradient
        shift = (k1 - k0) - (q1 - q0) if bottom_right else 0
        one = [t[None] for t in (grad_o[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1], o[q0:q1])]
        glse = None if grad_lse is None else grad_lse[:, q0:q1][None]
        g = attention_backward(one[0], glse, *one[1:], lse[:, q0:q1][None], scale, causal,
                               causal_offset + shift, local, local_offset + shift, softcap)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


@_attention_varlen_bwd.register_fake
def _attention_varlen_bwd_fake(grad_o, grad_lse, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, scale, causal, causal_offset, local,
                               local_offset, softcap, bottom_right, deterministic=False):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_backward(ctx, grad_o, grad_lse):
    q, k, v, cu_q, cu_k, o, lse = ctx.saved_tensors
    if grad_o is None:
        grad_o = torch.zeros_like(o)
    dq, dk, dv = _attention_varlen_bwd(grad_o, grad_lse, q, k, v, o, lse, cu_q, cu_k, *ctx.args)
    return (dq, dk, dv) + (None,) * 12


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *args = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k, *output)
    ctx.args = tuple(args)  # the maxima, scale, causal, causal_offset, local, local_offset,
    # softcap, bottom_right, deterministic


_attention_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup)


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: bool = False, scale: Optional[float] = None,
                     alignment: str = "top_left",
                     window: Optional[tuple[Optional[int], Optional[int]]] = None,
                     softcap: Optional[float] = None, return_lse: bool = False,
                     deterministic: bool = False):
    """attention over sequences of their own lengths packed along the rows (FlashAttention's
    varlen): q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv); sequence i is rows
    cu_seqlens_q[i]:cu_seqlens_q[i + 1] of q and cu_seqlens_k[i]:cu_seqlens_k[i + 1] of k and v
    (int32 on q's device). Options as :func:`attention`'s, per sequence. Returns o (total_q, H,
    Dv) and, with return_lse, lse (H, total_q). In eager mode the lengths are read once (one
    synchronization) and checked against the tensors and the maxima; under torch.compile or a
    CUDA graph's capture they are not, and the kernels' grids trust max_seqlen_q and
    max_seqlen_k to be at least each sequence's rows and keys."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(NAME, name, t, dtypes=DTYPES, ndim=3)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(NAME, name, t, dtypes=(torch.int32,), ndim=1)
        if t.shape[0] < 1:
            raise ArgumentError(f"{NAME}: {name} must hold batch + 1 >= 1 offsets, got none")
    check_same_device(NAME, q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if cu_seqlens_q.shape[0] - 1 > MAX_GRID_YZ:
        raise ArgumentError(f"{NAME}: at most {MAX_GRID_YZ} sequences in one call (the launch "
                            f"grid's z), got {cu_seqlens_q.shape[0] - 1}; split the call")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ArgumentError(f"{NAME}: cu_seqlens_q and cu_seqlens_k must hold one offset per "
                            f"sequence each, got {cu_seqlens_q.shape[0]} and "
                            f"{cu_seqlens_k.shape[0]}")
    check_call(q[None], k[None], v[None], scale, alignment, causal, window, softcap)
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise ArgumentError(f"{NAME}: {name} must be an int >= 0, got {m!r}")
    if not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing():
        _lengths(cu_seqlens_q, q.shape[0], max_seqlen_q, "q")
        _lengths(cu_seqlens_k, k.shape[0], max_seqlen_k, "k")
    d = q.shape[2]
    scale = d ** -0.5 if scale is None else float(scale)
    # offsets sans Sk - Sq
    upper, hi, local, lo = kernel_mask(0, 0, bool(causal), "top_left", window)
    o, lse = _attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, scale, upper, hi, local, lo,
                                   float(softcap or 0.0), alignment == "bottom_right",
                                   bool(deterministic))
    return (o, lse) if return_lse else o


def reference_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, **kwargs) -> tuple[Tensor, Tensor]:
    """(o, lse) of attention_varlen by :func:`reference`, one sequence at a time."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    o = q.new_zeros((q.shape[0], q.shape[1], v.shape[2]))
    lse = q.new_full((q.shape[1], q.shape[0]), -math.inf)
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
        if q1 > q0 and k1 > k0:
            oi, li = reference(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **kwargs)
            o[q0:q1], lse[:, q0:q1] = oi[0], li[0]
    return o, lse


__all__ = ["attention", "attention_varlen", "reference", "reference_varlen"]
