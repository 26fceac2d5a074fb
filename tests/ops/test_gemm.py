"""vitrail.ops mm / bmm / gemm / scaled_mm / grouped_mm: argument errors, fake impls and configs
on the CPU; values against an fp64 reference (every dtype, layouts, epilogues, odd shapes,
non-contiguous and misaligned inputs), autograd, opcheck and torch.compile on a GPU."""
from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import requires_gpu
from vitrail.jit.errors import ArgumentError

def family():
    """The gemm family's module (vitrail.ops.gemm, whose attribute name is also a function)."""
    import importlib
    return importlib.import_module("vitrail.ops.gemm")


# float32 runs as TF32 here: both operands rounded to 10-bit mantissas (2^-11 each), so a
# product may be off by 2^-10 of its size before any accumulation (seen at M=N=K=1)
ULP = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -10}

pytestmark = pytest.mark.warm_cache


# ------------------------------------------------------------------------------ CPU tests
def test_argument_errors():
    ops = family()
    cpu = torch.randn(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ArgumentError, match="a must be on a CUDA device"):
        ops.mm(cpu, cpu.t())
    meta = lambda *s, dt=torch.bfloat16: torch.empty(*s, device="meta", dtype=dt)  # noqa: E731
    with pytest.raises(ArgumentError, match="must be on a CUDA device"):
        ops.gemm(meta(4, 8), meta(8, 3))


def test_fake_impls_shapes_and_dtypes():
    family()  # registers the custom ops
    meta = lambda *s, dt=torch.bfloat16: torch.empty(*s, device="meta", dtype=dt)  # noqa: E731
    out = torch.ops.vitrail.gemm(meta(5, 7), meta(7, 3), None, meta(3), 1.0, 0.0, "gelu", 0.01,
                                 None, None, torch.float32)
    assert out.shape == (5, 3) and out.dtype == torch.float32
    out = torch.ops.vitrail.gemm(meta(4, 5, 7), meta(7, 3), None, None, 1.0, 0.0, None, 0.01,
                                 None, None, None)
    assert out.shape == (4, 5, 3) and out.dtype == torch.bfloat16
    e4 = torch.float8_e4m3fn
    out = torch.ops.vitrail.scaled_mm(meta(5, 32, dt=e4), meta(32, 16, dt=e4),
                                      meta((), dt=torch.float32), meta((), dt=torch.float32),
                                      None, torch.bfloat16, False)
    assert out.shape == (5, 16) and out.dtype == torch.bfloat16


def test_heuristic_and_space():
    from vitrail.gemm import LinearCombination
    from vitrail.gemm.ops import configs, model
    from vitrail.tune import limits
    lim = limits(arch="90a")
    fused = configs.Kind("bf16", "bf16", "row", "col", LinearCombination("bf16", bias="col",
                                                                          activation="silu"))
    grid = [configs.Problem(m, n, k, batch) for m in (1, 7, 64, 300, 2048, 16384)
            for n in (8, 1000, 4096, 57344) for k in (16, 777, 8192, 131072) for batch in (1, 9)]
    for kind in configs.default_kinds() + [fused]:
        space = configs.space(kind)
        valid = space.valid(lim)
        assert 0 < len(valid) < space.size  # the descriptions refuse some combinations
        assert kind.plain == (kind is not fused)
        assert kind.torch_passes == (kind is fused)  # silu after addmm's bias: one pass
        chosen = {space.default(p, lim) for p in grid}  # default() refuses an invalid choice
        assert chosen <= set(model.CANDIDATES) | {model.TORCH_CONFIG}
        assert model.TORCH_CONFIG in chosen  # torch's ops where cuBLAS is the faster
        kernels = {c.tile for c in chosen if c.backend == "vitrail"}
        assert len(kernels) >= (2 if kind.plain else 3)  # the choice follows the shape
        big = space.default(configs.Problem(8192, 8192, 8192), lim)
        assert (big.tile, big.cluster, big.backend) == ("128x256x64", "2x1", "vitrail")
        reason = space.reasons(space.config(tile="64x128x64", cluster="1x1",
                                            schedule="cooperative", scheduler="persistent",
                                            backend="vitrail"), lim)
        assert reason and "cooperative schedule" in reason[0]
    out_f32 = configs.Kind("bf16", "bf16", "row", "col", LinearCombination("f32"))
    assert out_f32.torch_passes is None
    assert "torch's ops do not compute" in configs.space(out_f32).reasons(
        model.TORCH_CONFIG, lim)[0]
    assert configs.space(configs.default_kinds()[0]).reasons(
        big, limits(arch="80"))[0].startswith("the GEMM kernels are sm_90a")


def test_selection_generalizes():
    """Each shape of the shipped sweep chosen from the others only (leave one out): the choice
    is within a few percent of the shape's best option, and never much slower than torch."""
    from vitrail.gemm.ops import model
    rows = model.table()
    slowdowns, vs_torch = [], []
    for i, (point, slowdown) in enumerate(rows):
        others = rows[:i] + rows[i + 1:]
        m, n, k, batch = (round(2 ** x) for x in point[:4])
        for torch_ok in (True, False):
            chosen = model.label(model.choose(m, n, k, batch, torch_ok=torch_ok, rows=others))
            if torch_ok:
                slowdowns.append(slowdown[chosen])
                vs_torch.append(slowdown["torch"] / slowdown[chosen])
            else:
                assert chosen != model.TORCH
    geo = math.exp(sum(map(math.log, slowdowns)) / len(slowdowns))
    assert len(rows) > 300 and geo < 1.025, geo  # measured: 1.015
    assert min(vs_torch) > 0.85 and sum(v < 0.97 for v in vs_torch) <= len(rows) // 60


