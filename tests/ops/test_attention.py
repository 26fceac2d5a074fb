"""vitrail.ops.attention: compiled for sm_90a on the CPU (NVRTC: wgmma not serialized, no
spills; head dims of each TMA box width and wgmma shape) and the backward's algebra against
autograd of the fp64 reference on the CPU; on a Hopper GPU, values and gradients against an fp64
reference for odd lengths, both causal alignments, GQA, head dims of 16 to 256, fully masked rows
and SDPA's layout."""
from __future__ import annotations

import importlib
import itertools
import math

import pytest
import torch

from tests.conftest import assert_builds_clean, has_gpu, smem_check
from vitrail.jit.errors import ArgumentError
from vitrail.plan import GENERAL

A = importlib.import_module("vitrail.ops.attention")
HOPPER = has_gpu() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm_90) GPU")
pytestmark = pytest.mark.warm_cache  # --kernel-cache: one build per kernel across the module


@pytest.mark.slow
@pytest.mark.parametrize("which,d,causal,options", [
    # D 64 once, with variable lengths (its blocks with no mask take exp2_fma: the D <= 64 path)
    ("fwd", 128, True, {}), ("fwd", 128, True, {"local": True, "softcap": True}),
    ("fwd", 64, True, {"varlen": True}),
    # representatives (CI's two cores build each in about 40 s): TMA boxes 16 wide with P V's
    # wgmma 80 wide (one of CuTe's extended shapes), boxes 32 wide, v's head dim of its own
    ("fwd", 80, True, {}), ("fwd", 96, False, {}), ("fwd", 192, True, {"dv": 128}),
    # three consumer warpgroups (D 64 above too): D 32, the producer's 40 registers (a CTA per
    # tile), the softcap
    ("fwd", 32, False, {"softcap": True, "persistent": False}),
    # the backward: the fast one (dQ by atomics: dS K's tiles, bulk reduce-adds) at both head
    # dims, with a window and the softcap; the deterministic one (its two kernels) with varlen
    ("bwd", 128, True, {}), ("bwd", 64, False, {}),
    ("bwd", 128, False, {"local": True, "softcap": True}),
    ("bwd", 128, True, {"varlen": True, "deterministic": True})])
def test_compiles_for_sm90a(which, d, causal, options):
    source = (A.source if which == "fwd" else A.bwd_source)(torch.bfloat16, d, causal, **options)
    if which == "fwd":  # the launch's shared memory is the kernel's (or its layout overruns it)
        source += smem_check(A.smem_bytes(d, torch.bfloat16, options.get("dv", d)))
    names = (["attention_fwd"] if which == "fwd" else
             list(A.bwd_kernel_names(options.get("deterministic", False))))
    assert_builds_clean(source, f"attention_{which}", names, include_dirs=[A.HERE],
                        flags=["-default-device"])


def test_three_consumer_warpgroups_at_small_head_dims():
    """bf16 and fp16 at D and Dv up to 64 take three consumer warpgroups (192 rows a tile) for
    sequences of WG3_MIN_ROWS query rows or more (and where the rows are not given: the largest
    tile), in the kernel's config too; shorter ones, PAGED, FP8 and larger head dims two (128
    rows), as before."""
    for dtype in A.DTYPES:
        for d, dv in ((16, 16), (32, 32), (64, 64), (64, 32), (48, 64)):
            assert A.warpgroups(d, dv, dtype) == 3 and A.block_m(d, dv, dtype) == 192, (d, dv)
            assert A.warpgroups(d, dv, dtype, rows=A.WG3_MIN_ROWS) == 3, (d, dv)
            assert A.block_m(d, dv, dtype, rows=A.WG3_MIN_ROWS - 1) == 128, (d, dv)
            assert A.warpgroups(d, dv, dtype, paged=True) == 2, (d, dv)
        for d, dv in ((64, 128), (128, 64), (80, 80), (128, 128), (256, 256)):
            assert A.warpgroups(d, dv, dtype) == 2 and A.block_m(d, dv, dtype) == 128, (d, dv)
    assert A.warpgroups(64, 64, torch.float8_e4m3fn) == 2
    assert A.block_m(64) == A.block_m(64, 64, torch.bfloat16) == 192
    assert all(A.block_m(d, dtype=dtype, paged=True) == 128  # decode_route's tile of rows
               for d in A.HEAD_DIMS for dtype in A.DTYPES)
    source = A.source(torch.float16, 64, True)
    assert "constexpr int WG = 3;\nconstexpr int BM = 192;" in source
    assert "constexpr int WG = 2;\nconstexpr int BM = 128;" in A.source(torch.float16, 64, True,
                                                                       wg=2)
    for source in (A.source(torch.bfloat16, 128, True), A.source(torch.bfloat16, 64, False,
                                                                  paged=True)):
        assert "constexpr int WG = 2;\nconstexpr int BM = 128;" in source
    # Q's 192 rows: 24 KB at D 64 beside two stages of 128 keys
    assert A.smem_bytes(64) == 1024 + 192 * 64 * 2 + 2 * 128 * 128 * 2 + 16 * 2 + 24
    assert A.smem_bytes(64, paged=True) == A.smem_bytes(64, wg=2) == A.smem_bytes(64) - 64 * 64 * 2


@pytest.mark.parametrize("d,dtype,paged,threads,rows", [
    (64, torch.bfloat16, False, 512, 192), (32, torch.float16, False, 512, 192),
    (64, torch.bfloat16, True, 384, 128), (128, torch.bfloat16, False, 384, 128)])
