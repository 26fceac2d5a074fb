"""vitrail.ops.attention_kvcache: the PAGED forward compiled for sm_90a on the CPU (no spills, no
serialized wgmma); the call's decomposition (chunks, GQA packing, the combination, the block
table) on the CPU with the kernel replaced by its fp64 meaning; its refusals; on a Hopper GPU,
values against an fp64 reference over paged and unpaged caches (page sizes below, at and above
the kernel's block of keys, a shuffled table, NaN in the rows no entry holds), lengths of 0 to
the capacity, GQA, causal and windowed query rows, the softcap, split-KV, a CUDA graph and
torch.compile."""
from __future__ import annotations

import importlib
import math

import pytest
import torch

from tests.conftest import assert_builds_clean, has_gpu, smem_check
from vitrail.jit.errors import ArgumentError
from vitrail.ops.common import DISPATCH

A = importlib.import_module("vitrail.ops.attention")
K = importlib.import_module("vitrail.ops.attention.kvcache")
HOPPER = has_gpu() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm_90) GPU")
pytestmark = pytest.mark.warm_cache


@pytest.mark.slow
@pytest.mark.parametrize("d,causal,options", [
    (128, False, {}), (64, True, {"local": True, "softcap": True, "persistent": False})])
def test_the_paged_forward_compiles_for_sm90a(d, causal, options):
    source = A.source(torch.bfloat16, d, causal, paged=True, **options)
    assert "constexpr bool PAGED = true;" in source and "constexpr bool VARLEN = true;" in source
    source += smem_check(A.smem_bytes(d, paged=True))
    assert_builds_clean(source, "attention_fwd", ["attention_fwd"], include_dirs=[A.HERE],
                        flags=["-default-device"])


def _cpu_tensors_pass(monkeypatch):
    """The device checks pass CPU tensors (the decomposition runs on the CPU); the others
    stay."""
    for module in (A, K):
        monkeypatch.setattr(module, "check_tensor", lambda *a, **kw: None)
        monkeypatch.setattr(module, "check_same_device", lambda *a, **kw: None)


