"""`vitrail bench sympow`: the sympow family beside the unfused torch paths, in one run.

sympow forward/backward in GB/s against this run's copy bandwidth; sympow_mma and
mma_sympow_bwd (wgmma on sm_90a, and the sm80 mma.sync kernels beside them) in TFLOP/s
counting the expanded FLOPs (2 * rows * D * N) against this run's bf16 matmul rate, with the
unfused path (the expansion stored, then torch.bmm) as baseline; and the peak memory of fused
and unfused forward + backward.
"""
from __future__ import annotations

import importlib

from vitrail.bench import Row, register

CASES_ELEMENTWISE = [("X[65536,64] p=2 d_tile=8", 65536, 64, 2, 8),
                     ("X[16384,32] p=4 d_tile=4", 16384, 32, 4, 4)]


def build() -> None:
    import torch

    from vitrail.tune import limits
    S = importlib.import_module("vitrail.ops.sympow")
    lim = limits()
    kinds = [("elementwise", 2, 8), ("elementwise", 4, 4), ("mma", 2, 8)]
    if lim.arch.major == 9 and lim.arch.suffix == "a":
        kinds.append(("mma90", 2, 8))
    for kind, p, t in kinds:
        op = S.variant_op(kind, torch.bfloat16, p, t)
        op.module(op.space.default({"vec": 8}, lim))


def _torch_sympow(x, power, d_tile):
    """The unfused torch path in x's dtype (outer products of tiles, then one cat)."""
    from vitrail.ops.sympow.reference import sympow_reference
    return sympow_reference(x, power, d_tile, keep_dtype=True)


def _time(fn) -> float:
    from vitrail.profile import measure
    return measure(fn, warmup=5, rep=20).median


