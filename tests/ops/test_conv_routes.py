"""conv2d's GEMM route (1x1 filters, no padding, one group) on the CPU: the custom ops with
vitrail's GEMM replaced by torch's matmul, in float64 against torch's conv2d and its autograd,
so that the pixels' views, the stride's copies and dx's scatter are checked without a GPU."""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import requires_nvrtc

C2D = importlib.import_module("vitrail.ops.conv")


@pytest.fixture
def gemm_on_the_cpu(monkeypatch):
    """The GEMM's run_into as torch computes it; the GEMM route taken on the CPU."""
    from vitrail.gemm.ops.reference import activation as act
    runs = []

    def run_into(d, a, b, c, bias, alpha, beta, activation, *rest, tf32):
        assert tf32  # a convolution's fp32 is TF32's (torch.backends.cudnn.allow_tf32)
        runs.append("mm" if bias is None and activation is None else "gemm")
        d.copy_(act(a @ b + (0 if bias is None else bias), activation))
    monkeypatch.setattr(C2D, "run_into", run_into)
    monkeypatch.setattr(C2D, "_require_hopper", lambda device: None)
    monkeypatch.setattr(C2D, "_run", lambda *a: pytest.fail("an implicit-GEMM kernel ran"))
    return runs


@pytest.mark.parametrize("stride", [(1, 1), (2, 2), (3, 2)])
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("path", ["custom op", "autograd.Function"])
def test_a_1x1_convolution_is_a_gemm_over_pixels(gemm_on_the_cpu, stride, activation, path):
    """Through either autograd path: the custom op's (torch.compile, transforms) and the
    Function an eager call that records gradients runs (straight to the plans); relu's
    derivative from the output, gelu's from the convolution run again without it."""
    g = torch.Generator().manual_seed(sum(stride))
    n, c, h, w, k = 2, 5, 7, 6, 3
    x = torch.randn(n, c, h, w, generator=g, dtype=torch.float64).contiguous(
        memory_format=torch.channels_last).requires_grad_(True)
    wt = torch.randn(k, c, 1, 1, generator=g, dtype=torch.float64).contiguous(
        memory_format=torch.channels_last).requires_grad_(True)
    b = torch.randn(k, generator=g, dtype=torch.float64).requires_grad_(True)
    if path == "custom op":
        y = C2D._conv2d(x, wt, b, list(stride), [0, 0], [0, 0], [1, 1], activation)
    else:
        y = C2D._CONV2D(x, wt, b, (*stride, 0, 0, 0, 0, 1, 1), activation, 1)
    x2, w2, b2 = (t.detach().clone().requires_grad_(True) for t in (x, wt, b))
    want = F.conv2d(x2, w2, b2, stride)
    want = {None: want, "relu": F.relu(want), "gelu": F.gelu(want)}[activation]
    assert y.shape == want.shape and y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, want)
    dy = torch.randn(want.shape, generator=g, dtype=torch.float64).contiguous(
        memory_format=torch.channels_last)
    y.backward(dy)
    want.backward(dy)
    # gelu's derivative is taken in fp32 (of z run again): fp32's tolerance for it
    tol = dict(rtol=1e-5, atol=1e-5) if activation == "gelu" else {}
    torch.testing.assert_close(x.grad, x2.grad, msg="dx", **tol)
    torch.testing.assert_close(wt.grad, w2.grad, msg="dw", **tol)
    torch.testing.assert_close(b.grad, b2.grad, rtol=1e-5, atol=1e-5)  # summed in fp32
    assert x.grad.is_contiguous(memory_format=torch.channels_last)
    assert wt.grad.is_contiguous(memory_format=torch.channels_last)
    assert gemm_on_the_cpu.count("mm") == 2 and "gemm" in gemm_on_the_cpu


def test_what_takes_the_gemm_route():
    """1x1, unpadded, one group, and unit stride or channels TMA cannot read (not multiples of
    8); reasons() says such a convolution runs, whatever its channel counts (as a 3x3's of one
    group, on zero-padded channels), and a strided 1x1 of aligned channels is the implicit-GEMM
    kernels'."""
    w1 = torch.empty(8, 4, 1, 1)
    assert C2D.is_gemm(w1, (0, 0), (0, 0), 1, (1, 1), (4, 8))
    assert not C2D.is_gemm(w1, (1, 0), (1, 0), 1, (1, 1), (4, 8))  # padded
    assert not C2D.is_gemm(w1, (0, 0), (0, 0), 2, (1, 1), (4, 8))  # grouped
    assert not C2D.is_gemm(torch.empty(8, 4, 3, 1), (0, 0), (0, 0), 1, (1, 1), (4, 8))
    assert C2D.is_gemm([1, 1], [0, 0], [0, 0], 1, [1, 1], (4, 8))
    assert not C2D.is_gemm(w1, (0, 0), (0, 0), 1, (2, 2), (16, 8))  # read in place
    assert not C2D.is_gemm(w1, (0, 0), (0, 0), 1, (1, 2), (16, 8))
    assert C2D.is_gemm(w1, (0, 0), (0, 0), 1, (2, 2), (12, 8))  # C not a multiple of 8
    assert C2D.is_gemm(w1, (0, 0), (0, 0), 1, (2, 2), (16, 20))  # nor K
    assert C2D.is_gemm(w1, (0, 0), (0, 0), 1, (1, 1), (12, 20))
    x = torch.empty(2, 12, 9, 9, dtype=torch.bfloat16, device="meta")
    assert C2D.reasons(x, torch.empty(20, 12, 1, 1, dtype=torch.bfloat16, device="meta"),
                       stride=2) == []
    assert C2D.reasons(x, torch.empty(20, 12, 3, 3, dtype=torch.bfloat16, device="meta"),
                       padding=1) == []  # the kernels, on 16 and 24 channels
    x16 = torch.empty(2, 16, 9, 9, dtype=torch.bfloat16, device="meta")
    w16 = torch.empty(24, 16, 1, 1, dtype=torch.bfloat16, device="meta")
    for kind in ("fprop", "dgrad", "wgrad"):  # the kernels' own checks, which pass
        assert C2D.reasons(x16, w16, stride=2, kind=kind) == [], kind