def test_unaligned_problems_take_the_nearest_kernel_or_torch_where_copies_do_not_pay():
    """N or K not a multiple of 8 (few measured shapes of that class): the kernel from the
    nearest shapes of either class; torch, where it may, where its time is too short for the
    kernel to win back the host time of its aligned copies, or where unaligned shapes near it
    measured it faster; never because nothing unaligned was measured near it (torch cannot use
    TMA there). Its problem key is its own: 4095^3 does not share 4096^3's choice."""
    from vitrail.gemm.ops import model
    from vitrail.gemm.ops.launch import problem_key
    def least(n):  # torch's least time for the kernel's route: more where the output is padded
        return model.UNALIGNED_KERNEL_FROM["n" if n % 8 else "k"]
    for m, n, k in [(4095, 4095, 4095), (3000, 3000, 3001), (2048, 50257, 4096),
                    (16, 50257, 4096), (8191, 8191, 4096), (6000, 2000, 1001)]:
        assert model.torch_unaligned_s(m, n, k) >= least(n)
        chosen = model.choose(m, n, k, torch_ok=True)
        assert chosen.backend == "vitrail" and chosen == model.choose(m, n, k, torch_ok=False)
    for m, n, k in [(1, 50257, 768), (1000, 999, 1000), (17, 33, 65), (32, 11007, 4096),
                    (64, 12345, 6789), (257, 1000, 999)]:
        assert model.torch_unaligned_s(m, n, k) < least(n)
        assert model.choose(m, n, k, torch_ok=True) == model.TORCH_CONFIG
        assert model.choose(m, n, k, torch_ok=False).backend == "vitrail"
    # a long K, its own measured row left out: the aligned long-K shapes' stream-K kernel
    rows = [r for r in model.table() if (r[0][0], r[0][2]) != (math.log2(333), 16.0)]
    assert len(rows) == len(model.table()) - 1
    assert model.choose(333, 333, 65536, torch_ok=False, rows=rows).scheduler == "stream_k"
    # an unaligned shape measured near, where torch was the faster: torch
    kernel = model.label(model.CANDIDATES[0])
    aligned = {"M": 4096, "N": 4096, "K": 4096, "L": 1, "torch": 2.0, "configs": {kernel: 1.0}}
    unaligned = dict(aligned, N=4095, K=4095, torch=0.5)
    near = model.table_rows(model.make_table([aligned, unaligned]))
    assert model.choose(4000, 4001, 4003, torch_ok=True, rows=near) == model.TORCH_CONFIG
    assert model.choose(4000, 4000, 4000, torch_ok=True, rows=near).backend == "vitrail"
    unaligned["torch"] = 2.0
    near = model.table_rows(model.make_table([aligned, unaligned]))
    assert model.choose(4000, 4001, 4003, torch_ok=True, rows=near).backend == "vitrail"
    assert problem_key(4095, 4095, 4095, 1) != problem_key(4096, 4096, 4096, 1)
    assert problem_key(4093, 4095, 4095, 1) == problem_key(4095, 4095, 4095, 1)


def test_a_fused_kind_runs_torchs_ops_only_where_its_matmul_gains_more_than_they_cost():
    """Torch's route for a fused epilogue adds its passes over D (Kind.torch_passes) to the
    matmul: taken where the selection measured cuBLAS much the faster (few rows, long K), not
    where the two are near (squares), and ever less as the passes grow."""
    from vitrail.gemm import LinearCombination
    from vitrail.gemm.ops import configs, model
    from vitrail.gemm.ops.sweep import shapes

    def passes(**epilogue):
        return configs.Kind("bf16", "bf16", "row", "col",
                            LinearCombination("bf16", **epilogue)).torch_passes
    assert passes(bias="col") == 0 and passes(bias="row") == 1
    assert passes(bias="col", activation="gelu", clamp=True) == 2
    assert passes(element_source="bf16", bias="col", activation="silu") == 3
    assert model.choose(16, 4096, 14336, torch_ok=True, passes=1) == model.TORCH_CONFIG
    assert model.choose(128, 128, 131072, torch_ok=True, passes=3) == model.TORCH_CONFIG
    for m, n, k in [(4096, 4096, 4096), (8192, 8192, 8192), (128, 28672, 4096)]:
        assert model.choose(m, n, k, torch_ok=True, passes=1).backend == "vitrail"
    kernels = [model.choose(s.M, s.N, s.K, s.L, torch_ok=False) for s in shapes()]
    counts = []
    for p in range(4):
        routes = [model.choose(s.M, s.N, s.K, s.L, torch_ok=True, passes=p) for s in shapes()]
        counts.append(sum(c == model.TORCH_CONFIG for c in routes))
        assert all(c in (model.TORCH_CONFIG, k) for c, k in zip(routes, kernels))
    assert counts[0] > counts[1] > counts[2] > counts[3] > 0, counts


@pytest.mark.parametrize("case", ["plain", "alpha", "bias-col-silu", "bias-row-gelu",
                                  "c-bias-relu-clamp", "c-broadcast-tanh", "batched-fold",
                                  "batched-c-bias-row", "every-activation"])
def test_torchs_ops_compute_the_fused_epilogue(case):
    """launch.torch_fused (torch's route of a fused kind) against the fp64 reference, on the
    CPU: every addend, the batched forms and every activation."""
    from vitrail.gemm.epilogue import ACTIVATIONS
    from vitrail.gemm.ops.launch import torch_fused
    from vitrail.gemm.ops.reference import gemm_reference
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)
    M, N, K = 33, 40, 24
    a, b = r(M, K), r(K, N)
    kws = {"plain": [{}], "alpha": [dict(alpha=0.5)],
           "bias-col-silu": [dict(bias=r(N), activation="silu")],
           "bias-row-gelu": [dict(bias=r(M, 1), activation="gelu")],
           "c-bias-relu-clamp": [dict(c=r(M, N), beta=-0.5, bias=r(N), activation="relu",
                                      clamp_min=0.1, clamp_max=1.5)],
           "c-broadcast-tanh": [dict(c=r(N), beta=2.0, activation="tanh")],
           "batched-fold": [dict(bias=r(N), activation="silu")],
           "batched-c-bias-row": [dict(c=r(3, M, N), beta=1.0, bias=r(M, 1), alpha=2.0)],
           "every-activation": [dict(activation=act, slope=0.2) for act in ACTIVATIONS]}[case]
    if case.startswith("batched"):
        a = r(3, M, K)
        b = b if case == "batched-fold" else r(3, K, N)
    for kw in kws:
        d = torch.empty(*a.shape[:-2], M, N, dtype=torch.bfloat16)
        torch_fused(d, a, b, kw.get("c"), kw.get("bias"), kw.get("alpha", 1.0),
                    kw.get("beta", 0.0), kw.get("activation"), kw.get("slope", 0.01),
                    kw.get("clamp_min"), kw.get("clamp_max"))
        ref = gemm_reference(a, b, kw.get("c"), alpha=kw.get("alpha", 1.0),
                             beta=kw.get("beta", 0.0), bias=kw.get("bias"),
                             activation_name=kw.get("activation"), slope=kw.get("slope", 0.01),
                             clamp_min=kw.get("clamp_min"), clamp_max=kw.get("clamp_max"),
                             out_dtype=torch.float64)
        err = (d.double() - ref).abs().max().item()
        assert err <= 2 ** -6 * (ref.abs().max().item() + 1), (kw.get("activation"), err)


