"""Copy problems from a shape (``vitrail tune``): a flat, transposing or row-slice copy into a
contiguous tensor, routed as the public function routes it (``route``), and random inputs on
the GPU when the candidates are timed."""
from __future__ import annotations

import torch

from vitrail.op import Shaped, family
from vitrail.ops.copy import FAMILY, route
from vitrail.ops.copy.configs import Variant

SHAPE = "ROWS[xCOLS[xLD]]"
DTYPES = ("float32", "bfloat16", "float16")
_DOC = ("ROWS: a flat copy of ROWS contiguous elements; ROWSxCOLS: x.t() of a contiguous COLS x "
        "ROWS tensor into a contiguous ROWS x COLS one (the vector transpose where the sizes "
        "allow 16-byte accesses, else the tiled kernel); ROWSxCOLSxLD: the first COLS columns "
        "of a ROWS x LD tensor (LD > COLS, the rows kernel). --dtype IN or IN:OUT (a "
        "conversion, e.g. bfloat16:float32)")


def _layout(shape: tuple[int, ...], ti: torch.dtype, to: torch.dtype, device) -> tuple:
    """(x, out) of the copy the shape describes (see _DOC), on device."""
    if len(shape) == 1:
        x = torch.empty(shape, dtype=ti, device=device)
    elif len(shape) == 2:
        x = torch.empty(shape[::-1], dtype=ti, device=device).t()
    else:
        rows, cols, ld = shape
        if ld <= cols:
            raise ValueError(f"--shape {rows}x{cols}x{ld}: LD must exceed COLS (a row slice)")
        x = torch.empty(rows, ld, dtype=ti, device=device)[:, :cols]
    return x, torch.empty(x.shape, dtype=to, device=device)


def _shaped(shape: tuple[int, ...], ti: torch.dtype, to: torch.dtype) -> Shaped:
    op, key, problem, extra = route(*_layout(shape, ti, to, "meta"))

    def args() -> tuple:
        x, out = _layout(shape, ti, to, "cuda")
        x.copy_(torch.randn(x.shape, device="cuda"))
        chosen = route(x, out)  # the GPU's addresses: the same route (allocations are aligned)
        return (out, x, *chosen[3])
    return Shaped(op, key, problem, args)


def _dtypes(dtype: str) -> tuple[torch.dtype, torch.dtype]:
    names = dtype.split(":")
    if len(names) > 2 or any(n not in DTYPES for n in names):
        raise ValueError(f"--dtype {dtype!r}: expected IN or IN:OUT, each one of "
                         f"{', '.join(DTYPES)}")
    return getattr(torch, names[0]), getattr(torch, names[-1])


def _resolve(shape: tuple[int, ...], dtype: str, *, backward: bool = False,
             device: torch.device | None = None) -> Shaped:
    return _shaped(shape, *_dtypes(dtype))


def variant_problem(variant: Variant, shape: tuple[int, ...],
                    dtype: str | None = None) -> Shaped:
    """The problem of the shape's copy (see _DOC) on this variant: ValueError where the public
    function routes that copy to another variant (each variant runs its own layouts)."""
    shaped, op = _shaped(shape, variant.src, variant.dst), FAMILY[variant]
    if shaped.op is not op:
        form = ("a flat copy", "a transposing copy", "a row slice's copy")[len(shape) - 1]
        raise ValueError(f"--shape {'x'.join(map(str, shape))} ({form}) runs {shaped.op.name}, "
                         f"not {op.name} (the shapes each kind takes: vitrail tune --help)")
    return shaped


family("copy", SHAPE, _DOC, DTYPES + tuple(f"{a}:{b}" for a in DTYPES for b in DTYPES if a != b),
       _resolve)
FAMILY.set_problems(variant_problem)
