"""sympow, sympow_mma and mma_sympow_bwd against the explicit tensor-power reference.

CPU: the reference's math (order, the inner-product identity), the kernels' index tables
replayed in torch, argument errors, fake implementations, compile-only builds for sm_90a.
GPU: every op against the reference on fresh random inputs (NaN-poisoned outputs, odd sizes,
non-contiguous inputs, every dtype, powers 1-4, several d and d_tile), gradients against autograd
through the reference, opcheck, torch.compile(fullgraph=True), peak memory of the fused paths.
"""
from __future__ import annotations

import importlib
import math

import pytest
import torch

from tests.conftest import requires_gpu, requires_nvrtc
from vitrail.jit.errors import ArgumentError
from vitrail.ops.sympow.reference import (
    mma_sympow_bwd_reference,
    multiplicity,
    sympow_dim,
    sympow_mma_reference,
    sympow_reference,
)

pytestmark = pytest.mark.warm_cache  # GPU tests share --kernel-cache (one compile per module)

S = importlib.import_module("vitrail.ops.sympow")
configs = importlib.import_module("vitrail.ops.sympow.configs")
F64 = torch.float64


def test_the_gradient_rules_step_is_the_python_backwards_call(monkeypatch):
    """sympow's C++ gradient rule: its one step (what the C++ autograd node calls without
    Python) is the backward kernel's front call that the rule's Python backward makes where no
    graph of the gradients is asked for, with the same arguments; no rule off the last dim."""
    from vitrail.plan.native import ARG, GRAD, INPUT, VALUE
    S = importlib.import_module("vitrail.ops.sympow")
    calls = []
    monkeypatch.setattr(S, "_sympow_bwd", lambda *a: calls.append(a) or torch.zeros(()))
    x, dz = torch.randn(2, 5, 64), torch.randn(2, 5, 2304)
    assert S._sympow_rule(x, 2, 8, dim=1) is None
    backward, spec, inputs, name, steps = S._sympow_rule(x, 2, 8, -1, False)
    assert name == "vitrail::SympowBackward" and inputs == (0,)
    args = [v if kind == VALUE else {INPUT: x, GRAD: dz}[kind] for kind, v in spec]
    with torch.no_grad():
        backward(*args)
    (fn, fn_args, gradient), = steps
    assert gradient == 0 and fn is S._sympow_bwd
    fn(*(args[v] if kind == ARG else v for kind, v in fn_args))
    assert calls == [(x, dz, 2, 8, False)] * 2


# ------------------------------------------------------------------ CPU: the math
def test_order_matches_the_definition():
    x = torch.randn(3, 4, dtype=F64)
    z = sympow_reference(x, 2, d_tile=2)
    a, b = x[:, :2], x[:, 2:]
    outer = lambda u, v: (u[:, :, None] * v[:, None, :]).flatten(1)
    want = torch.cat([outer(a, a), math.sqrt(2) * outer(a, b), outer(b, b)], dim=1)
    torch.testing.assert_close(z, want)
    assert z.shape[1] == sympow_dim(4, 2, 2) == 12
    assert multiplicity((0, 0, 1, 2)) == 12 and multiplicity((1, 1, 1)) == 1


@pytest.mark.parametrize("power,d,d_tile", [(1, 16, 4), (2, 16, 1), (2, 32, 8), (3, 12, 2),
                                            (3, 16, 4), (4, 8, 1), (4, 16, 4)])
def test_inner_product_identity(power, d, d_tile):
    x, y = torch.randn(5, d, dtype=F64), torch.randn(5, d, dtype=F64)
    zx, zy = sympow_reference(x, power, d_tile), sympow_reference(y, power, d_tile)
    assert zx.shape[-1] == sympow_dim(d, power, d_tile)
    torch.testing.assert_close((zx * zy).sum(-1), (x * y).sum(-1) ** power)


def _replay_forward(x, power, d_tile, dc):
    """What sympow_fwd computes, from its group table, in torch."""
    gidx, gcoef, _, _ = configs.tables(x.shape[-1], power, d_tile, dc, "cpu")
    cols = []
    for packed, coef in zip(gidx.tolist(), gcoef.tolist()):
        packed &= 0xFFFFFFFF
        v = torch.full(x.shape[:-1], coef, dtype=x.dtype)
        for l in range(power - 1):
            v = v * x[..., (packed >> (8 * l)) & 255]
        last = packed >> 24
        cols += [v * x[..., last + b] for b in range(d_tile)]
    return torch.stack(cols, -1)


def _factor_grads(x, dz, power, d_tile, dc):
    """(tuple j, factor l, first feature of l's tile, the gradient of tuple j's block with
    respect to factor l [rows, d_tile]) from the kernels' tuple table, in torch."""
    _, _, tidx, tcoef = configs.tables(x.shape[-1], power, d_tile, dc, "cpu")
    t, block = d_tile, d_tile ** power
    for j, (packed, coef) in enumerate(zip(tidx.tolist(), tcoef.tolist())):
        packed &= 0xFFFFFFFF
        starts = [(packed >> (8 * l)) & 255 for l in range(power)]
        frags = [x[:, s:s + t] for s in starts]
        g = dz[:, j * block:(j + 1) * block].reshape((-1,) + (t,) * power)
        for l in range(power):
            v = g * coef
            for m in range(power):
                if m != l:
                    shape = [1] * (power + 1)
                    shape[0], shape[m + 1] = -1, t
                    v = v * frags[m].reshape(shape)
            dims = [i + 1 for i in range(power) if i != l]
            yield j, l, starts[l], v.sum(dims) if dims else v


def _replay_backward(x, dz, power, d_tile, dc):
    """What sympow_bwd computes, from its tuple table, in torch."""
    dx = torch.zeros_like(x)
    for _, _, start, grad in _factor_grads(x, dz, power, d_tile, dc):
        dx[:, start:start + d_tile] += grad
    return dx


