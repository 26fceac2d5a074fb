"""softmax and log_softmax problems from a shape (``vitrail tune``): rows x n of a contiguous
tensor, the variant the public function routes them to (``route_contiguous``), or a variant the
user names, and random inputs on the GPU when the candidates are timed."""
from __future__ import annotations

import torch

from vitrail.op import Shaped, family
from vitrail.ops.softmax import FAMILY, route_contiguous
from vitrail.ops.softmax.configs import Variant, problem_of

SHAPE = "ROWSxCOLS"
DTYPES = ("float32", "bfloat16", "float16")


def _args(kind: str, rows: int, n: int, dtype: torch.dtype, log: bool):
    """(out, a, b) as the op is called: the forward's a = b = x, the backward's a = y, b = dy."""
    def make() -> tuple:
        x = torch.randn(rows, n, device="cuda", dtype=dtype)
        if kind == "fwd":
            return torch.empty_like(x), x, x
        y = (torch.log_softmax if log else torch.softmax)(x.float(), -1).to(dtype)
        return torch.empty_like(x), y, torch.randn_like(x)
    return make


def variant_problem(variant: Variant, shape: tuple[int, ...],
                    dtype: str | None = None) -> Shaped:
    """The problem of rows x n (a contiguous tensor) on a variant of the family, whatever the
    public function would route it to (dtype: the variant's own)."""
    path, kind, dt, v, log, window = variant
    rows, n = shape
    if v > 1 and not window and path != "packed" and n % v and rows > 1:
        raise ValueError(f"{variant.name} reads rows in 16-byte vectors of {v} elements: "
                         f"--shape's COLS must be a multiple of {v} (the windowed variant, "
                         f"...v{v}w, takes other rows)")
    cols = n + (v - 1 if window else 0)  # the windows' columns (route_contiguous)
    key, problem = problem_of(path, rows, cols, dt.itemsize)
    return Shaped(FAMILY[variant], key, problem, _args(kind, rows, n, dt, log))


def _family(log: bool):
    def resolve(shape: tuple[int, ...], dtype: str, *, backward: bool = False,
                device: torch.device | None = None) -> Shaped:
        rows, n = shape
        dt = getattr(torch, dtype)
        kind = "bwd" if backward else "fwd"
        op, key, problem = route_contiguous(kind, rows, n, dt, log, device)
        return Shaped(op, key, problem, _args(kind, rows, n, dt, log))
    return resolve


for _log, _name in ((False, "softmax"), (True, "log_softmax")):
    family(_name, SHAPE, f"{_name} along the last dim of a contiguous ROWS x COLS tensor (the "
           f"forward; --backward: the backward)", DTYPES, _family(_log), backward=True)
FAMILY.set_problems(variant_problem)
