"""Configs of the copy kernels: the flat kernel's vectors in flight and CTA size, the tiled
(element) kernel's tile and CTA size, the vector transpose's lane and warp arrangement, the rows
kernel's lanes per row and vectors per lane."""
from __future__ import annotations

from vitrail.tune import Space, max_shared, max_threads, require

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