@register("sympow", "sympow, sympow_mma, mma_sympow_bwd vs the unfused torch paths", build)
def run() -> list[Row]:
    import torch

    S = importlib.import_module("vitrail.ops.sympow")
    from vitrail.ops.sympow.reference import sympow_dim
    bf = torch.bfloat16
    rows: list[Row] = []
    # this run's ceilings
    big = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")
    big2 = torch.empty_like(big)
    copy_gbps = 2 * big.numel() / _time(lambda: big2.copy_(big)) / 1e6
    big = big2 = None
    m = torch.randn(8192, 8192, device="cuda", dtype=bf)
    mm_tflops = 2 * 8192 ** 3 / _time(lambda: m @ m) / 1e9
    m = None
    print(f"  this run: copy {copy_gbps:.0f} GB/s, bf16 matmul {mm_tflops:.0f} TFLOP/s")

    def add(case, impl, ms, *, flops=0.0, nbytes=0.0, baseline=False):
        extra = {}
        if nbytes:
            extra["pct_copy"] = round(100 * nbytes / ms / 1e6 / copy_gbps, 1)
        if flops:
            extra["pct_matmul"] = round(100 * flops / ms / 1e9 / mm_tflops, 1)
        group = ("sympow_mma, mma_sympow_bwd: fused vs unfused" if flops else
                 "sympow, sympow_bwd (elementwise)")
        rows.append(Row(case, impl, ms, "ms", baseline=baseline, ms=ms, flops=flops,
                        bytes=nbytes, extra=extra, group=group))
        print(f"    {case:38s} {impl:26s} {ms:8.3f} ms " + " ".join(
            f"{k}={v}%" for k, v in extra.items()))

    for name, n, d, p, t in CASES_ELEMENTWISE:
        D = sympow_dim(d, p, t)
        x = torch.randn(n, d, device="cuda", dtype=bf)
        fwd_bytes = 2 * n * (d + D)
        bwd_bytes = 2 * n * (2 * d + D)
        add(f"sympow fwd {name}", "torch eager", _time(lambda: _torch_sympow(x, p, t)),
            nbytes=fwd_bytes, baseline=True)
        add(f"sympow fwd {name}", "vitrail", _time(lambda: S.sympow(x, p, t)), nbytes=fwd_bytes)
        dz = torch.randn(n, D, device="cuda", dtype=bf)
        xg = x.detach().requires_grad_(True)
        zt = _torch_sympow(xg, p, t)
        add(f"sympow bwd {name}", "torch autograd",
            _time(lambda: torch.autograd.grad(zt, xg, dz, retain_graph=True)), nbytes=bwd_bytes,
            baseline=True)
        zt = None
        add(f"sympow bwd {name}", "vitrail",
            _time(lambda: torch.ops.vitrail.sympow_bwd(x, dz, p, t, True)), nbytes=bwd_bytes)
        dz = x = xg = None
        torch.cuda.empty_cache()

    P, M, d, p, t, N = 64, 4096, 64, 2, 8, 64
    D = sympow_dim(d, p, t)
    flops = 2.0 * P * M * D * N
    # query side: a [P, M, d] expands K
    a = torch.randn(P, M, d, device="cuda", dtype=bf)
    b = (torch.randn(P, D, N, device="cuda") / 48).to(bf)
    case = f"sympow_mma query P{P} M{M} d{d} N{N}"
    add(case, "unfused (sympow+bmm)", _time(lambda: torch.bmm(S.sympow(a, p, t), b)),
        flops=flops, baseline=True)
    add(case, "vitrail fused", _time(lambda: S.sympow_mma(a, b, -1, p, t)), flops=flops)
    add(case, "vitrail fused sm80 mma.sync",
        _time(lambda: S.mma_impl(a, b, -1, p, t, 1.0, True, wgmma=False)), flops=flops)
    # state side: a [P, d, K] expands M
    ak = torch.randn(P, d, M, device="cuda", dtype=bf)
    bk = (torch.randn(P, M, N, device="cuda") / 64).to(bf)
    case = f"sympow_mma state P{P} d{d} K{M} N{N}"
    add(case, "unfused (sympow+bmm)",
        _time(lambda: torch.bmm(S.sympow(ak, p, t, dim=-2), bk)), flops=flops, baseline=True)
    add(case, "vitrail fused", _time(lambda: S.sympow_mma(ak, bk, -2, p, t)), flops=flops)
    add(case, "vitrail fused sm80 mma.sync",
        _time(lambda: S.mma_impl(ak, bk, -2, p, t, 1.0, True, wgmma=False)), flops=flops)
    # mma_sympow_bwd, query side: c = a [P, M, d], grad [P, M, N], b^T [P, N, D]
    g = torch.randn(P, M, N, device="cuda", dtype=bf)
    bt = b.transpose(1, 2).contiguous()
    case = f"mma_sympow_bwd query P{P} M{M} d{d} N{N}"
    add(case, "unfused (bmm+sympow_bwd)",
        _time(lambda: torch.ops.vitrail.sympow_bwd(a, torch.bmm(g, bt), p, t, True)),
        flops=flops, baseline=True)
    add(case, "vitrail fused", _time(lambda: S.mma_sympow_bwd(g, bt, a, -1, p, t)), flops=flops)
    add(case, "vitrail fused sm80 mma.sync",
        _time(lambda: S.mma_bwd_impl(g, bt, a, -1, p, t, 1.0, True, wgmma=False)), flops=flops)
    # state side: c = ak [P, d, K], grad [P, D, N], bk^T [P, N, K]
    gs = torch.randn(P, D, N, device="cuda", dtype=bf)
    bkt = bk.transpose(1, 2).contiguous()
    case = f"mma_sympow_bwd state P{P} d{d} K{M} N{N}"
    add(case, "unfused (bmm+sympow_bwd)",
        _time(lambda: torch.ops.vitrail.sympow_bwd(
            ak.transpose(1, 2), torch.bmm(gs, bkt).transpose(1, 2), p, t, True)),
        flops=flops, baseline=True)
    add(case, "vitrail fused", _time(lambda: S.mma_sympow_bwd(gs, bkt, ak, -2, p, t)),
        flops=flops)

    # peak memory of forward + backward, query side
    expanded = P * M * D * 2
    for impl, f in [("unfused", lambda u, v: torch.bmm(S.sympow(u, p, t), v)),
                    ("vitrail fused", lambda u, v: S.sympow_mma(u, v, -1, p, t))]:
        u, v = a.detach().requires_grad_(True), b.detach().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        f(u, v).sum().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        rows.append(Row("peak memory query fwd+bwd", impl, peak / 2 ** 20, "MiB",
                        baseline=impl == "unfused",
                        extra={"expanded_MiB": expanded / 2 ** 20}))
        print(f"    peak memory fwd+bwd {impl:16s} {peak / 2 ** 20:9.1f} MiB "
              f"(expanded operand {expanded / 2 ** 20:.0f} MiB)")
    return rows