@pytest.fixture
def record(monkeypatch):
    """launch.run on CPU tensors, recording (kind, problem, prepared operands) instead of
    launching: the host-side preparation (layouts, copies, kinds) is tested without a GPU."""
    from vitrail.gemm.ops import launch, operands, testing
    monkeypatch.setattr(launch, "is_hopper", lambda device: True)
    monkeypatch.setattr(operands, "_WARNED", set())
    with testing.recording() as found:
        yield found


def prepared_reasons(kind, problem, tensors):
    """can_implement of the heuristic's operation on the prepared operands."""
    from vitrail.gemm.arguments import GemmArguments, describe
    from vitrail.gemm.ops import configs
    from vitrail.tune import limits
    from vitrail.gemm.ops import model
    a, b, c, d, bias, sa, sb = tensors
    config = configs.space(kind).default(problem, limits(arch="90a"))
    if config.backend != "vitrail":  # torch's matmul runs it; the kernel chosen without torch
        config = model.choose(problem.M, problem.N, problem.K, problem.L, torch_ok=False)
    op = configs.operation(kind, config)
    args = GemmArguments(A=describe(a, "a", op.A.layout), B=describe(b, "b", op.B.layout),
                         D=describe(d, "d", op.D.layout), M=problem.M, N=problem.N,
                         K=problem.K, L=problem.L, bias=bias, scale_a=sa, scale_b=sb,
                         C=None if c is None else describe(c, "c", "row"))
    return op.can_implement(args)


def test_a_kinds_name_tells_its_output_type():
    """Kinds that differ in their output's type only have names of their own (the name keys
    their tuning records); the usual output (the 16-bit inputs' own, fp32 for TF32, bf16 for
    FP8) keeps the short name."""
    from vitrail.gemm import LinearCombination
    from vitrail.gemm.ops.configs import Kind

    def kind(el, out, **kw):
        return Kind(el, el, "row", "row", LinearCombination(out, **kw))
    assert kind("bf16", "bf16").name == "gemm.bf16.rrr.lincomb"
    assert kind("bf16", "f32").name == "gemm.bf16.rrr.lincomb.out_f32"
    assert kind("tf32", "f32").name == "gemm.tf32.rrr.lincomb"
    scales = dict(scale_a="tensor", scale_b="tensor")
    assert kind("e4m3", "bf16", **scales).name == "gemm.e4m3.rrr.lincomb_stt"
    assert kind("e4m3", "f16", **scales).name == "gemm.e4m3.rrr.lincomb_stt.out_f16"
    names = {kind(el, out).name for el in ("bf16", "f16") for out in ("bf16", "f16", "f32")}
    assert len(names) == 6


def test_the_epilogue_benchmark_times_every_epilogue_on_the_plain_ones_config():
    """`vitrail bench gemm-epilogues` (issue 28, item 4): per shape, every activation, a bias,
    a clamp and beta * C, each a kernel of its own, all on the one config of the plain kernel
    they are measured against; run only when named."""
    from vitrail import bench, ops
    from vitrail.gemm.epilogue import ACTIVATIONS
    from vitrail.gemm.ops import benchmarks
    epis = benchmarks.epilogues()
    assert next(iter(epis)) == "plain" and epis["plain"].tag == "lincomb"
    assert set(ACTIVATIONS) <= set(epis) and {"bias", "clamp", "beta*C"} <= set(epis)
    assert epis["beta*C"].has_source and epis["clamp"].clamp and epis["bias"].bias == "col"
    jobs = list(benchmarks._epilogue_jobs())
    assert len(jobs) == len(benchmarks.EPILOGUE_SHAPES) * len(epis)
    for shape in benchmarks.EPILOGUE_SHAPES:
        mine = [(op, config) for s, op, config in jobs if s == shape]
        assert len({op.name for op, _ in mine}) == len(epis)  # a kernel per epilogue
        assert len({tuple(sorted(c.items())) for _, c in mine}) == 1  # on one config
        assert mine[0][1]["backend"] == "vitrail"
    registry = ops.load_benchmarks()
    assert registry["gemm-epilogues"].by_name
    assert "gemm-epilogues" not in {b.name for b in bench.select(registry, [])}


def test_a_config_not_built_runs_torchs_ops_while_it_builds_behind(monkeypatch):
    """settings(build_behind=True): a call whose config is not ready asks for its build in the
    background and computes D by torch's ops (one matmul when plain, else the reference's
    sequence), marking its recording provisional; without the setting, or once the config is
    ready, the kernel runs. On CPU tensors: the host side, the kernel never launched."""
    import vitrail
    from vitrail.gemm.ops import launch, operands, testing
    from vitrail.gemm.ops.reference import gemm_reference
    from vitrail.op import Op
    monkeypatch.setattr(launch, "is_hopper", lambda device: True)
    monkeypatch.setattr(operands, "_WARNED", set())
    asked, ran, ready = [], [], [False]
    monkeypatch.setattr(Op, "ready", lambda self, config: ready[0])
    monkeypatch.setattr(Op, "build_behind", lambda self, config: asked.append(self.name))
    monkeypatch.setattr(Op, "__call__", lambda self, *args: ran.append(self.name))
    marked = []
    monkeypatch.setattr(launch, "provisional", lambda: marked.append(True))
    bf = torch.bfloat16
    a, b = torch.randn(96, 64, dtype=bf), torch.randn(64, 40, dtype=bf)
    bias = torch.randn(40, dtype=bf)
    plain = (None, None, 1.0, 0.0, None, 0.01, None, None)
    fused = (None, bias, 1.0, 0.0, "gelu", 0.01, None, None)
    with testing.kernels_only():
        with vitrail.settings(build_behind=True):
            out = launch.run(a, b, *plain, bf)
            torch.testing.assert_close(out, torch.mm(a, b), rtol=0, atol=0)  # torch's matmul
            out = launch.run(a, b, *fused, bf)
            want = gemm_reference(a, b, bias=bias, activation_name="gelu", out_dtype=bf,
                                  compute_dtype=torch.float32)
            torch.testing.assert_close(out, want, rtol=0, atol=0)
            assert len(asked) == 2 and len(marked) == 2 and ran == []
            assert asked[0] != asked[1]  # each kind's config builds
            ready[0] = True
            launch.run(a, b, *plain, bf)
        assert len(ran) == 1 and len(asked) == 2
        ready[0] = False
        launch.run(a, b, *plain, bf)  # the setting off: the call waits for its kernel
        assert len(ran) == 2 and len(asked) == 2 and len(marked) == 2


