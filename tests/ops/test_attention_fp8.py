"""attention_fp8: the FP8 (e4m3) forward. CPU: V^T's key order, the checks, a compile-only build
for sm_90a; GPU: values against the fp64 reference of the same e4m3 inputs and descales."""
from __future__ import annotations

import importlib

import pytest
import torch

from tests.conftest import (assert_builds_clean, requires_gpu, requires_nvrtc,
                            smem_check)
from vitrail.jit.errors import ArgumentError
from vitrail.ops.attention import fp8

A = importlib.import_module("vitrail.ops.attention")
E4M3 = torch.float8_e4m3fn


def test_v_transposed_holds_each_key_where_the_product_reads_it():
    """Position 16 h + 4 q + 2 i + j of each 32 holds key 16 h + 8 i + 2 q + j: the columns of
    P a thread's accumulators hold, in the order of the e4m3 A registers; zeros past the keys."""
    order = fp8.key_order(64)
    assert sorted(order.tolist()) == list(range(64))
    assert order[:8].tolist() == [0, 1, 8, 9, 2, 3, 10, 11]
    assert order[16:20].tolist() == [16, 17, 24, 25] and order[32] == 32
    b, sk, hk, dv = 2, 45, 3, 32
    v = torch.randn(b, sk, hk, dv).to(E4M3)
    vt = fp8.transposed_v_reference(v, 64)
    assert vt.shape == (b, dv, hk, 64) and vt.stride(3) == 1
    want = torch.zeros(b, 64, hk, dv)
    want[:, :sk] = v.float()
    want = want[:, order].permute(0, 3, 2, 1)  # (b, dv, hk, positions)
    assert torch.equal(vt.float(), want)


def test_tensors_off_the_gpu_are_refused_by_name():
    q = torch.zeros(1, 4, 2, 64, dtype=E4M3)
    with pytest.raises(ArgumentError, match="q must be on a CUDA device"):
        fp8.attention_fp8(q, q, q)


@requires_gpu
def test_bad_input_is_refused_by_name():
    q = torch.zeros(1, 4, 2, 64, dtype=E4M3, device="cuda")
    with pytest.raises(ArgumentError, match="q"):
        fp8.attention_fp8(q.to(torch.bfloat16), q, q)
    with pytest.raises(ArgumentError, match="out_dtype"):
        fp8.attention_fp8(q, q, q, out_dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="head_dim 48"):
        z = torch.zeros(1, 4, 2, 48, dtype=E4M3, device="cuda")
        fp8.attention_fp8(z, z, z)
    with pytest.raises(ArgumentError, match="descale_k"):
        fp8.attention_fp8(q, q, q, descale_k=torch.ones(3))
    with pytest.raises(ArgumentError, match="descale_v"):
        fp8.attention_fp8(q, q, q, descale_v=-1.0)


@requires_nvrtc
@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 128])
def test_the_fp8_forward_compiles_for_sm90a(d):
    """e4m3 Q K^T and P V (V^T K-major, P converted in its registers): no spills, no wgmma
    serialized (at D 64 too, whose softmax differs in the bf16 kernel)."""
    source = (A.source(E4M3, d, True, out_dtype=torch.bfloat16)
              + smem_check(A.smem_bytes(d, E4M3)))
    assert_builds_clean(source, "attention_fwd",
                        ["attention_fwd"], include_dirs=[A.HERE], flags=["-default-device"])


@requires_nvrtc
def test_the_v_transpose_kernel_compiles():
    from vitrail.jit import compiler
    for dv in (64, 256):
        source = f"constexpr int DV = {dv};\n#include \"smxx_attention_fp8_vt.cuh\"\n"
        entry, _ = compiler.build_entry(source, name="attention_fp8_vt", backend="nvrtc",
                                        arch="90a", include_dirs=[A.HERE])
        res = entry.meta["resources"]["attention_fp8_vt"]
        assert res["spill_stores"] == 0 and res["stack"] == 0, res


@requires_gpu
@pytest.mark.parametrize("b,sk,hk,dv,keys,strided", [(2, 45, 3, 32, 64, False),
                                                     (1, 4097, 8, 128, 4224, False),
                                                     (3, 300, 2, 256, 320, True),
                                                     (2, 128, 1, 96, 128, True)])