def test_the_forward_launches_its_tile_of_rows(monkeypatch, d, dtype, paged, threads, rows):
    """launch with a recording kernel: the grid's row blocks, the CTA's threads, Q's TMA box and
    the shared memory follow the kernel's warpgroups (a CTA per tile; persistent: the grid a CTA
    per SM up to the tiles)."""
    import contextlib
    monkeypatch.setattr(A, "_map", lambda t, rows, width=None: ("map", t.shape, rows))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(A, "tile_counters", lambda device: "counters")
    monkeypatch.setattr(A, "sm_count", lambda index: 132)
    log = []
    fwd = _Recorder("attention_fwd", log)
    b, sq, sk, h, hk = 2, 1000, 700, 6, 2
    q4 = torch.empty(b, sq, h, d, dtype=dtype)
    k4, v4 = torch.empty(b, sk, hk, d, dtype=dtype), torch.empty(b, sk, hk, d, dtype=dtype)
    o, lse = torch.empty(b, sq, h, d, dtype=dtype), torch.empty(b, h, sq)
    blocks = -(-sq // rows)
    paged_args = (torch.full((b,), sk, dtype=torch.int32), None, 0, sk, 1, sk) if paged else None
    for persistent in (False, True):
        A.launch(fwd, o, lse, q4, k4, v4, sq, sk, b, 0.125, 0, 0, 0.0, persistent=persistent,
                 paged=paged_args)
        _, grid, block, args, shared = log[-1]
        assert grid == ((min(blocks * h * b, 132), 1, 1) if persistent else (blocks, h, b))
        assert block == threads and args[2] == ("map", q4.shape, rows)
        assert args[24:26] == (blocks, blocks * h * b)  # row_blocks, tiles
        assert shared == A.smem_bytes(d, dtype, d, paged)


def test_every_head_dim_fits_shared_memory():
    """Each D's TMA box width divides it, and the kernel's shared memory fits a CTA (227 KB) at
    every (D, Dv); with Dv = D the blocks of keys are as before (128 up to D 128, else 64)."""
    assert A.HEAD_DIMS == tuple(range(16, 257, 16))
    for d in A.HEAD_DIMS:
        c = A.chunk(d)
        assert c in (16, 32, 64) and d % c == 0 and (c == 64 or d % (2 * c)), d
        assert A.block_n(d) == A.block_n(d, d) == (128 if d <= 128 else 64)
        for dv in A.HEAD_DIMS:
            assert A.block_n(d, dv) == 64 or dv <= 128, (d, dv)  # O's registers
            for dtype in A.DTYPES:
                assert A.smem_bytes(d, dtype, dv) <= 227 * 1024, (d, dv)
    assert A.smem_bytes(128) == A.smem_bytes(128, torch.bfloat16, 128)
    assert (A.block_n(192, 128), A.block_n(256, 128), A.block_n(64, 256)) == (128, 64, 64)
    assert [A.chunk(d) for d in (64, 128, 192, 256)] == [64] * 4  # the maps as before


def test_the_backwards_fit_shared_memory_and_name_their_kernels():
    """The fast backward's attention_bwd_dkv adds two dS tiles and two fp32 dQ tiles (32 KB each
    pair at D 128, bf16) to the deterministic one's, within a CTA's 227 KB."""
    for d in A.BWD_HEAD_DIMS:
        for dtype in A.DTYPES:
            fast = A.bwd_smem_bytes(d, dtype, deterministic=False)
            slow = A.bwd_smem_bytes(d, dtype, deterministic=True)
            assert fast["attention_bwd_dkv"] - slow["attention_bwd_dkv"] == 2 * 64 * 128 * 2 + \
                2 * 64 * 64 * 4
            assert max(fast.values()) <= A.SMEM_LIMIT and max(slow.values()) <= A.SMEM_LIMIT
    assert A.bwd_smem_bytes(128)["attention_bwd_dkv"] == 134192  # the deterministic as before
    assert A.bwd_kernel_names(True) == ("attention_bwd_dq", "attention_bwd_dkv")
    assert A.bwd_kernel_names(False) == ("attention_bwd_dkv", "attention_bwd_dq_convert")
    for det in (False, True):
        source = A.bwd_source(torch.float16, 64, True, deterministic=det)
        assert f"constexpr bool ATOMIC_DQ = {'false' if det else 'true'};" in source


class _Recorder:
    """A compiled kernel's stand-in: records each launch (grid, block, arguments, shared
    memory)."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getitem__(self, launch):
        grid, block = launch
        return lambda *args, shared_mem=0: self.log.append(
            (self.name, grid, block, args, shared_mem))


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_the_backward_launches_on_the_cpu(monkeypatch, varlen, deterministic):
    """_run_backward with recording kernels: the deterministic backward launches dQ's kernel
    then dK/dV's (no dq_accum); the fast one zeros dq_accum (lse2's rows, D wide, fp32), hands
    it to dK/dV's kernel, then converts it into dq over BQ rows a CTA, with seqlen_q, the padded
    rows, the heads, the scale and cu_q / cu_pad."""
    import contextlib
    monkeypatch.setattr(A, "_map", lambda t, rows: ("map", t.shape, rows))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    log = []
    kernels = {n: _Recorder(n, log) for n in A.bwd_kernel_names(deterministic)}
    b, sq, sk, h, hk, d = (1, 300, 500, 4, 2, 64) if varlen else (2, 300, 500, 4, 2, 64)
    q4, do4 = torch.randn(b, sq, h, d), torch.randn(b, sq, h, d)
    k4, v4 = torch.randn(b, sk, hk, d), torch.randn(b, sk, hk, d)
    padded = 384
    lse2 = torch.randn((h, padded) if varlen else (b, h, padded))
    delta = torch.randn(lse2.shape)
    dq, dk, dv = torch.empty_like(q4), torch.empty_like(k4), torch.empty_like(v4)
    cu = (torch.tensor([0, 100, 300], dtype=torch.int32),) * 2
    extra = (*cu, torch.tensor([0, 128, 384], dtype=torch.int32), 1) if varlen else \
        (None, None, None, 0)
    rows, keys, batch = (200, 300, 2) if varlen else (sq, sk, b)
    ints = A._bwd_ints(0 if varlen else sq, 0 if varlen else sk, padded, h, hk, 0.125, 3, 0, 0.0)
    A._run_backward(kernels, dq, dk, dv, lse2, delta, q4, k4, v4, do4, rows, keys, batch, ints,
                    extra)
    smem = A.bwd_smem_bytes(d, q4.dtype, deterministic)
    names = [entry[0] for entry in log]
    assert names == list(A.bwd_kernel_names(deterministic))
    dkv = log[names.index("attention_bwd_dkv")]
    assert dkv[1] == (-(-keys // 128), hk, batch) and dkv[2] == A.BWD_THREADS
    assert dkv[4] == smem["attention_bwd_dkv"]
    assert dkv[3][:4] == (dk, dv, lse2, delta) and dkv[3][8:-1] == (*ints, *extra)
    accum = dkv[3][-1]
    if deterministic:
        assert accum is None
        assert log[0][1] == (-(-rows // 128), h, batch) and log[0][3][0] is dq
        return
    assert accum.shape == lse2.shape + (d,) and accum.dtype == torch.float32
    assert not accum.any()  # zeros: the kernels add into it
    _, grid, block, args, shared = log[1]
    assert grid == (-(-rows // 64), h, batch) and block == A.DQ_CONVERT_THREADS and shared == 0
    assert args[0] is dq and args[1] is accum
    assert args[2:] == (ints[0], padded, h, 0.125, extra[0], extra[2])


def test_the_backward_is_deterministic_where_asked_or_where_torch_is(monkeypatch):
    assert not A._deterministic(False) and A._deterministic(True)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert A._deterministic(False)


def test_head_dim_refusals_name_the_tensor(monkeypatch):
    """v's head dim may differ from q's and k's (o takes it), k's may not; each refusal names
    the tensor (checked on the CPU: the device check set aside)."""
    import functools

    from vitrail.ops import common
    monkeypatch.setattr(A, "check_tensor", functools.partial(common.check_tensor, cuda=False))

    def x(*shape):
        return torch.empty(shape, dtype=torch.bfloat16)
    A.check_call(x(2, 9, 4, 192), x(2, 7, 2, 192), x(2, 7, 2, 128), None, "top_left")
    A.check_call(x(1, 9, 4, 96), x(1, 7, 4, 96), x(1, 7, 4, 32), None, "top_left")
    for q, k, v, error, match in (
            ((2, 9, 4, 192), (2, 7, 2, 128), (2, 7, 2, 128), ArgumentError,
             r"k's head_dim \(dim 3\) must be q's 192, got 128"),
            ((2, 9, 4, 64), (2, 7, 2, 64), (2, 8, 2, 128), ArgumentError,
             r"v \(2, 8, 2, 128\) does not match k \(2, 7, 2, 64\): batch, seqlen and heads"),
            ((2, 9, 4, 64), (2, 7, 2, 64), (2, 7, 2, 72), NotImplementedError,
             "v's head_dim 72 is not supported; supported: a multiple of 16 from 16 to 256"),
            ((2, 9, 4, 264), (2, 7, 2, 264), (2, 7, 2, 64), NotImplementedError,
             "q's and k's head_dim 264 is not supported")):
        with pytest.raises(error, match=match):
            A.check_call(x(*q), x(*k), x(*v), None, "top_left")
    cu = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(ArgumentError, match="k's head_dim"):
        A.attention_varlen(x(9, 4, 64), x(9, 2, 32), x(9, 2, 64), cu, cu, 9, 9)


@pytest.mark.parametrize("d,box,swizzle", [(64, 64, 128), (96, 32, 64), (80, 16, 32),
                                           (256, 64, 128), (160, 32, 64), (240, 16, 32)])
def test_the_tma_boxes_are_the_kernels_swizzle_atoms(monkeypatch, d, box, swizzle):
    """The maps' boxes: chunk(D) elements of D by the rows given, swizzled as wide as a row."""
    seen = {}
    monkeypatch.setattr(A, "tensor_map", lambda t, **kw: seen.update(kw))
    A._map(torch.empty(2, 5, 3, d, dtype=torch.bfloat16), 128)
    assert seen["dims"] == (d, 5, 3, 2) and seen["box"] == (box, 128, 1, 1)
    assert seen["swizzle"] == swizzle


def test_reference_matches_sdpa_on_the_cpu():
    q, k, v = (torch.randn(2, 7, 4, 16, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        o, lse = A.reference(q, k, v, causal=causal)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
        torch.testing.assert_close(o, want.transpose(1, 2))
        assert lse.shape == (2, 4, 7)


def test_the_reference_window_is_flash_attentions():
    """window=(left, right): query i sees keys i + offset - left .. i + offset + right (offset:
    0 top-left, Sk - Sq bottom-right); causal=True is right = 0. Checked against SDPA with the
    boolean mask written out."""
    q = torch.randn(1, 9, 2, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 13, 2, 8, dtype=torch.float64) for _ in range(2))
    for window, alignment in (((2, 1), "top_left"), ((3, None), "bottom_right"),
                              ((None, 0), "top_left"), ((0, 0), "bottom_right")):
        offset = 0 if alignment == "top_left" else 13 - 9
        i, j = torch.arange(9)[:, None], torch.arange(13)[None, :]
        left, right = window
        seen = torch.ones(9, 13, dtype=torch.bool)
        if left is not None:
            seen &= j >= i + offset - left
        if right is not None:
            seen &= j <= i + offset + right
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=seen)
        o, _ = A.reference(q, k, v, window=window, alignment=alignment)
        torch.testing.assert_close(o, want.transpose(1, 2))
    o, _ = A.reference(q, k, v, causal=True, window=(2, None))
    want, _ = A.reference(q, k, v, window=(2, 0))
    torch.testing.assert_close(o, want)


def test_refusals_name_the_argument():
    q = torch.randn(1, 8, 4, 64).to(torch.bfloat16)
    with pytest.raises(Exception, match="q must be on a CUDA device"):
        A.attention(q, q, q)
    for bad in ((1,), (-1, 2), (1.5, 2), "left"):
        with pytest.raises(ArgumentError, match="window must be"):
            A.check_options(False, bad, None)
    with pytest.raises(ArgumentError, match="causal=True is a window's right size of 0"):
        A.check_options(True, (4, 2), None)
    for bad in (0, -1.0, math.inf, "1"):
        with pytest.raises(ArgumentError, match="softcap must be"):
            A.check_options(False, None, bad)
    if not has_gpu():
        return
    q = q.cuda()
    with pytest.raises(Exception, match="multiple of k's and v's"):
        A.attention(q, q[:, :, :3], q[:, :, :3])
    for d in (8, 72, 272):
        with pytest.raises(NotImplementedError, match=f"head_dim {d} is not supported; "
                                                      f"supported: a multiple of 16 from 16"):
            x = torch.randn(1, 8, 4, d, device="cuda", dtype=torch.bfloat16)
            A.attention(x, x, x)
    with pytest.raises(Exception, match="alignment"):
        A.attention(q, q, q, causal=True, alignment="middle")
    x = torch.empty(A.MAX_GRID_YZ + 1, 1, 1, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(Exception, match="batch 65536; split the call"):
        A.attention(x, x, x)


def _qkv(b, sq, sk, h, hk, d, dtype, seed=0, dv=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, sk, hk, dv or d, device="cuda", generator=g).to(dtype)
    return q, k, v


def _check(q, k, v, **kw):
    o, lse = A.attention(q, k, v, return_lse=True, **kw)
    ro, rlse = A.reference(q.double(), k.double(), v.double(), **kw)
    tol = 2e-2 if q.dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(o.double(), ro, rtol=tol, atol=tol)
    finite = rlse.isfinite()
    torch.testing.assert_close(lse.double()[finite], rlse[finite], rtol=1e-3, atol=1e-3)
    assert (lse[~finite] == -math.inf).all() and not o.double()[~finite.transpose(1, 2)].any()


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("sq,sk", [(1, 1), (7, 7), (1000, 1000), (4097, 4097), (128, 1000),
                                   (1000, 128)])
def test_values(dtype, d, sq, sk):
    q, k, v = _qkv(2, sq, sk, 4, 4, d, dtype)
    _check(q, k, v)


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [32, 80, 96, 160])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (77, 77), (300, 300), (77, 300), (300, 77)])
def test_values_at_head_dims_not_a_multiple_of_64(dtype, d, causal, sq, sk):
    """TMA boxes of 32 (D 32, 96, 160) and 16 elements (80) with their swizzles, P V's wgmma
    of CuTe's extended shapes (80, 160), causal and not, Sq != Sk both ways."""
    q, k, v = _qkv(2, sq, sk, 4, 2, d, dtype, seed=d + sq)
    _check(q, k, v, causal=causal)


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,dv", [(192, 128), (128, 64), (64, 128), (96, 32)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", [(1, 1), (77, 300), (300, 77), (1000, 1000)])
def test_values_with_a_v_head_dim_of_its_own(dtype, d, dv, causal, sq, sk):
    """o (B, Sq, H, Dv): P V and the stores Dv wide, V's TMA boxes chunk(Dv) wide, K's chunk(D);
    (192, 128) takes blocks of 128 keys."""
    q, k, v = _qkv(2, sq, sk, 4, 2, d, dtype, seed=d + dv, dv=dv)
    assert A.attention(q, k, v).shape == (2, sq, 4, dv)
    _check(q, k, v, causal=causal)