def test_preparation_layouts_and_copies(record):
    from vitrail.gemm.ops.launch import run
    bf = torch.bfloat16
    a, w = torch.randn(100, 64, dtype=bf), torch.randn(40, 64, dtype=bf)
    plain = (None, None, 1.0, 0.0, None, 0.01, None, None)
    out = run(a, w.t(), *plain, bf)  # a transposed view: 'col', read as is
    kind, problem, tensors = record[-1]
    assert (kind.layout_a, kind.layout_b) == ("row", "col") and out.shape == (100, 40)
    assert tensors[1].data_ptr() == w.data_ptr()  # no copy
    assert prepared_reasons(kind, problem, tensors) == []
    a_col = torch.randn(64, 128, dtype=bf).t()  # M-major, leading stride 128
    run(a_col, w.t(), *plain, bf)
    assert (record[-1][0].layout_a, record[-1][0].layout_b) == ("col", "col")
    assert record[-1][2][0].data_ptr() == a_col.data_ptr()
    with pytest.warns(UserWarning, match="aligned buffer"):  # M-major, stride 100: copied
        run(a.t().contiguous().t(), w.t(), *plain, bf)
    assert record[-1][0].layout_a == "row" and prepared_reasons(*record[-1]) == []
    odd = torch.randn(100, 70, dtype=bf)[:, 3:67]  # misaligned address and leading stride
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the note is given once per process, not again
        run(odd, w.t(), *plain, bf)
    kind, problem, tensors = record[-1]
    assert tensors[0].data_ptr() != odd.data_ptr() and torch.equal(tensors[0], odd)
    assert prepared_reasons(kind, problem, tensors) == []
    # N = 7: D is computed into a padded buffer and returned contiguous
    out = run(a, torch.randn(64, 7, dtype=bf), *plain, bf)
    assert out.is_contiguous() and out.shape == (100, 7)
    assert prepared_reasons(*record[-1]) == []


def test_preparation_epilogues_batches_and_fp8(record):
    from vitrail.gemm.ops.launch import run
    bf = torch.bfloat16
    a, b = torch.randn(3, 50, 24, dtype=bf), torch.randn(24, 40, dtype=bf)
    c, bias_row = torch.randn(40, dtype=bf), torch.randn(50, 1, dtype=torch.float32)
    out = run(a.transpose(1, 2).contiguous().transpose(1, 2), b, c, bias_row, 2.0, 0.5, "gelu",
              0.01, None, 1.0, torch.float32)
    kind, problem, tensors = record[-1]
    assert out.shape == (3, 50, 40) and out.dtype == torch.float32 and problem.L == 3
    epi = kind.epilogue
    assert (epi.bias, epi.element_bias, epi.element_source, epi.activation, epi.clamp) == \
        ("row", "f32", "f32", "gelu", True)
    assert tensors[1].stride(0) != 0  # the shared B is materialized per batch
    assert prepared_reasons(kind, problem, tensors) == []
    run(a, b, None, torch.randn(40, dtype=bf), 1.0, 0.0, None, 0.01, None, None, bf)
    kind, problem, tensors = record[-1]
    assert problem.M == 150 and problem.L == 1 and kind.epilogue.bias == "col"  # folded
    f32 = torch.randn(33, 20), torch.randn(20, 16)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 allowed: the kernel's fp32 mode
    try:
        run(*f32, *(None, None, 1.0, 0.0, None, 0.01, None, None), torch.float32)
    finally:
        torch.set_float32_matmul_precision(before)
    kind, problem, tensors = record[-1]
    assert (kind.element, kind.layout_a, kind.layout_b) == ("tf32", "row", "col")  # K-major
    assert prepared_reasons(kind, problem, tensors) == []
    e4 = torch.randn(64, 128).to(torch.float8_e4m3fn)
    e5 = torch.randn(48, 128).to(torch.float8_e5m2).t()
    run(e4, e5, None, None, 1.0, 0.0, None, 0.0, None, None, bf,
        scale_a=torch.rand(64, 1), scale_b=torch.tensor(2.0), fast_accum=True)
    kind, problem, tensors = record[-1]
    assert (kind.element, kind.element_b, kind.fast_accum) == ("e4m3", "e5m2", True)
    assert (kind.epilogue.scale_a, kind.epilogue.scale_b) == ("row", "tensor")
    assert prepared_reasons(kind, problem, tensors) == []
    for M, N, K in [(0, 5, 8), (5, 0, 8)]:
        empty = run(torch.randn(M, K, dtype=bf), torch.randn(K, N, dtype=bf), *plain_args(), bf)
        assert empty.shape == (M, N)
    z = run(torch.randn(5, 0, dtype=bf), torch.randn(0, 6, dtype=bf), torch.ones(5, 6, dtype=bf),
            None, 1.0, 2.0, None, 0.01, None, None, bf)
    assert torch.equal(z, torch.full((5, 6), 2.0, dtype=bf))  # K = 0: beta * c


def plain_args():
    return (None, None, 1.0, 0.0, None, 0.01, None, None)


