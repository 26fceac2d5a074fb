"""`vitrail bench softmax`: softmax and log_softmax forward and backward, GB/s and % of the copy
bandwidth measured in the same run, beside torch eager, torch.compile and a copy of the same
bytes (the reach of a problem that small)."""
from __future__ import annotations

from vitrail.bench import Row, register
from vitrail.bench.memory import build_configs, copy_gbps, rows_for

CASES = [((32768, 4096), "bfloat16"), ((32768, 4096), "float32"), ((4096, 32768), "bfloat16"),
         ((65536, 512), "bfloat16"), ((65536, 128), "float32"), ((16, 262144), "bfloat16"),
         ((8, 1 << 20), "float32"), ((256, 65536), "bfloat16"), ((4194304, 7), "bfloat16"),
         ((2097152, 7), "float32")]


def build() -> None:
    """Compile the kernels the cases take (their routes on this GPU, or the build target's), in
    parallel."""
    import torch

    from vitrail.ops.softmax import route_contiguous
    chosen = []
    for (rows, n), dt in CASES:
        dtype = getattr(torch, dt)
        for kind, log in (("fwd", False), ("fwd", True), ("bwd", False)):
            op, key, problem = route_contiguous(kind, rows, n, dtype, log, None)
            chosen.append((op, op.config(key, problem)))
    build_configs(chosen, "softmax bench")


@register("softmax", "softmax/log_softmax fwd+bwd, GB/s vs torch", build)
def run() -> list[Row]:
    import torch

    import vitrail.ops as ops
    from vitrail.ops.softmax import softmax_bwd
    ceiling = copy_gbps()
    print(f"  copy bandwidth this run: {ceiling:.0f} GB/s")
    rows = []
    cfwd = torch.compile(lambda t: torch.softmax(t, -1))
    cbwd = torch.compile(lambda y, g: y * (g - (g * y).sum(-1, keepdim=True)))
    for (m, n), dt in CASES:
        dtype = getattr(torch, dt)
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        y = torch.softmax(x, -1)
        dy = torch.randn_like(x)
        nb = 2 * x.numel() * x.element_size()
        # a copy moving the same bytes: what a problem this small can reach (launch latency and
        # the ramp of a short kernel weigh on small problems, e.g. 16 MB in 16 x 262144)
        src = torch.empty(int(1.5 * nb) // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        half = src[:nb // 2], dst[:nb // 2]
        same_fwd = {"copy, same bytes": lambda: half[1].copy_(half[0])}
        same_bwd = {"copy, same bytes": lambda: dst.copy_(src)}
        case = f"fwd {dt} {m}x{n}"
        rows += rows_for(case, {"vitrail": lambda: ops.softmax(x),
                                "torch eager": lambda: torch.softmax(x, -1),
                                "torch.compile": lambda: cfwd(x), **same_fwd}, nb, ceiling,
                         "softmax forward")
        if n <= 4096 and dt == "bfloat16":
            rows += rows_for(f"log fwd {dt} {m}x{n}",
                             {"vitrail": lambda: ops.log_softmax(x),
                              "torch eager": lambda: torch.log_softmax(x, -1)}, nb, ceiling,
                             "log_softmax forward")
        case = f"bwd {dt} {m}x{n}"
        rows += rows_for(case, {
            "vitrail": lambda: softmax_bwd(y, dy, 1, False),
            "torch eager": lambda: torch._softmax_backward_data(dy, y, -1, x.dtype),
            "torch.compile": lambda: cbwd(y, dy), **same_bwd}, 1.5 * nb, ceiling,
            "softmax backward")
    return rows
