"""`vitrail bench attention` (the forward) and `vitrail bench attention.backward` (forward and
backward): against torch SDPA's cuDNN and flash backends in the same run, bf16, (batch, seqlen,
heads, head_dim) tensors, TFLOP/s counting only the visible scores (a causal problem does half
the work). Both run when named."""
from __future__ import annotations

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

    from vitrail.ops.attention import BWD_HEAD_DIMS, bwd_kernels, kernel, persistent_for
    variants = sorted({(d, dv, causal, persistent_for(s)) for _, s, _, d, dv, causal in CASES})
    jobs = [lambda d=d, dv=dv, c=c, p=p: kernel(torch.bfloat16, d, c, dv=dv, persistent=p)
            for d, dv, c, p in variants]
    jobs += [lambda d=d, c=c, det=det: bwd_kernels(torch.bfloat16, d, c, deterministic=det)
             for d, c in sorted({(d, c) for d, dv, c, _ in variants if d == dv})
             if d in BWD_HEAD_DIMS for det in (False, True)]
    with ThreadPoolExecutor(max(1, min(8, len(jobs)))) as pool:
        list(pool.map(lambda job: job(), jobs))


def _sdpa(backend):
    import torch
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):  # SDPA's (batch, heads, seqlen, head_dim) views, no copy
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return run


def _timed(case: str, fns: dict, work: float, group: str) -> list[Row]:
    """TFLOP/s rows of the implementations of one case, timed together; an implementation that
    refuses the case is reported, not fatal (SDPA's backends refuse some)."""
    from vitrail.profile import compare
    ok = {}
    for impl, fn in fns.items():
        try:
            fn()
            ok[impl] = fn
        except Exception as e:
            print(f"  {case} {impl}: {type(e).__name__}: {str(e)[:200]}")
    return [Row(case=case, impl=impl, value=work / t.median / 1e9, unit="TFLOP/s",
                lower_is_better=False, baseline=not impl.startswith("vitrail"), ms=t.median,
                flops=work,
                math="bf16", group=group)
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