# ------------------------------------------------------------------------------ GPU tests
@pytest.fixture
def poison():
    """Outputs start as NaN, and every GEMM runs a vitrail kernel (not torch's matmul, which
    the selection takes where it is faster: test_selection_routes)."""
    from vitrail.gemm.ops import testing
    with testing.poisoned(), testing.kernels_only():
        yield


@requires_gpu
def test_selection_routes():
    """Plain bf16 products on both routes of the selection (torch's matmul, vitrail's kernels),
    through the general path and then the plan, against fp64; alpha on the torch route."""
    ops = family()
    from vitrail.gemm.ops import launch, model
    routes = set()
    for M, N, K in [(1024, 1024, 1024), (8192, 8192, 8192), (16, 4096, 14336), (100, 300, 70),
                    (5000, 3000, 2000)]:
        a, w = rand(M, K), rand(N, K)
        ref = a.double() @ w.double().t()
        routes.add(model.choose(M, N, K, torch_ok=True).backend)
        for _ in range(2):  # a miss (the general path), then the plan
            assert_matches(ops.mm(a, w.t()), ref, a @ w.t(), torch.bfloat16)
        assert_matches(ops.gemm(a, w.t(), alpha=0.5), ref * 0.5, 0.5 * (a @ w.t()),
                       torch.bfloat16)
    assert routes == {"vitrail", "torch"}
    # a torch-route signature calls torch directly from its plan
    assert any(plan is launch._torch_plan for plan in launch.PLANS._plans.values())


@requires_gpu
def test_fused_epilogues_on_torchs_route():
    """Fused epilogues where the selection runs torch's ops (16 rows against K = 14336: cuBLAS
    much the faster): every addend and activation against fp64, through the general path and
    then the signature's plan (torch's ops called directly); a batch against one matrix; the
    gradients."""
    ops = family()
    from vitrail.gemm.ops import launch, model
    from vitrail.gemm.ops.reference import gemm_reference
    M, N, K = 16, 4096, 14336
    assert model.choose(M, N, K, torch_ok=True, passes=3) == model.TORCH_CONFIG
    launch.forget_choices()
    for epi in EPILOGUES:
        for _ in range(2):  # a miss (the general path), then the plan
            check_epilogue(epi, M, N, K)
    plans = list(launch.PLANS._plans.values())
    assert len(plans) == len(EPILOGUES)
    assert all(isinstance(p, launch._FusedPlan) for p in plans), plans
    a, b, bias = rand(2, 8, K), rand(K, N), rand(N)
    for _ in range(2):
        ref = gemm_reference(a.double(), b.double(), bias=bias.double(), activation_name="silu")
        torch_out = gemm_reference(a, b, bias=bias, activation_name="silu",
                                   compute_dtype=torch.float32)
        assert_matches(ops.gemm(a, b, bias=bias, activation="silu"), ref, torch_out,
                       torch.bfloat16)
    a, b, bias = (t.requires_grad_() for t in (rand(M, K), rand(K, N), rand(N)))
    g = rand(M, N)
    grads = torch.autograd.grad(ops.gemm(a, b, bias=bias, activation="gelu"), (a, b, bias), g)
    a2, b2, bias2 = (t.detach().double().requires_grad_() for t in (a, b, bias))
    refs = torch.autograd.grad(torch.nn.functional.gelu(a2 @ b2 + bias2), (a2, b2, bias2),
                               g.double())
    for ours, r in zip(grads, refs):
        assert (ours.double() - r).abs().max().item() <= 0.03 * r.abs().max().item()


@requires_gpu
def test_a_cold_config_runs_torch_while_it_builds_behind(monkeypatch, tmp_path):
    """settings(build_behind=True), a config in no cache (a fresh one): the first calls run
    torch's ops and return at once; the build lands in the background, and the calls after it
    run the kernel, through the general path and then its plan."""
    import threading
    import time

    import vitrail
    from vitrail import jit
    from vitrail.gemm.ops import testing
    from vitrail.gemm.ops.reference import gemm_reference
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(tmp_path / "cache"))
    jit.clear_memory_cache()
    ops = family()
    f16 = torch.float16
    a, w, bias = rand(1000, 520, dtype=f16), rand(264, 520, dtype=f16), rand(264, dtype=f16)
    kw = dict(bias=bias, activation="hardswish", clamp_max=2.5)  # a kind no other test builds
    ref = gemm_reference(a.double(), w.double().t(), bias=bias.double(),
                         activation_name="hardswish", clamp_max=2.5)
    torch_out = gemm_reference(a, w.t(), bias=bias, activation_name="hardswish", clamp_max=2.5,
                               out_dtype=f16, compute_dtype=torch.float32)
    from vitrail.gemm.ops import launch
    from vitrail.plan import GENERAL
    with testing.kernels_only(), vitrail.settings(build_behind=True):
        start = time.perf_counter()
        for _ in range(3):
            assert_matches(ops.gemm(a, w.t(), **kw), ref, torch_out, f16)
        waited = time.perf_counter() - start
        builds = [t for t in threading.enumerate() if t.name.startswith("vitrail-build-")]
        assert builds and waited < 20, waited  # no call waited for nvcc (30-70 s a config)
        assert len(launch.PLANS) == 0  # the stand-in's calls stored no plan
        for thread in builds:
            thread.join(900)
        assert list((tmp_path / "cache").rglob("*.so"))  # the build landed in the cache
        for _ in range(3):  # the kernel: the general path, then its plan
            assert_matches(ops.gemm(a, w.t(), **kw), ref, torch_out, f16)
        plans = list(launch.PLANS._plans.values())
        assert len(plans) == 1 and plans[0] not in (GENERAL, launch._torch_plan)


