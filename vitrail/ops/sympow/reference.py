"""Plain-torch references of the sympow family: the definitions the kernels are tested against.

Tiled symmetric power of x (d features, d = n * t with t = d_tile), power p: for every
non-decreasing tuple of tile indices i1 <= ... <= ip, in lexicographic order, the tensor product
x[i1] (x) ... (x) x[ip] of the t-sized tiles (first factor most significant), scaled by
sqrt(p! / prod(count_j!)) when duplicate_correction is on. D = C(n+p-1, p) * t^p features, and
with the correction <sympow(x), sympow(y)> = <x, y>^p. This is vidrial 0.2.1's order, so code
written for its ``sympow`` reads the same features here.

Everything is differentiable (autograd through the reference is the gradient reference) and
computed in float32 at least (float64 stays float64); callers cast.
"""
from __future__ import annotations

import itertools
import math
from functools import cache

import torch


@cache
def tuples(n: int, power: int) -> tuple[tuple[int, ...], ...]:
    """The non-decreasing tuples of tile indices in lexicographic order."""
    return tuple(itertools.combinations_with_replacement(range(n), power))


def multiplicity(tup: tuple[int, ...]) -> int:
    """p! / prod(count_j!): how many orderings of the tuple there are."""
    m = math.factorial(len(tup))
    for j in set(tup):
        m //= math.factorial(tup.count(j))
    return m


def sympow_dim(d: int, power: int, d_tile: int = 1) -> int:
    """D, the number of features of sympow(x) for d input features: C(n+p-1, p) * t^p with
    n = d / t (integer arithmetic only, so symbolic sizes in fake tensors work too)."""
    n = d // d_tile
    count = 1
    for i in range(power):
        count = count * (n + i)
    return count // math.factorial(power) * d_tile ** power


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def sympow_reference(x: torch.Tensor, power: int, d_tile: int = 1, dim: int = -1,
                     duplicate_correction: bool = True, *,
                     keep_dtype: bool = False) -> torch.Tensor:
    """The explicit tiled symmetric power of x along dim (float32, or float64 for float64;
    keep_dtype: in x's own dtype, the unfused torch path a benchmark compares with)."""
    x = (x if keep_dtype else _wide(x)).movedim(dim, -1)
    d = x.shape[-1]
    n, t = d // d_tile, d_tile
    tiles = x.reshape(x.shape[:-1] + (n, t))
    blocks = []
    for tup in tuples(n, power):
        z = tiles[..., tup[0], :]
        for i in tup[1:]:
            z = (z.unsqueeze(-1) * tiles[..., i, :].unsqueeze(-2)).flatten(-2)
        if duplicate_correction:
            z = z * math.sqrt(multiplicity(tup))
        blocks.append(z)
    return torch.cat(blocks, dim=-1).movedim(-1, dim)


def sympow_mma_reference(a: torch.Tensor, b: torch.Tensor, expand_dim: int, power: int,
                         d_tile: int = 1, scale_a: float = 1.0,
                         duplicate_correction: bool = True) -> torch.Tensor:
    """sympow(a along expand_dim) * scale_a @ b, with the expansion stored (the unfused path)."""
    e = sympow_reference(a, power, d_tile, expand_dim, duplicate_correction) * scale_a
    return e @ _wide(b)


def mma_sympow_bwd_reference(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                             expand_dim: int, power: int, d_tile: int = 1,
                             scale_a: float = 1.0,
                             duplicate_correction: bool = True) -> torch.Tensor:
    """The gradient with respect to c of <sympow(c along expand_dim) * scale_a, a @ b>: what
    sympow_mma's backward needs for its expanded operand (a = grad of the output, b = the other
    operand transposed)."""
    with torch.enable_grad():
        c = _wide(c).detach().requires_grad_(True)
        g = _wide(a) @ _wide(b)
        e = sympow_reference(c, power, d_tile, expand_dim, duplicate_correction) * scale_a
        (grad,) = torch.autograd.grad(e, c, g)
    return grad
