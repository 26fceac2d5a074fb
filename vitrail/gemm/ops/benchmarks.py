"""`vitrail bench gemm`: mm/bmm (bf16, fp16), fused bias+gelu, FP8 scaled_mm and grouped_mm,
TFLOP/s beside torch (cuBLAS) measured in the same run; the issue's shapes. `vitrail bench
gemm-sweep`: the selection's sweep. `vitrail bench gemm-epilogues`: what each epilogue costs.

``build()`` precompiles every kernel the benchmark uses, in parallel (vitrail.tune.compile_all),
so the timed run compiles nothing.
"""
from __future__ import annotations

from vitrail.bench import Row, register

SHAPES = [(2048, 2048, 2048, 1), (4096, 4096, 4096, 1), (8192, 8192, 8192, 1),
          (16384, 16384, 1024, 1), (8192, 1024, 8192, 1), (64, 8192, 8192, 1),
          (4096, 4096, 4096, 8)]
MOE = [(m, 4096, 7168) for m in (128, 256, 512, 384, 1024, 64, 768, 320)]


def _jobs():
    """(Op, config) of every kernel the benchmark runs, from the heuristic."""
    import torch

    from vitrail.gemm import LinearCombination
    from vitrail.gemm.ops.configs import Kind, Problem
    from vitrail.gemm.ops.launch import op_for
    from vitrail.tune import limits
    lim = limits()
    jobs = []

    def add(kind, problems):
        op = op_for(kind)
        for p in problems:
            config = op.space.default(p, lim)
            if (op, config) not in jobs:
                jobs.append((op, config))
    probs = [Problem(m, n, k, b) for m, n, k, b in SHAPES] + [Problem(m, n, k) for m, n, k in MOE]
    for el in ("bf16", "f16"):
        add(Kind(el, el, "row", "row", LinearCombination(el)), probs)
    add(Kind("bf16", "bf16", "row", "row", LinearCombination("bf16", bias="col",
                                                             activation="gelu")),
        [Problem(8192, 8192, 8192), Problem(4096, 4096, 4096)])
    for fast in (True, False):  # fast accumulation, and exact (scaled_mm's default)
        add(Kind("e4m3", "e4m3", "row", "col", LinearCombination(
            "bf16", scale_a="tensor", scale_b="tensor"), fast_accum=fast),
            [Problem(8192, 8192, 8192), Problem(4096, 4096, 4096)])
    del torch
    return jobs


def build() -> None:
    import torch

    from vitrail.gemm.ops.grouped import operation as grouped_operation
    from vitrail.tune import compile_all, limits
    lim = limits()
    kwargs = [kw for kw in (op.render(c) for op, c in _jobs()) if kw is not None]
    kwargs.append(grouped_operation(torch.bfloat16, "row").compile_kwargs())
    jobs = [(i, dict(kw, arch=lim.arch.name)) for i, kw in enumerate(kwargs)]
    failures = compile_all(jobs, verbose=True, label="gemm bench")
    for i, error in failures.items():
        print(f"  build failed: {error[:2000]}")


def group_of(case: str) -> str:
    """The plot's panel of a case: what a reader compares it with."""
    first = case.split()[0]
    if first in ("bfloat16", "float16"):
        return f"{first} mm/bmm shapes"
    return {"bf16": "bf16 bias+gelu epilogue", "fp8": "fp8 e4m3 scaled_mm",
            "grouped": "grouped_mm (MoE)"}.get(first, "other")


def _rows(case: str, fns: dict, flops: float, math: str = "bf16") -> list[Row]:
    """The case's implementations timed together (vitrail.profile.compare: interleaved rounds,
    so the GPU's clock drift under GEMM load falls on all of them alike)."""
    from vitrail.profile import compare
    ok = {}
    for impl, fn in fns.items():
        try:
            fn()
            ok[impl] = fn
        except Exception as e:  # a failing implementation is reported, not fatal
            print(f"  {case} {impl}: {type(e).__name__}: {str(e)[:300]}")
    ours = next(iter(fns))
    return [Row(case=case, impl=impl, value=flops / t.median / 1e9, unit="TFLOP/s",
                lower_is_better=False, baseline=impl != ours, ms=t.median, flops=flops,
                math=math, group=group_of(case))
            for impl, t in (compare(ok) if ok else {}).items()]


