"""The GEMM family's tuning space and heuristic, and the mapping config -> GemmOperation.

A *kind* is what the tensors fix (dtypes, layouts, epilogue); a *config* is what we choose
(tile, cluster, kernel schedule, tile scheduler); one Op per kind (built on first use) holds the
space over configs, so PickBest tunes tiles, never dtypes. Constraints are the descriptions' own
validation: a config that cannot become a kernel is refused with the description's reason.

Heuristic (H100, 132 SMs; each rule's measurement is beside it in heuristic()): 128x256x64
cooperative with a 2x1 cluster for large 16-bit problems (the stock CUTLASS config that reached
764 TFLOP/s at 8192^3); one row of tiles (M <= 128) and a long K: 64x64 ping-pong or 128x64
cooperative tiles; other outputs with too few tiles to fill the GPU and a long K, 128x128 tiles
on the stream-K scheduler, which splits K across CTAs; short K (<= 1024) with many tiles:
128x128 ping-pong with a 2x1 cluster; TF32 uses K tiles of 32, FP8 K tiles of 128. FP8 with
exact accumulation takes 128x256 tiles too: the overlapped-promotion mainloop keeps two
64-column temporaries beside the accumulators, 192 registers (CUTLASS's collective needs a
second full accumulator, which spills at 128x256). H100, torch._scaled_mm exact = 1, same run:
128x256 1.02x at 4096^3 and 1.00x at 6144^3, where 128x128 runs 0.94x and 0.91x; at 8192^3
0.95-1.04x in six runs. Measured slower there: 128x192 (0.96-0.97x), a 1x2 cluster (0.99x),
stream-K (0.92x), 64x256 ping-pong (0.85-0.87x: each warpgroup loads its own B).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from vitrail.gemm import (GemmOperation, LinearCombination, MathInstruction, TensorDescription,
                          TileDescription)
from vitrail.tune import Space
from vitrail.tune.space import Config, Limits


@dataclass(frozen=True)
class Kind:
    """What the call's tensors fix: element types, layouts, epilogue."""
    element: str  # bf16, f16, tf32, e4m3/e5m2 (A; B may differ for FP8)
    element_b: str
    layout_a: str
    layout_b: str
    epilogue: LinearCombination
    fast_accum: bool = False

    @property
    def name(self) -> str:
        return (f"gemm.{self.element}{'' if self.element_b == self.element else '_' + self.element_b}"
                f".{self.layout_a[0]}{self.layout_b[0]}r.{self.epilogue.tag}"
                + (".fast" if self.fast_accum else ""))


@dataclass(frozen=True)
class Problem:
    M: int
    N: int
    K: int
    L: int = 1


TILES = ["128x256x64", "128x128x64", "256x128x64", "64x128x64", "64x256x64", "128x128x32",
         "128x256x32", "128x128x128", "128x256x128", "64x128x128", "128x64x64", "128x64x128",
         "64x64x64", "64x64x128"]
CLUSTERS = ["1x1", "2x1", "1x2"]


def operation(kind: Kind, config: Config) -> GemmOperation:
    """The GemmOperation of kind under config (ValueError: the description's reason)."""
    tm, tn, tk = (int(x) for x in config["tile"].split("x"))
    cm, cn = (int(x) for x in config["cluster"].split("x"))
    math = MathInstruction(kind.element, kind.element_b, math_operation=(
        "multiply_add_fast_accum" if kind.fast_accum else "multiply_add"))
    return GemmOperation(
        A=TensorDescription(kind.element, kind.layout_a),
        B=TensorDescription(kind.element_b, kind.layout_b),
        D=TensorDescription(kind.epilogue.element_output, "row"), math=math,
        tile=TileDescription((tm, tn, tk), (cm, cn, 1), 0, config["schedule"],
                             config["scheduler"]),
        epilogue=kind.epilogue)


def _valid(kind: Kind):
    def check(c: Config, lim: Limits) -> Optional[str]:
        if lim.arch.major != 9:
            return f"the GEMM kernels are sm_90a (Hopper); the target is {lim.arch}"
        try:
            operation(kind, c)
        except ValueError as e:
            return str(e)
        return None
    return check


def heuristic(kind: Kind):
    def choose(problem: Optional[Problem], lim: Limits) -> dict:
        bits = {"bf16": 16, "f16": 16, "tf32": 32}.get(kind.element, 8)
        tk = {16: 64, 32: 32, 8: 128}[bits]
        big = {"tile": f"128x256x{tk}", "cluster": "2x1", "schedule": "cooperative",
               "scheduler": "persistent"}
        if bits == 32:
            big["tile"] = "128x128x32"
        if problem is None:
            return big
        sms = lim.sm_count or 132
        m, n, k = problem.M, problem.N, problem.K
        tiles = -(-m // 128) * -(-n // 256) * problem.L
        if bits == 16 and m <= 128 and k >= 2048:
            # one row of tiles, memory-bound on B: tiles no higher than M, narrow enough that
            # N / width CTAs keep the SMs streaming B (H100, cuBLAS = 1: M=64 x 8192 x 8192,
            # 64x64 ping-pong 0.98x against 0.93x for 64x128 and 0.86x for 128x128 stream-K;
            # 64 x 4096 x 4096 0.98x; 32 x 8192 x 8192 0.97x; M=128: 128x64 cooperative 0.99x
            # against 0.89x for 128x128 stream-K)
            if m <= 64:
                return {"tile": "64x64x64", "cluster": "1x1", "schedule": "pingpong",
                        "scheduler": "persistent"}
            return {"tile": "128x64x64", "cluster": "1x1", "schedule": "cooperative",
                    "scheduler": "persistent"}
        if tiles < sms // 2 and k >= 2048:
            return {"tile": f"128x128x{tk}" if bits != 32 else "128x128x32", "cluster": "1x1",
                    "schedule": "cooperative", "scheduler": "stream_k"}
        if bits == 16 and k <= 1024 and tiles >= sms:
            # short K, many tiles: the epilogue is a large share of each tile; ping-pong
            # overlaps one warpgroup's epilogue with the other's mainloop (H100: 1.05-1.11x
            # cuBLAS at 16384^2 x 1024, 1.02-1.05x at 8192^2 and 4096^2 x 1024, against
            # 0.95-1.03x cooperative; at K = 2048 cooperative wins, 0.96x against 0.91x)
            return {"tile": "128x128x64", "cluster": "2x1", "schedule": "pingpong",
                    "scheduler": "persistent"}
        return big
    return choose


def space(kind: Kind) -> Space:
    return Space({"tile": TILES, "cluster": CLUSTERS, "schedule": ["cooperative", "pingpong"],
                  "scheduler": ["persistent", "stream_k"]},
                 constraints=[_valid(kind)], heuristic=heuristic(kind))


# what `vitrail precompile gemm` builds: the heuristic's configs for these kinds and problems
def default_kinds() -> list[Kind]:
    plain = LinearCombination("bf16")
    return [Kind("bf16", "bf16", "row", "row", plain), Kind("bf16", "bf16", "row", "col", plain),
            Kind("f16", "f16", "row", "row", LinearCombination("f16"))]


DEFAULT_PROBLEMS = [Problem(4096, 4096, 4096), Problem(64, 8192, 8192)]
