"""`vitrail bench host`: what an eager call costs the host, for every public op beside torch.

Two tables. **Host µs per call**: each public op on a problem small enough that the GPU keeps up,
called back to back (no synchronization inside a round of ``CALLS`` calls, fewer than the launch
queue holds), beside torch's equivalent call. **Small problems**: eager wall time per call
(back-to-back calls, then one synchronization) of problems whose GPU work takes 5-100 µs,
forward and forward+backward, for vitrail and torch, and the same calls replayed from a CUDA
graph (the host's share removed), so that the table shows where host time decides. Each
implementation first runs for ``WARMUP_S`` (the GPU's clocks up), then all are timed in rounds
that alternate between them. Before any of it, the cases' kernels are built side by side in
processes of their own (``BUILDERS``), so a cold cache does not compile them one by one.

sympow has no torch op; its rows compare with the one torch call that does the nearest work:
the outer product ``x[..., :, None] * x[..., None, :]`` (sympow p2), ``torch.bmm`` of the same
operands (sympow_mma, mma_sympow_bwd).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

from vitrail.bench import Row, register
from vitrail.bench.jit_overhead import per_call_us

CALLS = 200  # calls a round: the launch queue (1024 entries) never fills, so the host is timed
ROUNDS = 15


WARMUP_S = 0.2  # of calls per implementation before timing: modules loaded, clocks up


def _warm(fn: Callable[[], object]) -> None:
    """Call fn for WARMUP_S seconds at least (synchronized): a GPU left idle by host-only
    cases runs at low clocks, and the first timed function would pay for raising them."""
    import torch
    began, calls = time.perf_counter(), 0
    while calls < 10 or time.perf_counter() - began < WARMUP_S:
        fn()
        torch.cuda.synchronize()
        calls += 1


def _rounds(runs: dict[str, Callable[[], None]], calls: int, rounds: int) -> dict[str, float]:
    """Median wall µs per call of each runs[name]() (which makes ``calls`` calls), in rounds
    that go round-robin over the names, so that a drift of the machine falls on all alike."""
    import torch
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(s) for name, s in samples.items()}


def wall_us(fns: dict[str, Callable[[], object]], calls: int = 100,
            rounds: int = 7) -> dict[str, float]:
    """Median wall µs per call of ``calls`` back-to-back calls ending in a synchronization."""
    for fn in fns.values():
        _warm(fn)

    def batch(fn):
        def run():
            for _ in range(calls):
                fn()
        return run
    return _rounds({name: batch(fn) for name, fn in fns.items()}, calls, rounds)


def graph_us(fns: dict[str, Callable[[], object]], calls: int = 100,
             rounds: int = 7) -> dict[str, float]:
    """Median wall µs per call of ``calls`` calls captured in one CUDA graph and replayed."""
    import torch
    graphs = {}
    for name, fn in fns.items():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        _warm(graph.replay)
    return _rounds({name: graph.replay for name, graph in graphs.items()}, calls, rounds)


def _host_cases():
    """[(case, {impl: fn}, baseline impl)] of every public op on a small problem."""
    import torch
    import torch.nn.functional as F

    import vitrail.ops as ops
    dev, bf = "cuda", torch.bfloat16
    a = torch.randn(256, 256, device=dev, dtype=bf)
    b = torch.randn(256, 256, device=dev, dtype=bf)
    bias = torch.randn(256, device=dev, dtype=bf)
    a3 = torch.randn(4, 256, 256, device=dev, dtype=bf)
    b3 = torch.randn(4, 256, 256, device=dev, dtype=bf)
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0, device=dev)
    ga = torch.randn(512, 256, device=dev, dtype=bf)
    gw = torch.randn(4, 256, 256, device=dev, dtype=bf)
    ends = torch.tensor([128, 256, 384, 512], device=dev, dtype=torch.int32)
    xs = torch.randn(32, 4096, device=dev, dtype=bf)
    xt = torch.randn(1024, 1024, device=dev, dtype=bf).t()
    xc = torch.randn(1024, 1024, device=dev, dtype=bf)
    xp = torch.randn(4, 256, 64, device=dev, dtype=bf)
    qa = torch.randn(4, 256, 64, device=dev, dtype=bf)
    D = ops.sympow(qa[:1, :1], 2, 8).shape[-1]
    qb = torch.randn(4, D, 64, device=dev, dtype=bf) / 48
    g = torch.randn(4, 256, 64, device=dev, dtype=bf)
    gt = torch.randn(4, 64, D, device=dev, dtype=bf)
    cases = [
        ("mm bf16 256^3", {"vitrail": lambda: ops.mm(a, b), "torch": lambda: torch.mm(a, b)}),
        ("bmm bf16 4x256^3", {"vitrail": lambda: ops.bmm(a3, b3),
                              "torch": lambda: torch.bmm(a3, b3)}),
        ("gemm bias+relu bf16 256^3", {
            "vitrail": lambda: ops.gemm(a, b, bias=bias, activation="relu"),
            "torch": lambda: F.relu(torch.addmm(bias, a, b))}),
        ("gemm c, beta=1 bf16 256^3", {"vitrail": lambda: ops.gemm(a, b, a, beta=1.0),
                                       "torch": lambda: torch.addmm(a, a, b)}),
        ("scaled_mm fp8 256^3", {
            "vitrail": lambda: ops.scaled_mm(a8, b8, one, one),
            "torch": lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=bf)}),
        ("copy transpose bf16 1024^2", {"vitrail": lambda: ops.copy(xt),
                                        "torch": lambda: xt.contiguous()}),
        ("copy bf16->fp32 1024^2", {"vitrail": lambda: ops.copy(xc, dtype=torch.float32),
                                    "torch": lambda: xc.to(torch.float32)}),
        ("softmax bf16 32x4096", {"vitrail": lambda: ops.softmax(xs),
                                  "torch": lambda: torch.softmax(xs, -1)}),
        ("log_softmax bf16 32x4096", {"vitrail": lambda: ops.log_softmax(xs),
                                      "torch": lambda: torch.log_softmax(xs, -1)}),
        ("sympow p2 t8 4x256x64", {
            "vitrail": lambda: ops.sympow(xp, 2, 8),
            "torch": lambda: xp[..., :, None] * xp[..., None, :]}),
        ("sympow_mma p2 t8 4x256x64", {"vitrail": lambda: ops.sympow_mma(qa, qb, -1, 2, 8),
                                       "torch": lambda: torch.bmm(qa, qa.transpose(1, 2))}),
        ("mma_sympow_bwd p2 t8 4x256x64", {
            "vitrail": lambda: ops.mma_sympow_bwd(g, gt, qa, -1, 2, 8),
            "torch": lambda: torch.bmm(g, gt)}),
    ]
    cl = torch.channels_last
    cx = torch.randn(8, 64, 28, 28, device=dev, dtype=bf).contiguous(memory_format=cl)
    cw = torch.randn(64, 64, 3, 3, device=dev, dtype=bf).contiguous(memory_format=cl) / 24
    cb = torch.randn(64, device=dev, dtype=bf)
    cases.append(("conv2d bias relu bf16 8x64x28x28 3x3", {
        "vitrail": lambda: ops.conv2d(cx, cw, cb, padding=1, activation="relu"),
        "torch": lambda: F.relu(F.conv2d(cx, cw, cb, padding=1))}))
    # attention on a decoding step too small for the GPU to hide the host: one query row over
    # 256 keys, GQA 8/2, D 64; torch: SDPA in its (batch, heads, seqlen, dim) layout
    aq = torch.randn(1, 1, 8, 64, device=dev, dtype=bf)
    ak, av = (torch.randn(1, 256, 2, 64, device=dev, dtype=bf) for _ in "kv")
    alens = torch.full((1,), 256, device=dev, dtype=torch.int32)

    def sdpa():
        return F.scaled_dot_product_attention(aq.transpose(1, 2), ak.transpose(1, 2),
                                              av.transpose(1, 2), enable_gqa=True)
    cases.append(("attention bf16 B1 Sq1 Sk256 H8/2 D64", {
        "vitrail": lambda: ops.attention(aq, ak, av), "torch": sdpa}))
    cases.append(("attention_kvcache bf16 B1 Sq1 Sk256 H8/2 D64", {
        "vitrail": lambda: ops.attention_kvcache(aq, ak, av, alens), "torch": sdpa}))
    grouped = {"vitrail": lambda: ops.grouped_mm(ga, gw, ends)}
    if hasattr(torch, "_grouped_mm"):
        wt = gw.transpose(-1, -2).contiguous().transpose(-1, -2)
        grouped["torch"] = lambda: torch._grouped_mm(ga, wt, ends)
    else:
        grouped["torch"] = lambda: torch.mm(ga, gw[0])
    cases.insert(5, ("grouped_mm bf16 4 groups 512x256x256", grouped))
    return cases


def _small_cases():
    """[(case, {impl: fn})] of small problems, forward and forward+backward."""
    import torch
    import torch.nn.functional as F

    import vitrail.ops as ops
    dev, bf = "cuda", torch.bfloat16
    cases = []
    for m, n in ((256, 8192), (32, 131072), (4096, 1024)):
        x = torch.randn(m, n, device=dev, dtype=bf)
        xg = x.clone().requires_grad_(True)
        dy = torch.randn_like(x)
        cases.append((f"softmax fwd bf16 {m}x{n}", {
            "vitrail": lambda x=x: ops.softmax(x), "torch": lambda x=x: torch.softmax(x, -1)}))
        cases.append((f"softmax fwd+bwd bf16 {m}x{n}", {
            "vitrail": lambda xg=xg, dy=dy: torch.autograd.grad(ops.softmax(xg), xg, dy),
            "torch": lambda xg=xg, dy=dy: torch.autograd.grad(torch.softmax(xg, -1), xg, dy)}))
    for m, n, k in ((256, 256, 256), (1024, 1024, 1024), (2048, 2048, 8192)):
        a = torch.randn(m, k, device=dev, dtype=bf)
        b = torch.randn(k, n, device=dev, dtype=bf)
        cases.append((f"mm bf16 {m}x{n}x{k}", {
            "vitrail": lambda a=a, b=b: ops.mm(a, b), "torch": lambda a=a, b=b: a @ b}))
    a = torch.randn(1024, 1024, device=dev, dtype=bf, requires_grad=True)
    w = torch.randn(1024, 1024, device=dev, dtype=bf, requires_grad=True)
    bias = torch.randn(1024, device=dev, dtype=bf, requires_grad=True)
    gy = torch.randn(1024, 1024, device=dev, dtype=bf)
    # each case's tensors bound as defaults: the conv cases below rebind w and gy
    cases.append(("gemm bias+relu fwd+bwd bf16 1024^3", {
        "vitrail": lambda a=a, w=w, bias=bias, gy=gy: torch.autograd.grad(
            ops.gemm(a, w, bias=bias, activation="relu"), (a, w, bias), gy),
        "torch": lambda a=a, w=w, bias=bias, gy=gy: torch.autograd.grad(
            F.relu(torch.addmm(bias, a, w)), (a, w, bias), gy)}))
    cl = torch.channels_last
    for stride in (1, 2):  # ResNet-50's 3x3 C128 layers at batch 8; /2: dx in stride phases
        x = torch.randn(8, 128, 28 * stride, 28 * stride, device=dev, dtype=bf).contiguous(
            memory_format=cl).requires_grad_(True)
        w = (torch.randn(128, 128, 3, 3, device=dev, dtype=bf) / 34).contiguous(
            memory_format=cl).requires_grad_(True)
        gy = torch.randn(8, 128, 28, 28, device=dev, dtype=bf).contiguous(memory_format=cl)
        name = f"conv2d 3x3{'/2' if stride > 1 else ''} bf16 8x128x{28 * stride}^2"
        cases.append((f"{name} fwd", {
            "vitrail": lambda x=x, w=w, s=stride: ops.conv2d(x.detach(), w.detach(), None, s, 1),
            "torch": lambda x=x, w=w, s=stride: F.conv2d(x.detach(), w.detach(), None, s, 1)}))
        cases.append((f"{name} fwd+bwd", {
            "vitrail": lambda x=x, w=w, gy=gy, s=stride: torch.autograd.grad(
                ops.conv2d(x, w, None, s, 1), (x, w), gy),
            "torch": lambda x=x, w=w, gy=gy, s=stride: torch.autograd.grad(
                F.conv2d(x, w, None, s, 1), (x, w), gy)}))
    xt = torch.randn(2048, 2048, device=dev, dtype=bf).t()
    cases.append(("copy transpose bf16 2048^2", {
        "vitrail": lambda xt=xt: ops.copy(xt), "torch": lambda xt=xt: xt.contiguous()}))
    # a decoding step: one query row a sequence over 4096 cached keys, GQA 32/8 (split-KV and
    # the group's heads packed); torch: SDPA's choice, in its (batch, heads, seqlen, dim) layout
    q = torch.randn(8, 1, 32, 128, device=dev, dtype=bf)
    k, v = (torch.randn(8, 4096, 8, 128, device=dev, dtype=bf) for _ in "kv")
    cases.append(("attention decode bf16 B8 Sk4096 H32/8 D128", {
        "vitrail": lambda: ops.attention(q, k, v),
        "torch": lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)}))
    # the same step over the keys as a KV cache with its lengths on the device (unpaged)
    lens = torch.full((8,), 4096, device=dev, dtype=torch.int32)
    cases.append(("attention_kvcache decode bf16 B8 Sk4096 H32/8 D128", {
        "vitrail": lambda: ops.attention_kvcache(q, k, v, lens),
        "torch": lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)}))
    return cases


BUILDERS = 12  # processes at most that build the cases' kernels before the timing


def warm(part: int, parts: int) -> None:
    """Call the vitrail side of every ``parts``-th case from ``part`` once: what it compiles
    lands in the kernel cache (a child process of _build_side_by_side)."""
    import torch
    for case, fns in (_host_cases() + _small_cases())[part::parts]:
        try:
            fns["vitrail"]()
            torch.cuda.synchronize()
        except Exception as e:  # the timed run reports it with the case
            print(f"    {case}: {type(e).__name__}: {str(e)[:200]}", flush=True)


def _build_side_by_side() -> None:
    """Build the cases' kernels before anything is timed, in processes that each call every
    k-th case once: a cold cache's compiles run side by side (one after another in the timed
    process otherwise, for minutes), and the timed process finds them cached. A process that
    fails costs nothing but time: its cases compile, or report their error, in the timed run."""
    import subprocess
    import sys

    from vitrail.tune.tuner import child_env, worker_count
    parts, start, env = worker_count(BUILDERS, BUILDERS), time.perf_counter(), child_env()
    children = [subprocess.Popen([sys.executable, "-c", "from vitrail.ops.benchmarks import "
                                  f"warm; warm({i}, {parts})"], env=env) for i in range(parts)]
    for child in children:
        child.wait()
    print(f"  the cases' kernels built or found in {parts} processes in "
          f"{time.perf_counter() - start:.0f} s")


def build() -> None:
    """Nothing to build without a GPU: the cases' kernels are those the calls choose, built at
    the start of a run (_build_side_by_side; host time is measured after warm-up)."""


@register("host", "host µs per eager call of every public op, and small problems eager vs "
          "graph, beside torch", build)
def run() -> list[Row]:
    from vitrail.plan import native
    _build_side_by_side()
    rows: list[Row] = []
    path = "C++" if native.load(wait=True) is not None else "Python (VITRAIL_NATIVE_PLANS=0?)"
    print(f"  plans run from {path}")
    print(f"  host µs per call ({CALLS} back-to-back calls a round, median of {ROUNDS} rounds)")
    for case, fns in _host_cases():
        try:
            got = per_call_us(fns, calls=CALLS, rounds=ROUNDS)
        except Exception as e:  # one op failing must not hide the others' figures
            print(f"    {case}: {type(e).__name__}: {str(e)[:200]}")
            continue
        for impl, us in got.items():
            rows.append(Row(f"host {case}", impl, us, "µs/call", baseline=impl == "torch",
                            group=f"host µs per call ({CALLS} back-to-back calls)"))
        print(f"    {case:40s} vitrail {got['vitrail']:7.1f}  torch {got['torch']:7.1f}  "
              f"({got['torch'] / got['vitrail']:.2f}x)")
    print("  small problems: µs per call, eager (back to back) and replayed from a CUDA graph")
    for case, fns in _small_cases():
        try:
            got = {f"{impl} {how}": us for how, f in (("eager", wall_us), ("graph", graph_us))
                   for impl, us in f(fns).items()}
            got = {k: got[k] for k in ("vitrail eager", "vitrail graph", "torch eager",
                                       "torch graph")}
        except Exception as e:
            print(f"    {case}: {type(e).__name__}: {str(e)[:200]}")
            continue
        for impl, us in got.items():
            rows.append(Row(case, impl, us, "µs/call", baseline=impl.startswith("torch"),
                            group="small problems: eager, and replayed from a CUDA graph"))
        print(f"    {case:40s} " + "  ".join(f"{k} {v:7.1f}" for k, v in got.items())
              + f"  (eager {got['torch eager'] / got['vitrail eager']:.2f}x)")
    return rows