def _entry_keys(cache, lens, table, e, upto=None):
    """Entry e's cached rows (its first lens[e], or upto of them) as a (keys, Hkv, D) tensor."""
    n = lens[e] if upto is None else upto
    if table is None:
        return cache[e, :n]
    page = cache.shape[1]
    pages = table[e, :-(-n // page)].long()
    return cache[pages].flatten(0, 1)[:n]


def _paged_on_the_cpu(q, k_cache, v_cache, lens, table, cu_q, rows, splits, chunk, scale,
                      causal, causal_offset, local, local_offset, softcap):
    """The PAGED kernel's meaning: sequence z is chunk z % splits of entry z / splits, its rows
    q's of the entry (q (batch, rows, heads, d)), its keys [c chunk, min((c + 1) chunk, len)) of
    the entry's cache, masks bottom-right within the sequence; o and lse packed by sequence, o in
    q's dtype, lse fp32 (fp64 reference underneath)."""
    cq = cu_q.tolist()
    lengths = lens.tolist()
    capacity = k_cache.shape[1] * (table.shape[1] if table is not None else 1)
    # the kernel's preconditions: whole blocks of keys a chunk, chunks over the capacity
    assert chunk % A.block_n(q.shape[2], v_cache.shape[3]) == 0
    assert (splits - 1) * chunk < capacity <= splits * chunk
    total = (len(cq) - 1) * rows
    o = q.new_zeros((total, q.shape[2], v_cache.shape[3]))
    lse = torch.full((q.shape[2], total), -math.inf)
    window = (-local_offset if local else None, causal_offset if causal else None)
    for z, (q0, q1) in enumerate(zip(cq, cq[1:])):
        assert q1 - q0 == rows == q.shape[1]
        e, c = divmod(z, splits)
        n = min(lengths[e], capacity)
        k0, k1 = c * chunk, min((c + 1) * chunk, n)
        if k1 <= k0:
            continue
        k = _entry_keys(k_cache, lengths, table, e, n)[k0:k1]
        v = _entry_keys(v_cache, lengths, table, e, n)[k0:k1]
        oz, lz = A.reference(*(t[None].double() for t in (q[e], k, v)), scale=scale,
                             softcap=softcap or None, alignment="bottom_right",
                             window=window if window != (None, None) else None)
        o[q0:q1], lse[:, q0:q1] = oz[0].to(q.dtype), lz[0].float()
    return o, lse


def _paged_run_on_the_cpu(*args):
    """_paged_run (the kernel into o and lse) by _paged_on_the_cpu."""
    *call, o, lse = args
    o_ref, lse_ref = _paged_on_the_cpu(*call)
    o.copy_(o_ref)
    lse.copy_(lse_ref)


def _on_the_cpu(monkeypatch, path):
    """The kernel replaced by its meaning on the path a call takes: "eager" (paged_into, a
    plan's general path) or "dispatch" (the custom ops torch.compile traces)."""
    monkeypatch.setattr(A, "_paged_run", _paged_run_on_the_cpu)
    monkeypatch.setattr(A, "_paged_fwd", _paged_on_the_cpu)
    if path == "dispatch":
        monkeypatch.setattr(K, "call_mode", lambda *t: DISPATCH)
    _cpu_tensors_pass(monkeypatch)


def _cache(b, capacity, hk, d, dv, page, lens, gen, fill=0.0):
    """(k_cache, v_cache, table): unpaged (b, capacity, ...) where page is None, else pages of
    `page` rows in a shuffled pool with a spare, each entry's table row over capacity keys;
    rows no entry holds are `fill`."""
    if page is None:
        k = torch.randn(b, capacity, hk, d, generator=gen)
        v = torch.randn(b, capacity, hk, dv, generator=gen)
        for e, n in enumerate(lens):
            k[e, n:], v[e, n:] = fill, fill
        return k, v, None
    per = -(-capacity // page)
    pool = b * per + 1
    table = torch.randperm(pool, generator=gen)[:b * per].view(b, per).to(torch.int32)
    k = torch.full((pool, page, hk, d), fill)
    v = torch.full((pool, page, hk, dv), fill)
    for e, n in enumerate(lens):
        for p in range(-(-n // page)):
            m = min(page, n - p * page)
            k[table[e, p], :m] = torch.randn(m, hk, d, generator=gen)
            v[table[e, p], :m] = torch.randn(m, hk, dv, generator=gen)
    return k, v, table


@pytest.mark.parametrize("b,sq,h,hk,d,dv,capacity,page,lens,extra", [
    (2, 1, 8, 2, 64, 64, 300, 64, [300, 17], {}),                    # GQA packed, one chunk
    (3, 1, 4, 4, 32, 48, 2048, 128, [2048, 1000, 0], {"num_splits": 5}),  # a split, an empty entry
    (2, 1, 4, 1, 16, 16, 1500, None, [1500, 3], {}),                 # unpaged, the default split
    (2, 3, 4, 2, 32, 32, 256, 16, [200, 2], {"causal": True}),       # rows masked: one pass
    (1, 4, 2, 2, 16, 16, 512, 256, [333], {"window": (40, 0), "softcap": 7.0}),
    (2, 1, 2, 2, 16, 16, 1100, 128, [1100, 1099], {"causal": True, "scale": 0.2}),
    (1, 2, 4, 2, 16, 32, 4096, 128, [4000], {"num_splits": 1})])
@pytest.mark.parametrize("path", ["eager", "dispatch"])
def test_the_call_over_a_cache_is_the_reference(monkeypatch, b, sq, h, hk, d, dv, capacity,
                                                page, lens, extra, path):
    """The decomposition on the CPU: attention_kvcache (the kernel replaced by its meaning,
    _paged_on_the_cpu) against the fp64 reference over each entry's gathered keys, both
    bottom-right aligned; eagerly (paged_into) and through the custom ops (paged_dispatch)."""
    _on_the_cpu(monkeypatch, path)
    gen = torch.Generator().manual_seed(capacity)
    k, v, table = _cache(b, capacity, hk, d, dv, page, lens, gen)
    q = torch.randn(b, sq, h, d, generator=gen).to(torch.bfloat16)
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    o, lse = K.attention_kvcache(q, k, v, seqlens, table, return_lse=True, **extra)
    options = {key: val for key, val in extra.items() if key != "num_splits"}
    ro, rlse = K.reference_kvcache(q, k, v, seqlens, table, **options)
    assert o.shape == (b, sq, h, dv) and o.dtype == q.dtype and lse.shape == (b, h, sq)
    torch.testing.assert_close(o.double(), ro, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double(), rlse, rtol=1e-5, atol=1e-5)


def test_refusals_name_the_argument(monkeypatch):
    q = torch.randn(2, 1, 4, 64).to(torch.bfloat16)
    with pytest.raises(Exception, match="q must be on a CUDA device"):
        K.attention_kvcache(q, q, q, 1)
    _cpu_tensors_pass(monkeypatch)
    cache = torch.zeros(2, 256, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ArgumentError, match="k_cache's batch"):
        K.attention_kvcache(q, cache[:1], cache[:1], 1)
    with pytest.raises(ArgumentError, match="multiple of k_cache's and v_cache's"):
        K.attention_kvcache(q, cache[:, :, :1].expand(2, 256, 3, 64),
                            cache[:, :, :1].expand(2, 256, 3, 64), 1)
    with pytest.raises(ArgumentError, match="v_cache .* does not match k_cache"):
        K.attention_kvcache(q, cache, cache[:, :128], 1)
    with pytest.raises(ArgumentError, match="cache_seqlens must be"):
        K.attention_kvcache(q, cache, cache, 1.5)
    with pytest.raises(ArgumentError, match="cache_seqlens must be >= 0"):
        K.attention_kvcache(q, cache, cache, -1)
    with pytest.raises(ArgumentError, match=r"cache_seqlens must be \(2,\)"):
        K.attention_kvcache(q, cache, cache, torch.zeros(3, dtype=torch.int32))
    table = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ArgumentError, match="a page of 24 rows"):
        K.attention_kvcache(q, cache[:, :24], cache[:, :24], 1, table)
    with pytest.raises(ArgumentError, match="block_table must be"):
        K.attention_kvcache(q, cache, cache, 1, table[:1])
    with pytest.raises(ArgumentError, match="num_splits must be"):
        K.attention_kvcache(q, cache, cache, 1, num_splits=0)
    with pytest.raises(ArgumentError, match="window must be"):
        K.attention_kvcache(q, cache, cache, 1, window=(1,))


# ---------------------------------------------------------------------------------- GPU
def _gpu_case(b, sq, h, hk, d, dv, capacity, page, lens, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k, v, table = _cache(b, capacity, hk, d, dv, page, lens, gen, fill=math.nan)
    q = torch.randn(b, sq, h, d, generator=gen)
    to = dict(device="cuda", dtype=dtype)
    return (q.to(**to), k.to(**to), v.to(**to),
            torch.tensor(lens, dtype=torch.int32, device="cuda"),
            None if table is None else table.cuda())


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,sq,h,hk,d,dv,capacity,page,lens,extra", [
    (4, 1, 32, 8, 128, 128, 8192, 128, [8192, 5000, 1, 0], {}),        # decoding, split, GQA
    (2, 1, 16, 16, 128, 128, 4096, 16, [4096, 77], {}),                # vLLM's 16-row pages
    (2, 1, 8, 2, 64, 64, 3000, 64, [2999, 1500], {}),
    (3, 1, 8, 8, 256, 256, 2048, 256, [2048, 700, 64], {}),            # a block of 64 keys
    (2, 1, 8, 8, 128, 128, 5000, None, [5000, 4097], {}),              # unpaged
    (2, 4, 8, 2, 128, 128, 1024, 32, [1024, 9], {"causal": True}),     # several query rows
    (2, 7, 4, 4, 64, 64, 600, 128, [600, 300], {"window": (100, 0), "softcap": 30.0}),
    (2, 1, 8, 2, 192, 128, 4096, 64, [4096, 1234], {"num_splits": 3})])
def test_values(dtype, b, sq, h, hk, d, dv, capacity, page, lens, extra):
    """Against the fp64 reference over each entry's gathered keys; the rows no entry holds are
    NaN, which must not reach the output."""
    q, k, v, seqlens, table = _gpu_case(b, sq, h, hk, d, dv, capacity, page, lens, dtype)
    o, lse = K.attention_kvcache(q, k, v, seqlens, table, return_lse=True, **extra)
    options = {key: val for key, val in extra.items() if key != "num_splits"}
    ro, rlse = K.reference_kvcache(q, k, v, seqlens, table, **options)
    assert o.shape == (b, sq, h, dv) and o.dtype == dtype and lse.shape == (b, h, sq)
    assert not o.isnan().any()
    torch.testing.assert_close(o.double(), ro, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double(), rlse, rtol=2e-3, atol=2e-3)


@needs_hopper
def test_a_page_past_the_entry_and_lengths_past_the_capacity():
    """A table row's pages past an entry's keys hold -1 (no page): never read. A length past
    the capacity is cut to it."""
    q, k, v, seqlens, table = _gpu_case(2, 1, 8, 8, 128, 128, 1024, 128, [1024, 200])
    table[1, 2:] = -1
    o = K.attention_kvcache(q, k, v, seqlens, table)
    torch.testing.assert_close(o.double(), K.reference_kvcache(q, k, v, seqlens, table)[0],
                               rtol=2e-2, atol=2e-2)
    longer = seqlens.clone()
    longer[0] = 5000
    torch.testing.assert_close(K.attention_kvcache(q, k, v, longer, table), o)


@needs_hopper
def test_a_decoding_loop_in_a_cuda_graph_and_under_torch_compile():
    """One step captured, replayed after the lengths and the new keys change in place (the
    lengths stay on the device); torch.compile(fullgraph=True) gives the eager values."""
    q, k, v, seqlens, table = _gpu_case(4, 1, 16, 4, 128, 128, 4096, 64, [100, 4000, 2048, 1])
    o = K.attention_kvcache(q, k, v, seqlens, table)  # builds, and the warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.attention_kvcache(q, k, v, seqlens, table)
    graph.replay()
    torch.testing.assert_close(out, o)
    for e in range(4):  # one more key each
        page, row = divmod(int(seqlens[e]), k.shape[1])
        k[table[e, page], row] = torch.randn_like(k[0, 0])
        v[table[e, page], row] = torch.randn_like(v[0, 0])
    seqlens += 1
    graph.replay()
    want = K.reference_kvcache(q, k, v, seqlens, table)[0]
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
    compiled = torch.compile(lambda *a: K.attention_kvcache(*a), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, seqlens, table),
                               K.attention_kvcache(q, k, v, seqlens, table))


@needs_hopper
@pytest.mark.parametrize("page,lens,extra", [
    (16, [100, 4000, 2048, 1], {}), (None, [4096, 3, 0, 17], {"return_lse": True}),
    (64, [300, 1, 64, 65], {"causal": True, "num_splits": 1, "return_lse": True})])
def test_a_decoding_step_runs_its_plan(page, lens, extra):
    """A step with the lengths on the device records its plan once, at its signature's second
    call; later steps run it (new lengths) with the values of the reference; an int
    length takes the general path every call. One chunk unpacked (num_splits=1, MHA): lse in
    the kernel's layout, (B, H, Sq) strided."""
    from vitrail.plan import GENERAL
    q, k, v, seqlens, table = _gpu_case(4, 1 if not extra.get("causal") else 3, 16,
                                        4 if page != 64 else 16, 128, 128, 4096, page, lens)
    plans = lambda: sum(p is not GENERAL for p in A.PLANS._plans.values())  # noqa: E731
    before = plans()
    for step in range(3):
        got = K.attention_kvcache(q, k, v, seqlens, table, **extra)
        assert plans() == before + (step >= 1)  # recorded at the second call
        want = K.reference_kvcache(q, k, v, seqlens, table, causal=extra.get("causal", False))
        got = got if isinstance(got, tuple) else (got, None)
        torch.testing.assert_close(got[0].double(), want[0], rtol=2e-2, atol=2e-2)
        if got[1] is not None:
            finite = want[1].isfinite()
            torch.testing.assert_close(got[1].double()[finite], want[1][finite], rtol=1e-4,
                                       atol=1e-4)
        seqlens.sub_(1).clamp_(min=0)  # shorter: rows the entries hold (no NaN)
    for e in range(len(lens)):  # every entry's first 5 rows keys (the first page holds them)
        row = (e,) if table is None else (int(table[e, 0]),)
        k[row][:5], v[row][:5] = torch.randn_like(k[row][:5]), torch.randn_like(v[row][:5])
    int_len = K.attention_kvcache(q, k, v, 5, table, **extra)
    assert plans() == before + 1
    got = int_len if isinstance(int_len, tuple) else (int_len,)
    want = K.reference_kvcache(q, k, v, 5, table, causal=extra.get("causal", False))
    torch.testing.assert_close(got[0].double(), want[0], rtol=2e-2, atol=2e-2)


def test_the_benchmarks_pages_hold_the_keys_where_their_table_says():
    """attention.decode's kvcache rows read the case's own keys: page i of entry e in the pool
    at table[e, i] (a shuffled pool), so its GB/s are those of the same problem."""
    from vitrail.ops.attention import benchmarks
    x = torch.randn(3, 64, 2, 8)
    pool, table = benchmarks._paged(x, 16), benchmarks._table(3, 4, "cpu")
    assert pool.shape == (12, 16, 2, 8) and sorted(table.flatten().tolist()) == list(range(12))
    assert table.tolist() != sorted(table.flatten().tolist())  # shuffled
    gathered = torch.stack([_entry_keys(pool, [64] * 3, table, e) for e in range(3)])
    assert torch.equal(gathered, x)
