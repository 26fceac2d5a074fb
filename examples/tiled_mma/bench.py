"""The example GEMM against torch.mm (cuBLAS) on this GPU, timed fairly (vitrail.profile).

    python -m examples.tiled_mma.bench [M N K ...]
"""
from __future__ import annotations

import sys

import torch

from examples.tiled_mma.gemm import gemm
from vitrail.profile.timing import compare


def main(argv: list[str]) -> None:
    sizes = [int(v) for v in argv] or [4096, 4096, 4096, 8192, 8192, 8192, 2048, 2048, 8192]
    if len(sizes) % 3:
        raise SystemExit("give sizes as M N K triples")
    print(torch.cuda.get_device_name(), "bf16, TFLOP/s by the median of interleaved rounds")
    for m, n, k in zip(*[iter(sizes)] * 3):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        t = compare({"example": lambda: gemm(a, b), "torch.mm": lambda: torch.mm(a, b.T)},
                    rep=200)
        flop = 2 * m * n * k
        tf = {name: flop / (x.median * 1e-3) / 1e12 for name, x in t.items()}
        print(f"{m} x {n} x {k}: example {tf['example']:.0f}, torch.mm {tf['torch.mm']:.0f} "
              f"TFLOP/s: {tf['example'] / tf['torch.mm']:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