@requires_gpu
def test_pick_best_times_torch_among_the_candidates(monkeypatch, tmp_path):
    """PickBest times torch's matmul beside the kernels and the store keeps torch as the winner
    where it is faster (M = N = 128, K = 131072: torch 30 µs, the best kernel 109 µs on the
    H100); PickAny then takes the stored choice."""
    ops = family()
    from vitrail.gemm.ops import launch
    from vitrail.tune import PickAny, PickBest, TuningStore, settings, tuner
    store = TuningStore(tmp_path / "tuning.sqlite")  # not the shared cache's store
    monkeypatch.setattr(tuner, "TuningStore", lambda: store)
    launch.forget_choices()  # (the store is new)
    a, b = rand(128, 131072), rand(131072, 128)
    ref = a.double() @ b.double()
    with settings(policy=PickBest, max_configs=3):
        assert_matches(ops.mm(a, b), ref, a @ b, torch.bfloat16)
    (record,) = store.records()
    assert record.config["backend"] == "torch", record.timings
    assert len([t for t in record.timings if t["ms"] is not None]) == 3
    launch.forget_choices()  # forget the memo: the store answers PickAny
    with settings(policy=PickAny):
        assert_matches(ops.mm(a, b), ref, a @ b, torch.bfloat16)
    assert any(plan is launch._torch_plan for plan in launch.PLANS._plans.values())


def assert_matches(out, ref64, torch_out, dtype):
    """Our error against fp64 is at most 2x torch's own error in the same dtype, plus an ulp."""
    assert out.shape == ref64.shape, (out.shape, ref64.shape)
    assert not torch.isnan(out).any(), "NaN in the output (an element was not written)"
    scale = ref64.abs().max().item() + 1e-6
    err = (out.double() - ref64).abs().max().item()
    terr = (torch_out.double() - ref64).abs().max().item()
    assert err <= 2 * terr + ULP[dtype] * scale, f"error {err:.3g} vs torch {terr:.3g} " \
                                                 f"(scale {scale:.3g})"


class tf32:
    """fp32 matmuls in TF32 for torch and vitrail (at the default 'highest' precision vitrail
    runs its 3xTF32 kernel instead: tests/ops/test_gemm_modes.py)."""
    def __enter__(self):
        self.before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")

    def __exit__(self, *exc):
        torch.set_float32_matmul_precision(self.before)


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda").to(dtype)