def test_the_v_transpose_kernel_matches_the_reference(b, sk, hk, dv, keys, strided):
    """The pass's kernel against torch's copies, to the bit: odd key counts, padding, heads of
    SDPA's layout (v a transposed view) and a head dim slice."""
    gen = torch.Generator(device="cuda").manual_seed(sk)
    if strided:  # (b, hk, sk, dv + 32) storage: v's keys strided, its head dim a slice
        v = _e4m3(b, hk, sk, dv + 32, gen=gen).transpose(1, 2)[..., :dv]
    else:
        v = _e4m3(b, sk, hk, dv, gen=gen)
    got = fp8.transposed_v(v, keys)
    want = fp8.transposed_v_reference(v, keys)
    assert got.shape == want.shape == (b, dv, hk, keys)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _e4m3(*shape, gen, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(E4M3)


@requires_gpu
@pytest.mark.parametrize("b,sq,h,hk,sk,d,dv,options", [
    (2, 300, 4, 2, 700, 128, 128, {}),
    (2, 300, 4, 2, 700, 128, 128, {"causal": True}),
    (1, 77, 8, 1, 1000, 64, 64, {"causal": True, "alignment": "bottom_right"}),
    (2, 129, 2, 2, 257, 256, 256, {"window": (100, 20), "out_dtype": torch.float16}),
    (1, 200, 4, 4, 333, 192, 128, {"softcap": 30.0}),
    (3, 1, 16, 2, 4097, 128, 128, {}),
])
def test_values_match_the_reference(b, sq, h, hk, sk, d, dv, options):
    """o within FP8's rounding of P (relative RMS error under 4%, each element within 0.15 of
    the largest), the lse (from fp32 scores) within 1e-3; per-head descales on q and k, a
    per-tensor one on v."""
    gen = torch.Generator(device="cuda").manual_seed(d + sk)
    q, k, v = _e4m3(b, sq, h, d, gen=gen), _e4m3(b, sk, hk, d, gen=gen), _e4m3(b, sk, hk, dv,
                                                                                 gen=gen)
    dq = torch.rand(h, device="cuda", generator=gen) + 0.5
    dk = torch.rand(hk, device="cuda", generator=gen) + 0.5
    descales = {"descale_q": dq, "descale_k": dk, "descale_v": 0.75}
    out_dtype = options.pop("out_dtype", torch.bfloat16)
    o, lse = fp8.attention_fp8(q, k, v, **options, **descales, return_lse=True,
                               out_dtype=out_dtype)
    assert o.dtype == out_dtype and o.shape == (b, sq, h, dv) and lse.shape == (b, h, sq)
    want, want_lse = fp8.reference(q, k, v, **descales, **options)
    err = o.double() - want
    rms = err.pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
    assert rms < 0.04, rms
    assert err.abs().max() <= 0.15 * want.abs().max(), err.abs().max()
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], rtol=1e-3, atol=1e-3)


@requires_gpu
def test_fp8_against_bf16_on_the_same_values():
    """The same e4m3 values through the bf16 forward (exact in bf16): the FP8 forward's o is as
    close to it as P's rounding allows, and its lse within 1e-3 (e4m3 wgmma sums its products
    at less than fp32's precision: 2e-4 measured on the H200)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (_e4m3(2, 512, 8, 128, gen=gen) for _ in range(3))
    o8, lse8 = fp8.attention_fp8(q, k, v, causal=True, return_lse=True)
    o16, lse16 = A.attention(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16),
                             causal=True, return_lse=True)
    rms = (o8.float() - o16.float()).pow(2).mean().sqrt() / o16.float().pow(2).mean().sqrt()
    assert rms < 0.04, rms
    torch.testing.assert_close(lse8, lse16, rtol=1e-3, atol=1e-3)


@requires_gpu
def test_number_descales_are_each_their_own():
    """Descales given as numbers (kept on the GPU once per set of values, not made a call):
    each call gets its own; a power of two scales o exactly and the lse by its log."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (_e4m3(1, 130, 4, 64, gen=gen) for _ in range(3))
    o, lse = fp8.attention_fp8(q, k, v, return_lse=True)
    for _ in range(2):  # the second time from the cache
        o2, _ = fp8.attention_fp8(q, k, v, descale_v=2.0, return_lse=True)
        assert torch.equal(o2, 2 * o)
        o3, lse3 = fp8.attention_fp8(q, k, v, descale_q=2.0, descale_k=0.5, return_lse=True)
        assert torch.equal(o3, o) and torch.equal(lse3, lse)
    _, lse4 = fp8.attention_fp8(q, k, v, descale_q=2.0, return_lse=True)
    want, want_lse = fp8.reference(q, k, v, descale_q=2.0)
    torch.testing.assert_close(lse4.double(), want_lse, rtol=1e-3, atol=1e-3)