@needs_hopper
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("sq,sk", [(7, 7), (1000, 1000), (100, 1000), (1000, 100), (4097, 300)])
def test_causal_both_alignments(alignment, sq, sk):
    q, k, v = _qkv(2, sq, sk, 4, 4, 128, torch.bfloat16, seed=1)
    _check(q, k, v, causal=True, alignment=alignment)  # top-left sq > sk: rows see every key;
    # bottom-right sq > sk: the first sq - sk rows see none (zeros, lse -inf)


@needs_hopper
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("sq,sk,window,causal,alignment", [
    (1000, 1000, (100, None), True, "top_left"), (1000, 1000, (0, 0), False, "top_left"),
    (300, 1000, (257, 129), False, "bottom_right"), (1000, 300, (None, 64), False, "top_left"),
    (4097, 4097, (1000, 1000), False, "top_left"), (500, 700, (64, None), True, "bottom_right")])
def test_sliding_windows(d, sq, sk, window, causal, alignment):
    """Windows narrower and wider than a block, off the block grid, one-sided and two-sided,
    with causal, both alignments (rows that see no key: zeros, lse -inf)."""
    q, k, v = _qkv(2, sq, sk, 4, 2, d, torch.bfloat16, seed=13)
    _check(q, k, v, window=window, causal=causal, alignment=alignment)


@needs_hopper
@pytest.mark.parametrize("d,causal,window", [(64, False, None), (128, True, None),
                                              (256, False, (200, 10))])
@pytest.mark.parametrize("softcap", [0.5, 30.0])
def test_softcap(d, causal, window, softcap):
    q, k, v = _qkv(2, 777, 777, 4, 4, d, torch.float16, seed=14)
    _check(q, k, v, causal=causal, window=window, softcap=softcap)


@needs_hopper
@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_gqa(ratio):
    q, k, v = _qkv(2, 300, 500, 8, 8 // ratio, 128, torch.bfloat16, seed=2)
    _check(q, k, v, causal=True)


@needs_hopper
def test_sdpa_layout_without_a_copy_and_a_scale():
    q, k, v = _qkv(2, 256, 256, 4, 4, 64, torch.float16, seed=3)
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not qt.is_contiguous()  # (B, H, S, D) memory, read in place
    _check(qt, kt, vt, scale=0.3)


@needs_hopper
def test_expanded_keys_and_values_are_read_right():
    """k and v broadcast over the batch (stride 0, as expand gives): copied, not refused."""
    q, k, v = _qkv(3, 200, 300, 4, 2, 64, torch.bfloat16, seed=5)
    k, v = k[:1].expand(3, -1, -1, -1), v[:1].expand(3, -1, -1, -1)
    assert k.stride(0) == 0
    _check(q, k, v, causal=True)


def _reference_grads(q, k, v, go, glse, **kw):
    """dq, dk, dv of sum(o * go) + sum(lse * glse) by autograd through the fp64 reference (rows
    that see no key, lse -inf, take no lse gradient)."""
    q, k, v = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    o, lse = A.reference(q, k, v, **kw)
    loss = (o * go.double()).sum()
    if glse is not None:
        loss = loss + (torch.where(lse.isfinite(), lse, 0) * glse.double()).sum()
    loss.backward()
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("b,sq,sk,h,hk,d,causal,alignment,extra", [
    (2, 7, 7, 4, 2, 64, False, "top_left", {}), (1, 33, 17, 6, 2, 32, True, "top_left", {}),
    (1, 17, 33, 6, 3, 32, True, "bottom_right", {}),
    (1, 40, 20, 4, 1, 16, True, "bottom_right", {}),
    (2, 50, 50, 2, 2, 16, True, "top_left", {}),
    (1, 45, 45, 4, 2, 16, True, "top_left", {"window": (6, None)}),
    (1, 30, 50, 2, 1, 16, False, "bottom_right", {"window": (9, 4)}),
    (1, 50, 30, 2, 2, 16, False, "top_left", {"window": (None, 3), "softcap": 2.5}),
    (2, 21, 21, 2, 2, 16, False, "top_left", {"softcap": 0.7}),
    # v's head dim other than q's and k's
    (2, 7, 7, 4, 2, 64, False, "top_left", {"dv": 32}),
    (1, 33, 17, 6, 2, 32, True, "bottom_right", {"dv": 48}),
    (1, 45, 45, 4, 2, 16, True, "top_left", {"window": (6, None), "dv": 32}),
    (1, 50, 30, 2, 2, 48, False, "top_left", {"window": (None, 3), "softcap": 2.5, "dv": 16})])
def test_the_backward_algebra_on_the_cpu(monkeypatch, dtype, b, sq, sk, h, hk, d, causal,
                                         alignment, extra):
    """The backward's blocks (5 query rows each here), GQA, both alignments, sliding windows,
    the softcap, rows that see no key, an lse gradient and v's head dim other than q's, against
    autograd through the fp64 reference."""
    from vitrail.ops.attention import backward
    extra = dict(extra)
    dv = extra.pop("dv", d)
    g = torch.Generator().manual_seed(sq * sk + d)
    q, k, v = (torch.randn(b, s, n, e, generator=g, dtype=torch.float64)
               for s, n, e in ((sq, h, d), (sk, hk, d), (sk, hk, dv)))
    kw = dict(causal=causal, alignment=alignment, **extra)
    o, lse = A.reference(q, k, v, **kw)
    go, glse = torch.randn(o.shape, generator=g), torch.randn(lse.shape, generator=g)
    glse = torch.where(lse.isfinite(), glse, 0).float()
    want = _reference_grads(q, k, v, go, glse, **kw)
    monkeypatch.setattr(backward, "TILE_ELEMENTS", 5 * b * h * sk)
    mask = A.kernel_mask(sq, sk, causal, alignment, extra.get("window"))
    got = backward.attention_backward(go.to(dtype), glse, q.to(dtype), k.to(dtype), v.to(dtype),
                                      o.to(dtype), lse.float(), d ** -0.5, *mask,
                                      extra.get("softcap", 0.0))
    tol = 1e-6 if dtype == torch.float64 else 2e-2  # fp64: the lse passes in fp32
    for x, w, what in zip(got, want, ("dq", "dk", "dv")):
        assert x.shape == w.shape and x.dtype == dtype, what
        torch.testing.assert_close(x.double(), w, rtol=tol, atol=tol * w.abs().max().item(),
                                   msg=lambda m: f"{what}: {m}")


def _check_grads(q, k, v, with_lse=False, deterministic=False, **kw):
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    o, lse = A.attention(q, k, v, return_lse=True, deterministic=deterministic, **kw)
    g = torch.Generator(device="cuda").manual_seed(7)
    go = torch.randn(o.shape, device="cuda", generator=g).to(o.dtype)
    glse = torch.randn(lse.shape, device="cuda", generator=g) if with_lse else None
    loss = (o.float() * go.float()).sum()
    if with_lse:
        glse = torch.where(lse.isfinite(), glse, 0)
        loss = loss + (torch.where(lse.isfinite(), lse, 0) * glse).sum()
    loss.backward()
    want = _reference_grads(q, k, v, go, glse, **kw)
    tol = 2e-2 if q.dtype == torch.bfloat16 else 5e-3
    for x, w, what in zip((q.grad, k.grad, v.grad), want, ("dq", "dk", "dv")):
        assert x.shape == w.shape and x.dtype == q.dtype, what
        torch.testing.assert_close(x.double(), w, rtol=tol, atol=tol * w.abs().max().item(),
                                   msg=lambda m: f"{what}: {m}")


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("sq,sk,causal", [(7, 7, False), (1000, 1000, True), (300, 1000, True),
                                          (1000, 300, False)])
def test_gradients(dtype, d, sq, sk, causal):
    q, k, v = _qkv(2, sq, sk, 4, 4, d, dtype, seed=8)
    _check_grads(q, k, v, causal=causal)


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sq,sk,causal", [(1, 1, False), (77, 300, True), (300, 77, False),
                                          (300, 300, True)])
