"""Side by side (vitrail.profile.compare, interleaved) on the GPU: the sympow wgmma kernels'
old and new variants at the bench shapes (P 64, M = K 4096, d 64, p 2, d_tile 8, N 64, bf16),
beside torch.bmm of the same output shape and the unfused paths `vitrail bench sympow` uses.
One line each: median ms, TFLOP/s (2 P K D N), % of a bf16 8192^3 matmul timed in this run, and
the ratio to the case's baseline."""
import importlib

import torch

from vitrail.profile import bench
from vitrail.profile.bench import compare

S = importlib.import_module("vitrail.ops.sympow")
from vitrail.ops.sympow.reference import sympow_dim  # noqa: E402

bf = torch.bfloat16
P, M, d, p, t, N = 64, 4096, 64, 2, 8, 64
D = sympow_dim(d, p, t)
FLOPS = 2.0 * P * M * D * N
m = torch.randn(8192, 8192, device="cuda", dtype=bf)
mm = 2 * 8192 ** 3 / bench(lambda: m @ m, warmup=5, rep=20).median / 1e9
m = None
print(f"bf16 matmul 8192^3: {mm:.0f} TFLOP/s")


def show(case, fns, baseline):
    res = compare(fns, rounds=5, rep=50)
    base = res[baseline].median
    for name, tm in res.items():
        tf = FLOPS / tm.median / 1e9
        print(f"{case:14s} {name:34s} {tm.median:7.3f} ms  {tf:6.1f} TFLOP/s  "
              f"{100 * tf / mm:5.1f}% of matmul  x{base / tm.median:5.2f} vs {baseline}  "
              f"(spread {tm.spread:.1%})", flush=True)


# state side: a [P, d, K], b [P, K, N] -> [P, D, N]
ak = torch.randn(P, d, M, device="cuda", dtype=bf)
bk = (torch.randn(P, M, N, device="cuda") / 64).to(bf)
xs = torch.randn(P, D, M, device="cuda", dtype=bf)  # bmm of the same output shape
ref = S._mma_impl(ak, bk, -2, p, t, 1.0, True, order="p", wgs=2)
for wgs in (2, 3):
    got = S._mma_impl(ak, bk, -2, p, t, 1.0, True, wgs=wgs)
    print(f"state wgs={wgs} max |diff| vs old: {(got.float() - ref.float()).abs().max().item():.3g}")
show("state", {
    "old m_wg, P fastest": lambda: S._mma_impl(ak, bk, -2, p, t, 1.0, True, order="p", wgs=2),
    "m_wg, tiles fastest": lambda: S._mma_impl(ak, bk, -2, p, t, 1.0, True, order="tiles", wgs=2),
    "m_wg3, P fastest": lambda: S._mma_impl(ak, bk, -2, p, t, 1.0, True, order="p", wgs=3),
    "m_wg3, tiles fastest": lambda: S._mma_impl(ak, bk, -2, p, t, 1.0, True, order="tiles", wgs=3),
    "torch.bmm [P,D,K]@[P,K,N]": lambda: torch.bmm(xs, bk),
    "unfused (sympow+bmm)": lambda: torch.bmm(S.sympow(ak, p, t, dim=-2), bk),
}, "old m_wg, P fastest")
xs = ak = bk = None

# query side: a [P, M, d], b [P, D, N] -> [P, M, N]
a = torch.randn(P, M, d, device="cuda", dtype=bf)
b = (torch.randn(P, D, N, device="cuda") / 48).to(bf)
xq = torch.randn(P, M, D, device="cuda", dtype=bf)
show("query", {
    "old k_wg, P fastest": lambda: S._mma_impl(a, b, -1, p, t, 1.0, True, order="p"),
    "k_wg, tiles fastest": lambda: S._mma_impl(a, b, -1, p, t, 1.0, True, order="tiles"),
    "torch.bmm [P,M,D]@[P,D,N]": lambda: torch.bmm(xq, b),
    "unfused (sympow+bmm)": lambda: torch.bmm(S.sympow(a, p, t), b),
}, "old k_wg, P fastest")
xq = None

# mma_sympow_bwd, query side: c = a [P, M, d], grad [P, M, N], b^T [P, N, D]
g = torch.randn(P, M, N, device="cuda", dtype=bf)
bt = b.transpose(1, 2).contiguous()
ref = S._mma_bwd_impl(g, bt, a, -1, p, t, 1.0, True, order="p", defer=False)
got = S._mma_bwd_impl(g, bt, a, -1, p, t, 1.0, True, defer=True)
print(f"bwd defer max |diff| vs old: {(got.float() - ref.float()).abs().max().item():.3g} "
      f"(max |old| {ref.float().abs().max().item():.3g})")
show("bwd query", {
    "old bwd_k_wg, P fastest":
        lambda: S._mma_bwd_impl(g, bt, a, -1, p, t, 1.0, True, order="p", defer=False),
    "bwd_k_wg, tiles fastest":
        lambda: S._mma_bwd_impl(g, bt, a, -1, p, t, 1.0, True, order="tiles", defer=False),
    "bwd_k_wg2, P fastest":
        lambda: S._mma_bwd_impl(g, bt, a, -1, p, t, 1.0, True, order="p", defer=True),
    "bwd_k_wg2, tiles fastest":
        lambda: S._mma_bwd_impl(g, bt, a, -1, p, t, 1.0, True, order="tiles", defer=True),
    "torch.bmm [P,M,N]@[P,N,D]": lambda: torch.bmm(g, bt),
    "unfused (bmm+sympow_bwd)":
        lambda: torch.ops.vitrail.sympow_bwd(a, torch.bmm(g, bt), p, t, True),
}, "unfused (bmm+sympow_bwd)")