def _replay_gather(x, dz, power, d_tile, dc):
    """What sympow_bwd_gather computes, from its tuple table and slots table, in torch."""
    slots, entries = configs.gather_slots(x.shape[-1], power, d_tile, "cpu")
    t, ld = d_tile, configs.part_ld(power, d_tile)
    n_tuples = configs.tables(x.shape[-1], power, d_tile, dc, "cpu")[2].numel()
    part = torch.full((x.shape[0], n_tuples * ld), float("nan"), dtype=x.dtype)
    for j, l, _, grad in _factor_grads(x, dz, power, d_tile, dc):
        part[:, j * ld + l * t:j * ld + (l + 1) * t] = grad
    dx = torch.zeros_like(x)
    for u in range(x.shape[1] // t):
        for a in range(t):
            dx[:, u * t + a] = part[:, slots[u] + a].sum(-1)
    assert slots.shape == (x.shape[1] // t, entries)
    return dx


@pytest.mark.parametrize("power,d,d_tile", [(1, 8, 2), (2, 8, 1), (2, 16, 4), (3, 8, 2),
                                            (4, 8, 2)])
@pytest.mark.parametrize("dc", [True, False])
def test_kernel_tables_reproduce_the_reference(power, d, d_tile, dc):
    torch.manual_seed(power * 10 + d + d_tile)
    x = torch.randn(3, d, dtype=F64)
    tol = {"rtol": 1e-5, "atol": 1e-5}  # the tables hold float32 coefficients
    torch.testing.assert_close(_replay_forward(x, power, d_tile, dc),
                               sympow_reference(x, power, d_tile, duplicate_correction=dc), **tol)
    xr = x.clone().requires_grad_(True)
    z = sympow_reference(xr, power, d_tile, duplicate_correction=dc)
    dz = torch.randn_like(z)
    (want,) = torch.autograd.grad(z, xr, dz)
    torch.testing.assert_close(_replay_backward(x, dz, power, d_tile, dc), want, **tol)
    torch.testing.assert_close(_replay_gather(x, dz, power, d_tile, dc), want, **tol)


WG_FAST = [(2, 16, 8), (2, 32, 16), (3, 8, 4), (3, 16, 8), (4, 8, 4)]  # d_tile**power % 64 == 0


def _tuple_table(d, P, t):
    """The tuple table the kernels read (configs.tables, duplicate correction on): each tuple's
    factors' first features (bytes 0 .. P-1 of its packed word), and its coefficients."""
    _, _, tidx, tcoef = configs.tables(d, P, t, True, "cpu")
    return [[(v & 0xFFFFFFFF) >> (8 * l) & 255 for l in range(P)] for v in tidx.tolist()], tcoef


@pytest.mark.parametrize("power,d,d_tile", WG_FAST)
def test_wgmma_fragment_maps_reproduce_the_reference(power, d, d_tile):
    """sm90_sympow_mma.cuh's index math, replayed: expand K builds fragment element (k-step s,
    half h, lane q, element j) of k-block kt from input features start + U + R + slot (bit fields
    of the feature's offset in its tuple); expand M multiplies fixed input rows per fragment row
    and feeds k-block columns in the KPerm order. Both must give the expansion's values."""
    torch.manual_seed(power + d + d_tile)
    t, P = d_tile, power
    logt, block = t.bit_length() - 1, t ** power
    lo = lambda l: (P - 1 - l) * logt  # noqa: E731
    ctm = lambda l: (0x39 >> lo(l)) & (t - 1)  # noqa: E731
    starts, tcoef = _tuple_table(d, P, t)
    x = torch.randn(3, d, dtype=F64)
    z = sympow_reference(x, P, t)
    got = torch.full_like(z, float("nan"))
    for kt in range(z.shape[1] // 64):
        tu, e0 = divmod(kt * 64, block)
        for s in range(4):
            for h in range(2):
                for q in range(4):
                    for j in range(2):
                        ct = 16 * s + 8 * h + j
                        v = tcoef[tu].item()
                        for l in range(P):
                            off = starts[tu][l] + ((e0 >> lo(l)) & (t - 1)) + \
                                ((2 * q >> lo(l)) & (t - 1))
                            c = (ct >> lo(l)) & (t - 1)
                            assert c & ~ctm(l) == 0
                            v = v * x[:, off + c]
                        got[:, kt * 64 + 16 * s + 8 * h + 2 * q + j] = v
    torch.testing.assert_close(got, z)
    kperm = [16 * ((p >> 1) & 3) + 4 * (p >> 4) + 2 * ((p >> 3) & 1) + (p & 1) for p in range(64)]
    assert sorted(kperm) == list(range(64))
    assert all(kperm[r + 32] == kperm[r] + 8 for r in range(32))  # KPerm::STEP (TileStream)
    for s in range(4):  # load_cols: lane q's 16 columns from 16 q; word 2 s + h: step s, half h
        for h in range(2):
            for q in range(4):
                for j in range(2):
                    assert 16 * q + 2 * (2 * s + h) + j == kperm[16 * s + 8 * h + 2 * q + j]
    a = torch.randn(d, 64, dtype=F64)  # one k-block of columns
    zm = sympow_reference(a, P, t, dim=0)
    gm = torch.full_like(zm, float("nan"))
    for fw in range(0, zm.shape[0], 64):
        tu = fw // block
        for r in range(64):  # r = 16 * warp + lane // 4 + 8 * h'
            e = fw - tu * block + r
            v = torch.full((64,), tcoef[tu].item(), dtype=F64)
            for l in range(P):
                v = v * a[starts[tu][l] + ((e >> lo(l)) & (t - 1))]
            gm[fw + r] = v[kperm]  # wgmma position pos holds column kperm[pos]
    torch.testing.assert_close(gm, zm[:, kperm])


@pytest.mark.parametrize("power,d,d_tile", WG_FAST)
def test_wgmma_bwd_contraction_reproduces_the_reference(power, d, d_tile):
    """mma_sympow_bwd_k_wg's contraction, replayed: lane q of a quad holds accumulator columns
    8 j + 2 q + jj of each k-block of G; it loads its factors' values (load_factors), sums
    G * prod_{o != l} x[o] per slot, adds the quad's partial sums by shuffles where factor l's
    field leaves lane bits out (covers), and owner(u) alone adds digit u into dx. Each feature
    of dx must be added by one lane per k-block, and the sums must give sympow's gradient."""
    torch.manual_seed(power + d + d_tile + 1)
    t, P = d_tile, power
    logt, block = t.bit_length() - 1, t ** power
    lo = lambda l: (P - 1 - l) * logt  # noqa: E731
    ctm = lambda l: (0x39 >> lo(l)) & (t - 1)  # noqa: E731
    covers = lambda l, bit: lo(l) <= bit < lo(l) + logt  # noqa: E731
    owner = lambda u: ((u >> 1) & 1) | ((u & 1) << 1) if t == 4 else (u >> 1) & 3  # noqa: E731
    starts, tcoef = _tuple_table(d, P, t)
    x = torch.randn(3, d, dtype=F64)
    D = sympow_dim(d, P, t)
    G = torch.randn(3, D, dtype=F64)
    dx = torch.zeros_like(x)
    for kt in range(D // 64):
        tu, e0 = divmod(kt * 64, block)
        coef = tcoef[tu].item()
        gr = {}  # (q, l, slot) -> this lane's partial sums (per row)
        for q in range(4):
            for j in range(8):
                for jj in range(2):
                    ct = 8 * j + jj
                    g = G[:, kt * 64 + ct + 2 * q]
                    xs = []
                    for l in range(P):
                        c = (ct >> lo(l)) & (t - 1)
                        assert c & ~ctm(l) == 0
                        off = starts[tu][l] + (((e0 + 2 * q) >> lo(l)) & (t - 1))
                        xs.append((c, x[:, off + c]))
                    for l in range(P):
                        v = g
                        for o in range(P):
                            if o != l:
                                v = v * xs[o][1]
                        key = (q, l, xs[l][0])
                        gr[key] = gr.get(key, 0) + v
        for bit, flip in ((1, 1), (2, 2)):  # the shuffles, in the kernel's order
            gr = {(q, l, c): v + (0 if covers(l, bit) else gr[(q ^ flip, l, c)])
                  for (q, l, c), v in gr.items()}
        writers = {}
        for (q, l, c), total in gr.items():
            base = ((e0 + 2 * q) >> lo(l)) & (t - 1)
            if owner(base + c) == q:
                feat = starts[tu][l] + base + c
                assert writers.setdefault((feat, l), q) == q
                dx[:, feat] += coef * total
        by_feature = {}
        for (feat, _), q in writers.items():
            assert by_feature.setdefault(feat, q) == q, "two lanes add into one feature"
    xr = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(sympow_reference(xr, P, t), xr, G)
    torch.testing.assert_close(dx, want, rtol=1e-5, atol=1e-5)  # (float32 coefficients)


def test_quarter_backward_reproduces_the_reference():
    """sympow_bwd_quarter (p=4, d_tile=4), replayed: 16-byte chunk c of a round lands at item
    q // 4, quarter q % 4 (q = c // 8) of the padded stage; thread k of an item takes the
    quarter with first digit k as a 3-factor block scaled by the coefficient: factor 0's digit
    k gets <its factor-3 gradient, x3>, factors 1-3 get x0[k] times theirs, added over k."""
    torch.manual_seed(44)
    d, P, t = 12, 4, 4
    block, q_ld = t ** P, t ** P // 4 + 8  # elements; Q_LD for 2-byte types
    for c in range(64 * block // 8):  # the stage's chunk map is the quarter layout, padded
        q, cc = divmod(c, block // 4 // 8)
        item, k = divmod(q, 4)
        assert c * 8 == item * block + k * 64 + cc * 8
        assert (item * 4 * q_ld + k * q_ld + cc * 8) % 8 == 0
    starts, tcoef = _tuple_table(d, P, t)
    x = torch.randn(2, d, dtype=F64)
    D = sympow_dim(d, P, t)
    dz = torch.randn(2, D, dtype=F64)
    dx = torch.zeros_like(x)
    for j, st in enumerate(starts):
        coef = tcoef[j].item()
        xs = [x[:, s:s + t] for s in st]
        g = dz[:, j * block:(j + 1) * block].reshape(-1, t, t, t, t)
        for k in range(t):
            gq = g[:, k]  # [rows, a1, a2, b]: the quarter a0 = k
            g1 = coef * torch.einsum("rabc,rb,rc->ra", gq, xs[2], xs[3])
            g2 = coef * torch.einsum("rabc,ra,rc->rb", gq, xs[1], xs[3])
            g3 = coef * torch.einsum("rabc,ra,rb->rc", gq, xs[1], xs[2])
            dx[:, st[0] + k] += (g3 * xs[3]).sum(-1)
            for l, gl in ((1, g1), (2, g2), (3, g3)):
                dx[:, st[l]:st[l] + t] += xs[0][:, k:k + 1] * gl
    xr = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(sympow_reference(xr, P, t), xr, dz)
    torch.testing.assert_close(dx, want, rtol=1e-5, atol=1e-5)  # (float32 coefficients)


def test_mma_references_agree_with_autograd():
    a, b = torch.randn(2, 5, 8, dtype=F64), torch.randn(2, sympow_dim(8, 2, 2), 3, dtype=F64)
    ar = a.clone().requires_grad_(True)
    c = sympow_mma_reference(ar, b, -1, 2, 2, scale_a=0.5)
    g = torch.randn_like(c)
    (want,) = torch.autograd.grad(c, ar, g)
    got = mma_sympow_bwd_reference(g, b.transpose(1, 2), a, -1, 2, 2, scale_a=0.5)
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------------ CPU: errors, fakes
@pytest.mark.parametrize("kwargs,message", [
    (dict(power=5), "power must be an int from 1 to 4"),
    (dict(power=2, d_tile=3), "d_tile must be one of"),
    (dict(power=2, d_tile=5, d=10), "d_tile must be one of"),
    (dict(power=2, d=512), "1 to 256 features"),
    (dict(power=2, d_tile=8, d=36), "must divide"),
    (dict(power=4, d_tile=8), "over the kernels' limit of 512; use d_tile <= 4"),
])
def test_unsupported_problems_are_refused_clearly(kwargs, message):
    d = kwargs.pop("d", 64)
    with pytest.raises(ArgumentError, match=message):
        configs.check_support("sympow", d, kwargs.pop("power"), kwargs.pop("d_tile", 1))


def test_bad_tensors_are_named():
    with pytest.raises(ArgumentError, match="sympow: x must be on a CUDA device"):
        S.sympow(torch.randn(4, 16), 2)
    with pytest.raises(ArgumentError, match="sympow_mma: a must be on a CUDA device"):
        S.sympow_mma(torch.randn(2, 4, 16), torch.randn(2, 136, 8), -1, 2)


def test_fake_implementations_give_shapes():
    x = torch.empty(3, 5, 64, device="meta", dtype=torch.bfloat16)
    assert torch.ops.vitrail.sympow(x, 2, 8, True).shape == (3, 5, 2304)
    assert torch.ops.vitrail.sympow_bwd(x, x.new_empty(3, 5, 2304), 2, 8, True).shape == x.shape
    a = torch.empty(4, 100, 64, device="meta")
    b = torch.empty(4, 2304, 32, device="meta")
    assert torch.ops.vitrail.sympow_mma(a, b, -1, 2, 8, 1.0, True).shape == (4, 100, 32)
    a2 = torch.empty(4, 64, 100, device="meta")
    b2 = torch.empty(4, 100, 32, device="meta")
    assert torch.ops.vitrail.sympow_mma(a2, b2, -2, 2, 8, 1.0, True).shape == (4, 2304, 32)
    g = torch.empty(4, 100, 32, device="meta")
    assert torch.ops.vitrail.mma_sympow_bwd(g, b.transpose(1, 2), a, -1, 2, 8, 1.0,
                                            True).shape == a.shape


@pytest.mark.slow
@requires_nvrtc
@pytest.mark.parametrize("dtype,power,d_tile", [(torch.bfloat16, 2, 8), (torch.float32, 4, 4),
                                                (torch.float16, 3, 2), (torch.float16, 4, 4),
                                                (torch.bfloat16, 3, 8), (torch.float32, 2, 2)])
def test_kernels_build_for_sm90a_without_spills(dtype, power, d_tile):
    """Each kernel states its CTAs per SM (__launch_bounds__), so ptxas allocates registers
    against that budget: no spills on the NVRTC installed, and CI runs this again with the
    newest one pyproject.toml admits (VITRAIL_NVRTC)."""
    kinds = ["elementwise", "mma"] + (["mma90"] if configs.wgmma_supports(dtype, power, d_tile)
                                      else [])
    for kind in kinds:
        op = S.variant_op(kind, dtype, power, d_tile)
        config = op.space.default({"vec": 8 if dtype != torch.float32 else 4}, _lim())
        res = op.module(config).resources()
        assert res and all(r.spill_stores == 0 and r.stack == 0 for r in res.values()), res


def _lim():
    from vitrail.tune import limits
    return limits()


def test_launch_grid_orders_and_limits():
    """Tiles fastest: one dimension (P * tiles, as cta_tile decodes it); P fastest, or where the
    product is over gridDim.x's limit: (P, tiles0, tiles1); both decode to the same CTAs."""
    assert configs.launch_grid(64, 18, 1, "tiles") == (1152, 1, 1)
    assert configs.launch_grid(70000, 2, 3, "tiles") == (420000, 1, 1)
    assert configs.launch_grid(64, 18, 1, "p") == (64, 18, 1)
    assert configs.launch_grid(1 << 20, 1 << 12, 1, "tiles") == (1 << 20, 1 << 12, 1)

    def decode(grid, block, tiles0, tiles1):  # cta_tile, in Python
        x, y, z = block
        if grid[1] == grid[2] == 1:
            per = tiles0 * tiles1
            p, t = divmod(x, per)
            return p, t // tiles1, t % tiles1
        return x, y, z
    P, t0, t1 = 5, 3, 2
    want = {(p, i, j) for p in range(P) for i in range(t0) for j in range(t1)}
    for order in configs.LAUNCH_ORDERS:
        g = configs.launch_grid(P, t0, t1, order)
        got = [decode(g, (x, y, z), t0, t1) for z in range(g[2]) for y in range(g[1])
               for x in range(g[0])]
        assert sorted(got) == sorted(want)
        if order == "tiles":  # a problem's tiles launched together
            assert [p for p, _, _ in got] == sorted(p for p, _, _ in got)
    with pytest.raises(ArgumentError, match="launch order"):
        configs.launch_grid(4, 1, 1, "rows")
    with pytest.raises(ArgumentError, match="grid"):
        configs.launch_grid(4, 70000, 1, "p")
    with pytest.raises(ArgumentError, match="warpgroups"):
        configs.state_wgs(2, 4)


def test_state_side_takes_the_tma_mainloop_where_it_applies():
    """The expand-M kernel's TMA mainloop: 3 warpgroups and K a multiple of 64 (b's view steps
    16 rows, a k-block never reaches the next problem's rows); cp.async for the rest."""
    assert configs.state_tma(4096, 3) and configs.state_tma(64, 3)
    assert not configs.state_tma(1000, 3) and not configs.state_tma(130, 3)
    assert not configs.state_tma(4096, 2)


def test_wgmma_variants_are_the_configs_and_the_heuristic_keeps_the_measured_ones():
    """The wgmma kernels' launch order, expand-K mainloop and backward kernel are parameters of
    their space (PickBest times them); the heuristic takes tiles fastest, TMA and the deferred
    sums; the sm80 kernels' space is unchanged."""
    from vitrail.tune import limits
    lim = limits(arch="90a")
    assert dict(configs.MMA90.default(None, lim)) == {"THREADS": configs.MMA_THREADS,
                                                      "ORDER": "tiles", "TMA": True,
                                                      "DEFER": True}
    assert len(configs.MMA90.valid(lim)) == 8
    assert dict(configs.MMA.default(None, lim)) == {"THREADS": configs.MMA_THREADS}
    op = S.variant_op("mma90", torch.bfloat16, 2, 8)
    assert op.space is configs.MMA90
    sources = {op.render(c)["source"] for c in configs.MMA90.valid(lim)}
    assert sources == {S.SOURCES["mma90"]}  # one build serves every variant


def test_wgmma_launches_resolve_the_config_variant():
    """_launch asks a wgmma launch for the config's kernel, grid and arguments (no GPU: a
    module that records what it would launch)."""
    launched = []

    class Module:
        def kernel(self, name):
            class Launcher:
                def __getitem__(self, grid_block):
                    return lambda *args, shared_mem: launched.append(
                        (name, grid_block, args, shared_mem))
            return Launcher()

    from vitrail.tune import limits

    def variant(config, *args):
        kernel = "k_tma" if config.TMA else "k_wg"
        return kernel, configs.launch_grid(3, 2, 1, config.ORDER), 99, args
    lim = limits(arch="90a")
    for config in configs.MMA90.valid(lim):
        S._launch(Module(), config, variant, None, 0, "x", 1)
        name, (grid, threads), args, smem = launched[-1]
        assert name == ("k_tma" if config.TMA else "k_wg") and threads == 256 and smem == 99
        assert grid == ((6, 1, 1) if config.ORDER == "tiles" else (3, 2, 1))
        assert args == ("x", 1)
    S._launch(Module(), configs.MMA.default(None, lim), "sympow_mma_k", (4, 1, 1), 7, "y")
    assert launched[-1] == ("sympow_mma_k", ((4, 1, 1), 256), ("y",), 7)


@pytest.mark.slow
@requires_nvrtc
def test_new_wgmma_variants_build_for_sm90a():
    """sympow_mma_m_wg3 and sympow_mma_m_tma3 (384 threads, 2 CTAs a SM: at most 85 registers
    at p 2) and mma_sympow_bwd_k_wg2 (2 CTAs of 256: at most 128) build without spills, beside
    the kernels they may replace. Where cuobjdump is at hand: HGMMA in their SASS, TMA loads in
    the TMA mainloop's, and no wgmma kernel writes a register an in-flight wgmma reads."""
    op = S.variant_op("mma90", torch.bfloat16, 2, 8)
    mod = op.module(op.space.default({"vec": 8}, _lim()))
    res = mod.resources()
    for name, most in [("sympow_mma_m_wg3", 80), ("sympow_mma_m_tma3", 80),
                       ("sympow_mma_m_wg", 80), ("sympow_mma_k_wg", 80),
                       ("sympow_mma_k_tma", 80),
                       ("mma_sympow_bwd_k_wg2", 128), ("mma_sympow_bwd_k_wg", 128)]:
        r = res[name]
        assert r.spill_stores == r.spill_loads == r.stack == 0 and r.registers <= most, (name, r)
    try:
        sass = mod.sass
    except Exception:  # noqa: BLE001 (no cuobjdump: the resources above still hold)
        return
    from vitrail.jit.sass import kernel_sass, wgmma_register_hazards
    for name in res:
        body = kernel_sass(sass, name)
        assert "HGMMA" in body, name
        assert wgmma_register_hazards(body) == [], name
    assert "UTMALDG.5D" in kernel_sass(sass, "sympow_mma_m_tma3")
    assert "UTMALDG.3D" in kernel_sass(sass, "sympow_mma_k_tma")


# ------------------------------------------------------------------ GPU helpers
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -23}


def _close(got, ref, base, what, factor=3.0, floor_rel=4 * EPS[torch.float32]):
    """got's error against ref (fp32/fp64) is at most factor x base's (torch in got's dtype)
    plus a floor relative to the largest value (fp32 rounding of long sums)."""
    got, ref, base = got.double(), ref.double(), base.double()
    assert not got.isnan().any(), f"{what}: NaN (an element was not written)"
    err = (got - ref).abs().max().item()
    floor = floor_rel * ref.abs().max().item() + 1e-30
    bound = factor * (base - ref).abs().max().item() + floor
    assert err <= bound, f"{what}: max error {err:.3g} over {bound:.3g}"


def _nan(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


# ------------------------------------------------------------------ GPU: sympow
SYMPOW_CASES = [(1, 16, 4), (2, 16, 1), (2, 64, 8), (2, 32, 16), (3, 24, 2), (3, 32, 8),
                (4, 16, 1), (4, 32, 4), (2, 256, 16), (2, 256, 4)]  # the last: atomics fallback


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("power,d,d_tile", SYMPOW_CASES)
def test_sympow_forward_backward(dtype, power, d, d_tile):
    torch.manual_seed(power * 1000 + d + d_tile)
    rows = 37 if d <= 64 else 5
    x = torch.randn(rows, d, device="cuda", dtype=dtype)
    D = sympow_dim(d, power, d_tile)
    z = S._sympow_impl(x, power, d_tile, True, out=_nan((rows, D), dtype))
    ref = sympow_reference(x, power, d_tile)
    _close(z, ref, ref.to(dtype), f"sympow p={power} d={d} t={d_tile}")
    dz = torch.randn(rows, D, device="cuda", dtype=dtype)
    dx = S._sympow_bwd_impl(x, dz, power, d_tile, True, out=_nan((rows, d), dtype))
    xr = x.double().requires_grad_(True)
    (want,) = torch.autograd.grad(sympow_reference(xr, power, d_tile), xr, dz.double())
    # the baseline: the exact gradient rounded to dtype; the kernel sums in fp32 and rounds once
    _close(dx, want, want.to(dtype), f"sympow backward p={power} d={d} t={d_tile}",
           floor_rel=2e-6)


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("power,d,d_tile", [(2, 16, 4), (4, 8, 2), (3, 12, 4), (2, 64, 16)])
def test_sympow_forward_loops_over_rows(dtype, power, d, d_tile):
    """sympow_fwd with more rows than it covers at once (configs.fwd_rows_at_once): each
    thread's fixed chunk over several rows, the last pass partial."""
    torch.manual_seed(power + d + d_tile)
    D = sympow_dim(d, power, d_tile)
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    while (d_tile ** power) % vec:
        vec //= 2
    at_once = configs.fwd_rows_at_once(1 << 30, D // vec, torch.device("cuda"))
    rows = 2 * at_once + 3
    x = torch.randn(rows, d, device="cuda", dtype=dtype)
    z = S._sympow_impl(x, power, d_tile, True, out=_nan((rows, D), dtype))
    ref = sympow_reference(x, power, d_tile)
    _close(z, ref, ref.to(dtype), f"sympow rows={rows} p={power} d={d} t={d_tile}")


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("power,d,d_tile", [(2, 64, 8), (2, 32, 4), (3, 16, 4), (1, 64, 16),
                                            (4, 16, 4), (4, 32, 4)])
def test_sympow_backward_pipe(dtype, power, d, d_tile, monkeypatch):
    """The persistent backward kernels over more rows than CTAs, the last pass partial:
    sympow_bwd_pipe (staged blocks; equal to the one-block gather kernel: same sums in the same
    order) and sympow_bwd_quarter (p=4, d_tile=4, 16-bit), both against the reference. The
    small one-block CTAs, which come first where a row fits them, are ruled out here."""
    monkeypatch.setattr(configs, "GATHER_SMEM", 0)
    torch.manual_seed(d + power + 7)
    D = sympow_dim(d, power, d_tile)
    _, _, tidx, _ = configs.tables(d, power, d_tile, True, "cpu")
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    stage = configs.gather_stage(dtype, power, d_tile, vec)
    per_block = configs.pipe_rows(d, power, d_tile, tidx.numel(), stage)
    quarter = configs.quarter_smem(dtype, power, d_tile, vec, d, tidx.numel())
    if not (per_block or quarter):
        pytest.skip("no persistent kernel for this problem")
    smem = quarter or configs.gather_smem(d, power, d_tile, tidx.numel(), per_block, 2 * stage)
    ctas = 8 if quarter else configs.PIPE_CTAS[torch.empty((), dtype=dtype).element_size()]
    grid = configs.pipe_grid(1 << 30, smem, torch.device("cuda"), ctas)
    per_block = per_block or 1
    rows = 2 * grid * per_block + per_block // 2 + 1
    x = torch.randn(rows, d, device="cuda", dtype=dtype)
    dz = torch.randn(rows, D, device="cuda", dtype=dtype)
    got = S._sympow_bwd_impl(x, dz, power, d_tile, True, out=_nan((rows, d), dtype))
    if not quarter:
        one = S._sympow_bwd_impl(x, dz, power, d_tile, True, out=_nan((rows, d), dtype),
                                 pipe=False)
        assert torch.equal(got, one)
    xr = x.double().requires_grad_(True)
    (want,) = torch.autograd.grad(sympow_reference(xr, power, d_tile), xr, dz.double())
    _close(got, want, want.to(dtype), f"sympow_bwd_pipe p={power} d={d} t={d_tile}",
           floor_rel=2e-6)


@requires_gpu
@pytest.mark.parametrize("power,d,d_tile", [(2, 64, 8), (4, 32, 4)])
def test_sympow_backward_paths(power, d, d_tile):
    """sympow_bwd_gather with its cp.async stage (p=2) or 16-byte loads in place (p=4), and with
    dz 2 bytes off 16-byte alignment (element loads), over many CTAs: all equal the reference.
    (SYMPOW_CASES' (2, 256, 4) takes the atomics kernel, sympow_bwd.)"""
    dtype = torch.bfloat16
    torch.manual_seed(d + power)
    rows, D = 1000, sympow_dim(d, power, d_tile)
    x = torch.randn(rows, d, device="cuda", dtype=dtype)
    xr = x.double().requires_grad_(True)
    zr = sympow_reference(xr, power, d_tile)
    buf = torch.randn(rows * D + 1, device="cuda", dtype=dtype)
    for dz in (buf[:-1].view(rows, D), buf[1:].view(rows, D)):
        (want,) = torch.autograd.grad(zr, xr, dz.double(), retain_graph=True)
        dx = S._sympow_bwd_impl(x, dz, power, d_tile, True, out=_nan((rows, d), dtype))
        _close(dx, want, want.to(dtype), f"sympow backward p={power} offset "
               f"{dz.data_ptr() % 16}", floor_rel=2e-6)


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sympow_dims_batches_noncontiguous_and_identity(dtype):
    x = torch.randn(3, 40, 5, 2, device="cuda", dtype=dtype)[..., 0]  # non-contiguous
    y = torch.randn(3, 40, 5, device="cuda", dtype=dtype)
    z = S.sympow(x, 2, 8, dim=1)
    assert z.shape == (3, sympow_dim(40, 2, 8), 5)
    ref = sympow_reference(x, 2, 8, dim=1)
    _close(z, ref, ref.to(dtype), "sympow dim=1")
    for p, t in [(2, 8), (3, 4), (4, 2)]:
        ip = (S.sympow(x.float(), p, t, dim=1) * S.sympow(y.float(), p, t, dim=1)).sum(1)
        want = ((x.double() * y.double()).sum(1)) ** p
        torch.testing.assert_close(ip.double(), want, rtol=2e-4, atol=1e-3 * want.abs().max())
    with pytest.raises(ArgumentError, match="sympow: x must have dtype float32, float16, "
                       "bfloat16, got float64"):
        S.sympow(x.double(), 2, 8, dim=1)
    with pytest.raises(ArgumentError, match="sympow_mma: b must have 2304 rows"):
        S.sympow_mma(torch.randn(2, 5, 64, device="cuda"), torch.randn(2, 2300, 8, device="cuda"),
                     -1, 2, 8)
    for shape in [(0, 16), (16,)]:
        e = torch.randn(shape, device="cuda", dtype=dtype)
        assert S.sympow(e, 2, 4).shape == shape[:-1] + (sympow_dim(16, 2, 4),)


@requires_gpu
def test_sympow_autograd_opcheck_and_compile():
    x = torch.randn(33, 32, device="cuda", requires_grad=True)
    z = S.sympow(x, 3, 4)
    g = torch.randn_like(z)
    (got,) = torch.autograd.grad(z, x, g)
    xr = x.detach().double().requires_grad_(True)
    (want,) = torch.autograd.grad(sympow_reference(xr, 3, 4), xr, g.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    xs = torch.randn(9, 16, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.vitrail.sympow.default, (xs, 2, 4, True))
    torch.library.opcheck(torch.ops.vitrail.sympow_bwd.default,
                          (xs, torch.randn(9, 160, device="cuda", dtype=torch.bfloat16), 2, 4,
                           True))
    f = torch.compile(lambda t: S.sympow(t, 2, 4).square().sum(), fullgraph=True)
    xc = torch.randn(7, 16, device="cuda", requires_grad=True)
    f(xc).backward()
    xe = xc.detach().clone().requires_grad_(True)
    S.sympow(xe, 2, 4).square().sum().backward()
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ GPU: fused matmuls
MMA_CASES = [(1, 32, 8), (2, 16, 1), (2, 64, 8), (2, 32, 4), (3, 16, 4), (4, 16, 2)]


def _operands(expand_dim, power, d, d_tile, dtype, P=3, M=70, N=40, K=90):
    D = sympow_dim(d, power, d_tile)
    if expand_dim == -1:
        a, b = torch.randn(P, M, d), torch.randn(P, D, N) / math.sqrt(D)
    else:
        a, b = torch.randn(P, d, K), torch.randn(P, K, N) / math.sqrt(K)
    return a.cuda().to(dtype), b.cuda().to(dtype)


@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("expand_dim", [-1, -2])
@pytest.mark.parametrize("power,d,d_tile", MMA_CASES)
def test_sympow_mma_and_its_backward(dtype, expand_dim, power, d, d_tile):
    torch.manual_seed(power * 100 + d + d_tile - expand_dim)
    a, b = _operands(expand_dim, power, d, d_tile, dtype)
    scale = 0.75
    rows = a.shape[1] if expand_dim == -1 else sympow_dim(d, power, d_tile)
    c = S.mma_impl(a, b, expand_dim, power, d_tile, scale, True,
                   out=_nan((a.shape[0], rows, b.shape[-1]), dtype))
    ref = sympow_mma_reference(a, b, expand_dim, power, d_tile, scale)
    unfused = (sympow_reference(a, power, d_tile, expand_dim).to(dtype) * scale) @ b
    _close(c, ref, unfused, f"sympow_mma {expand_dim} p={power} d={d} t={d_tile}")
    g = torch.randn_like(c)
    bt = b.transpose(1, 2)
    got = S.mma_bwd_impl(g, bt, a, expand_dim, power, d_tile, scale, True,
                         out=_nan(a.shape, dtype))
    want = mma_sympow_bwd_reference(g, bt, a, expand_dim, power, d_tile, scale)
    # the unfused path in dtype: a @ b rounded to dtype (torch.bmm), then sympow's backward
    eye = torch.eye(bt.shape[-1], device="cuda", dtype=dtype).expand(a.shape[0], -1, -1)
    base = mma_sympow_bwd_reference(g @ bt, eye, a, expand_dim, power, d_tile, scale).to(dtype)
    _close(got, want, base, f"mma_sympow_bwd {expand_dim} p={power} d={d} t={d_tile}",
           factor=4.0, floor_rel=2e-6)


WG_CASES = [(2, 64, 8), (2, 32, 16), (3, 16, 4), (3, 16, 8), (4, 16, 4)]


# (launch order, expand-M warpgroups, expand-K mainloop): the config's, each order, and each
# state kernel (3 warpgroups: cp.async where K is not a multiple of 64, TMA where it is)
WG_VARIANTS = [(None, None, None), ("p", 2, None), ("tiles", 2, None), ("tiles", 3, False),
               ("tiles", 3, True)]


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("expand_dim", [-1, -2])
@pytest.mark.parametrize("power,d,d_tile", WG_CASES)
@pytest.mark.parametrize("P,M,N,K", [(2, 300, 136, 1000), (1, 77, 37, 90), (3, 200, 72, 1024)])
@pytest.mark.parametrize("order,wgs,tma", WG_VARIANTS)
def test_sympow_mma_on_wgmma(dtype, expand_dim, power, d, d_tile, P, M, N, K, order, wgs, tma):
    """sm90_sympow_mma.cuh: several k-blocks (pipeline wrap-around), row and column tails, two
    column tiles, and (second shape) rows not 16 bytes long (element-by-element tile loads);
    both launch orders, and the 2- and 3-warpgroup expand-M kernels (192 features a CTA: a
    partly live last tile where D is not a multiple of 192), the latter with both mainloops
    (third shape: K a multiple of 64, where the TMA one applies; N 72: a partial 64-wide box);
    the expand-K kernel (which wgs does not concern) with both of its mainloops (tma)."""
    if not configs.wgmma_applies(dtype, power, d_tile, torch.device("cuda")):
        pytest.skip("the wgmma kernels run on sm_90a")
    torch.manual_seed(power * 100 + d + d_tile + M - expand_dim)
    a, b = _operands(expand_dim, power, d, d_tile, dtype, P=P, M=M, N=N, K=K)
    scale = 0.75
    rows = M if expand_dim == -1 else sympow_dim(d, power, d_tile)
    c = S.mma_impl(a, b, expand_dim, power, d_tile, scale, True, out=_nan((P, rows, N), dtype),
                   order=order, wgs=wgs, tma=tma)
    ref = sympow_mma_reference(a, b, expand_dim, power, d_tile, scale)
    unfused = (sympow_reference(a, power, d_tile, expand_dim).to(dtype) * scale) @ b
    _close(c, ref, unfused, f"sympow_mma wgmma {expand_dim} p={power} d={d} t={d_tile}")


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("power,d,d_tile", WG_CASES + [(2, 256, 16), (3, 24, 4)])
@pytest.mark.parametrize("P,N,K", [(3, 136, 1024), (40, 8, 64)])
@pytest.mark.parametrize("expand_dim", [-1, -2])
def test_tma_mainloops_are_bitwise_the_cp_async_ones(dtype, power, d, d_tile, P, N, K,
                                                      expand_dim):
    """The wgmma kernels' two mainloops feed the same fragments and the same b rows to the same
    wgmmas in the same order: their outputs are equal bit for bit (d 256: a's 256-row box;
    d 24: a's stage not a multiple of 1 KiB; N 136: three column tiles, the last box partial;
    expand K: K is the number of rows, tma picks the mainloop). Expand M takes TMA wherever K
    is a multiple of 64: the cp.async kernel runs K - 24 (its last k-block's 24 rows
    zero-filled), the TMA one K with those rows zero."""
    if not configs.wgmma_applies(dtype, power, d_tile, torch.device("cuda")):
        pytest.skip("the wgmma kernels run on sm_90a")
    torch.manual_seed(power * 100 + d + d_tile + K)
    a, b = _operands(expand_dim, power, d, d_tile, dtype, P=P, M=K, N=N, K=K)
    rows = K if expand_dim == -1 else sympow_dim(d, power, d_tile)
    if expand_dim == -1:
        got = S.mma_impl(a, b, expand_dim, power, d_tile, 0.75, True,
                         out=_nan((P, rows, N), dtype), tma=True)
        want = S.mma_impl(a, b, expand_dim, power, d_tile, 0.75, True, tma=False)
    else:
        short = K - 24
        assert configs.state_tma(K, 3) and not configs.state_tma(short, 3)
        a[..., short:] = 0
        b[:, short:] = 0
        got = S.mma_impl(a, b, expand_dim, power, d_tile, 0.75, True,
                         out=_nan((P, rows, N), dtype), wgs=3)
        want = S.mma_impl(a[..., :short], b[:, :short], expand_dim, power, d_tile, 0.75, True,
                          wgs=3)
    assert not got.isnan().any(), "TMA mainloop: unwritten outputs"
    assert torch.equal(got, want), (got.float() - want.float()).abs().max().item()


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("power,d,d_tile", WG_CASES + [(2, 128, 8)])
@pytest.mark.parametrize("P,M,N", [(2, 300, 64), (1, 77, 37), (1, 130, 128)])
@pytest.mark.parametrize("order,defer", [(None, None), ("p", False), ("tiles", False),
                                         ("tiles", True)])
def test_mma_sympow_bwd_on_wgmma(dtype, power, d, d_tile, P, M, N, order, defer):
    """mma_sympow_bwd_k_wg (expand K): several feature blocks and tuples, row tails, dY rows
    not 16 bytes long (zero-padded), and two 64-column chunks of dY (N = 128); both launch
    orders, and both kernels (factor 0's sums deferred over runs of k-blocks or not)."""
    lda = -(-N // 8) * 8
    if not (configs.wgmma_applies(dtype, power, d_tile, torch.device("cuda"))
            and configs.wgmma_bwd_fits(d, lda)):
        pytest.skip("the wgmma kernels run on sm_90a")
    torch.manual_seed(power * 100 + d + d_tile + M + N)
    a, b = _operands(-1, power, d, d_tile, dtype, P=P, M=M, N=N)
    scale = 0.75
    g = torch.randn(P, M, N, device="cuda", dtype=dtype)
    bt = b.transpose(1, 2)
    got = S.mma_bwd_impl(g, bt, a, -1, power, d_tile, scale, True, out=_nan(a.shape, dtype),
                         order=order, defer=defer)
    want = mma_sympow_bwd_reference(g, bt, a, -1, power, d_tile, scale)
    eye = torch.eye(bt.shape[-1], device="cuda", dtype=dtype).expand(P, -1, -1)
    base = mma_sympow_bwd_reference(g @ bt, eye, a, -1, power, d_tile, scale).to(dtype)
    _close(got, want, base, f"mma_sympow_bwd wgmma p={power} d={d} t={d_tile} N={N}",
           factor=4.0, floor_rel=2e-6)


@requires_gpu
@pytest.mark.parametrize("order", ["tiles", "p"])
def test_wgmma_kernels_with_many_problems(order):
    """P = 70000 problems (over gridDim.y's 65535) of a few tiles each: every problem's tiles
    decoded from the launch index (checked on the first and last problems)."""
    dtype, power, d, d_tile = torch.bfloat16, 2, 16, 8
    if not configs.wgmma_applies(dtype, power, d_tile, torch.device("cuda")):
        pytest.skip("the wgmma kernels run on sm_90a")
    torch.manual_seed(7)
    P, M, N, K, D = 70000, 130, 8, 20, sympow_dim(d, power, d_tile)
    pick = torch.tensor([0, 1, 2, P // 2, P - 2, P - 1], device="cuda")
    scale = 0.75
    for expand_dim, wgs in [(-1, None), (-2, 2), (-2, 3)]:
        a, b = _operands(expand_dim, power, d, d_tile, dtype, P=P, M=M if expand_dim == -1 else 5,
                         N=N, K=K)
        rows = a.shape[1] if expand_dim == -1 else D
        c = S.mma_impl(a, b, expand_dim, power, d_tile, scale, True,
                       out=_nan((P, rows, N), dtype), order=order, wgs=wgs)
        ap, bp = a[pick], b[pick]
        ref = sympow_mma_reference(ap, bp, expand_dim, power, d_tile, scale)
        unfused = (sympow_reference(ap, power, d_tile, expand_dim).to(dtype) * scale) @ bp
        _close(c[pick], ref, unfused, f"sympow_mma {expand_dim} P={P} {order} wgs={wgs}")
        assert not c.isnan().any(), f"sympow_mma {expand_dim} P={P} {order}: unwritten outputs"
        a = b = c = None
    a, b = _operands(-1, power, d, d_tile, dtype, P=P, M=M, N=N)
    g = torch.randn(P, M, N, device="cuda", dtype=dtype)
    bt = b.transpose(1, 2)
    for defer in (False, True):
        got = S.mma_bwd_impl(g, bt, a, -1, power, d_tile, scale, True, out=_nan(a.shape, dtype),
                             order=order, defer=defer)
        want = mma_sympow_bwd_reference(g[pick], bt[pick], a[pick], -1, power, d_tile, scale)
        eye = torch.eye(D, device="cuda", dtype=dtype).expand(len(pick), -1, -1)
        base = mma_sympow_bwd_reference(g[pick] @ bt[pick], eye, a[pick], -1, power, d_tile,
                                        scale).to(dtype)
        _close(got[pick], want, base, f"mma_sympow_bwd P={P} {order} defer={defer}", factor=4.0,
               floor_rel=2e-6)
        assert not got.isnan().any(), f"mma_sympow_bwd P={P} {order}: unwritten outputs"


@requires_gpu
@pytest.mark.parametrize("P,rows,N,d", [(32, 4096, 64, 64), (4096, 130, 8, 16)])
@pytest.mark.parametrize("expand_dim", [-1, -2])
def test_wgmma_every_problem_of_a_large_batch(P, rows, N, d, expand_dim):
    """Every problem of large batches against the unfused path (the expansion stored, fp32
    matmul). The expand-K kernel once left its block's last wgmma in flight while the next
    block's register fragments were built: every problem was wrong at P=256, M=4096, d=64, and
    a few in a thousand at M=130, d=16, while small batches passed."""
    dtype, power, d_tile = torch.bfloat16, 2, 8
    if not configs.wgmma_applies(dtype, power, d_tile, torch.device("cuda")):
        pytest.skip("the wgmma kernels run on sm_90a")
    torch.manual_seed(P + rows)
    D = sympow_dim(d, power, d_tile)
    if expand_dim == -1:
        a = torch.randn(P, rows, d, device="cuda", dtype=dtype)
        b = (torch.randn(P, D, N, device="cuda") / math.sqrt(D)).to(dtype)
    else:
        a = torch.randn(P, d, rows, device="cuda", dtype=dtype)
        b = (torch.randn(P, rows, N, device="cuda") / math.sqrt(rows)).to(dtype)
    c = S.sympow_mma(a, b, expand_dim, power, d_tile, scale_a=0.75)
    for s in range(0, P, 32):
        x = a[s:s + 32] if expand_dim == -1 else a[s:s + 32].transpose(1, 2)
        e = S._sympow_impl(x.contiguous(), power, d_tile, True).float() * 0.75
        ref = torch.bmm(e if expand_dim == -1 else e.transpose(1, 2), b[s:s + 32].float())
        err = (c[s:s + 32].float() - ref).abs().amax((1, 2))
        bad = (~(err <= 0.02 * ref.abs().amax((1, 2)) + 1e-3)).nonzero().flatten()
        assert bad.numel() == 0, (f"sympow_mma expand_dim={expand_dim}: problems "
                                  f"{(bad + s)[:8].tolist()} of {P} wrong (max error "
                                  f"{err.max().item():.3g})")


@requires_gpu
@pytest.mark.parametrize("expand_dim", [-1, -2])
def test_sympow_mma_autograd_batches_opcheck_compile(expand_dim):
    d, p, t = 32, 2, 8
    D = sympow_dim(d, p, t)
    if expand_dim == -1:
        a, b = torch.randn(2, 3, 50, d), torch.randn(2, 3, D, 24) / math.sqrt(D)
    else:
        a, b = torch.randn(2, 3, d, 50), torch.randn(2, 3, 50, 24) / 8
    a = a.cuda().requires_grad_(True)
    b = b.cuda().requires_grad_(True)
    c = S.sympow_mma(a, b, expand_dim, p, t, scale_a=0.5)
    g = torch.randn_like(c)
    da, db = torch.autograd.grad(c, (a, b), g)
    ar, br = a.detach().double().requires_grad_(True), b.detach().double().requires_grad_(True)
    cr = sympow_reference(ar, p, t, expand_dim) * 0.5 @ br
    ra, rb = torch.autograd.grad(cr, (ar, br), g.double())
    torch.testing.assert_close(c.double(), cr, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(da.double(), ra, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(db.double(), rb, rtol=1e-4, atol=1e-4)
    a3 = a.detach().reshape((6,) + a.shape[2:]).to(torch.bfloat16)
    b3 = b.detach().reshape((6,) + b.shape[2:]).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.vitrail.sympow_mma.default, (a3, b3, expand_dim, p, t, 0.5,
                                                                 True))
    c3 = torch.ops.vitrail.sympow_mma(a3, b3, expand_dim, p, t, 0.5, True)
    torch.library.opcheck(torch.ops.vitrail.mma_sympow_bwd.default,
                          (torch.randn_like(c3), b3.transpose(1, 2), a3, expand_dim, p, t, 0.5,
                           True))
    f = torch.compile(lambda u, v: S.sympow_mma(u, v, expand_dim, p, t).sum(), fullgraph=True)
    ac, bc = a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    f(ac, bc).backward()
    ae, be = a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    S.sympow_mma(ae, be, expand_dim, p, t).sum().backward()
    torch.testing.assert_close(ac.grad, ae.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(bc.grad, be.grad, rtol=1e-4, atol=1e-4)


@requires_gpu
def test_fused_paths_never_hold_the_expansion():
    P, M, d, N, p, t = 16, 2048, 64, 64, 2, 8
    D = sympow_dim(d, p, t)
    expanded = P * M * D * 2
    a = torch.randn(P, M, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = (torch.randn(P, D, N, device="cuda") / 48).to(torch.bfloat16).requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    c = S.sympow_mma(a, b, -1, p, t)
    c.sum().backward()
    torch.cuda.synchronize()
    grew = torch.cuda.max_memory_allocated() - start
    assert grew < expanded / 4, f"peak grew by {grew} bytes; the expansion is {expanded}"


# ------------------------------------------------------------------ GPU: the example
def _example():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).parents[2] / "examples" / "power_attention" / "power_attention.py"
    spec = importlib.util.spec_from_file_location("power_attention_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@requires_gpu
def test_power_attention_example_matches_unfused_and_trains():
    ex = _example()
    torch.manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(2, 2, 256, 32, device="cuda"), dim=-1)
            for _ in range(2))
    v = torch.randn(2, 2, 256, 16, device="cuda")
    args = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    y = ex.power_attention(*args, chunk=64, fused=True)
    yr = ex.power_attention(*ref, chunk=64, fused=False)
    torch.testing.assert_close(y, yr, rtol=1e-4, atol=1e-4)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    for got, want in zip(args, ref):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-3, atol=1e-3)
    losses = ex.train(steps=4, T=256, width=64)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
