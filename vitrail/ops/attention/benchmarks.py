"""`vitrail bench attention` (the forward), `vitrail bench attention.backward` (forward and
backward) and `vitrail bench attention.fp8` (the FP8 forward): against torch SDPA's cuDNN and
flash backends in the same run, bf16, (batch, seqlen, heads, head_dim) tensors, TFLOP/s
counting only the visible scores (a causal problem does half the work). All run when named."""
from __future__ import annotations

from typing import Optional

from vitrail.bench import Row, register

# (batch, seqlen, heads, head_dim, v head_dim, causal): seqlen 1k to 16k at 16k tokens a batch;
# head dims 64, 96, 128 and 256, and 192 with a v head dim of 128 (DeepSeek's MLA shapes)
CASES = [(b, s, h, d, dv, causal)
         for s, b in ((1024, 16), (4096, 4), (16384, 1))
         for d, dv, h in ((64, 64, 32), (96, 96, 16), (128, 128, 16), (192, 128, 16),
                          (256, 256, 8))
         for causal in (False, True)]


def flops(b: int, s: int, h: int, d: int, dv: int, causal: bool) -> float:
    """Q K^T and P V: 2 b h s^2 (d + dv), half of it where causal."""
    return 2.0 * b * h * s * s * (d + dv) / (2 if causal else 1)


def _name(b: int, s: int, h: int, d: int, dv: int, causal: bool) -> str:
    return f"{'causal ' if causal else ''}B{b} S{s} H{h} D{d}{f' Dv{dv}' if dv != d else ''}"


