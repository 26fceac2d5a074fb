"""vitrail.ops.copy: any strides and dtypes, into a new tensor or into out; autograd, opcheck,
torch.compile; compile-only builds for sm_90a in CI."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import requires_gpu, requires_nvcc

pytestmark = pytest.mark.warm_cache


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_the_gradient_rules_step_is_the_python_backwards_call(monkeypatch, dtype):
    """copy's C++ gradient rule: its one step (what the C++ autograd node calls without Python)
    is the copy back to x's dtype that the rule's Python backward makes where no graph of the
    gradients is asked for, with the same arguments; a copy into ``out`` has no rule."""
    import importlib
    from vitrail.plan.native import ARG, GRAD, VALUE
    C = importlib.import_module("vitrail.ops.copy")
    calls = []
    monkeypatch.setattr(C, "_copy", lambda *a: calls.append(a) or torch.zeros(()))
    x, dy = torch.randn(3, 5, dtype=torch.bfloat16), torch.randn(3, 5)
    assert C._rule(x, out=torch.empty(3, 5), dtype=dtype) is None
    backward, spec, inputs, name, steps = C._rule(x, dtype=dtype)
    assert name == "vitrail::CopyBackward" and inputs == (0,)
    args = [v if kind == VALUE else {GRAD: dy}[kind] for kind, v in spec]
    with torch.no_grad():
        backward(*args)
    (fn, fn_args, gradient), = steps
    assert gradient == 0 and fn is C._copy
    fn(*(args[v] if kind == ARG else v for kind, v in fn_args))
    assert calls == [(dy, torch.bfloat16)] * 2


@pytest.mark.slow
@requires_nvcc
def test_compile_each_kernel(monkeypatch):
    monkeypatch.setenv("VITRAIL_ARCH", "90a")
    from vitrail.ops.copy import FAMILY, Variant
    from vitrail.tune import limits
    lim = limits(arch="90a")
    for op in (FAMILY[Variant("flat", torch.bfloat16, torch.float32, 4)],
               FAMILY[Variant("tiled", torch.float16, torch.float32)],
               FAMILY[Variant("transpose", torch.float32, torch.bfloat16)]):
        res = op.module(op.space.default(None, lim)).resources()
        assert res and not any(r.spills for r in res.values())
    op = FAMILY[Variant("rows", torch.bfloat16, torch.float32, 4)]
    for problem in [(1000, 8), (20, 8)]:
        res = op.module(op.space.default(problem, lim)).resources()
        assert res and not any(r.spills for r in res.values())


def _inputs(dtype):
    g = lambda *s: torch.randn(*s, device="cuda").to(dtype)  # noqa: E731
    return {
        "contiguous": g(1000, 37),
        "odd flat": g(12345),
        "offset": g(4097)[1:],
        "transpose": g(333, 517).t(),
        "permute3": g(7, 65, 130).permute(2, 0, 1),
        "slice": g(64, 300)[:, 5:260],
        "step": g(50, 80)[::3, ::2],
        "expand": g(1, 70).expand(90, 70),
        "5d": g(3, 4, 5, 6, 7).permute(4, 2, 0, 3, 1),
        "scalar": g(()),
    }


@requires_gpu
@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_copy_values(src, dst):
    import vitrail.ops as ops
    for name, x in _inputs(src).items():
        y = ops.copy(x, dtype=dst)
        assert y.is_contiguous() and y.dtype == dst and y.shape == x.shape, name
        assert torch.equal(y, x.to(dst)), name
        out = torch.full((x.shape[::-1]), float("nan"), device="cuda", dtype=dst)
        out = out.permute(*reversed(range(x.dim()))) if x.dim() else out
        ops.copy(x, out=out)
        assert torch.equal(out, x.to(dst)), name


def _transposes(src, dst):
    """Transposing copies the 16-byte transpose takes: (name, x, out). Sizes not multiples of the
    8 x 8 (or 4 x 4) block leave ragged blocks at the edges; batch dims; padded output rows."""
    g = lambda *s: torch.randn(*s, device="cuda").to(src)  # noqa: E731
    new = lambda x: torch.empty(x.shape, device="cuda", dtype=dst)  # noqa: E731
    x = g(136, 520).t()
    yield "2-D", x, new(x)
    x = g(4, 72, 1000).permute(0, 2, 1)
    yield "batched", x, new(x)
    x = g(2, 3, 40, 48).permute(1, 0, 3, 2)
    yield "4-D", x, new(x)
    x = g(333, 520)[:, :517].t()
    yield "ragged, padded out", x, torch.empty(517, 336, device="cuda", dtype=dst)[:, :333]
    x = g(3, 8)[:, :5].t()
    yield "smaller than a block", x, torch.empty(5, 8, device="cuda", dtype=dst)[:, :3]


@requires_gpu
@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_vector_transpose(src, dst):
    from vitrail.ops.copy import FAMILY, Variant, copy, route
    for name, x, out in _transposes(src, dst):
        assert route(x, out)[0] is FAMILY[Variant("transpose", src, dst)], name
        out.fill_(float("nan"))
        copy(x, out=out)
        assert torch.equal(out, x.to(dst)), name
    # what it cannot take goes to the element kernel: an unaligned row stride, an odd offset
    x = torch.randn(130, 36, device="cuda").to(src)
    shifted = torch.randn(4681, device="cuda").to(src)[1:].view(130, 36)
    for name, y in (("row stride", x[:, :35].t()), ("offset", shifted.t())):
        out = torch.empty(y.shape, device="cuda", dtype=dst)
        assert route(y, out)[0] is FAMILY[Variant("tiled", src, dst)], name
        copy(y, out=out)
        assert torch.equal(out, y.to(dst)), name


@requires_gpu
@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_rows(src, dst):
    """Rows apart along the same fastest dim (slices, padded rows): 16-byte vectors where every
    row starts aligned on both sides, else one element per access; short rows: the tiled kernel."""
    from vitrail.ops.copy import copy, route
    for name, x, out, op in _rows(src, dst):
        assert route(x, out)[0] is op, name
        out.fill_(float("nan"))
        copy(x, out=out)
        assert torch.equal(out, x.to(dst)), name


def _rows(src, dst):
    """(name, x, out, the op that should take it)."""
    from vitrail.ops.copy import FAMILY, Variant
    v = 16 // max(torch.empty((), dtype=d).element_size() for d in (src, dst))
    g = lambda *s: torch.randn(*s, device="cuda").to(src)  # noqa: E731
    new = lambda x: torch.empty(x.shape, device="cuda", dtype=dst)  # noqa: E731
    x = g(70, 1032)[:, 8:1008]
    yield "slice", x, new(x), FAMILY[Variant("rows", src, dst, v)]
    x = g(40, 3, 264).permute(1, 0, 2)[:, :, :256]
    yield "batched", x, new(x), FAMILY[Variant("rows", src, dst, v)]
    x, out = g(70, 1032)[:, 8:1011], torch.empty(70, 1008, device="cuda", dtype=dst)[:, :1003]
    yield "ragged end, padded out", x, out, FAMILY[Variant("rows", src, dst, v)]
    x = g(70, 1032)[:, 5:1008]
    yield "unaligned", x, new(x), FAMILY[Variant("rows", src, dst, 1)]
    x = g(50, 24)[:, :v]
    yield "short rows", x, new(x), FAMILY[Variant("tiled", src, dst)]


@requires_gpu
@pytest.mark.parametrize("src,dst", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)])
def test_vector_transpose_every_config(src, dst):
    import concurrent.futures as cf

    from vitrail.ops.copy import FAMILY, Variant, route
    from vitrail.tune import limits
    op = FAMILY[Variant("transpose", src, dst)]
    configs = op.space.valid(limits())
    with cf.ThreadPoolExecutor(8) as pool:
        modules = dict(zip(configs, pool.map(op.module, configs)))
    for config, module in modules.items():
        for name, x, out in _transposes(src, dst):
            _, _, _, args = route(x, out)
            out.fill_(float("nan"))
            op.launch(module, config, out, x, *args)
            assert torch.equal(out, x.to(dst)), (config.label, name)


@requires_gpu
def test_copy_autograd_opcheck_compile_errors():
    import vitrail.ops as ops
    from vitrail.jit import ArgumentError
    from vitrail.ops.copy import copy_op, copy_out_op
    x = torch.randn(30, 40, device="cuda", requires_grad=True)
    y = ops.copy(x.t(), dtype=torch.bfloat16)
    (g,) = torch.autograd.grad(y.float().sum(), x)
    torch.testing.assert_close(g, torch.ones_like(x))
    torch.library.opcheck(copy_op, (x.detach().t(), torch.float16))
    torch.library.opcheck(copy_out_op, (x.detach().t(), torch.empty(40, 30, device="cuda")))
    f = torch.compile(lambda t: ops.copy(t.t()) * 2, fullgraph=True)
    torch.testing.assert_close(f(x.detach()), x.detach().t() * 2)
    with pytest.raises(ArgumentError, match="shape"):
        ops.copy(x, out=torch.empty(3, device="cuda"))
    with pytest.raises(ArgumentError, match="dtype"):
        ops.copy(x, dtype=torch.int32)