def test_gradients_at_a_head_dim_without_fused_kernels(dtype, sq, sk, causal):
    """D 96: the forward's kernel, the backward's matmuls (backward.py)."""
    q, k, v = _qkv(2, sq, sk, 4, 2, 96, dtype, seed=16)
    assert not A.fused_backward_runs(q, k, v)
    _check_grads(q, k, v, with_lse=True, causal=causal)


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,dv", [(192, 128), (128, 64), (64, 128), (96, 32)])
@pytest.mark.parametrize("sq,sk,causal", [(77, 300, True), (300, 300, False)])
def test_gradients_with_a_v_head_dim_of_its_own(dtype, d, dv, sq, sk, causal):
    """The backward's matmuls (the fused kernels take Dv = D only), GQA, a loss on the lse."""
    q, k, v = _qkv(2, sq, sk, 4, 2, d, dtype, seed=17, dv=dv)
    assert not A.fused_backward_runs(q, k, v)
    _check_grads(q, k, v, with_lse=True, causal=causal, alignment="bottom_right")


@needs_hopper
@pytest.mark.parametrize("ratio", [1, 4])
def test_gradients_gqa_bottom_right_and_the_lse(ratio):
    """GQA (dk, dv summed over the group), rows that see no key, and a loss on the lse."""
    q, k, v = _qkv(2, 500, 300, 8, 8 // ratio, 128, torch.bfloat16, seed=9)
    _check_grads(q, k, v, with_lse=True, causal=True, alignment="bottom_right")


@needs_hopper
@pytest.mark.parametrize("window,softcap", [((100, None), None), ((50, 20), 5.0), (None, 1.0)])
def test_gradients_with_a_window_and_a_softcap(window, softcap):
    q, k, v = _qkv(2, 600, 700, 4, 2, 128, torch.bfloat16, seed=15)
    _check_grads(q, k, v, with_lse=True, window=window, softcap=softcap,
                 causal=window is not None and window[1] is None, alignment="bottom_right")


@needs_hopper
def test_gradients_in_sdpa_layout_under_torch_compile():
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2)
               for x in _qkv(2, 256, 256, 4, 4, 64, torch.float16, seed=10))
    f = torch.compile(lambda a, b, c: A.attention(a, b, c, causal=True), fullgraph=True)
    qs, ks, vs = (x.detach().requires_grad_(True) for x in (q, k, v))
    f(qs, ks, vs).float().sum().backward()
    want = _reference_grads(q, k, v, torch.ones(q.shape, device="cuda"), None, causal=True)
    for x, w in zip((qs.grad, ks.grad, vs.grad), want):
        torch.testing.assert_close(x.double(), w, rtol=5e-3, atol=5e-3 * w.abs().max().item())


@needs_hopper
@pytest.mark.parametrize("d", A.BWD_HEAD_DIMS)
@pytest.mark.parametrize("causal,extra", [(True, {}), (False, {"window": (300, 40)}),
                                          (True, {"window": (129, None), "softcap": 3.0}),
                                          (False, {"softcap": 0.5})])
def test_the_fused_backward_is_deterministic_and_agrees_with_the_matmul_path(d, causal, extra):
    """Same bits on every run (no atomics), and within rounding of backward.py's matmuls, with
    the diagonal, a window's edges and the softcap."""
    from vitrail.ops.attention.backward import attention_backward
    q, k, v = _qkv(2, 777, 901, 8, 2, d, torch.bfloat16, seed=12)
    o, lse = A.attention(q, k, v, causal=causal, alignment="bottom_right", return_lse=True,
                         **extra)
    go = torch.randn_like(o)
    mask = A.kernel_mask(777, 901, causal, "bottom_right", extra.get("window"))
    args = (go, None, q, k, v, o, lse, d ** -0.5, *mask, extra.get("softcap", 0.0))
    assert A.fused_backward_runs(q, k, v)
    first = torch.ops.vitrail.attention_bwd(*args, True)
    again = torch.ops.vitrail.attention_bwd(*args, True)
    fast = torch.ops.vitrail.attention_bwd(*args)
    plain = attention_backward(*args)
    for x, y, f, z, what in zip(first, again, fast, plain, ("dq", "dk", "dv")):
        assert torch.equal(x, y), what
        for got in (x, f):
            torch.testing.assert_close(got.float(), z.float(), rtol=2e-2,
                                       atol=2e-2 * z.float().abs().max().item(), msg=what)
    # torch's deterministic mode picks the deterministic kernels: the same bits
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        chosen = torch.ops.vitrail.attention_bwd(*args)
    finally:
        torch.use_deterministic_algorithms(was)
    assert all(torch.equal(x, y) for x, y in zip(first, chosen))


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", A.BWD_HEAD_DIMS)
@pytest.mark.parametrize("b,sq,sk,h,hk,causal,alignment,extra", [
    (2, 1000, 1000, 4, 4, True, "top_left", {}), (1, 77, 1000, 8, 2, False, "top_left", {}),
    (2, 1000, 77, 8, 1, True, "bottom_right", {}), (1, 1, 1, 2, 1, False, "top_left", {}),
    (2, 600, 700, 4, 2, True, "bottom_right", {"window": (129, None), "softcap": 3.0}),
    (1, 700, 600, 4, 4, False, "top_left", {"window": (300, 40), "softcap": 0.5})])
def test_the_fast_backward_against_the_reference_and_the_deterministic_one(
        dtype, d, b, sq, sk, h, hk, causal, alignment, extra):
    """The fast backward (the default: dQ summed by atomics in attention_bwd_dkv, written by
    attention_bwd_dq_convert): dq, dk and dv against autograd through the fp64 reference (a loss
    on the lse too) and against the deterministic kernels, with GQA, odd lengths, rows that see
    no key, the diagonal, a window's edges and the softcap; dq's unwritten rows would be NaN."""
    q, k, v = _qkv(b, sq, sk, h, hk, d, dtype, seed=sq + sk + d)
    kw = dict(causal=causal, alignment=alignment, **extra)
    _check_grads(q, k, v, with_lse=True, **kw)
    o, lse = A.attention(q, k, v, return_lse=True, **kw)
    go = torch.randn_like(o)
    mask = A.kernel_mask(sq, sk, causal, alignment, extra.get("window"))
    args = (go, None, q, k, v, o, lse, d ** -0.5, *mask, extra.get("softcap", 0.0))
    fast = torch.ops.vitrail.attention_bwd(*args)
    slow = torch.ops.vitrail.attention_bwd(*args, True)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    for x, y, what in zip(fast, slow, ("dq", "dk", "dv")):
        assert x.isfinite().all(), what
        torch.testing.assert_close(x.float(), y.float(), rtol=tol,
                                   atol=tol * y.float().abs().max().item(), msg=what)
    assert torch.equal(fast[1], slow[1]) and torch.equal(fast[2], slow[2])  # dK, dV: same sums


@needs_hopper
@pytest.mark.parametrize("d", A.BWD_HEAD_DIMS)
def test_the_deterministic_backward_gives_the_same_bits_twice(d):
    """deterministic=True through attention(): the gradients' bits repeat; the default (fast)
    ones agree with them within rounding."""
    q, k, v = _qkv(2, 1000, 1000, 8, 2, d, torch.bfloat16, seed=31)
    go = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)

    def grads(deterministic):
        x = [t.detach().requires_grad_(True) for t in (q, k, v)]
        o = A.attention(*x, causal=True, deterministic=deterministic)
        return torch.autograd.grad(o, x, go)
    first, again, fast = grads(True), grads(True), grads(False)
    for x, y, f, what in zip(first, again, fast, ("dq", "dk", "dv")):
        assert torch.equal(x, y), what
        torch.testing.assert_close(f.float(), x.float(), rtol=2e-2,
                                   atol=2e-2 * x.float().abs().max().item(), msg=what)


@needs_hopper
def test_opcheck():
    q, k, v = _qkv(1, 130, 130, 2, 2, 64, torch.bfloat16, seed=11)
    q.requires_grad_(True)
    torch.library.opcheck(torch.ops.vitrail.attention_fwd.default, (q, k, v, 0.125, True, 0))
    v = torch.randn(1, 130, 2, 32, device="cuda", dtype=torch.bfloat16)  # o 32 wide
    torch.library.opcheck(torch.ops.vitrail.attention_fwd.default, (q, k, v, 0.125, False, 0))


def test_the_benchmark_registers_its_grid():
    from vitrail.ops import load_benchmarks
    from vitrail.ops.attention import benchmarks as b
    entry = load_benchmarks()["attention"]
    assert entry.run is b.run and entry.build is b.build and entry.by_name
    assert len(b.CASES) == 30 and {c[3:5] for c in b.CASES} == {
        (64, 64), (96, 96), (128, 128), (192, 128), (256, 256)}
    assert all(bb * s == 16384 for bb, s, *_ in b.CASES)
    assert b.flops(1, 1024, 1, 64, 64, True) * 2 == b.flops(1, 1024, 1, 64, 64, False) == \
        4 * 1024**2 * 64
    assert b.flops(1, 1024, 1, 192, 128, False) == 2 * 1024**2 * (192 + 128)
    assert b._name(2, 1024, 16, 192, 128, True) == "causal B2 S1024 H16 D192 Dv128"
    assert load_benchmarks()["attention.backward"].run is b.run_backward
    assert b.TRAIN_CASES == b.CASES
    decode = load_benchmarks()["attention.decode"]
    assert decode.run is b.run_decode and decode.build is b.build_decode and decode.by_name
    assert all(h % hk == 0 for _, _, h, hk, _ in b.DECODE_CASES)
    # a case's K and V, bf16, unpaged and in each page size's pool, fit an 80 GB GPU with room
    assert max(2 * 2 * bb * sk * hk * d for bb, sk, _, hk, d in b.DECODE_CASES) * \
        (1 + len(b.DECODE_PAGES)) <= 32 << 30
    assert (32, 65536, 32, 8, 128) in b.DECODE_CASES  # a serving batch at long context


def _sdpa(q, k, v, causal):
    """o (B, Sq, H, Dv) by torch's SDPA in fp32 (causal: top-left), k and v repeated over each
    GQA group."""
    g = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.float().transpose(1, 2) for x in (q, k, v))
    kt, vt = (x.repeat_interleave(g, dim=1) for x in (kt, vt))
    o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    return o.transpose(1, 2)