@requires_gpu
def test_number_descales_first_seen_in_a_captured_graph():
    """A set of number descales first met while a CUDA graph is captured is made in the graph
    (its fills run at each replay), not kept: an eager call after it gets its own."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = (_e4m3(1, 70, 2, 64, gen=gen) for _ in range(3))
    want = fp8.attention_fp8(q, k, v, descale_q=0.375, descale_v=1.5)  # cached from here on
    fp8._constant_descales.cache_clear()
    fp8.attention_fp8(q, k, v, descale_q=0.375, descale_v=1.5)  # warm-up before the capture
    fp8._constant_descales.cache_clear()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = fp8.attention_fp8(q, k, v, descale_q=0.375, descale_v=1.5)
    torch.cuda.current_stream().wait_stream(stream)
    # before any replay: a descale tensor kept from the capture would hold what was never filled
    assert torch.equal(fp8.attention_fp8(q, k, v, descale_q=0.375, descale_v=1.5), want)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@requires_gpu
def test_opcheck_and_torch_compile():
    """The custom op passes torch.library.opcheck (its fake impl against the real one), and a
    compiled function with no graph break gives the eager result's bits."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (_e4m3(2, 200, 4, 64, gen=gen) for _ in range(3))
    descale = torch.rand(8, device="cuda", generator=gen) + 0.5
    # not test_schema: torch's schema check compares inputs by allclose, which e4m3 lacks
    torch.library.opcheck(torch.ops.vitrail.attention_fp8_fwd.default,
                          (q, k, v, descale, 0.125, True, 0, False, 0, 0.0, torch.bfloat16),
                          test_utils=("test_faketensor", "test_autograd_registration",
                                      "test_aot_dispatch_dynamic"))

    def fn(q, k, v):
        return fp8.attention_fp8(q, k, v, causal=True, descale_k=0.5, return_lse=True)
    eager = fn(q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)(q, k, v)
    for x, y in zip(eager, compiled):
        assert torch.equal(x, y)


def test_the_benchmark_times_fp8_against_bf16_on_the_grid(monkeypatch):
    """`vitrail bench attention.fp8`: the forward's grid; the FP8 row's math is fp8 (its roof
    twice bf16's), and its ratios are against vitrail's bf16 forward and cuDNN."""
    import types

    from vitrail import profile
    from vitrail.ops import load_benchmarks
    from vitrail.ops.attention import benchmarks as b
    entry = load_benchmarks()["attention.fp8"]
    assert entry.run is b.run_fp8 and entry.build is b.build_fp8 and entry.by_name
    monkeypatch.setattr(profile, "compare",
                        lambda fns: {impl: types.SimpleNamespace(median=2.0) for impl in fns})
    rows = b._timed("c", {"vitrail fp8": lambda: None, "vitrail bf16": lambda: None,
                          "SDPA cuDNN": lambda: None}, 4e9, "D128",
                    math={"vitrail fp8": "fp8"}, baselines={"vitrail bf16", "SDPA cuDNN"})
    by = {r.impl: r for r in rows}
    assert by["vitrail fp8"].math == "fp8" and not by["vitrail fp8"].baseline
    assert by["vitrail bf16"].math == "bf16" and by["vitrail bf16"].baseline
    assert by["SDPA cuDNN"].baseline and by["vitrail fp8"].value == 2.0  # 4 GFLOP in 2 ms
    plain = b._timed("c", {"vitrail": lambda: None, "SDPA flash": lambda: None}, 4e9, "D128")
    assert [(r.impl, r.baseline, r.math) for r in plain] == [
        ("vitrail", False, "bf16"), ("SDPA flash", True, "bf16")]