@register("gemm", "vitrail.ops mm/bmm/gemm/scaled_mm/grouped_mm vs torch (cuBLAS)", build)
def run() -> list[Row]:
    import torch
    import torch.nn.functional as F

    from vitrail.gemm.ops import bmm, gemm, grouped_mm, mm, scaled_mm
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        dn = str(dtype).removeprefix("torch.")
        for m, n, k, b in SHAPES:
            shape = (b, m, k) if b > 1 else (m, k)
            x = torch.randn(shape, device="cuda", dtype=dtype)
            y = torch.randn((b, k, n) if b > 1 else (k, n), device="cuda", dtype=dtype)
            ours = (lambda: bmm(x, y)) if b > 1 else (lambda: mm(x, y))
            case = f"{dn} {m}x{n}x{k}" + (f" batch {b}" if b > 1 else "")
            rows += _rows(case, {"vitrail": ours, "torch.matmul": lambda: x @ y},
                          2.0 * m * n * k * b, math="bf16" if dtype is torch.bfloat16 else "fp16")
    for s in (4096, 8192):
        x = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(s, s, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(s, device="cuda", dtype=torch.bfloat16)
        rows += _rows(f"bf16 {s}^3 bias+gelu", {
            "vitrail": lambda: gemm(x, w, bias=bias, activation="gelu"),
            "torch gelu(addmm)": lambda: F.gelu(torch.addmm(bias, x, w))}, 2.0 * s ** 3)
        a8 = torch.randn(s, s, device="cuda").to(torch.float8_e4m3fn)
        b8 = torch.randn(s, s, device="cuda").to(torch.float8_e4m3fn).t()
        one = torch.tensor(1.0, device="cuda")
        for fast in (True, False):
            rows += _rows(f"fp8 e4m3 {s}^3 {'fast' if fast else 'exact'} accumulation", {
                "vitrail": lambda fast=fast: scaled_mm(a8, b8, one, one, use_fast_accum=fast),
                "torch._scaled_mm": lambda fast=fast: torch._scaled_mm(
                    a8, b8, one, one, out_dtype=torch.bfloat16, use_fast_accum=fast)},
                2.0 * s ** 3, math="fp8")
    ms = [m for m, _, _ in MOE]
    _, n, k = MOE[0]
    a = torch.randn(sum(ms), k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(len(ms), k, n, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor(ms, device="cuda").cumsum(0).to(torch.int32)
    starts = [0] + ends.tolist()[:-1]
    loop = lambda: [a[s:e] @ w[g] for g, (s, e) in enumerate(zip(starts, ends.tolist()))]  # noqa
    fns = {"vitrail grouped_mm": lambda: grouped_mm(a, w, ends), "torch.matmul loop": loop}
    if hasattr(torch, "_grouped_mm"):
        wt = w.transpose(-1, -2).contiguous().transpose(-1, -2)
        fns["torch._grouped_mm"] = lambda: torch._grouped_mm(a, wt, ends)
    rows += _rows(f"grouped bf16 8 MoE groups N{n} K{k}", fns, 2.0 * sum(ms) * n * k)
    return rows


def build_sweep() -> None:
    """The selection's kernels for the sweep (every candidate, B row- and column-major)."""
    from vitrail.gemm import LinearCombination
    from vitrail.gemm.ops import model
    from vitrail.gemm.ops.configs import Kind
    from vitrail.gemm.ops.launch import op_for
    from vitrail.tune import compile_all, limits
    lim = limits()
    jobs = []
    for el in ("bf16", "f16"):
        for lb in ("row", "col"):
            op = op_for(Kind(el, el, "row", lb, LinearCombination(el)))
            jobs += [((el, lb, c), dict(op.render(c), arch=lim.arch.name))
                     for c in model.CANDIDATES if not op.space.reasons(c, lim)]
    for key, error in compile_all(jobs, verbose=True, label="gemm sweep").items():
        print(f"  build failed {key}: {error[:2000]}")


@register("gemm-sweep", "vitrail.ops mm/bmm on the selection's sweep (315 shapes: LLM linear "
          "layers at 1-16384 tokens, squares, odd sizes, long K, batches) vs torch, bf16 and "
          "fp16, CUDA graph and eager", build_sweep, by_name=True)
def run_sweep() -> list[Row]:
    import torch

    from vitrail.gemm.ops import sweep
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        dn = str(dtype).removeprefix("torch.")
        graph, eager = {}, {}
        for rec in sweep.time_calls(dtype):
            case = f"{dn} {rec['name']}" + (" held out" if rec["held_out"] else "")
            flops = 2.0 * rec["M"] * rec["N"] * rec["K"] * rec["L"]
            for impl, base in (("vitrail", False), ("torch", True)):
                rows.append(Row(case=case, impl=impl, value=rec["graph"][impl] * 1e3, unit="us",
                                baseline=base, ms=rec["graph"][impl], flops=flops,
                                extra={"eager_us": rec["eager"][impl] * 1e3},
                                group=f"{dn}, CUDA graph"))
            graph[rec["name"]] = rec["graph"]["torch"] / rec["graph"]["vitrail"]
            eager[rec["name"]] = rec["eager"]["torch"] / rec["eager"]["vitrail"]
        print(f"{dn} CUDA graph, torch time / vitrail time: {sweep.summary(graph)}")
        print(f"{dn} eager, torch time / vitrail time: {sweep.summary(eager)}")
    return rows


# ---------------------------------------------------------------- what each epilogue costs
EPILOGUE_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 8192, 1024)]


def epilogues(el: str = "bf16") -> dict:
    """{name: LinearCombination} of the epilogues timed against the plain one ('plain' first):
    a bias, each activation alone, a clamp, beta * C, and nn.Linear's bias + gelu."""
    from vitrail.gemm import LinearCombination
    from vitrail.gemm.epilogue import ACTIVATIONS
    out = {"plain": LinearCombination(el), "bias": LinearCombination(el, bias="col")}
    out.update((act, LinearCombination(el, activation=act)) for act in ACTIVATIONS)
    out["clamp"] = LinearCombination(el, clamp=True)
    out["beta*C"] = LinearCombination(el, element_source=el)
    out["bias+gelu"] = LinearCombination(el, bias="col", activation="gelu")
    return out


def _epilogue_jobs():
    """(shape, Op, config) of every kernel gemm-epilogues runs: per shape, the config the
    selection takes among vitrail's kernels, the same for every epilogue."""
    from vitrail.gemm.ops import model
    from vitrail.gemm.ops.configs import Kind
    from vitrail.gemm.ops.launch import op_for
    for m, n, k in EPILOGUE_SHAPES:
        config = model.choose(m, n, k, 1, torch_ok=False)
        for lc in epilogues().values():
            yield (m, n, k), op_for(Kind("bf16", "bf16", "row", "row", lc)), config


def build_epilogues() -> None:
    from vitrail.tune import compile_all, limits
    lim = limits()
    kwargs = []
    for _, op, config in _epilogue_jobs():
        kw = dict(op.render(config), arch=lim.arch.name)
        if kw not in kwargs:
            kwargs.append(kw)
    for _, error in compile_all(list(enumerate(kwargs)), verbose=True,
                                label="gemm epilogues").items():
        print(f"  build failed: {error[:2000]}")


@register("gemm-epilogues", "each fused epilogue of vitrail's GEMM (bias, the activations, "
          "clamp, beta*C) against the plain GEMM of the same config, bf16, CUDA graphs",
          build_epilogues, by_name=True)
def run_epilogues() -> list[Row]:
    import math

    import torch

    from vitrail.gemm.ops import model
    from vitrail.gemm.ops.sweep import Graph, fair_ms
    rows = []
    names = list(epilogues())  # 'plain' first: every other one's baseline
    jobs = list(_epilogue_jobs())
    for (m, n, k), config in dict.fromkeys((s, c) for s, _, c in jobs):
        ops = [op for s, op, c in jobs if s == (m, n, k)]
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        c = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        sets = [(a, b, torch.empty(m, n, device="cuda", dtype=torch.bfloat16))]
        flops = 2.0 * m * n * k
        launches = max(4, math.ceil(10e-3 * 700e12 / flops))  # a replay of ~10 ms

        def graph(op, lc):
            cc = c if lc.has_source else None
            bb = bias if lc.bias else None

            def launch(a, b, d, module=op.module(config)):
                op.launch(module, config, a, b, cc, d, bb, None, None, 1.0, 0.5, 0.01, -1.0,
                          1.0, 1)
            return Graph(launch, sets, launches)
        graphs = {name: graph(op, lc) for (name, lc), op in zip(epilogues().items(), ops)}
        shape = f"{m}x{n}x{k}"
        for name in names[1:]:
            # each against the plain kernel timed beside it, alternating: the GPU's clock
            # falls under sustained GEMM load, and the pair sees the same clock
            ms = fair_ms({"plain": graphs["plain"], name: graphs[name]}, rounds=6)
            case = f"bf16 {shape} {name}"
            for impl, t, base in ((name, ms[name], False), ("plain", ms["plain"], True)):
                rows.append(Row(case=case, impl=f"vitrail {impl}", value=flops / t / 1e9,
                                unit="TFLOP/s", lower_is_better=False, baseline=base, ms=t,
                                flops=flops, math="bf16", group=f"bf16 {shape}, "
                                f"{model.label(config)}"))
            print(f"{case:<32} {ms[name] * 1e3:8.1f} us against plain {ms['plain'] * 1e3:8.1f}"
                  f" us: {ms[name] / ms['plain'] - 1:+6.1%}", flush=True)
    return rows