def layout(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values in another memory layout: 'row', 'col' (a transposed view), 'slice'
    (a column slice, leading stride padded), 'offset' (address not 16-byte aligned)."""
    if how == "row":
        return t.contiguous()
    if how == "col":
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == "slice":
        big = torch.empty(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype, device=t.device)
        big[..., 1:t.shape[-1] + 1] = t
        return big[..., 1:t.shape[-1] + 1]
    if how == "offset":
        flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = flat[1:].view(t.shape)
        view.copy_(t)
        return view
    raise ValueError(how)


SHAPES = [(1, 1, 1), (7, 7, 7), (1000, 7, 4097), (7, 1000, 1000), (4097, 1000, 7),
          (1000, 4097, 1000), (128, 256, 64), (1, 4097, 4097)]


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_mm_values(dtype, M, N, K, poison):
    ops = family()
    a, b = rand(M, K, dtype=dtype), rand(K, N, dtype=dtype)
    ref = a.double() @ b.double()
    with tf32():
        assert_matches(ops.mm(a, b), ref, a @ b, dtype)


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("la,lb", [("row", "col"), ("col", "row"), ("col", "col"),
                                   ("slice", "row"), ("offset", "col"), ("row", "slice")])
def test_mm_layouts(dtype, la, lb, poison):
    ops = family()
    a, b = rand(1000, 520, dtype=dtype), rand(520, 300, dtype=dtype)
    ref = a.double() @ b.double()
    a2, b2 = layout(a, la), layout(b, lb)
    assert_matches(ops.mm(a2, b2), ref, a @ b, dtype)


@requires_gpu
def test_transposed_views_are_not_copied(monkeypatch):
    ops = family()
    from vitrail.gemm.ops import launch, operands
    copies = []
    real = operands.aligned

    def spy(t, want):
        out = real(t, want)
        copies.append(out[0].data_ptr() != t.data_ptr())
        return out
    monkeypatch.setattr(launch, "aligned", spy)  # launch.run's
    monkeypatch.setattr(operands, "aligned", spy)  # the 3xTF32 path's (accurate.py)
    a, b = rand(256, 512), rand(384, 512)
    ops.mm(a, b.t())
    ops.mm(a.t().contiguous().t(), b.t())
    assert copies == [False, False, False, False]


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bmm(dtype, poison):
    ops = family()
    a, b = rand(3, 1000, 72, dtype=dtype), rand(3, 72, 520, dtype=dtype)
    with tf32():
        check_bmm(ops, a, b, dtype)


def check_bmm(ops, a, b, dtype):
    assert_matches(ops.bmm(a, b), a.double() @ b.double(), torch.bmm(a, b), dtype)
    bt = layout(b, "col")
    assert_matches(ops.bmm(a, bt), a.double() @ b.double(), torch.bmm(a, b), dtype)
    # a batch against one matrix (folded into M) and a broadcast batch (materialized)
    b2 = rand(72, 520, dtype=dtype)
    assert_matches(ops.gemm(a, b2), a.double() @ b2.double(), a @ b2, dtype)
    a1 = rand(1, 1000, 72, dtype=dtype).expand(3, -1, -1)
    assert_matches(ops.bmm(a1, b), a1.double() @ b.double(), torch.bmm(a1, b), dtype)


EPILOGUES = [
    dict(bias="col"), dict(bias="row"), dict(c=True, alpha=0.5, beta=-2.0),
    dict(bias="col", activation="relu"), dict(bias="col", activation="gelu"),
    dict(bias="col", activation="gelu_tanh", c=True, beta=0.5),
    dict(activation="silu"), dict(activation="sigmoid"), dict(activation="tanh"),
    dict(activation="hardswish", bias="row"), dict(activation="leaky_relu", slope=0.2),
    dict(bias="col", activation="gelu", clamp_min=-0.1, clamp_max=0.3),
]


@requires_gpu
@pytest.mark.parametrize("epi", EPILOGUES, ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()))
@pytest.mark.parametrize("M,N,K", [(1000, 4097, 520), (7, 1000, 1000)])
def test_gemm_epilogues(epi, M, N, K, poison):
    check_epilogue(epi, M, N, K)


@requires_gpu
@pytest.mark.parametrize("epi", [EPILOGUES[5], EPILOGUES[9]], ids=["c-bias-gelu_tanh", "row"])
def test_gemm_epilogue_stream_k(epi, poison):
    """A skinny problem with a long K: the stream-K kernel reduces partial tiles, then the
    fused epilogue runs once per tile."""
    check_epilogue(epi, 7, 1000, 4097)


@requires_gpu
def test_relu_and_clamp_keep_nan_and_clamp_as_torch_does(poison):
    """relu and clamp as torch's: a NaN stays NaN (the epilogue's max and min propagate it),
    and a clamp whose min exceeds its max gives the max everywhere (min(max(x, lo), hi))."""
    ops = family()
    a, b = rand(128, 256), rand(256, 136)
    a[5] = float("nan")
    z = a.float() @ b.float()
    silu = torch.nn.functional.silu(z)
    for kw, ref in ((dict(activation="relu"), torch.relu(z)),
                    (dict(clamp_min=-0.25, clamp_max=0.5), torch.clamp(z, -0.25, 0.5)),
                    (dict(clamp_min=0.5, clamp_max=-0.25), torch.clamp(z, 0.5, -0.25)),
                    (dict(activation="silu", clamp_max=0.0), torch.clamp(silu, max=0.0))):
        out = ops.gemm(a, b, out_dtype=torch.float32, **kw)
        assert torch.isnan(out[5]).all() and not torch.isnan(out[torch.arange(128) != 5]).any()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4, equal_nan=True)


@requires_gpu
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "sigmoid", "tanh"])
def test_activation_math_in_fp32(act, poison):
    """Each activation's formula in the epilogue, element by element: I @ X passes X's bf16
    values through exactly (one product each, fp32 sums), so the fp32 output is act(x) as the
    kernel computes it, against the fp64 formula on [-12, 12] and near 0: within a few fp32
    ulps, also where the result is tiny (gelu's left tail)."""
    from vitrail.gemm.ops.reference import activation
    ops = family()
    x = torch.cat([torch.linspace(-12, 12, 256 * 56), torch.linspace(-1e-3, 1e-3, 256 * 8)])
    x = x.to(torch.bfloat16).reshape(64, 256).t().contiguous().cuda()  # (256, 64)
    eye = torch.eye(256, dtype=torch.bfloat16, device="cuda")
    out = ops.gemm(eye, x, activation=act, out_dtype=torch.float32)
    ref = activation(x.double(), act)
    torch.testing.assert_close(out.double(), ref, rtol=2e-6, atol=4e-7)


def check_epilogue(epi, M, N, K):
    ops = family()
    from vitrail.gemm.ops.reference import gemm_reference
    epi = dict(epi)
    a, b = rand(M, K), rand(K, N)
    kw = {k: epi[k] for k in ("alpha", "beta", "activation", "slope", "clamp_min", "clamp_max")
          if k in epi}
    c = rand(M, N) if epi.get("c") else None
    bias = {"col": rand(N), "row": rand(M, 1), None: None}[epi.get("bias")]
    out = ops.gemm(a, b, c, bias=bias, **kw)
    rkw = dict(kw)
    rkw["activation_name"] = rkw.pop("activation", None)
    ref = gemm_reference(a, b, c, bias=bias, out_dtype=torch.float64, **rkw)
    torch_out = gemm_reference(a, b, c, bias=bias, compute_dtype=torch.float32, **rkw)
    assert_matches(out, ref, torch_out, torch.bfloat16)


@requires_gpu
def test_out_dtype_and_empty(poison):
    ops = family()
    a, b = rand(300, 256), rand(256, 200)
    out = ops.mm(a, b, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert_matches(out, a.double() @ b.double(), (a.float() @ b.float()), torch.float32)
    for (M, N, K) in [(0, 5, 8), (5, 0, 8), (5, 8, 0)]:
        x, y = rand(M, K), rand(K, N)
        r, t = ops.mm(x, y), torch.mm(x, y)
        assert r.shape == t.shape and r.dtype == t.dtype and torch.equal(r, t)
    assert ops.bmm(rand(0, 5, 8), rand(0, 8, 3)).shape == (0, 5, 3)


@requires_gpu
def test_autograd_matches_torch():
    ops = family()
    a = rand(130, 72).requires_grad_()
    b = rand(72, 96).requires_grad_()
    bias = rand(96).requires_grad_()
    c = rand(130, 96).requires_grad_()
    out = ops.gemm(a, b, c, beta=0.5, bias=bias, activation="gelu")
    g = rand(130, 96)
    grads = torch.autograd.grad(out, (a, b, c, bias), g)
    a2, b2, c2, bias2 = (t.detach().double().requires_grad_() for t in (a, b, c, bias))
    ref = torch.nn.functional.gelu(a2 @ b2 + 0.5 * c2 + bias2)
    refs = torch.autograd.grad(ref, (a2, b2, c2, bias2), g.double())
    for ours, r in zip(grads, refs):
        err = (ours.double() - r).abs().max().item()
        assert err <= 0.03 * r.abs().max().item(), err
    x = rand(4, 33, 40).requires_grad_()
    y = rand(40, 24).requires_grad_()
    gx, gy = torch.autograd.grad(ops.gemm(x, y).float().sum(), (x, y))
    rx, ry = torch.autograd.grad((x.double() @ y.double()).sum(), (x, y))
    assert (gx.double() - rx).abs().max() <= 0.02 * rx.abs().max()
    assert (gy.double() - ry).abs().max() <= 0.02 * ry.abs().max()


@requires_gpu
def test_opcheck_and_compile():
    ops = family()
    a, b, bias = rand(64, 32), rand(32, 48), rand(48)
    torch.library.opcheck(torch.ops.vitrail.gemm.default,
                          (a, b, None, bias, 1.0, 0.0, "relu", 0.01, None, None, None))
    f = torch.compile(lambda x, y, z: ops.gemm(x, y, bias=z, activation="relu") * 2,
                      fullgraph=True)
    torch.testing.assert_close(f(a, b, bias), 2 * ops.gemm(a, b, bias=bias, activation="relu"))


@requires_gpu
@pytest.mark.parametrize("da,db", [(torch.float8_e4m3fn, torch.float8_e4m3fn),
                                   (torch.float8_e4m3fn, torch.float8_e5m2)])
@pytest.mark.parametrize("rowwise", [False, True])
# the heuristic's two exact-accumulation kernels: few tiles and a long K on stream-K (128x128),
# else 128x256 tiles (K = 1152: a sequence of 4 k-tiles twice, then one alone)
@pytest.mark.parametrize("M,N,K", [(1000, 528, 4096), (1000, 1104, 1152)],
                         ids=["stream_k", "128x256"])
def test_scaled_mm(da, db, rowwise, M, N, K, poison):
    ops = family()
    a = (rand(M, K, dtype=torch.float32) * 0.5).to(da)
    b = (rand(N, K, dtype=torch.float32) * 0.5).to(db).t()  # column-major, as torch wants
    if rowwise:
        sa = torch.rand(M, 1, device="cuda") + 0.5
        sb = torch.rand(1, N, device="cuda") + 0.5
    else:
        sa, sb = torch.tensor(0.75, device="cuda"), torch.tensor(1.25, device="cuda")
    bias = rand(N)
    out = ops.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16)
    ref = (a.double() @ b.double()) * sa.double() * sb.double() + bias.double()
    theirs = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16)
    assert_matches(out, ref, theirs, torch.bfloat16)


