"""`vitrail bench copy`: contiguous, converting and transposing copies, GB/s beside torch."""
from __future__ import annotations

from vitrail.bench import Row, register
from vitrail.bench.memory import build_configs, copy_gbps, rows_for


def build() -> None:
    """Compile the kernels the cases take (their default configs), in parallel."""
    import torch

    from vitrail.ops.copy import FAMILY, Variant
    from vitrail.tune import limits
    lim = limits()
    bf, f32 = torch.bfloat16, torch.float32
    build_configs([(FAMILY[key], FAMILY[key].space.default(problem, lim)) for key, problem in [
        (Variant("flat", bf, f32, 4), None), (Variant("transpose", bf, bf), None),
        (Variant("transpose", f32, f32), None), (Variant("rows", bf, bf, 8), (2000, 16)),
        (Variant("rows", f32, f32, 4), (4000, 16))]], "copy bench")


@register("copy", "vitrail.ops.copy vs torch copy_ / contiguous()", build)
def run() -> list[Row]:
    import torch

    import vitrail.ops as ops
    ceiling = copy_gbps()
    print(f"  copy bandwidth this run: {ceiling:.0f} GB/s")
    rows = []
    for dt in ("bfloat16", "float32"):
        dtype = getattr(torch, dt)
        x = torch.randn(16384, 16384, device="cuda", dtype=dtype)
        out = torch.empty_like(x)
        nb = 2 * x.numel() * x.element_size()
        rows += rows_for(f"contiguous {dt} 16384^2", {
            "vitrail": lambda: ops.copy(x, out=out),
            "torch eager": lambda: out.copy_(x)}, nb, ceiling)
        xt = x.t()
        ct = torch.compile(lambda t: t.contiguous() + 0)
        rows += rows_for(f"transpose {dt} 16384^2", {
            "vitrail": lambda: ops.copy(xt, out=out),
            "torch eager": lambda: out.copy_(xt),
            "torch.compile": lambda: ct(xt)}, nb, ceiling)
        x3 = torch.randn(64, 512, 1024, device="cuda", dtype=dtype).permute(0, 2, 1)
        o3 = torch.empty(x3.shape, device="cuda", dtype=dtype)
        rows += rows_for(f"permute(0,2,1) {dt} 64x512x1024", {
            "vitrail": lambda: ops.copy(x3, out=o3),
            "torch eager": lambda: o3.copy_(x3),
            "torch.compile": lambda: ct(x3)}, 2 * x3.numel() * x3.element_size(), ceiling)
        xs = x[:, :16000]
        os_ = torch.empty(xs.shape, device="cuda", dtype=dtype)
        rows += rows_for(f"slice [:, :16000] {dt} 16384^2", {
            "vitrail": lambda: ops.copy(xs, out=os_),
            "torch eager": lambda: os_.copy_(xs),
            "torch.compile": lambda: ct(xs)}, 2 * xs.numel() * xs.element_size(), ceiling)
    x = torch.randn(16384, 16384, device="cuda", dtype=torch.bfloat16)
    o = torch.empty(x.shape, device="cuda", dtype=torch.float32)
    rows += rows_for("bf16->fp32 16384^2", {
        "vitrail": lambda: ops.copy(x, out=o),
        "torch eager": lambda: o.copy_(x)}, x.numel() * 6, ceiling)
    return rows