@pytest.fixture
def three_warpgroups(monkeypatch):
    """D <= 64 on three consumer warpgroups at every length (the default takes them from
    WG3_MIN_ROWS rows), the plans of earlier calls forgotten before and after."""
    from vitrail.plan import clear_all
    monkeypatch.setattr(A, "WG3_MIN_ROWS", 1)
    clear_all()
    yield
    clear_all()


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b,sq,sk,h,hk", [
    (2, 1, 1, 6, 2), (2, 190, 190, 6, 2), (2, 193, 193, 6, 2), (2, 1000, 1000, 6, 2),
    (2, 193, 1000, 6, 6), (2, 1000, 190, 6, 1), (4, 1000, 1000, 16, 4)])  # the last: persistent
def test_three_warpgroups_against_sdpa(dtype, d, causal, b, sq, sk, h, hk, three_warpgroups):
    """The kernel of three consumer warpgroups (192 rows a tile; D 32 and 64): o against torch's
    SDPA in fp32 and the lse against the fp64 reference, lengths not multiples of 192 (a last
    tile of 1 row and of 190), causal and not, GQA and MQA, the grid a CTA per tile and one a
    CTA per SM."""
    assert A.warpgroups(d, d, dtype, rows=sq) == 3
    q, k, v = _qkv(b, sq, sk, h, hk, d, dtype, seed=sq + sk + d)
    o, lse = A.attention(q, k, v, causal=causal, return_lse=True)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    torch.testing.assert_close(o.float(), _sdpa(q, k, v, causal), rtol=tol, atol=tol)
    _, rlse = A.reference(q.double(), k.double(), v.double(), causal=causal)
    torch.testing.assert_close(lse.double(), rlse, rtol=1e-3, atol=1e-3)


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_three_warpgroups_varlen_against_sdpa(dtype, d, causal, three_warpgroups):
    """attention_varlen on the kernel of three consumer warpgroups: each sequence's o against
    SDPA in fp32 (GQA 3), lengths of 1, 190, 193, 1000, 0 and 385 rows and keys."""
    lq, lk = [1, 190, 193, 1000, 0, 385], [1, 193, 190, 1000, 5, 385]
    q, k, v, cq, ck = _varlen_inputs(lq, lk, 6, 2, d, dtype, seed=d + 40)
    o = A.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=causal)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    for i, (n, m) in enumerate(zip(lq, lk)):
        if n == 0:
            continue
        a, c = cq[i].item(), ck[i].item()
        want = _sdpa(q[None, a:a + n], k[None, c:c + m], v[None, c:c + m], causal)[0]
        torch.testing.assert_close(o[a:a + n].float(), want, rtol=tol, atol=tol,
                                   msg=lambda msg, i=i: f"sequence {i}: {msg}")


@needs_hopper
@pytest.mark.parametrize("d,causal,wg3", [(64, True, False), (64, True, True), (128, False, False),
                                         (256, True, False)])
def test_the_ping_pong_changes_no_bit(d, causal, wg3, monkeypatch):
    """The warpgroups taking turns (a ring of three at D 64 where wg3) reorders when each issues
    its products, not what they compute: the op (ping-pong) and the lockstep kernel give the
    same bits."""
    from vitrail.plan import clear_all
    if wg3:
        monkeypatch.setattr(A, "WG3_MIN_ROWS", 1000)
    clear_all()
    q, k, v = _qkv(2, 1000, 1000, 4, 2, d, torch.bfloat16, seed=4)
    o, lse = A.attention(q, k, v, causal=causal, return_lse=True, num_splits=1)  # one pass
    o2, lse2 = torch.empty_like(o), torch.empty_like(lse)
    wg = A.warpgroups(d, rows=1000)
    assert wg == (3 if wg3 else 2)
    A.launch(A.kernel(q.dtype, d, causal, pingpong=False, wg=wg), o2, lse2, q, k, v, 1000, 1000,
             2, d ** -0.5, 0, 0, 0.0, wg=wg)
    clear_all()
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


@needs_hopper
def test_the_persistent_counters_are_left_zero_and_kept_per_stream():
    """The persistent forward's tile counters: kept per stream and left zero by each launch (no
    fill per call), so back-to-back launches agree; another stream gets its own pair."""
    q, k, v = _qkv(4, 1024, 1024, 16, 16, 128, torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert A.persistent_for(1024, 8 * 16 * 4, sms)  # 512 tiles on the persistent grid
    first = A.attention(q, k, v)
    counters = A.tile_counters(q.device)
    torch.cuda.synchronize()
    assert counters.tolist() == [0, 0]
    for _ in range(3):
        assert torch.equal(A.attention(q, k, v), first)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = A.attention(q, k, v)
        assert A.tile_counters(q.device) is not counters
    torch.cuda.synchronize()
    assert torch.equal(other, first) and counters.tolist() == [0, 0]


@needs_hopper
@pytest.mark.parametrize("d,causal,extra", [
    (64, True, {}), (128, False, {}), (96, True, {"window": (300, 0), "softcap": 30.0}),
    (256, False, {})])
def test_the_persistent_grid_changes_no_bit(d, causal, extra):
    """A CTA per SM taking tiles from a counter (the default) computes each tile as a CTA per
    tile does: the same bits, here with more tiles than SMs (several tiles a CTA), causal, a
    window and a softcap, and packed sequences of their own lengths."""
    q, k, v = _qkv(3, 1500, 1700, 8, 2, d, torch.bfloat16, seed=6)
    kw = dict(causal=causal, alignment="bottom_right", **extra)
    o, lse = A.attention(q, k, v, return_lse=True, **kw)
    upper, hi, local, lo = A.kernel_mask(1500, 1700, causal, "bottom_right", extra.get("window"))
    softcap = float(extra.get("softcap", 0.0))
    wg = A.warpgroups(d, rows=1500)  # the op's
    lockstep = A.kernel(q.dtype, d, upper, local=local, softcap=softcap > 0, persistent=False,
                        wg=wg)
    o2, lse2 = torch.empty_like(o), torch.empty_like(lse)
    A.launch(lockstep, o2, lse2, q, k, v, 1500, 1700, 3, d ** -0.5, hi, lo, softcap,
             persistent=False, wg=wg)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    lq, lk = [700, 0, 1, 1500, 129], [900, 3, 0, 1700, 128]
    q, k, v, cq, ck = _varlen_inputs(lq, lk, 8, 2, d, torch.bfloat16, seed=7)
    o, lse = A.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), return_lse=True, **kw)
    upper, hi, local, lo = A.kernel_mask(0, 0, causal, "top_left", extra.get("window"))
    wg = A.warpgroups(d, rows=max(lq))
    lockstep = A.kernel(q.dtype, d, upper, local=local, softcap=softcap > 0, varlen=True,
                        persistent=False, wg=wg)
    o2, lse2 = torch.empty_like(o), torch.empty_like(lse)
    A.launch(lockstep, o2, lse2, q[None], k[None], v[None], max(lq), 0, len(lq), d ** -0.5, hi,
             lo, softcap, cq, ck, bottom_right=True, persistent=False, wg=wg)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


# --------------------------------------------------------------------------- variable lengths
def _cu(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def test_varlen_lengths_are_checked():
    cu = _cu([3, 0, 5])
    assert A._lengths(cu, 8, 5, "q") == [0, 3, 3, 8]
    for bad, total, m, match in ((_cu([3, 5]), 9, 5, "rise from 0 to the 9 rows"),
                                 (torch.tensor([1, 4], dtype=torch.int32), 4, 5, "rise from 0"),
                                 (torch.tensor([0, 4, 2], dtype=torch.int32), 2, 5, "rise"),
                                 (cu, 8, 4, "max_seqlen_q=4 is below the longest")):
        with pytest.raises(ArgumentError, match=match):
            A._lengths(bad, total, m, "q")


@pytest.mark.parametrize("dv", [16, 32])
@pytest.mark.parametrize("causal,alignment,extra", [
    (False, "top_left", {}), (True, "bottom_right", {}), (True, "top_left", {"window": (3, None)}),
    (False, "bottom_right", {"window": (2, 1), "softcap": 1.5})])
def test_varlen_backward_on_the_cpu(causal, alignment, extra, dv):
    """Each sequence's gradient (the op's CPU path: backward.py per sequence) against autograd
    through the fp64 reference, lengths 0 included (no rows; rows but no keys), v's head dim
    q's or another."""
    g = torch.Generator().manual_seed(3)
    lq, lk = [5, 0, 9, 4], [7, 3, 6, 0]
    cq, ck = _cu(lq), _cu(lk)
    q = torch.randn(sum(lq), 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(sum(lk), 2, e, generator=g, dtype=torch.float64, requires_grad=True)
            for e in (16, dv))
    kw = dict(causal=causal, alignment=alignment, **extra)
    o, lse = A.reference_varlen(q, k, v, cq, ck, **kw)
    go, glse = torch.randn(o.shape, generator=g), torch.randn(lse.shape, generator=g)
    glse = torch.where(lse.isfinite(), glse, 0)
    ((o * go).sum() + (torch.where(lse.isfinite(), lse, 0) * glse).sum()).backward()
    upper, hi, local, lo = A.kernel_mask(0, 0, causal, "top_left", extra.get("window"))
    got = torch.ops.vitrail.attention_varlen_bwd(
        go, glse.float(), q.detach(), k.detach(), v.detach(), o.detach(), lse.detach().float(),
        cq, ck, max(lq), max(lk), 16 ** -0.5, upper, hi, local, lo, extra.get("softcap", 0.0),
        alignment == "bottom_right")
    for x, t, what in zip(got, (q, k, v), ("dq", "dk", "dv")):
        torch.testing.assert_close(x, t.grad, rtol=1e-6, atol=1e-6, msg=what)


def _varlen_inputs(lq, lk, h, hk, d, dtype, seed, dv=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lq), h, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(sum(lk), hk, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(sum(lk), hk, dv or d, device="cuda", generator=g).to(dtype)
    return q, k, v, _cu(lq, "cuda"), _cu(lk, "cuda")


@needs_hopper
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal,alignment,extra", [
    (False, "top_left", {}), (True, "top_left", {}), (True, "bottom_right", {}),
    (False, "bottom_right", {"window": (100, 30)}), (True, "top_left", {"softcap": 20.0})])