@requires_gpu
def test_grouped_mm(poison):
    ops = family()
    K, N = 256, 136
    ends = torch.tensor([100, 100, 357, 400], device="cuda", dtype=torch.int32)
    a, b = rand(420, K), rand(4, K, N)
    out = ops.grouped_mm(a, b, ends)
    starts = [0] + ends.tolist()[:-1]
    for g, (s, e) in enumerate(zip(starts, ends.tolist())):
        if e > s:
            ref = a[s:e].double() @ b[g].double()
            assert_matches(out[s:e], ref, a[s:e] @ b[g], torch.bfloat16)
    assert (out[400:] == 0).all()
    xs, ys = [rand(33, 64), rand(70, 128)], [rand(64, 24), rand(128, 40)]
    for o, x, y in zip(ops.grouped_mm(xs, ys), xs, ys):  # one grouped launch
        assert_matches(o, x.double() @ y.double(), x @ y, torch.bfloat16)
    xs, ys = [rand(33, 7), rand(70, 128)], [rand(7, 24), rand(128, 40)]
    for o, x, y in zip(ops.grouped_mm(xs, ys), xs, ys):  # K = 7: a loop of gemm
        assert_matches(o, x.double() @ y.double(), x @ y, torch.bfloat16)
    a, bt = rand(420, 72), rand(4, 136, 72).transpose(1, 2)  # column-major weights
    out = ops.grouped_mm(a, bt, ends)
    for g, (s, e) in enumerate(zip(starts, ends.tolist())):
        if e > s:
            assert_matches(out[s:e], a[s:e].double() @ bt[g].double(), a[s:e] @ bt[g],
                           torch.bfloat16)


@pytest.mark.parametrize("case", ["relu-bias-col", "gelu-c-batched-a", "silu-clamp-row-bias",
                                  "tanh-batched-b", "leaky-both-batched"])
def test_the_gradient_rule_against_autograd_on_the_cpu(monkeypatch, case):
    """The gradient rule (_plan_grads, what a C++ plan's backward calls) with its GEMMs run by
    the fp64 reference: a, b, c and bias's gradients against autograd through the reference,
    for gradients taken from the output (relu, tanh, leaky_relu) or from z recomputed (gelu,
    silu; clamps), bias per column and per row, c broadcast, a batch on either side."""
    from vitrail.gemm.ops import dense
    from vitrail.gemm.ops.reference import gemm_reference

    def mm(a, b, c, bias, alpha, beta, act, slope, lo, hi, out_dtype):
        return gemm_reference(a, b, c, alpha=alpha, beta=beta, bias=bias, activation_name=act,
                              slope=slope, clamp_min=lo, clamp_max=hi, out_dtype=out_dtype)
    monkeypatch.setattr(dense, "_backward_mm", lambda: mm)
    g = torch.Generator().manual_seed(len(case))
    M, N, K, L = 5, 6, 7, 3

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    kw = {"relu-bias-col": dict(a=t(M, K), b=t(K, N), bias=t(N), activation="relu"),
          "gelu-c-batched-a": dict(a=t(L, M, K), b=t(K, N), c=t(1, N), beta=0.5,
                                   activation="gelu"),
          "silu-clamp-row-bias": dict(a=t(M, K), b=t(K, N), bias=t(M, 1), activation="silu",
                                      clamp_min=-0.1, clamp_max=0.8),
          "tanh-batched-b": dict(a=t(M, K), b=t(L, K, N), activation="tanh", alpha=1.5),
          "leaky-both-batched": dict(a=t(L, M, K), b=t(L, K, N), bias=t(N), c=t(L, M, N),
                                     beta=2.0, activation="leaky_relu")}[case]
    a, b, c, bias = kw["a"], kw["b"], kw.get("c"), kw.get("bias")
    params = dense._params(kw.get("alpha", 1.0), kw.get("beta", 0.0), kw["activation"], 0.01,
                           kw.get("clamp_min"), kw.get("clamp_max"))
    y = gemm_reference(a, b, c, alpha=params[0], beta=params[1], bias=bias,
                       activation_name=params[2], slope=params[3], clamp_min=params[4],
                       clamp_max=params[5])
    grad = torch.randn(y.shape, generator=g, dtype=torch.float64)
    tensors = [x for x in (a, b, c, bias) if x is not None]
    want = torch.autograd.grad(y, tensors, grad)
    with torch.no_grad():
        got = dense._plan_grads(a, b, c, bias, y, grad, params,
                                tuple(x is not None for x in (a, b, c, bias)),
                                dense._from_y(params), None if c is None else tuple(c.shape))
    assert len(got) == len(want)
    tol = 1e-9 if dense._from_y(params) else 1e-4  # else z is recomputed in fp32 by design
    for x, w in zip(got, want):
        assert x.shape == w.shape and x.dtype == w.dtype
        torch.testing.assert_close(x, w, rtol=tol, atol=tol * w.abs().max().item())
