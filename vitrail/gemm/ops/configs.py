"""The GEMM family's tuning space and heuristic, and the mapping config -> GemmOperation.

A *kind* is what the tensors fix (dtypes, layouts, epilogue); a *config* is what we choose
(tile, cluster, kernel schedule, tile scheduler, and the backend: vitrail's kernel or torch's
ops); one Op per kind (built on first use) holds the space over configs, so PickBest tunes
tiles, never dtypes, and times torch's matmul (and its epilogue's ops, launch.torch_fused)
beside the kernels where torch computes the same thing (Kind.torch_passes). Constraints are the
descriptions' own validation: a config that cannot become a kernel is refused with the
description's reason.

Heuristic: 16-bit kinds take vitrail.gemm.ops.model's choice (measured neighbours, torch among the
options, its epilogue's passes counted). TF32 uses 128x128x32 tiles, FP8 128x256x128, with a 2x1
cluster; with too few tiles to fill the GPU and a long K, 128x128 tiles on the stream-K
scheduler. FP8 with exact accumulation takes 128x256 tiles too: the overlapped-promotion mainloop
keeps two 64-column temporaries beside the accumulators, 192 registers (CUTLASS's collective
needs a second full accumulator, which spills at 128x256); the other tiles, clusters and
schedulers tried were slower (docs/ops/gemm.md#fp8-exact-tiles).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from vitrail.device import DEFAULT_SM_COUNT
from vitrail.gemm import (GemmOperation, LinearCombination, MathInstruction, TensorDescription,
                          TileDescription)
from vitrail.gemm.ops import model
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
    def plain(self) -> bool:
        """torch's matmul computes this kind's result as is (alpha aside): 16-bit inputs, the
        output in their dtype, no epilogue (C, bias, activation, clamp, scales)."""
        return self.torch_passes == 0 and not self.epilogue.bias

    @property
    def torch_passes(self) -> Optional[int]:
        """The passes over D that torch's ops add to one cuBLAS matmul to compute this kind
        (launch.torch_fused: addmm or baddbmm taking C or a per-column bias as its addend, then
        the activation and the clamp in place): C, a per-row bias (an expanded copy before the
        product), a bias beside C, the activation and the clamp count one each. None: torch's
        ops do not compute it at cuBLAS speed (8-bit or fp32 inputs, another output type,
        scales)."""
        e = self.epilogue
        if not (self.element in ("bf16", "f16") and self.element_b == self.element
                and e.element_output == self.element and e.scale_a is None
                and e.scale_b is None):
            return None
        return (int(e.has_source) + int(e.bias == "row" or bool(e.bias and e.has_source))
                + int(e.activation is not None) + int(e.clamp))

    @property
    def name(self) -> str:
        """gemm.bf16.rcr.lincomb_biascol_gelu, gemm.e4m3.rcr.lincomb_stt.fast, ...; an output
        type other than the inputs' usual one (their own for 16-bit inputs, fp32 for TF32, bf16
        for FP8) is named too (gemm.bf16.rrr.lincomb.out_f32): the name keys tuning records."""
        usual = {"bf16": "bf16", "f16": "f16", "tf32": "f32"}.get(self.element, "bf16")
        out = self.epilogue.element_output
        b = "" if self.element_b == self.element else "_" + self.element_b
        return (f"gemm.{self.element}{b}.{self.layout_a[0]}{self.layout_b[0]}r.{self.epilogue.tag}"
                + (".fast" if self.fast_accum else "") + ("" if out == usual else f".out_{out}"))


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
BACKENDS = ["vitrail", "torch"]


def operation(kind: Kind, config: Config) -> GemmOperation:
    """The GemmOperation of kind under config (ValueError: the description's reason)."""
    if config["backend"] != "vitrail":
        raise ValueError(f"config {dict(config)} runs torch's matmul, not a vitrail kernel")
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
        if c["backend"] == "torch":
            if kind.torch_passes is None:
                return (f"torch's ops do not compute {kind.name} at cuBLAS speed (only 16-bit "
                        f"inputs, output in their dtype, no scales)")
            if c != model.TORCH_CONFIG:
                return "the torch backend is one config: " + model.label(model.TORCH_CONFIG)
            return None
        if lim.arch.major != 9:
            return f"the GEMM kernels are sm_90a (Hopper); the target is {lim.arch}"
        try:
            operation(kind, c)
        except ValueError as e:
            return str(e)
        return None
    return check


def heuristic(kind: Kind):
    def choose(problem: Optional[Problem], lim: Limits) -> Config:
        bits = {"bf16": 16, "f16": 16, "tf32": 32}.get(kind.element, 8)
        if bits == 16:
            if problem is None:
                return model.CANDIDATES[0]
            passes = kind.torch_passes
            return model.choose(problem.M, problem.N, problem.K, problem.L,
                                torch_ok=passes is not None and model.torch_allowed,
                                passes=passes or 0)
        tk = 32 if bits == 32 else 128  # TF32, FP8
        big = model.make_config(f"128x{128 if bits == 32 else 256}x{tk}", "2x1", "cooperative",
                            "persistent")
        if problem is None:
            return big
        sms = lim.sm_count or DEFAULT_SM_COUNT
        tiles = -(-problem.M // 128) * -(-problem.N // 256) * problem.L
        if tiles < sms // 2 and problem.K >= 2048:  # too few tiles, long K: split K
            return model.make_config(f"128x128x{tk}", "1x1", "cooperative", "stream_k")
        return big
    return choose


def space(kind: Kind) -> Space:
    return Space({"tile": TILES, "cluster": CLUSTERS, "schedule": ["cooperative", "pingpong"],
                  "scheduler": ["persistent", "stream_k"], "backend": BACKENDS},
                 constraints=[_valid(kind)], heuristic=heuristic(kind))


# what `vitrail precompile gemm` builds: the heuristic's configs for these kinds and problems
def default_kinds() -> list[Kind]:
    plain = LinearCombination("bf16")
    return [Kind("bf16", "bf16", "row", "row", plain), Kind("bf16", "bf16", "row", "col", plain),
            Kind("f16", "f16", "row", "row", LinearCombination("f16"))]


DEFAULT_PROBLEMS = [Problem(8192, 8192, 8192), Problem(64, 5120, 13824)]  # kernels, not torch
