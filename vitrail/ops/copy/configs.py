"""Configs of the copy kernels: the flat kernel's vectors in flight and CTA size, the tiled
(element) kernel's tile and CTA size, the vector transpose's lane and warp arrangement, the rows
kernel's lanes per row and vectors per lane; and the route (``route``): which variant copies a
layout, with which problem and launch arguments (the package's docstring says why)."""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from vitrail.device import vector
from vitrail.jit.errors import ArgumentError
from vitrail.tune import Space, bucket, max_shared, max_threads, require

MAX_DIMS = 6
ROWS_MIN_VECTORS = 16  # shorter rows would leave most lanes of the rows kernel idle: tiled kernel

FLAT = Space({"U": [1, 2, 4, 8], "THREADS": [128, 256, 512]},
             constraints=[max_threads(lambda c: c.THREADS)],
             heuristic=lambda n, lim: {"U": 4, "THREADS": 256})

TILED = Space({"TILE": [32, 64], "THREADS": [128, 256, 512]},
              constraints=[max_threads(lambda c: c.THREADS),
                           require(lambda c, lim: c.TILE * c.TILE % c.THREADS == 0
                                   and c.TILE * c.TILE // c.THREADS <= 32,
                                   "TILE^2={TILE}^2 must be 1 to 32 elements per thread of "
                                   "THREADS={THREADS}"),
                           max_shared(lambda c: c.TILE * (c.TILE + 1) * 4)],
              heuristic=lambda n, lim: {"TILE": 64, "THREADS": 256})

TRANSPOSE = Space({"LANES1": [2, 4, 8], "WARPS1": [1, 2, 4, 8], "THREADS": [128, 256, 512]},
                  constraints=[max_threads(lambda c: c.THREADS),
                               require(lambda c, lim: c.THREADS % (32 * c.WARPS1) == 0,
                                       "WARPS1={WARPS1} warps must divide THREADS={THREADS}")],
                  heuristic=lambda n, lim: {"LANES1": 8, "WARPS1": 2, "THREADS": 512})