def test_varlen_values(d, causal, alignment, extra):
    """16 sequences of random lengths up to 1000 (one of none, one of one), GQA 4: o and lse
    against the fp64 reference sequence by sequence, and a row of a 0-key sequence is 0."""
    g = torch.Generator().manual_seed(d)
    lq = [0, 1, *torch.randint(1, 1000, (14,), generator=g).tolist()]
    lk = [5, 0, *torch.randint(1, 1000, (14,), generator=g).tolist()]
    q, k, v, cq, ck = _varlen_inputs(lq, lk, 8, 2, d, torch.bfloat16, seed=d)
    kw = dict(causal=causal, alignment=alignment, **extra)
    o, lse = A.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), return_lse=True, **kw)
    ro, rlse = A.reference_varlen(q.double(), k.double(), v.double(), cq, ck, **kw)
    torch.testing.assert_close(o.double(), ro, rtol=2e-2, atol=2e-2)
    finite = rlse.isfinite()
    torch.testing.assert_close(lse.double()[finite], rlse[finite], rtol=1e-3, atol=1e-3)
    assert (lse[~finite] == -math.inf).all()


@needs_hopper
def test_varlen_gradients_and_opcheck():
    lq, lk = [300, 1, 0, 700], [500, 2, 9, 650]
    q, k, v, cq, ck = _varlen_inputs(lq, lk, 4, 4, 128, torch.bfloat16, seed=21)
    qs, ks, vs = (x.detach().requires_grad_(True) for x in (q, k, v))
    o = A.attention_varlen(qs, ks, vs, cq, ck, 700, 650, causal=True, alignment="bottom_right")
    go = torch.randn_like(o)
    o.backward(go)
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ro, _ = A.reference_varlen(q64, k64, v64, cq, ck, causal=True, alignment="bottom_right")
    ro.backward(go.double())
    for x, w, what in ((qs.grad, q64.grad, "dq"), (ks.grad, k64.grad, "dk"),
                       (vs.grad, v64.grad, "dv")):
        torch.testing.assert_close(x.double(), w, rtol=2e-2, atol=2e-2 * w.abs().max().item(),
                                   msg=what)
    torch.library.opcheck(torch.ops.vitrail.attention_varlen_fwd.default,
                          (qs, ks, vs, cq, ck, 700, 650, 0.1, True, 0, False, 0, 0.0, True))



def test_the_packed_backwards_rows_start_each_sequence_at_a_padded_offset():
    """_varlen_rows: lse2 (lse * log2 e, +inf for a row that sees no key) and delta
    (rowsum(dO * O) - the lse's gradient) of sequence i start at cu_pad[i], a multiple of
    ROWS_PADDED; the rows between sequences hold +inf and 0."""
    g = torch.Generator().manual_seed(5)
    lq = [130, 0, 1, 256, 7]
    cq, h, total = _cu(lq), 3, sum(lq)
    lse = torch.randn(h, total, generator=g)
    lse[1, 3] = -math.inf
    go, o = torch.randn(total, h, 16, generator=g), torch.randn(total, h, 16, generator=g)
    glse = torch.randn(h, total, generator=g)
    lse2, delta, cu_pad = A._varlen_rows(go, glse, o, lse, cq)
    pad = A.ROWS_PADDED
    assert cu_pad.tolist() == [0, 2 * pad, 2 * pad, 3 * pad, 5 * pad, 6 * pad]
    assert lse2.shape[1] % pad == 0 and lse2.shape[1] >= cu_pad[-1]
    rows = (go * o).sum(-1).t() - glse
    want_lse2 = torch.full_like(lse2, math.inf)
    want_delta = torch.zeros_like(delta)
    c = cq.tolist()
    for i, n in enumerate(lq):
        at = cu_pad[i].item()
        want_lse2[:, at:at + n] = lse[:, c[i]:c[i] + n] * math.log2(math.e)
        want_delta[:, at:at + n] = rows[:, c[i]:c[i] + n]
    want_lse2[1, 3] = math.inf  # a row that sees no key: P = 0
    torch.testing.assert_close(lse2, want_lse2)
    torch.testing.assert_close(delta, want_delta)


@needs_hopper
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,alignment,extra", [
    (False, "top_left", {}), (True, "top_left", {}), (True, "bottom_right", {}),
    (False, "bottom_right", {"window": (100, 30)}), (True, "top_left", {"softcap": 20.0})])
def test_the_fused_varlen_backward_matches_the_sequence_by_sequence_one(d, causal, alignment,
                                                                        extra, deterministic):
    """The op's varlen backward (fused_varlen_backward here: one launch per kernel; the fast
    one or the deterministic one) against the sequence-by-sequence one: 12 sequences of random
    lengths (none, one key, one row), GQA 4, the lse's gradient too; on a second run and
    replayed from a CUDA graph (no host synchronization), the same bits (deterministic) or
    the same values within rounding (fast: dq's sums in another order)."""
    g = torch.Generator().manual_seed(d + 7)
    lq = [0, 1, 200, *torch.randint(1, 700, (9,), generator=g).tolist()]
    lk = [5, 0, 1, *torch.randint(1, 700, (9,), generator=g).tolist()]
    q, k, v, cq, ck = _varlen_inputs(lq, lk, 8, 2, d, torch.bfloat16, seed=d + 7)
    kw = dict(causal=causal, alignment=alignment, **extra)
    o, lse = A.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), return_lse=True, **kw)
    gen = torch.Generator(device="cuda").manual_seed(1)
    go = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
    glse = torch.where(lse.isfinite(), torch.randn(lse.shape, device="cuda", generator=gen), 0)
    upper, hi, local, lo = A.kernel_mask(0, 0, causal, "top_left", extra.get("window"))
    args = (go, glse, q, k, v, o, lse, cq, ck)
    opts = (d ** -0.5, upper, hi, local, lo, float(extra.get("softcap", 0.0)),
            alignment == "bottom_right")
    want = A.sequence_by_sequence_backward(*args, *opts)
    got = torch.ops.vitrail.attention_varlen_bwd(*args, max(lq), max(lk), *opts, deterministic)
    for x, w, what in zip(got, want, ("dq", "dk", "dv")):
        torch.testing.assert_close(x.float(), w.float(), rtol=2e-2,
                                   atol=2e-2 * w.abs().max().item(), msg=what)

    def same(a, b):
        if deterministic:
            return torch.equal(a, b)
        return torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2 * b.abs().max().item())
    again = A.fused_varlen_backward(*args, max(lq), max(lk), *opts, deterministic)
    assert all(same(a, b) for a, b in zip(got, again))
    assert torch.equal(got[1], again[1]) and torch.equal(got[2], again[2])  # dK, dV
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = A.fused_varlen_backward(*args, max(lq), max(lk), *opts, deterministic)
    graph.replay()
    torch.cuda.synchronize()
    assert all(same(a, b) for a, b in zip(got, captured))


@needs_hopper
@pytest.mark.parametrize("d,dv", [(192, 128), (64, 128), (96, 32)])
def test_varlen_with_a_v_head_dim_of_its_own(d, dv):
    """o (total_q, H, Dv) and lse against the fp64 reference, the gradients against its
    autograd, and opcheck, with sequences of no rows and of one row."""
    lq, lk = [300, 1, 0, 77], [500, 2, 9, 77]
    q, k, v, cq, ck = _varlen_inputs(lq, lk, 4, 2, d, torch.bfloat16, seed=22, dv=dv)
    kw = dict(causal=True, alignment="bottom_right")
    qs, ks, vs = (x.detach().requires_grad_(True) for x in (q, k, v))
    o, lse = A.attention_varlen(qs, ks, vs, cq, ck, max(lq), max(lk), return_lse=True, **kw)
    assert o.shape == (sum(lq), 4, dv)
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ro, rlse = A.reference_varlen(q64, k64, v64, cq, ck, **kw)
    torch.testing.assert_close(o.double(), ro.detach(), rtol=2e-2, atol=2e-2)
    finite = rlse.isfinite()
    torch.testing.assert_close(lse.double()[finite], rlse.detach()[finite], rtol=1e-3, atol=1e-3)
    go = torch.randn_like(o)
    o.backward(go)
    ro.backward(go.double())
    for x, w, what in ((qs.grad, q64.grad, "dq"), (ks.grad, k64.grad, "dk"),
                       (vs.grad, v64.grad, "dv")):
        assert x.shape == w.shape, what
        torch.testing.assert_close(x.double(), w, rtol=2e-2, atol=2e-2 * w.abs().max().item(),
                                   msg=what)
    torch.library.opcheck(torch.ops.vitrail.attention_varlen_fwd.default,
                          (qs, ks, vs, cq, ck, max(lq), max(lk), d ** -0.5, True, 0, False, 0, 0.0,
                           True))


