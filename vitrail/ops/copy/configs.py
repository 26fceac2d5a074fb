"""Configs of the copy kernels: the flat kernel's vectors in flight and CTA size, the tiled
(transposing) kernel's tile and CTA size."""
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