def build() -> None:
    """Compile the kernels the cases take (one per head dim and causality, and the backward's
    where it has kernels), in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from vitrail.ops.attention import (BWD_HEAD_DIMS, bwd_kernels, kernel, persistent_for,
                                       warpgroups)
    from vitrail.device import target_limits
    sms = target_limits().sm_count
    variants = sorted({(d, dv, causal, persistent_for(s, -(-s // (64 * wg)) * h * b, sms), wg)
                       for b, s, h, d, dv, causal in CASES
                       for wg in (warpgroups(d, dv, rows=s),)})
    jobs = [lambda d=d, dv=dv, c=c, p=p, wg=wg: kernel(torch.bfloat16, d, c, dv=dv, persistent=p,
                                                      wg=wg)
            for d, dv, c, p, wg in variants]
    jobs += [lambda d=d, c=c, det=det: bwd_kernels(torch.bfloat16, d, c, deterministic=det)
             for d, c in sorted({(d, c) for d, dv, c, _, _ in variants if d == dv})
             if d in BWD_HEAD_DIMS for det in (False, True)]
    with ThreadPoolExecutor(max(1, min(8, len(jobs)))) as pool:
        list(pool.map(lambda job: job(), jobs))


def _sdpa(backend):
    import torch
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):  # SDPA's (batch, heads, seqlen, head_dim) views, no copy
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                enable_gqa=q.shape[2] != k.shape[2])
    return run


def _timed(case: str, fns: dict, work: float, group: str, unit: str = "TFLOP/s",
           math: Optional[dict] = None, baselines: Optional[set] = None) -> list[Row]:
    """Rows of the implementations of one case, timed together: TFLOP/s for work FLOPs (math:
    an implementation's math where not bf16), or GB/s for work bytes; the baselines are the
    implementations not named vitrail unless given. An implementation that refuses the case is
    reported, not fatal (SDPA's backends refuse some)."""
    from vitrail.profile import compare
    ok = {}
    for impl, fn in fns.items():
        try:
            fn()
            ok[impl] = fn
        except Exception as e:
            print(f"  {case} {impl}: {type(e).__name__}: {str(e)[:200]}")
    per_ms = 1e9 if unit == "TFLOP/s" else 1e6
    math = math or {}
    return [Row(case=case, impl=impl, value=work / t.median / per_ms, unit=unit,
                lower_is_better=False, ms=t.median, group=group,
                baseline=(impl in baselines if baselines is not None
                          else not impl.startswith("vitrail")),
                **({"flops": work, "math": math.get(impl, "bf16")} if unit == "TFLOP/s"
                   else {"bytes": work}))
            for impl, t in (compare(ok) if ok else {}).items()]


@register("attention", "vitrail.ops.attention forward vs torch SDPA (cuDNN, flash), bf16", build,
          by_name=True)
def run() -> list[Row]:
    import torch
    from torch.nn.attention import SDPBackend

    from vitrail.ops.attention import attention
    cudnn, flash = _sdpa(SDPBackend.CUDNN_ATTENTION), _sdpa(SDPBackend.FLASH_ATTENTION)
    rows = []
    for b, s, h, d, dv, causal in CASES:
        q, k, v = (torch.randn(b, s, h, e, device="cuda", dtype=torch.bfloat16)
                   for e in (d, d, dv))
        case = _name(b, s, h, d, dv, causal)
        fns = {"vitrail": lambda: attention(q, k, v, causal=causal),
               "SDPA cuDNN": lambda: cudnn(q, k, v, causal),
               "SDPA flash": lambda: flash(q, k, v, causal)}
        rows += _timed(case, fns, flops(b, s, h, d, dv, causal), f"D{d}")
    return rows


def build_fp8() -> None:
    """Compile the FP8 forward's kernels and V^T passes of the grid, and the bf16 ones beside."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from vitrail.ops.attention import fp8, kernel, persistent_for, warpgroups
    from vitrail.device import target_limits
    sms = target_limits().sm_count
    dtypes = (torch.float8_e4m3fn, torch.bfloat16)
    variants = sorted({(d, dv, causal, persistent_for(s, -(-s // (64 * wg)) * h * b, sms), i, wg)
                       for b, s, h, d, dv, causal in CASES for i, dt in enumerate(dtypes)
                       for wg in (warpgroups(d, dv, dt, rows=s),)})
    jobs = [lambda d=d, dv=dv, c=c, p=p, dt=dtypes[i], wg=wg: kernel(
                dt, d, c, dv=dv, persistent=p, out_dtype=torch.bfloat16, wg=wg)
            for d, dv, c, p, i, wg in variants]
    jobs += [lambda dv=dv: fp8.vt_kernel(dv) for dv in sorted({v[1] for v in variants})]
    with ThreadPoolExecutor(max(1, min(8, len(jobs)))) as pool:
        list(pool.map(lambda job: job(), jobs))


@register("attention.fp8", "vitrail.ops.attention_fp8 (e4m3 q, k, v; its V^T pass included) vs "
          "the bf16 forward (vitrail's, SDPA cuDNN) on the same values", build_fp8, by_name=True)
def run_fp8() -> list[Row]:
    import torch
    from torch.nn.attention import SDPBackend

    from vitrail.ops.attention import attention
    from vitrail.ops.attention.fp8 import attention_fp8
    cudnn = _sdpa(SDPBackend.CUDNN_ATTENTION)
    rows = []
    for b, s, h, d, dv, causal in CASES:
        q, k, v = (torch.randn(b, s, h, e, device="cuda", dtype=torch.bfloat16)
                   for e in (d, d, dv))
        q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
        q, k, v = (x.to(torch.bfloat16) for x in (q8, k8, v8))  # the same values in bf16
        fns = {"vitrail fp8": lambda: attention_fp8(q8, k8, v8, causal=causal),
               "vitrail bf16": lambda: attention(q, k, v, causal=causal),
               "SDPA cuDNN": lambda: cudnn(q, k, v, causal)}
        rows += _timed(_name(b, s, h, d, dv, causal), fns, flops(b, s, h, d, dv, causal),
                       f"D{d}", math={"vitrail fp8": "fp8"},
                       baselines={"vitrail bf16", "SDPA cuDNN"})
    return rows


# forward + backward: the forward's grid (where D is not 64 or 128, or Dv differs, the backward
# runs backward.py's matmuls)
TRAIN_CASES = CASES


@register("attention.backward", "vitrail.ops.attention forward + backward vs torch SDPA "
          "(cuDNN, flash), bf16", build, by_name=True)
def run_backward() -> list[Row]:
    """One forward and its backward (q, k and v's gradients), 3.5 times the forward's FLOPs
    (FlashAttention's count), against SDPA's backends doing the same in the same run: vitrail's
    default (fast) backward, and where it has kernels (D = Dv of 64 or 128) its deterministic
    one too."""
    import torch
    from torch.nn.attention import SDPBackend

    from vitrail.ops.attention import BWD_HEAD_DIMS, attention
    cudnn, flash = _sdpa(SDPBackend.CUDNN_ATTENTION), _sdpa(SDPBackend.FLASH_ATTENTION)
    rows = []
    for b, s, h, d, dv, causal in TRAIN_CASES:
        q, k, v = (torch.randn(b, s, h, e, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for e in (d, d, dv))
        go = torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16)
        case = _name(b, s, h, d, dv, causal)

        def step(forward):
            return lambda: torch.autograd.grad(forward(), (q, k, v), go)
        fns = {"vitrail": step(lambda: attention(q, k, v, causal=causal))}
        if d == dv and d in BWD_HEAD_DIMS:
            fns["vitrail deterministic"] = step(
                lambda: attention(q, k, v, causal=causal, deterministic=True))
        fns |= {"SDPA cuDNN": step(lambda: cudnn(q, k, v, causal).transpose(1, 2)),
                "SDPA flash": step(lambda: flash(q, k, v, causal).transpose(1, 2))}
        rows += _timed(case, fns, 3.5 * flops(b, s, h, d, dv, causal), f"D{d}")
    return rows


# decoding: one query row per (batch entry, head) against a long KV cache, no mask (what
# split-KV is for); GQA with 4 query heads a KV head, and MHA; tokens a batch at most 2^19, and
# a serving batch of 32 at 8k and 64k keys (GQA, D 128)
DECODE_CASES = [(b, sk, h, hk, d)
                for h, hk, d in ((32, 8, 128), (16, 16, 128), (32, 8, 64))
                for sk in (2048, 8192, 32768, 131072)
                for b in (1, 4, 16) if b * sk <= 1 << 19]
DECODE_CASES += [(32, sk, 32, 8, 128) for sk in (8192, 65536)]
DECODE_SPLITS = (1, 2, 4, 8, 16, 32, 64)
DECODE_PAGES = (16, 256)  # attention_kvcache's page sizes: vLLM's, and one past a block of keys


def build_decode() -> None:
    """The kernels decoding takes: the one-pass forward at each case's keys, the varlen forward
    at each split's chunk size and the kvcache's paged one (persistent or not), in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from vitrail.ops.attention import combine_kernel, kernel, warpgroups
    variants = {(d, var, p) for _, _, _, _, d in DECODE_CASES for var in (False, True)
                for p in (False, True)}
    jobs = [lambda d=d, var=var, p=p: kernel(torch.bfloat16, d, False, varlen=var, persistent=p,
                                             wg=warpgroups(d, rows=1))  # a few rows a head
            for d, var, p in sorted(variants)]
    jobs += [lambda d=d, p=p: kernel(torch.bfloat16, d, False, persistent=p, paged=True)
             for d, p in sorted({(d, p) for d, _, p in variants})]
    jobs += [lambda d=d: combine_kernel(torch.bfloat16, d)
             for d in sorted({c[4] for c in DECODE_CASES})]
    with ThreadPoolExecutor(max(1, min(8, len(jobs)))) as pool:
        list(pool.map(lambda job: job(), jobs))


@register("attention.decode", "vitrail.ops.attention decoding (one query row, long KV, split-KV) "
          "vs torch SDPA (cuDNN, flash), bf16", build_decode, by_name=True)
def run_decode() -> list[Row]:
    """GB/s over the bytes a decoding step must read (K and V once, q and o): vitrail's own
    choice of split and each fixed num_splits, attention_kvcache over the same keys as an
    unpaged cache and in shuffled pages (DECODE_PAGES), against SDPA's backends (GQA through
    enable_gqa) in the same run."""
    import torch
    from torch.nn.attention import SDPBackend

    from vitrail.ops.attention import attention
    from vitrail.ops.attention.kvcache import attention_kvcache
    cudnn, flash = _sdpa(SDPBackend.CUDNN_ATTENTION), _sdpa(SDPBackend.FLASH_ATTENTION)
    rows = []
    for b, sk, h, hk, d in DECODE_CASES:
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        lens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
        case = f"B{b} Sk{sk} H{h}/{hk} D{d}"
        nbytes = 2.0 * (2 * b * sk * hk * d + 2 * b * h * d)
        fns = {"vitrail": lambda: attention(q, k, v)}
        fns |= {f"vitrail splits {n}": lambda n=n: attention(q, k, v, num_splits=n)
                for n in DECODE_SPLITS if sk // n >= 128}
        fns["vitrail kvcache"] = lambda: attention_kvcache(q, k, v, lens)
        for page in DECODE_PAGES:
            kp, vp, table = _paged(k, page), _paged(v, page), _table(b, sk // page, q.device)
            fns[f"vitrail kvcache, pages of {page}"] = (
                lambda kp=kp, vp=vp, table=table: attention_kvcache(q, kp, vp, lens, table))
        fns |= {"SDPA cuDNN": lambda: cudnn(q, k, v, False),
                "SDPA flash": lambda: flash(q, k, v, False)}
        rows += _timed(case, fns, nbytes, f"H{h}/{hk} D{d}", unit="GB/s")
    return rows


def _table(b: int, pages: int, device="cuda"):
    """A block table (b, pages) over a pool of b * pages pages in a random order (a fixed
    seed): entry e's page i is pool page perm[e pages + i]."""
    import torch
    perm = torch.randperm(b * pages, generator=torch.Generator().manual_seed(b * pages))
    return perm.view(b, pages).to(device=device, dtype=torch.int32)


def _paged(x, page: int):
    """x (b, sk, heads, d) as _table(b, sk // page)'s pool of pages (pages, page, heads, d)."""
    import torch
    b, sk, h, d = x.shape
    pool = torch.empty(b * sk // page, page, h, d, device=x.device, dtype=x.dtype)
    pool[_table(b, sk // page, x.device).flatten().long()] = x.reshape(-1, page, h, d)
    return pool