def _varlen_on_the_cpu(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, causal_offset, local,
                       local_offset, softcap, bottom_right, deterministic=False):
    """attention_varlen's forward as the kernel computes it (o in q's dtype, lse fp32), by the
    fp64 reference sequence by sequence, unmasked (what _split_keys asks of it)."""
    assert not causal and not local and not bottom_right
    o = q.new_empty(q.shape[:2] + v.shape[2:])
    lse = torch.empty(q.shape[1], q.shape[0])
    cq, ck = cu_q.tolist(), cu_k.tolist()
    assert max(b - a for a, b in zip(cq, cq[1:])) <= max_q
    assert max(b - a for a, b in zip(ck, ck[1:])) <= max_k
    for q0, q1, k0, k1 in zip(cq, cq[1:], ck, ck[1:]):
        oz, lz = A.reference(*(t[None].double() for t in (q[q0:q1], k[k0:k1], v[k0:k1])),
                             scale=scale, softcap=softcap or None)
        o[q0:q1], lse[:, q0:q1] = oz[0].to(q.dtype), lz[0].float()
    return o, lse


@pytest.mark.parametrize("b,sq,h,hk,sk,d,dv,splits,extra", [
    (2, 1, 4, 2, 37, 32, 32, 4, {}), (1, 3, 2, 2, 50, 16, 48, 7, {"softcap": 5.0}),
    (3, 1, 2, 1, 3, 16, 16, 8, {"causal": True, "alignment": "bottom_right"}),
    (1, 2, 2, 1, 40, 16, 16, 3, {"scale": 0.3}), (2, 3, 6, 2, 1100, 16, 16, 1, {}),
    (2, 1, 8, 2, 1500, 16, 32, None, {}), (1, 50, 4, 2, 1100, 16, 16, 2, {})])
def test_split_keys_combine_the_chunks_like_one_pass(monkeypatch, b, sq, h, hk, sk, d, dv,
                                                     splits, extra):
    """No mask, gradients recorded: each batch entry's keys in chunks, each a sequence of the
    varlen kernel (here its fp64 reference on the CPU), combined by their log-sum-exps: o and
    lse as one pass over all keys (GQA's heads packed into the rows, one chunk or several, the
    default; rows too many to pack; Dv != D, softcap, more splits than keys, decoding's one row
    with a bottom-right causal mask, which hides no key)."""
    monkeypatch.setattr(A, "_attention_varlen_fwd", _varlen_on_the_cpu)
    calls, split_keys = [], A._split_keys
    monkeypatch.setattr(A, "_split_keys", lambda *a: calls.append(a) or split_keys(*a))
    monkeypatch.setattr(A, "check_call", lambda *a: None)  # CPU tensors (the checks: tests above)
    g = torch.Generator().manual_seed(sk)
    q = torch.randn(b, sq, h, d, generator=g).to(torch.bfloat16).requires_grad_()
    k = torch.randn(b, sk, hk, d, generator=g).to(torch.bfloat16)
    v = torch.randn(b, sk, hk, dv, generator=g).to(torch.bfloat16)
    o, lse = A.attention(q, k, v, num_splits=splits, return_lse=True, **extra)
    ro, rlse = A.reference(q.detach().double(), k.double(), v.double(), **extra)
    assert o.shape == ro.shape and o.dtype == q.dtype and lse.shape == (b, h, sq)
    torch.testing.assert_close(o.detach().double(), ro, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.detach().double(), rlse, rtol=1e-5, atol=1e-5)
    pack = h > hk and sq * h // hk <= A.block_m(d, dv, rows=sq * h // hk) and \
        sk >= A.DECODE_MIN_KEYS
    split = splits > 1 if splits else True  # the default, by splits_for: 1 to 4 tiles
    assert [c[4] for c in calls] == ([pack] if pack or split else [])


@pytest.mark.parametrize("b,sq,h,hk,sk,d,dv,splits,extra", [
    (2, 1, 8, 2, 1500, 16, 32, None, {}), (1, 3, 2, 2, 5000, 16, 48, 7, {"softcap": 5.0}),
    (2, 1, 4, 2, 3000, 32, 32, 4, {"causal": True, "alignment": "bottom_right"}),
    (1, 50, 4, 2, 1100, 16, 16, 2, {}), (2, 3, 6, 2, 1100, 16, 16, 1, {}),
    (3, 1, 2, 1, 300, 16, 16, 2, {"scale": 0.3}), (2, 1, 4, 4, 2000, 16, 16, 3, "bhsd")])
def test_decoding_without_gradients_runs_the_paged_forward(monkeypatch, b, sq, h, hk, sk, d,
                                                           dv, splits, extra):
    """No mask and no gradient: k and v read in place as a cache whose entries hold all their
    keys (the PAGED kernel, here its fp64 meaning on the CPU), GQA's heads packed, the keys in
    chunks of whole blocks, combined (the combination's reference on the CPU): o and lse as the
    reference's; K and V in SDPA's layout (batch 2) split too, with no copy. A plan's general
    path (the eager call records its signature's plan)."""
    from tests.ops.test_attention_kvcache import _paged_run_on_the_cpu
    monkeypatch.setattr(A, "_paged_run", _paged_run_on_the_cpu)
    monkeypatch.setattr(A, "fwd_into", lambda *a: pytest.fail("one pass, not the route"))
    monkeypatch.setattr(A, "_split_keys", lambda *a: pytest.fail("q's rows copied"))
    monkeypatch.setattr(A, "check_call", lambda *a: None)  # CPU tensors (the checks: tests above)
    layout, extra = (extra, {}) if extra == "bhsd" else ("bshd", extra)
    g = torch.Generator().manual_seed(sk)
    q = torch.randn(b, sq, h, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(b, hk, sk, n, generator=g).to(torch.bfloat16).transpose(1, 2)
            if layout == "bhsd" else
            torch.randn(b, sk, hk, n, generator=g).to(torch.bfloat16) for n in (d, dv))
    for _ in range(2):  # the call that records the plan, and one after it (general again here)
        o, lse = A.attention(q, k, v, num_splits=splits, return_lse=True, **extra)
        ro, rlse = A.reference(q.double(), k.double(), v.double(), **extra)
        assert o.shape == ro.shape and o.dtype == q.dtype and lse.shape == (b, h, sq)
        torch.testing.assert_close(o.double(), ro, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse.double(), rlse, rtol=1e-5, atol=1e-5)
        assert A.attention(q, k, v, num_splits=splits, **extra).equal(o)


def test_the_combination_of_chunks_against_its_formula():
    """combine_reference (the combine kernel's reference, its CPU path and its backward): o =
    sum_c exp(lse_c - lse) o_c with lse = log sum_c exp(lse_c), computed here head by head from
    the varlen layout (packed rows s g + j of KV head kv being head kv g + j's row s); a row
    whose chunks saw no key gives zeros and -inf; and the gradients through the op."""
    b, n, sq, g, hk, dv = 2, 3, 2, 2, 3, 8
    gen = torch.Generator().manual_seed(0)
    part = torch.randn(b * n * sq * g, hk, dv, generator=gen, dtype=torch.float64)
    part_lse = torch.randn(hk, b * n * sq * g, generator=gen, dtype=torch.float64)
    part_lse[1, :n * sq * g:sq * g] = -math.inf  # entry 0, row 0 of KV head 1: no key anywhere
    o, lse = A.combine_reference(part, part_lse, b, n, sq, g)
    assert o.shape == (b, sq, hk * g, dv) and lse.shape == (b, hk * g, sq)
    for e, s, kv, j in itertools.product(range(b), range(sq), range(hk), range(g)):
        rows = [(e * n + c) * sq * g + s * g + j for c in range(n)]
        ls = part_lse[kv, rows]
        want_lse = torch.logsumexp(ls, 0)
        assert torch.allclose(lse[e, kv * g + j, s], want_lse) or (
            want_lse == -math.inf and lse[e, kv * g + j, s] == -math.inf)
        want = (torch.zeros(dv, dtype=torch.float64) if want_lse == -math.inf else
                (torch.exp(ls - want_lse)[:, None] * part[rows, kv]).sum(0))
        torch.testing.assert_close(o[e, s, kv * g + j], want)
    assert (o[0, 0, g] == 0).all() and lse[0, g, 0] == -math.inf
    finite = part_lse.clone()
    finite[1] = 0.0
    torch.autograd.gradcheck(lambda p, pl: A._split_combine(p, pl, b, n, sq, g),
                             (part.requires_grad_(), finite.requires_grad_()))


def test_splits_for():
    """The automatic split: none where one pass's CTAs nearly fill the SMs or the keys are too
    few; else chunks of at least SPLIT_MIN_BLOCKS blocks, at most MAX_SPLITS, whose CTAs fill
    one wave nearly full (decoding: few CTAs, many keys)."""
    sms, bn = 132, 128
    for tiles in (106, 128, 132, 288, 500):  # 288: fewer waves split, but its rows copied
        assert A.splits_for(tiles, 1 << 16, bn, sms) == 1, tiles
    for keys in (1, 100, (2 * A.SPLIT_MIN_BLOCKS - 1) * bn):
        assert A.splits_for(8, keys, bn, sms) == 1, keys
    for tiles, keys in itertools.product((8, 16, 32, 64), (1 << 15, 1 << 17)):
        n = A.splits_for(tiles, keys, bn, sms)
        assert 0.8 * sms <= tiles * n <= sms and n <= A.MAX_SPLITS, (tiles, keys, n)
    assert A.splits_for(1, 1 << 24, bn, sms) <= A.MAX_SPLITS
    assert A.splits_for(8, 6 * bn, bn, sms) == 6 // A.SPLIT_MIN_BLOCKS


def test_unhashable_options_get_their_refusal_not_a_type_error(monkeypatch):
    """An eager call looks its plan up by its options before the checks: an option no key can
    hold is still refused by name."""
    K = importlib.import_module("vitrail.ops.attention.kvcache")
    for module in (A, K):  # CPU tensors pass the device checks
        monkeypatch.setattr(module, "check_tensor", lambda *a, **kw: None)
        monkeypatch.setattr(module, "check_same_device", lambda *a, **kw: None)
    q = torch.randn(1, 1, 2, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ArgumentError, match="window must be"):
        A.attention(q, k, k, window=[[4], 0])
    with pytest.raises(ArgumentError, match="num_splits must be"):
        A.attention(q, k, k, num_splits=[2])
    with pytest.raises(ArgumentError, match="window must be"):
        K.attention_kvcache(q, k, k, torch.tensor([8], dtype=torch.int32), window=[[4], 0])