def _rows_heuristic(problem: tuple[int, int], lim) -> dict:
    """problem: (vectors per row, bytes per input vector). About 32 bytes in flight per lane
    (more vectors per lane for narrow vectors), fewer where the row is short; lanes enough to cover
    the row in one chunk where possible, wasting at most half of them on the row's last chunk.
    No problem (precompile): a row of 1024 16-byte vectors."""
    vectors, nbytes = problem if problem is not None else (1024, 16)
    u = min(8, max(1, 32 // nbytes))
    while u > 1 and 32 * u > vectors:
        u //= 2
    lanes = next((n for n in (32, 64, 128, 256) if n * u >= vectors), 256)
    return {"LANES": lanes, "U": u, "THREADS": 256}


ROWS = Space({"LANES": [32, 64, 128, 256], "U": [1, 2, 4, 8], "THREADS": [256, 512]},
             constraints=[max_threads(lambda c: c.THREADS)],
             heuristic=_rows_heuristic)


# ------------------------------------------------------------------------------------ routing
class Variant(NamedTuple):
    """One instantiation of the kernel source, an Op of the family (its name, its compile and
    tuning key): the path (flat, transpose, rows, tiled), the input's and output's dtypes, and
    for flat and rows the vector width (16 bytes of the wider type, or 1: element by element)."""
    path: str
    src: torch.dtype
    dst: torch.dtype
    v: int = 0

    @property
    def name(self) -> str:
        """copy.flat.bfloat16.float32.v8, copy.transpose.float32.float32, ..."""
        dtypes = ".".join(str(t).removeprefix("torch.") for t in (self.src, self.dst))
        return f"copy.{self.path}.{dtypes}" + (f".v{self.v}" if self.v else "")


def variants(dtypes) -> list[Variant]:
    """Every variant of the family for dtypes (each pair, a conversion where they differ)."""
    out = []
    for src in dtypes:
        for dst in dtypes:
            widest = min(vector(src), vector(dst))  # a 16-byte vector on both sides
            out += [Variant("flat", src, dst, widest), Variant("flat", src, dst, 1),
                    Variant("tiled", src, dst), Variant("transpose", src, dst),
                    Variant("rows", src, dst, widest), Variant("rows", src, dst, 1)]
    return out


class Layout(NamedTuple):
    """A copy as its route sees it: the dtypes, the elements, and every dim of size > 1 as
    (size, input stride, output stride), in the output's order, slowest first, merged where both
    sides allow (``merge``); the input's and the output's addresses modulo 16 bytes."""
    src: torch.dtype
    dst: torch.dtype
    numel: int
    dims: tuple[tuple[int, int, int], ...]
    in_offset: int
    out_offset: int


def merge(shape, si, so) -> tuple[tuple[int, int, int], ...]:
    """Dims (size > 1) in the output's order, slowest first, merged where both sides allow."""
    dims = sorted((d for d in range(len(shape)) if shape[d] > 1), key=lambda d: -abs(so[d]))
    merged: list[tuple[int, int, int]] = []
    for d in dims:
        n, a, b = shape[d], si[d], so[d]
        if merged:
            pn, pa, pb = merged[-1]
            if pa == a * n and pb == b * n:
                merged[-1] = (pn * n, a, b)
                continue
        merged.append((n, a, b))
    return tuple(merged)


class Recipe(NamedTuple):
    """A route's answer: the variant, its problem key and problem, and the launch's arguments
    after (out, x)."""
    variant: Variant
    key: str
    problem: Any
    args: tuple


def route(layout: Layout) -> Recipe | None:
    """The variant that copies the layout (None: nothing to copy), in order: one flat pass
    where both sides are contiguous in one order; the vector transpose where the fastest dims
    differ and 16-byte accesses fit both sides; the rows kernel where both sides' fastest dim is
    the same, of stride 1, at least ROWS_MIN_VECTORS vectors; else the tiled kernel."""
    src, dst, numel, dims, in_offset, out_offset = layout
    if numel == 0:
        return None
    widest = min(vector(src), vector(dst))  # elements of a 16-byte vector on both sides
    if not dims or (len(dims) == 1 and dims[0][1] == 1 and dims[0][2] == 1):
        v = widest
        if in_offset % (v * src.itemsize) or out_offset % (v * dst.itemsize):
            v = 1
        return Recipe(Variant("flat", src, dst, v), f"n{bucket(numel)}", numel, ())
    fast = [list(d) for d in dims[::-1]]  # fastest output dim first
    if len(fast) > MAX_DIMS:
        raise ArgumentError(f"vitrail.ops.copy: the strides leave {len(fast)} dims that cannot "
                            f"be merged; at most {MAX_DIMS} are supported")
    # dim 1: the input's fastest dim, unless that is dim 0 (then any other one: the next)
    fastest_in = min(range(len(fast)), key=lambda i: abs(fast[i][1]))
    along0 = int(fastest_in == 0)
    if len(fast) == 1:
        fast.append([1, 0, 0])
    elif not along0:
        fast.insert(1, fast.pop(fastest_in))
    ndim = len(fast)
    fast += [[1, 0, 0]] * (MAX_DIMS - ndim)
    sizes, si, so = zip(*fast)
    key = f"n0{bucket(sizes[0])};n1{bucket(sizes[1])}"
    if not along0 and _vector_transpose(layout, si[:ndim], so[:ndim]):
        return Recipe(Variant("transpose", src, dst), key, None, (ndim, sizes, si, so))
    if along0 and si[0] == 1 and so[0] == 1:
        v = widest if _aligned_rows(layout, widest, si[:ndim], so[:ndim]) else 1
        vectors = -(-sizes[0] // v)
        if vectors >= ROWS_MIN_VECTORS:
            return Recipe(Variant("rows", src, dst, v), f"v{bucket(vectors)}",
                          (vectors, v * src.itemsize), (ndim, sizes, si, so))
    return Recipe(Variant("tiled", src, dst), f"{key};along0{along0}", None,
                  (ndim, along0, sizes, si, so))


def _vector_transpose(layout: Layout, si, so) -> bool:
    """Whether the transposing copy can move 16-byte vectors on both sides: the input's dim 1 and
    the output's dim 0 of stride 1, every other stride and both pointers 16-byte aligned."""
    if si[1] != 1 or so[0] != 1 or layout.in_offset or layout.out_offset:
        return False
    vi, vo = vector(layout.src), vector(layout.dst)
    return all(s % vi == 0 for i, s in enumerate(si) if i != 1) and \
        all(s % vo == 0 for i, s in enumerate(so) if i != 0)


def _aligned_rows(layout: Layout, v: int, si, so) -> bool:
    """Whether every row starts on a vector of v elements on both sides."""
    return (layout.in_offset % (v * layout.src.itemsize) == 0
            and layout.out_offset % (v * layout.dst.itemsize) == 0
            and all(s % v == 0 for s in si[1:]) and all(s % v == 0 for s in so[1:]))