def test_wgrad_chunks_fill_the_gpu_where_dw_is_small():
    """The model's choices: a dw of a few tiles over a large batch (ResNet-50's 3x3 C64 K64:
    5 tiles) runs in many chunks, one filling half the GPU or more in one pass; chunks are
    never empty, never more than the batch or MAX_CHUNKS, and never add a wave."""
    from vitrail.gemm.conv_arguments import MAX_CHUNKS
    chunks = C2D.wgrad_chunks
    assert 16 <= chunks(64, 576, 128, 56 * 56, 132) <= MAX_CHUNKS
    assert chunks(128, 1152, 128, 28 * 28, 132) > 8  # 9 tiles
    assert chunks(512, 4608, 128, 7 * 7, 132) == 1  # 144 tiles
    assert chunks(640, 2880, 8, 32 * 32, 132) == 1  # 115 tiles: one wave already
    assert chunks(320, 2880, 8, 64 * 64, 132) == 1  # 69 tiles: 3 chunks ran 0.77x as fast
    assert chunks(64, 576, 1, 224 * 224, 132) == 1  # one image
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        k, rsc = (int(v) for v in torch.randint(1, 80, (2,), generator=g) * 8)
        batch = int(torch.randint(1, 300, (1,), generator=g))
        pixels = int(torch.randint(1, 5000, (1,), generator=g))
        s = chunks(k, rsc, batch, pixels, 132)
        assert 1 <= s <= min(batch, MAX_CHUNKS)
        assert s == 1 or s * -(-k // 128) * -(-rsc // 128) <= 132  # never a wave more
        assert (s - 1) * -(-batch // s) < batch, (k, rsc, batch, pixels, s)  # none empty


def test_wgrad_in_chunks_sums_every_chunks_partial(monkeypatch):
    """_wgrad with the kernel replaced by torch's weight gradient, run as the chunked
    kernel's contract says (chunk i: images [i c, (i + 1) c), c = ceil(n / splits), into rows
    [i K, (i + 1) K) of the partials): dw equals torch's over the whole batch."""
    runs = []

    def kernel(kind, dy, x, d, bias, act, pad, stride, dilation, pad_hi, splits=1):
        assert kind == "wgrad" and pad == pad_hi
        n, k = dy.shape[0], dy.shape[3]
        chunk = -(-n // splits)
        for i in range(splits):
            rows = slice(i * chunk, min(n, (i + 1) * chunk))
            shape = (k, d.shape[3], d.shape[1], d.shape[2])
            dw = torch.nn.grad.conv2d_weight(x[rows].permute(0, 3, 1, 2), shape,
                                             dy[rows].permute(0, 3, 1, 2), stride, pad,
                                             dilation)
            d[i * k:(i + 1) * k] = dw.permute(0, 2, 3, 1).to(d.dtype)
        runs.append(splits)
    monkeypatch.setattr(C2D, "_run", kernel)
    monkeypatch.setattr(C2D, "sum_partials",  # the sum's kernel, as torch computes it
                        lambda partials, dw, splits: dw.copy_(
                            partials.view(splits, *dw.shape).sum(0)))
    monkeypatch.setattr(C2D, "sm_count", lambda index=None: 132)
    g = torch.Generator().manual_seed(3)
    n, c, h, w, k = 13, 8, 20, 20, 8
    x = torch.randn(n, h, w, c, generator=g, dtype=torch.float64)
    dy = torch.randn(n, h // 2, w // 2, k, generator=g, dtype=torch.float64)
    assert C2D.wgrad_chunks(k, 9 * c, n, (h // 2) * (w // 2), 132) > 1
    dw = torch.empty(k, 3, 3, c, dtype=torch.float64)
    C2D._wgrad(dy, x, dw, (1, 1), (2, 2), (1, 1), (1, 1))
    want = torch.nn.grad.conv2d_weight(x.permute(0, 3, 1, 2), (k, c, 3, 3),
                                       dy.permute(0, 3, 1, 2), (2, 2), (1, 1), (1, 1))
    assert runs and runs[0] > 1
    # the partials are fp32 (as the kernel's): dw within their rounding of torch's fp64
    torch.testing.assert_close(dw, want.permute(0, 2, 3, 1), rtol=1e-5, atol=1e-4)


def test_a_kernels_module_is_loaded_once_a_process(monkeypatch):
    """A variant of the family compiles (emits the whole source, finds the module) once per
    config, then its Op answers from a dictionary; its default config's operation is kernel()'s
    (the heuristic's tile)."""
    from vitrail import jit
    from vitrail.ops.conv.configs import Problem, Variant
    from vitrail.tune import limits
    calls = []
    monkeypatch.setattr(jit, "compile", lambda **kw: calls.append(kw["name"]) or object())
    variants = [Variant("fprop", torch.bfloat16), Variant("dgrad", torch.bfloat16)]
    ops = [C2D.FAMILY[v] for v in variants]
    monkeypatch.setattr(ops[0], "_modules", {})
    monkeypatch.setattr(ops[1], "_modules", {})
    problems = [Problem(v.kind, 96, 32, 9, 65536) for v in variants]
    configs = [op.space.default(p, limits()) for op, p in zip(ops, problems)]
    loaded = [op.module(c) for op, c in zip(ops + ops + ops, configs + configs + configs)]
    want = [C2D.kernel(p.kind, torch.bfloat16, p) for p in problems]
    assert calls == [op.name for op in want] and loaded[:2] == loaded[2:4] == loaded[4:]
    assert configs[1]["tile"] == "128x64x64" and configs[0]["tile"] == "128x128x64"


def _unit_stride_dgrad(kind, a, wt, d, bias, act, pad, stride, dilation, pad_hi, splits=1,
                       phases=None):
    """The dgrad kernel's contract in float64 (conv_arguments' roles, NHWC-indexed): d (N, H,
    W, C) = the gradient of the unit-stride convolution of padding (pad, pad_hi) and dilation
    whose output gradient is a (N, P, Q, K), filter wt (K, R, S, C); the geometry checked as the
    kernel checks it. With a table of phases (the phased kernel's): each row's problem, on
    a, wt and d's strides (the first phase's views, as the kernel reads them) from their starts
    plus the row's filter and dx offsets."""
    if phases is not None:
        from vitrail.gemm.conv_arguments import PHASE_VALUES
        assert phases.shape[1] == len(PHASE_VALUES) and phases.shape[0] > 1
        n, k = a.shape[0], a.shape[3]
        for b_off, d_off, h, w, r, s, ph, pw, ph_hi, pw_hi in phases.tolist():
            p = h + ph + ph_hi - dilation[0] * (r - 1)
            q = w + pw + pw_hi - dilation[1] * (s - 1)
            _unit_stride_dgrad(
                kind, a.as_strided((n, p, q, k), a.stride(), a.storage_offset()),
                wt.as_strided((k, r, s, wt.shape[3]), wt.stride(), wt.storage_offset() + b_off),
                d.as_strided((n, h, w, d.shape[3]), d.stride(), d.storage_offset() + d_off),
                bias, act, (ph, pw), stride, dilation, (ph_hi, pw_hi))
        return
    assert kind == "dgrad" and stride == (1, 1) and splits == 1 and bias is None
    n, p, q, k = a.shape
    _, r, s, c = wt.shape
    h, w = d.shape[1:3]
    assert min(pad) >= 0 and min(pad_hi) >= 0, (pad, pad_hi)
    assert (p, q) == (h + pad[0] + pad_hi[0] - dilation[0] * (r - 1),
                      w + pad[1] + pad_hi[1] - dilation[1] * (s - 1)), (a.shape, d.shape)
    out = torch.zeros(n, h, w, c, dtype=a.dtype)
    for i in range(r):
        for j in range(s):  # dx[y, x] += dy[y - i dh + pad_h, x - j dw + pad_w] w[i, j]
            ys = torch.arange(h) - i * dilation[0] + pad[0]
            xs = torch.arange(w) - j * dilation[1] + pad[1]
            vy, vx = (ys >= 0) & (ys < p), (xs >= 0) & (xs < q)
            part = a[:, ys[vy]][:, :, xs[vx]] @ wt[:, i, j]
            out[:, vy.nonzero()[:, 0, None], vx.nonzero()[:, 0]] += part
    d.copy_(out)


def test_a_strided_dgrad_runs_one_unit_stride_dgrad_a_phase(monkeypatch):
    """dx of convolutions (strides 1 to 3, dilations 1 to 3, paddings 0 to 2, sizes down to 1,
    filters 1x1 to 5x5; and strided 1x1s of aligned channels, which the GEMM does not run) as
    the phases' unit-stride dgrads (one at unit stride), each run by the kernel's contract in
    float64, into a dx filled with NaN: equal to torch's dx, every pixel written."""
    monkeypatch.setattr(C2D, "_run", _unit_stride_dgrad)
    monkeypatch.setattr(C2D, "_require_hopper", lambda device: None)
    new_dx = C2D._new_dx
    monkeypatch.setattr(C2D, "_new_dx", lambda *a: tuple(t.fill_(float("nan"))
                                                         for t in new_dx(*a)))
    g = torch.Generator().manual_seed(5)
    done = 0
    ones = [(h, w, 1, 1, stride, (1, 1), (0, 0)) for h, w, stride in (
        (7, 7, (2, 2)), (8, 5, (2, 3)), (1, 1, (2, 2)), (9, 4, (3, 1)), (2, 6, (1, 2)))]
    for i in range(400 + len(ones)):
        c = 8 if i >= 400 else 3  # the 1x1s: channels TMA reads, so not the GEMM's
        if i >= 400:
            h, w, r, s, stride, dil, pad = ones[i - 400]
        else:
            h, w = (int(v) for v in torch.randint(1, 14, (2,), generator=g))
            r, s = (int(v) for v in torch.randint(1, 6, (2,), generator=g))
            stride = tuple(int(v) for v in torch.randint(1, 4, (2,), generator=g))
            dil = tuple(int(v) for v in torch.randint(1, 4, (2,), generator=g))
            pad = tuple(int(v) for v in torch.randint(0, 3, (2,), generator=g))
        p, q = C2D._out_hw(h, w, r, s, pad, pad, stride, dil)
        if p < 1 or q < 1 or C2D.is_gemm((r, s), pad, pad, 1, stride, (c, 2 * c)):
            continue
        x = torch.randn(2, c, h, w, generator=g, dtype=torch.float64).requires_grad_(True)
        wt = torch.randn(2 * c, c, r, s, generator=g, dtype=torch.float64)
        y = F.conv2d(x, wt, None, stride, pad, dil)
        dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
        y.backward(dy)
        dx = C2D._conv2d_dgrad(dy.contiguous(memory_format=torch.channels_last),
                               wt.contiguous(memory_format=torch.channels_last), [h, w],
                               list(stride), list(pad), list(pad), list(dil))
        torch.testing.assert_close(dx, x.grad, msg=lambda m: f"{(h, w, r, s, stride, dil, pad)}"
                                   f": {m}")
        done += 1
    assert done > 200 + len(ones)


def test_kernel_problem_is_the_launchs(monkeypatch):
    """kernel_problem (what the bench's build list and reasons() give the heuristic) is the
    Problem of each launch _run makes, for each kind, unit and strided, grouped, and a strided
    dgrad in one launch of its phases (every phase's pixels) or of its one phase, found with no
    torch op a plan's record would refuse."""
    monkeypatch.setattr(C2D, "_require_hopper", lambda device: None)
    monkeypatch.setattr(C2D, "sm_count", lambda index=None: 132)
    monkeypatch.setattr(C2D, "sum_partials", lambda partials, dw, splits: None)
    from vitrail.plan import Record, _Watch
    seen = []

    def run(kind, a, b, d, bias, act, pad, stride, dil, pad_hi, splits=1, phases=None):
        record = Record()
        with _Watch(record):  # a plan's record: reading the phase table runs no torch op
            seen.append((C2D.launch_problem(kind, a, b, d, phases), phases is not None))
        assert record.replayable, record.why

    monkeypatch.setattr(C2D, "_run", run)
    for n, c, h, w, k, r, s, stride, pad, groups in (
            (2, 16, 9, 7, 24, 3, 3, 1, 1, 1), (3, 16, 11, 10, 32, 3, 3, 2, 1, 1),
            (2, 32, 8, 8, 16, 3, 3, 2, 1, 2), (1, 8, 9, 9, 16, 1, 1, 2, 0, 1),
            (2, 8, 12, 12, 8, 5, 3, 3, 2, 1)):
        bf, cl = torch.bfloat16, torch.channels_last  # (fp32's dgrad and wgrad: torch's)
        x = torch.randn(n, c, h, w, dtype=bf).contiguous(memory_format=cl)
        wt = torch.randn(k, c // groups, r, s, dtype=bf).contiguous(memory_format=cl)
        g = C2D._geometry((stride,) * 2, (pad,) * 2, (pad,) * 2, (1, 1))
        (y,) = C2D._new_y(x, wt, None, g, None, groups)
        calls = {"fprop": lambda: C2D._fprop_into(x, wt, None, y, g, None, groups),
                 "dgrad": lambda: C2D._dgrad_into(y, wt, C2D._new_dx(y, wt, h, w, g, groups)[0],
                                                  h, w, g, groups),
                 "wgrad": lambda: C2D._wgrad_into(y, x, C2D._new_dw(y, x, r, s, g, groups)[0],
                                                  r, s, g, groups)}
        for kind, call in calls.items():
            seen.clear()
            call()
            want = C2D.kernel_problem(kind, n, c, (h, w), k, (r, s), (pad,) * 2, (pad,) * 2,
                                      (stride,) * 2, (1, 1), groups)
            assert seen and all(got == want for got in seen), (kind, stride, seen, want)
    assert C2D.kernel_problem("dgrad", 2, 8, (12, 12), 8, (5, 3), (2, 2), (2, 2), (3, 3),
                              (1, 1))[0].pixels == 2 * 12 * 12  # 9 phases: every dx pixel


@pytest.mark.parametrize("bias, activation", [(False, None), (True, None), (False, "relu")])
@pytest.mark.parametrize("needs", [(True, True), (True, False), (False, True)])
def test_the_gradient_rules_steps_are_the_python_backwards_calls(monkeypatch, bias, activation,
                                                                 needs):
    """conv2d's C++ gradient rule: with no bias and no activation, its steps (what the C++
    autograd node calls without Python) make the dgrad and wgrad front calls the rule's Python
    backward makes, with its arguments, each step's result the gradient of its input; with a
    bias or an activation, no steps (the Python backward runs)."""
    from vitrail.plan.native import ARG, GRAD, INPUT, OUTPUT, VALUE
    calls = []
    for name in ("_dgrad", "_wgrad_of"):
        monkeypatch.setattr(C2D, name, lambda *a, name=name: calls.append((name, a)) or
                            torch.full((1,), float(len(calls))))
    x = torch.randn(2, 16, 9, 7).contiguous(memory_format=torch.channels_last)
    w = torch.randn(24, 8, 3, 3).contiguous(memory_format=torch.channels_last)
    x.requires_grad_(needs[0]), w.requires_grad_(needs[1])
    b = torch.randn(24) if bias else None
    rule = C2D._rule(x, w, b, 2, (1, 0), 1, 2, activation)
    backward, spec, inputs, name = rule[:4]
    assert name == "vitrail::Conv2dBackward" and inputs == ((0, 1, 2) if bias else (0, 1))
    dy = torch.randn(2, 24, 5, 4).contiguous(memory_format=torch.channels_last)
    given = {INPUT: lambda k: (x, w, b)[k], GRAD: lambda k: dy, OUTPUT: lambda k: None}
    args = [v if kind == VALUE else given[kind](v) for kind, v in spec]
    if bias or activation:
        assert len(rule) == 4
        return
    with torch.no_grad():
        want = backward(*args)
    python_calls, calls[:] = list(calls), []
    got = [None] * len(inputs)
    for fn, fn_args, gradient in rule[4]:
        got[gradient] = fn(*(args[v] if kind == ARG else v for kind, v in fn_args))
    assert calls == python_calls and [c[0] for c in calls] == \
        [n for n, need in zip(("_dgrad", "_wgrad_of"), needs) if need]
    assert [None if t is None else t.item() for t in got] == \
        [None if t is None else t.item() for t in want]


def test_a_depthwise_thread_owns_the_widest_vector_every_view_allows():
    """8, 4 or 2 packed channels a thread where m = 1 and each view's pointer and pixel strides
    allow 16-, 8- or 4-byte loads; one channel otherwise (odd counts, m > 1, offsets)."""
    from vitrail.ops.conv import depthwise

    def nhwc(c, offset=0):
        t = torch.empty(offset + 2 * 5 * 4 * c, dtype=torch.bfloat16)[offset:]
        return t.view(2, 5, 4, c)  # NHWC-indexed, channels packed
    assert [depthwise._vector(1, c, nhwc(c), nhwc(c)) for c in (32, 20, 6, 13)] == [8, 4, 2, 1]
    assert depthwise._vector(2, 32, nhwc(32), nhwc(32)) == 1
    assert depthwise._vector(1, 32, nhwc(32), nhwc(32, offset=2)) == 2  # 4 bytes past 16
    wide = torch.empty(2, 5, 4, 40, dtype=torch.bfloat16)[..., :32]  # a pixel stride of 40
    assert depthwise._vector(1, 32, wide, nhwc(32)) == 8
    assert depthwise.is_depthwise(16, (16, 1, 3, 3), 16)
    assert depthwise.is_depthwise(16, (48, 1, 3, 3), 16)
    assert not depthwise.is_depthwise(16, (16, 2, 3, 3), 8)
    assert not depthwise.is_depthwise(1, (4, 1, 3, 3), 1)  # one channel: a plain convolution


@requires_nvrtc
@pytest.mark.parametrize("kind, template", [
    ("fprop", (1, 8, 5, 1, 7, 2, 4)), ("fprop", (0, 1, 0, 0, 0, 0, 1)), ("dgrad", (1, 8)),
    ("wgrad", (1, 8, 9, 2, 4)), ("wgrad", (0, 1, 0, 0, 1)), ("taps", ())])
def test_the_depthwise_kernels_compile(kind, template, tmp_path, monkeypatch):
    """The depthwise kernels build with NVRTC for sm_90a (bf16 8 channels a thread with a bias
    and silu, a 7-wide filter compiled in; fp16 one channel a thread, tap by tap; each kind)
    and take pointers and scalars only, the geometry as many as _geometry gives (a struct by
    value would keep plans from replaying them); the GPU tests run them."""
    from vitrail.ops.conv import depthwise
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VITRAIL_ARCH", "90a")
    monkeypatch.setattr(depthwise, "_KERNELS", {})
    params = depthwise._kernel(kind, *template).compile().proto.params
    assert {p.kind for p in params} == {"pointer", "scalar"}
    if kind == "taps":
        return
    x = torch.empty(2, 9, 7, 16, dtype=torch.bfloat16)
    geometry = depthwise._geometry(x, x[:, :5, :4], torch.empty(3, 3, 16), (2, 2), (1, 1),
                                   (1, 1))
    assert len(geometry) == 25 and geometry[15:18] == (1, 48, 16)  # the taps' k, r, s strides
    assert [p.type for p in params[-25:]] == ["long long"] * 18 + ["int"] * 7


@requires_nvrtc
@pytest.mark.parametrize("bf16", [0, 1])
def test_the_sum_of_partials_compiles(bf16, tmp_path, monkeypatch):
    """The one sum of dw's fp32 partials (the chunked wgrad's and depthwise's) builds with NVRTC
    for sm_90a, fp16 and bf16, and takes pointers and scalars only (as a plan replays)."""
    from vitrail.ops.conv import partials
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VITRAIL_ARCH", "90a")
    monkeypatch.setattr(partials, "_KERNELS", {})
    params = partials._kernel(bf16).compile().proto.params
    assert [p.type for p in params] == ["float*", "unsigned short*", "long long", "long long"]
    assert {p.kind for p in params} == {"pointer", "scalar"}


def test_the_sum_of_partials_refuses_what_it_cannot_write():
    """sum_partials writes a packed bf16 or fp16 dw from packed fp32 partials; anything else is
    a ValueError saying what it got (before any launch)."""
    from vitrail.ops.conv.partials import sum_partials
    dw = torch.empty(4, 3, 3, 8, dtype=torch.bfloat16)
    parts = torch.empty(2 * dw.numel(), dtype=torch.float32)
    with pytest.raises(ValueError, match="packed"):
        sum_partials(parts, dw.permute(0, 3, 1, 2), 2)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        sum_partials(parts, dw.float(), 2)
    with pytest.raises(ValueError, match="fp32 blocks"):
        sum_partials(parts[:-1], dw, 2)
    with pytest.raises(ValueError, match="fp32 blocks"):
        sum_partials(parts.double(), dw, 2)


def test_the_space_offers_the_narrow_tile_two_ctas_an_sm():
    """Each kind's space: the wide and the narrow tile with as many stages as fit, and the
    narrow tile with configs.STAGES' few, whose shared memory (the operation's estimate, and
    the 1 KiB the SM keeps a CTA) lets two CTAs share an SM; the wide tile takes no stage count
    (one CTA an SM). A stage count is part of the kernel's name (its own build); none leaves
    the kernels as they were. Tiles of 128 rows may also run the persistent cooperative
    kernel, at deep stages."""
    from vitrail.device import target_limits
    from vitrail.ops.conv import configs
    lim = target_limits("90a")
    ws, coop = configs.SCHEDULES
    for kind in ("fprop", "dgrad", "wgrad"):
        space = configs.space(kind)
        valid = {(c["tile"], c["stages"], c["schedule"]) for c in space.valid(lim)}
        few = max(configs.STAGES)
        # the cooperative kernel: tiles of 128 rows (wgrad's narrow tile has 64), deep stages
        narrow_coop = {(configs.NARROW[kind], 0, coop)} if kind != "wgrad" else set()
        assert valid == {(configs.WIDE, 0, ws), (configs.NARROW[kind], 0, ws),
                         (configs.NARROW[kind], few, ws), (configs.WIDE, 0, coop)} | narrow_coop
        # wgrad's chunks and dgrad's phases in one launch: the non-persistent kernel only
        assert {c["schedule"] for c in configs.space(kind, False).valid(lim)} == {ws}
        narrow = configs.tile({"tile": configs.NARROW[kind]})
        op = C2D.operation(kind, torch.bfloat16, tile=narrow, stages=few)
        assert 2 * (op.smem_bytes(few) + 1024) <= lim.shared_per_sm, (kind, op.smem_bytes(few))
        assert op.name.endswith(f"_s{few}_lincomb")
        assert f"StageCount<{few}>" in op.emit()
        assert "_s" not in C2D.operation(kind, torch.bfloat16, tile=narrow).name.split("c1x1")[1]


@pytest.mark.parametrize("kind, k, c, taps, pixels, tile, stages, coop", [
    # a channel side (fprop's K, dgrad's C, wgrad's K) of at most 64: the narrow tile, with few
    # stages (two CTAs an SM) but for wgrad, and but where the GEMM K is short enough for the
    # persistent cooperative kernel (deep stages)
    ("fprop", 64, 512, 9, 128 * 56 * 56, "narrow", 3, False),  # GEMM K 4608
    ("fprop", 64, 256, 9, 128 * 56 * 56, "narrow", 0, True),  # 2304: COOPERATIVE_K
    ("dgrad", 256, 64, 1, 128 * 56 * 56, "narrow", 0, True),
    ("dgrad", 512, 64, 9, 128 * 56 * 56, "narrow", 3, False),
    ("wgrad", 64, 64, 9, 128 * 56 * 56, "narrow", 0, False),
    ("fprop", 256, 64, 9, 128 * 56 * 56, "wide", 0, True),
    ("dgrad", 64, 256, 9, 128 * 56 * 56, "wide", 0, True),
    ("fprop", 256, 320, 9, 128 * 56 * 56, "wide", 0, False),  # 2880
    # wide tiles that fill at most half of 132 SMs in one wave: the narrow tile, twice the CTAs
    ("fprop", 2048, 2048, 9, 8 * 8 * 8, "narrow", 0, False),  # 4 x 16 wide tiles
    ("dgrad", 2048, 2048, 9, 8 * 8 * 8, "narrow", 0, False),
    ("fprop", 2048, 256, 1, 8 * 8 * 8, "narrow", 0, True),
    ("fprop", 2048, 2048, 9, 8 * 8 * 9, "wide", 0, False),  # 5 x 16 = 80 wide tiles
    ("dgrad", 2048, 4096, 9, 8 * 8 * 8, "wide", 0, False),  # 4 x 32
    # wgrad's chunks fill the SMs; its GEMM K is the pixels: the cooperative kernel up to
    # COOPERATIVE_K_WGRAD of them
    ("wgrad", 2048, 2048, 9, 8 * 8 * 8, "wide", 0, True),
    ("wgrad", 2048, 2048, 9, 8 * 16 * 16, "wide", 0, False),
    ("wgrad", 128, 128, 1, 128 * 28 * 28, "wide", 0, False),
    ("fprop", 128, 128, 9, 128 * 28 * 28, "wide", 0, True)])
def test_the_heuristics_tile(kind, k, c, taps, pixels, tile, stages, coop):
    """configs.heuristic on 132 SMs (the arch's default count where no GPU gives one); where
    the launch may not take the persistent kernel (wgrad's chunks, dgrad's phases), the
    non-persistent one on the same tile, at the stages it would take."""
    from vitrail.device import target_limits
    from vitrail.ops.conv import configs
    want = {"tile": configs.WIDE if tile == "wide" else configs.NARROW[kind], "stages": stages,
            "schedule": "cooperative" if coop else "warpspecialized"}
    problem = configs.Problem(kind, k, c, taps, pixels)
    for lim in (target_limits("90a"), None):
        assert dict(configs.space(kind).default(problem, lim)) == want
        ws = dict(configs.space(kind, False).default(problem, lim))
        assert ws["schedule"] == "warpspecialized" and ws["tile"] == want["tile"]
        if not coop:
            assert ws == want


def test_fp32_runs_as_tf32_with_tiles_of_the_same_bytes():
    """fp32's kernels are TF32's: fp32 in memory, D fp32, a tile K of 32 (128 bytes a row, as
    bf16's 64), so that the narrow tile's few stages still let two CTAs share an SM; the
    variant is named so."""
    from vitrail.device import target_limits
    from vitrail.ops.conv.configs import Variant
    op = C2D.operation("fprop", torch.float32, bias=True, activation="silu",
                       tile=(128, 64, 64), stages=3)
    assert op.name.startswith("conv2d_fprop_tf32_f32_128x64x32_")
    assert Variant("fprop", torch.float32, True, "silu").name == "conv2d.fprop.tf32.bias.silu"
    assert 2 * (op.smem_bytes(3) + 1024) <= target_limits("90a").shared_per_sm


def _meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def test_fp32_reasons_and_refusals(monkeypatch):
    """fp32's fprop is judged as the TF32 kernel gets it (4 channels a 16-byte vector); its
    dgrad and wgrad run torch's backward (no reason); depthwise fp32 and fp32 with TF32 off
    are refused, saying what to use."""
    x, w = _meta(4, 32, 9, 9), _meta(48, 32, 3, 3)
    for kind in ("fprop", "dgrad", "wgrad"):
        assert C2D.reasons(x, w, _meta(48), 2, 1, activation="gelu", kind=kind) == []
    depthwise = C2D.reasons(_meta(4, 32, 9, 9), _meta(32, 1, 3, 3), groups=32)
    assert len(depthwise) == 1 and "bf16/fp16 only" in depthwise[0], depthwise
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    off = C2D.reasons(x, w)
    assert len(off) == 1 and "allow_tf32 is False" in off[0], off
    assert "torch.nn.functional.conv2d" in off[0]


@pytest.mark.parametrize("R, S, stride, padding, dilation, groups", [
    (3, 3, 1, (1, 1), 1, 1), (3, 3, 2, (1, 1), 1, 2), (4, 2, 1, "same", 1, 1),
    (2, 4, 1, "same", 2, 2), (5, 3, 3, (2, 0), (1, 2), 1)])
def test_the_fp32_backward_is_torchs_of_the_same_padding(R, S, stride, padding, dilation,
                                                         groups):
    """fp32's dx and dw by torch's convolution backward (_torch_dgrad, _torch_wgrad), with the
    geometry conv2d hands over: an even filter's 'same' padding pads more below than above,
    which torch's backward takes as x padded at its high side. In float64 against autograd
    through torch's conv2d of the same arguments."""
    g = torch.Generator().manual_seed(R * 10 + S)
    x = torch.randn(2, 8, 11, 9, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(6, 8 // groups, R, S, dtype=torch.float64, generator=g, requires_grad=True)
    y = F.conv2d(x, w, None, stride, padding, dilation, groups)
    dy = torch.randn(y.shape, dtype=torch.float64, generator=g)
    y.backward(dy)
    st, dil = C2D._pair(stride, "stride"), C2D._pair(dilation, "dilation")
    geometry = C2D._geometry(st, *C2D._padding(padding, w, st, dil), dil)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    C2D._torch_dgrad(dx, dy, w.detach(), geometry, groups)
    C2D._torch_wgrad(dw, dy, x.detach(), geometry, groups)
    torch.testing.assert_close(dx, x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw, w.grad, rtol=1e-12, atol=1e-12)


def _kernels_by_torch(kind, a, b, d, bias, activation, pad, stride, dilation, pad_hi, splits=1,
                      phases=None):
    """C2D._run as torch computes it (float64 on the CPU), on the NHWC-indexed views the
    kernels get; the channels must be whole 16-byte vectors, as the kernels' TMA loads need."""
    from vitrail.gemm.ops.reference import activation as act
    assert splits == 1 and phases is None
    assert all(t.shape[3] % 8 == 0 for t in (a, b, d)), [t.shape for t in (a, b, d)]
    nchw = [t.permute(0, 3, 1, 2) for t in (a, b, d)]
    high = [hi - lo for lo, hi in zip(pad, pad_hi)]
    if kind == "fprop":
        x = F.pad(nchw[0], (0, high[1], 0, high[0]))
        y = F.conv2d(x, nchw[1], bias, stride, pad, dilation)
        nchw[2].copy_(act(y, activation))
    elif kind == "dgrad":
        n, c, h, w = nchw[2].shape
        dx = torch.nn.grad.conv2d_input((n, c, h + high[0], w + high[1]), nchw[1], nchw[0],
                                        stride, pad, dilation)
        nchw[2].copy_(dx[:, :, :h, :w])
    else:
        x = F.pad(nchw[1], (0, high[1], 0, high[0]))
        nchw[2].copy_(torch.nn.grad.conv2d_weight(x, nchw[2].shape, nchw[0], stride, pad,
                                                  dilation))


@pytest.mark.parametrize("C, K, R, stride, padding, activation", [
    (11, 64, 7, 2, 3, None), (9, 96, 4, 4, 0, "relu"), (12, 16, 3, 1, 1, "silu"),
    (32, 4, 3, 1, 1, "silu"), (12, 20, 3, 1, "same", None), (13, 3, 2, 1, "same", "gelu"),
    (3, 20, 3, 1, 1, None)])  # (fewer than 8: fprop and wgrad run over patches, dgrad padded)
def test_channels_short_of_a_vector_run_zero_padded(monkeypatch, C, K, R, stride, padding,
                                                    activation):
    """One group whose C or K is not a multiple of 8 (odd counts, a 4-channel latent out):
    each kind runs on operands zero-padded to whole 16-byte vectors (what the kernels get:
    asserted), the extra channels of its output left out (fewer than 8 input channels: fprop
    and wgrad over x's patches, a GEMM, by torch here too, dgrad padded); y
    (with a bias and an activation), dx and dw as torch's, in float64 through autograd. Unit
    stride for dx (a strided one takes stride phases, which this stand-in does not run)."""
    from vitrail.gemm.ops.reference import activation as act
    monkeypatch.setattr(C2D, "_run", _kernels_by_torch)
    monkeypatch.setattr(C2D, "run_into", lambda d, a, b, c, bias, alpha, beta, activation, *_,
                        **kw: d.copy_(act(a @ b + (0 if bias is None else bias), activation)))
    monkeypatch.setattr(C2D, "_require_hopper", lambda device: None)
    monkeypatch.setattr(C2D, "sm_count", lambda index: 132)
    monkeypatch.setattr(C2D, "wgrad_chunks", lambda *shape: 1)  # (chunks: not this test's)
    g = torch.Generator().manual_seed(C * K + R)
    cl, f64 = torch.channels_last, torch.float64
    x = torch.randn(2, C, 13, 11, dtype=f64, generator=g).contiguous(memory_format=cl)
    w = torch.randn(K, C, R, R, dtype=f64, generator=g).contiguous(memory_format=cl)
    b = torch.randn(K, dtype=f64, generator=g)
    st, dil = C2D._pair(stride, "stride"), (1, 1)
    geometry = C2D._geometry(st, *C2D._padding(padding, w, st, dil), dil)
    (y,) = C2D._new_y(x, w, b, geometry, activation, 1)
    C2D._fprop_into(x, w, b, y, geometry, activation, 1)
    x64, w64, b64 = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    want = act(F.conv2d(x64, w64, b64, stride, padding), activation)
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
    dy = torch.randn(want.shape, dtype=f64, generator=g).contiguous(memory_format=cl)
    want.backward(dy)
    if activation is None:  # the kernels' dgrad and wgrad take the activation's derivative
        # applied first (_gradients): here dy is that
        (dw,) = C2D._new_dw(dy, x, R, R, geometry, 1)
        C2D._wgrad_into(dy, x, dw, R, R, geometry, 1)
        torch.testing.assert_close(dw, w64.grad, rtol=1e-12, atol=1e-12)
        if st == (1, 1):
            (dx,) = C2D._new_dx(dy, w, 13, 11, geometry, 1)
            C2D._dgrad_into(dy, w, dx, 13, 11, geometry, 1)
            torch.testing.assert_close(dx, x64.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("C, K, R, S, stride, padding, dilation, activation", [
    (3, 64, 7, 7, 2, 3, 1, "relu"), (3, 96, 4, 4, 4, 0, 1, None), (2, 16, 3, 3, 1, "same", 2,
    "gelu"), (4, 24, 2, 4, 1, "same", 1, None), (7, 8, 3, 5, (2, 1), (1, 2), (2, 1), "silu")])
def test_a_stem_is_a_gemm_over_its_patches(gemm_on_the_cpu, monkeypatch, C, K, R, S, stride,
                                           padding, dilation, activation):
    """Fewer than 8 input channels (an image's 3), one group: fprop is x's patches (N P Q x R S C,
    zeros in the padding, an even filter's 'same' padding one more at the end) times the
    filter, wgrad dy^T times the patches, each a GEMM whose operands' rows are whole 16-byte
    vectors (none copied by the GEMM); through the custom op and its autograd, y, dw and the
    bias's gradient in float64 against torch's (x takes no gradient: an image's)."""
    fixture_run = C2D.run_into

    def run_into(d, a, b, *rest, **kw):  # every operand's leading stride: whole vectors
        for t in (d, a, b):
            assert max(t.stride()) % 8 == 0 and min(t.stride()) == 1, t.stride()
        fixture_run(d, a, b, *rest, **kw)
    monkeypatch.setattr(C2D, "run_into", run_into)
    g = torch.Generator().manual_seed(C * R * S)
    cl, f64 = torch.channels_last, torch.float64
    x = torch.randn(2, C, 15, 12, dtype=f64, generator=g).contiguous(memory_format=cl)
    w = torch.randn(K, C, R, S, dtype=f64, generator=g).contiguous(memory_format=cl)
    b = torch.randn(K, dtype=f64, generator=g)
    w, b = w.requires_grad_(True), b.requires_grad_(True)
    st, dil = C2D._pair(stride, "stride"), C2D._pair(dilation, "dilation")
    pad, pad_hi = C2D._padding(padding, w, st, dil)
    for kind in ("fprop", "wgrad"):
        assert C2D.runs_patches(kind, C, w, pad, pad_hi, 1, st)
    assert not C2D.runs_patches("dgrad", C, w, pad, pad_hi, 1, st)
    y = C2D._conv2d(x, w, b, list(st), list(pad), list(pad_hi), list(dil), activation)
    w2, b2 = (t.detach().clone().requires_grad_(True) for t in (w, b))
    from vitrail.gemm.ops.reference import activation as act
    want = act(F.conv2d(x, w2, b2, stride, padding, dilation), activation)
    assert y.shape == want.shape and y.is_contiguous(memory_format=cl)
    torch.testing.assert_close(y, want)
    dy = torch.randn(want.shape, generator=g, dtype=f64).contiguous(memory_format=cl)
    y.backward(dy)
    want.backward(dy)
    tol = dict(rtol=1e-5, atol=1e-5) if activation in ("gelu", "silu") else {}  # z in fp32
    torch.testing.assert_close(w.grad, w2.grad, msg="dw", **tol)
    torch.testing.assert_close(b.grad, b2.grad, rtol=1e-5, atol=1e-5)
    assert w.grad.is_contiguous(memory_format=cl)
    again = ["gemm"] if activation in ("gelu", "silu") else []  # z again, for the derivative
    assert gemm_on_the_cpu == ["gemm", *again, "mm"]  # y (with the bias), dw: no kernel ran