def test_num_splits_is_checked_and_a_masked_call_takes_one_pass(monkeypatch):
    """Where a key is masked, K and V would need a copy, or (by default) the keys are few or the
    rows many, the call is one pass."""
    monkeypatch.setattr(A, "check_call", lambda *a: None)  # CPU tensors
    q = torch.randn(1, 2, 2, 16, dtype=torch.bfloat16)
    k = v = torch.randn(1, 64, 2, 16, dtype=torch.bfloat16)
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(ArgumentError, match="num_splits must be None or an integer >= 1"):
            A.attention(q, k, v, num_splits=bad)
    passes = []
    monkeypatch.setattr(A, "fwd_into", lambda *a: passes.append(a))
    monkeypatch.setattr(A, "_split_keys", lambda *a: pytest.fail("split a masked call"))
    monkeypatch.setattr(A, "paged_into", lambda *a: pytest.fail("split a masked call"))
    for kw in ({"causal": True}, {"causal": True, "alignment": "bottom_right"},
               {"window": (8, 0)}):
        A.attention(q, k, v, num_splits=4, **kw)  # two rows: the diagonal hides keys
    assert len(passes) == 3
    # with gradients, K and V whose (batch, seqlen) rows the varlen kernel cannot read without a
    # copy (SDPA's layout, batch 2): one pass, not a copy of the keys
    kt = torch.randn(2, 2, 64, 16, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    A.attention(torch.randn(2, 1, 4, 16, dtype=torch.bfloat16), kt, kt, num_splits=4)
    assert len(passes) == 4
    # by default, fewer keys than DECODE_MIN_KEYS, or a head's rows more than a tile: one pass,
    # GQA's heads not packed either
    few = torch.randn(2, A.DECODE_MIN_KEYS - 1, 2, 16, dtype=torch.bfloat16)
    A.attention(torch.randn(2, 1, 8, 16, dtype=torch.bfloat16), few, few)
    many = torch.randn(1, A.DECODE_MIN_KEYS, 4, 16, dtype=torch.bfloat16)
    A.attention(torch.randn(1, A.block_m(16, paged=True) + 1, 4, 16, dtype=torch.bfloat16),
                many, many)
    assert len(passes) == 6


@needs_hopper
@pytest.mark.parametrize("b,sq,h,hk,sk,d,splits,extra", [
    (2, 1, 8, 2, 3000, 128, 8, {"causal": True, "alignment": "bottom_right"}),
    (1, 4, 4, 4, 1000, 64, 5, {}), (3, 1, 4, 1, 700, 64, 16, {"softcap": 30.0}),
    (2, 1, 32, 8, 5000, 128, None, {}), (1, 3, 8, 2, 2000, 64, 1, {}),
    (1, 1, 16, 16, 20000, 128, None, {})])
def test_split_keys_on_the_gpu(b, sq, h, hk, sk, d, splits, extra):
    """num_splits > 1 against one pass and the fp64 reference: o, lse and the gradients of q, k
    and v through the varlen kernels' backward and the combination's."""
    g = torch.Generator(device="cuda").manual_seed(sk)
    q, k, v = (torch.randn(b, s, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
               .requires_grad_() for s, n in ((sq, h), (sk, hk), (sk, hk)))
    o, lse = A.attention(q, k, v, num_splits=splits, return_lse=True, **extra)
    one, one_lse = A.attention(q, k, v, return_lse=True, **extra)
    ro, rlse = A.reference(q.double(), k.double(), v.double(), **extra)
    torch.testing.assert_close(o.double(), ro, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(o.float(), one.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double(), rlse, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # the PAGED forward over k and v in place (its plan's general path),
        for _ in range(2):  # then the plan
            o2, lse2 = A.attention(q, k, v, num_splits=splits, return_lse=True, **extra)
            torch.testing.assert_close(o2.double(), ro, rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(lse2.double(), rlse, rtol=1e-4, atol=1e-4)
    go = torch.randn(o.shape, device="cuda", generator=g, dtype=o.dtype)
    got = torch.autograd.grad(o, (q, k, v), go)
    want = torch.autograd.grad(ro, (q, k, v), go.double())
    for x, w, what in zip(got, want, "qkv"):
        torch.testing.assert_close(x.double(), w.double(), rtol=2e-2,
                                   atol=2e-2 * w.abs().max().item(),
                                   msg=lambda m, what=what: f"d{what}: {m}")


@needs_hopper
def test_decoding_under_torch_compile_and_a_cuda_graph():
    """The packed and split decoding path (varlen forward, combination) traced whole by
    torch.compile and replayed from a CUDA graph: the eager values."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, s, n, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
               for s, n in ((1, 16), (9000, 4), (9000, 4)))
    want, want_lse = A.attention(q, k, v, return_lse=True)
    f = torch.compile(lambda a, b, c: A.attention(a, b, c, return_lse=True), fullgraph=True)
    for got, lse in (f(q, k, v), f(q, k, v)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = A.attention(q, k, v)
    q.copy_(torch.randn(q.shape, device="cuda", generator=gen))
    graph.replay()
    torch.testing.assert_close(out, A.attention(q, k, v), rtol=0, atol=0)


def _plans(plans) -> int:
    """The plans (not GENERAL) a family holds."""
    return sum(p is not GENERAL for p in plans._plans.values())


@needs_hopper
@pytest.mark.parametrize("case", ["one pass", "decoding", "decoding sdpa layout", "gqa lse",
                                  "gqa rows"])
def test_an_eager_call_records_its_plan_at_its_second_call_and_runs_it_after(case):
    """An eager call without gradients records its signature's plan at the signature's second
    call (no torch op but the outputs' and scratch allocations, nothing made per call; the first
    runs unrecorded), and the next call runs it: the same bits, the outputs new tensors, on new
    inputs too."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    b, sq, h, hk, sk, d = {"one pass": (2, 300, 4, 2, 700, 64),
                           "decoding": (4, 1, 32, 8, 5000, 128),
                           "decoding sdpa layout": (2, 1, 8, 8, 3000, 64),
                           "gqa lse": (2, 1, 16, 2, 9000, 128),
                           "gqa rows": (2, 3, 16, 2, 9000, 128)}[case]  # q's rows copied
    q = torch.randn(b, sq, h, d, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(b, hk, sk, d, device="cuda", generator=gen, dtype=torch.bfloat16)
            .transpose(1, 2) if "sdpa" in case else
            torch.randn(b, sk, hk, d, device="cuda", generator=gen, dtype=torch.bfloat16)
            for _ in range(2))
    kw = {"return_lse": True} if "lse" in case else {"causal": case == "one pass"}
    before = _plans(A.PLANS)
    first = A.attention(q, k, v, **kw)
    assert _plans(A.PLANS) == before, A.PLANS  # seen once: not recorded
    recorded = A.attention(q, k, v, **kw)
    assert _plans(A.PLANS) == before + 1, A.PLANS
    again = A.attention(q, k, v, **kw)
    for x, y, z in zip(*((first, recorded, again) if "lse" in case else
                         ((first,), (recorded,), (again,)))):
        assert torch.equal(x, y) and torch.equal(x, z) and x.data_ptr() != z.data_ptr()
    q2 = torch.randn_like(q)
    want = A.reference(q2.double(), k.double(), v.double(), causal=case == "one pass")
    got = A.attention(q2, k, v, **kw)
    got = got if "lse" in case else (got, None)
    torch.testing.assert_close(got[0].double(), want[0], rtol=2e-2, atol=2e-2)
    if got[1] is not None:
        torch.testing.assert_close(got[1].double(), want[1], rtol=1e-4, atol=1e-4)
    assert _plans(A.PLANS) == before + 1


@needs_hopper
@pytest.mark.parametrize("dtype,dv,g", [(torch.bfloat16, 48, 4), (torch.float16, 128, 1),
                                        (torch.bfloat16, 256, 2)])
def test_the_combine_kernel_matches_its_reference(dtype, dv, g):
    """smxx_attention_combine.cuh against combine_reference, rows that saw no key included."""
    b, n, sq, hk = 3, 5, 2, 3
    gen = torch.Generator(device="cuda").manual_seed(dv)
    part = torch.randn(b * n * sq * g, hk, dv, device="cuda", generator=gen).to(dtype)
    part_lse = 4 * torch.randn(hk, b * n * sq * g, device="cuda", generator=gen)
    part_lse[0, 1::7] = -math.inf  # some chunks without keys
    part_lse[2, :n * sq * g:sq * g] = -math.inf  # a row without any
    o, lse = A._split_combine(part, part_lse, b, n, sq, g)
    ro, rlse = A.combine_reference(part.double(), part_lse.double(), b, n, sq, g)
    torch.testing.assert_close(o.double(), ro, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse.double(), rlse, rtol=1e-5, atol=1e-5)
    assert o.dtype == dtype and lse.isneginf().sum() == rlse.isneginf().sum() > 0


@pytest.mark.parametrize("dtype,dv", [(torch.bfloat16, 48), (torch.float16, 256)])
def test_the_combine_kernel_compiles_for_sm90a(dtype, dv):
    """Split-KV's combination (a 6-lane and a 32-lane row) builds, without spills."""
    from vitrail.jit import compiler
    entry, _ = compiler.build_entry(A.combine_source(dtype, dv), name="attention_split_combine",
                                    backend="nvrtc", arch="90a", include_dirs=[A.HERE])
    res = entry.meta["resources"]["attention_split_combine"]
    assert res["spill_stores"] == 0 and res["stack"] == 0, res
