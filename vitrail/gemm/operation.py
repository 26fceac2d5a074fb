"""GemmOperation: a described GEMM that emits, compiles and runs, and says what it can't do.

    op = GemmOperation(
        A=TensorDescription("bf16", "row"), B=TensorDescription("bf16", "row"),
        D=TensorDescription("bf16", "row"),
        math=MathInstruction("bf16", "bf16"),
        tile=TileDescription((128, 256, 64), (2, 1, 1)),
        epilogue=LinearCombination("bf16", bias="col", activation="gelu"))
    op.compile()                                  # through vitrail.jit (nvcc), cached on disk
    args = GemmArguments.from_tensors(op, a, b, d=out, bias=bias)
    why = op.can_implement(args)                  # [] or the reasons, each saying what to change
    op.run(args)                                  # on the current torch stream (or stream=)

One compiled operation serves every M, N, K, batch count and stride it can implement: those
are runtime arguments. ``compile_many`` builds several operations in parallel processes.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

from vitrail.gemm import emit
from vitrail.gemm.descriptions import (FP8, MODE_RULES, MODES, MathInstruction,
                                       TensorDescription, TileDescription, bits,
                                       check_gemm_schedule, check_stages, check_tile_k,
                                       k_major)
from vitrail.gemm.epilogue import LinearCombination


class Buildable:
    """What every emitted operation (plain or grouped) does with its ``emit()`` and ``name``."""

    def compile_kwargs(self, arch: str | None = None) -> dict:
        """The keyword arguments of vitrail.jit.compile (picklable, for parallel builds)."""
        kw = dict(source=self.emit(), name=self.name, backend="nvcc")
        if arch is not None:
            kw["arch"] = arch
        return kw

    def compile(self, arch: str | None = None):
        """Build (or fetch from the cache) and load this operation; returns the module."""
        from vitrail import jit
        return jit.compile(**self.compile_kwargs(arch))


@dataclass(frozen=True)
class GemmOperation(Buildable):
    """A GEMM kernel: operands, math, tiles, epilogue and mode (all static).

    D = epilogue(A @ B) per batch; A is M x K, B is K x N, C and D are M x N. ``C`` is needed
    only when the epilogue reads a source (``element_source``); its layout defaults to D's.
    """
    A: TensorDescription
    B: TensorDescription
    D: TensorDescription
    math: MathInstruction
    tile: TileDescription = field(default_factory=TileDescription)
    epilogue: Optional[LinearCombination] = None
    C: Optional[TensorDescription] = None
    mode: str = "gemm"

    def __post_init__(self):
        if self.epilogue is None:
            object.__setattr__(self, "epilogue", LinearCombination(self.D.element))
        epi = self.epilogue
        if self.mode not in MODES:
            raise ValueError(f"GemmOperation.mode={self.mode!r}: expected one of "
                             f"{', '.join(MODES)}")
        rules = MODE_RULES[self.mode]
        check_gemm_schedule("GemmOperation", self.tile)
        if rules.scheduler == "stream_k" and self.tile.tile_scheduler != "stream_k":
            raise ValueError(f"GemmOperation: mode '{self.mode}' runs on the stream-K tile "
                             f"scheduler: set TileDescription(tile_scheduler='stream_k')")
        if rules.scheduler == "persistent" and self.tile.tile_scheduler != "persistent":
            raise ValueError(f"GemmOperation: mode '{self.mode}' runs on the persistent tile "
                             f"scheduler: leave TileDescription(tile_scheduler='persistent')")
        if rules.pointer_array:
            check_pointer_array_epilogue(self.mode, self.epilogue, rules.source)
            if self.tile.fp8_promotion == "overlapped":
                raise ValueError(f"GemmOperation: mode '{self.mode}' runs CUTLASS's "
                                 f"pointer-array mainloop; fp8_promotion='overlapped' is for "
                                 f"the other modes")
        if self.mode == "grouped" and self.D.layout != "row":
            raise ValueError("GemmOperation: mode 'grouped' writes row-major outputs: D must "
                             "be 'row'")
        for name, desc, elem in (("A", self.A, self.math.element_a),
                                 ("B", self.B, self.math.element_b)):
            if _memory_type(desc.element) != _memory_type(elem):
                raise ValueError(f"GemmOperation: {name}.element={desc.element} does not match "
                                 f"math.element_{name.lower()}={elem}")
        if self.D.element != epi.element_output:
            raise ValueError(f"GemmOperation: D.element={self.D.element} does not match "
                             f"epilogue.element_output={epi.element_output}")
        if epi.has_source:
            if self.C is None:
                object.__setattr__(self, "C", TensorDescription(epi.element_source,
                                                                self.D.layout))
            if self.C.element != epi.element_source:
                raise ValueError(f"GemmOperation: C.element={self.C.element} does not match "
                                 f"epilogue.element_source={epi.element_source}")
            if self.C.layout != self.D.layout:
                raise ValueError("GemmOperation: C and D must have the same layout (the "
                                 "epilogue reads C through D's tiling)")
        elif self.C is not None:
            raise ValueError("GemmOperation: C is described but the epilogue reads no source; "
                             "give LinearCombination(element_source=...)")
        a = self.math.element_a
        if (a in FP8 or a == "tf32") and not (k_major("a", self.A) and k_major("b", self.B)):
            raise ValueError(f"GemmOperation: {a} wgmma reads both operands K-major: A must be "
                             f"'row' and B 'col' (got A {self.A.layout}, B {self.B.layout}); "
                             f"transpose in memory first")
        if (epi.scale_a or epi.scale_b) and a not in FP8:
            raise ValueError("GemmOperation: scale_a/scale_b are for FP8 operands")
        check_tile_k(self.tile, a)
        check_stages(self.tile, self.smem_bytes)

    # ------------------------------------------------------------------------------ static
    def smem_bytes(self, stages: int) -> int:
        """An estimate of shared memory: mainloop stages plus the epilogue's buffers."""
        tm, tn, tk = self.tile.tile_shape
        per_stage = tm * tk * bits(self.math.element_a) // 8 + tn * tk * bits(
            self.math.element_b) // 8
        epi_tile = min(tm, 128) * min(tn, 64) if self.tile.kernel_schedule == "cooperative" \
            else 64 * min(tn, 64)
        epi = 2 * epi_tile * bits(self.D.element) // 8
        if self.epilogue.has_source:
            epi += 2 * epi_tile * bits(self.epilogue.element_source) // 8
        if self.epilogue.bias == "col" or self.epilogue.scale_b == "col":
            epi += tn * 4
        return stages * (per_stage + 16) + epi + 1024

    @property
    def fp8_exact(self) -> bool:
        """Whether this is FP8 with exact accumulation (promoted every k-tile)."""
        return self.math.element_a in FP8 and self.math.math_operation == "multiply_add"

    @property
    def overlapped_promotion(self) -> bool:
        """Whether this is FP8 exact accumulation on vitrail's overlapped mainloop
        (TileDescription.fp8_promotion)."""
        return (self.fp8_exact and not MODE_RULES[self.mode].pointer_array
                and self.tile.promotion_slices > 0)

    @property
    def wgmma_n(self) -> tuple[int, ...]:
        """The N widths of the kernel's wgmma instructions: the tile's, and a promotion slice's
        where FP8 exact accumulation overlaps its promotions."""
        n = self.tile.tile_shape[1]
        return (n, n // self.tile.promotion_slices) if self.overlapped_promotion else (n,)

    @property
    def name(self) -> str:
        m, t = self.math, self.tile
        tm, tn, tk = t.tile_shape
        cm, cn, _ = t.cluster_shape
        lay = "".join(x.layout[0] for x in (self.A, self.B, self.D))
        fast = "_fast" if m.math_operation == "multiply_add_fast_accum" else ""
        if self.mode == "grouped":  # the grouped kernels' names predate the mode
            return (f"grouped_{m.element_a}_{lay}_{self.D.element}_{tm}x{tn}x{tk}_c{cm}x{cn}_"
                    f"{t.kernel_schedule[:4]}{fast}")
        return (f"gemm_{m.element_a}_{lay}_{self.D.element}_{tm}x{tn}x{tk}_c{cm}x{cn}_"
                f"{t.kernel_schedule[:4]}_{t.tile_scheduler}"
                + (f"_s{t.stages}" if t.stages else "") + fast
                + ("_stockpromo" if self.fp8_exact and not self.overlapped_promotion else "")
                + f"_{self.epilogue.tag}" + MODE_RULES[self.mode].tag)

    def emit(self) -> str:
        """The C++ translation unit of this operation (its mode's hook: emit.EMITTERS)."""
        return emit.emit(self)

    def key(self) -> str:
        return hashlib.sha256(self.emit().encode()).hexdigest()[:16]

    # ----------------------------------------------------------------------------- runtime
    def can_implement(self, args) -> list[str]:
        """Why this operation cannot run ``args`` (its mode's arguments: GemmArguments,
        ArrayArguments); empty when it can."""
        from vitrail.gemm.arguments import RUNTIME
        return RUNTIME[MODE_RULES[self.mode].arguments][0](self, args)

    def run(self, args, *, stream=None, module=None) -> None:
        """Run on ``args`` (as can_implement) on ``stream`` (default: torch's current one)."""
        from vitrail.gemm.arguments import RUNTIME
        why = self.can_implement(args)
        if why:
            from vitrail.jit.errors import ArgumentError
            raise ArgumentError(f"{self.name} cannot implement this problem: "
                                + "; ".join(why))
        RUNTIME[MODE_RULES[self.mode].arguments][1](self, module or self.compile(), args,
                                                    stream)


def check_pointer_array_epilogue(mode: str, epi, source: bool = True) -> None:
    """ValueError unless the epilogue is alpha * acc (+ beta * C where ``source``), what the
    pointer-array modes emit."""
    extra = [n for n, v in (("bias", epi.bias), ("activation", epi.activation),
                            ("clamp", epi.clamp), ("scale_a", epi.scale_a),
                            ("scale_b", epi.scale_b)) if v]
    if not source and epi.has_source:
        extra.append("source (C)")
    if extra:
        emits = "alpha * A @ B (+ beta * C)" if source else "alpha * A @ B"
        raise ValueError(f"GemmOperation: mode '{mode}' emits D = {emits}; the epilogue's "
                         f"{', '.join(extra)} is not available in this mode (use mode "
                         f"'batched' on stacked tensors, or apply it afterwards)")


def _memory_type(e: str) -> str:
    return "f32" if e == "tf32" else e


def compile_many(ops: Sequence[GemmOperation], *, arch: str | None = None,
                 max_workers: int | None = None, verbose: bool = False) -> dict:
    """Build several operations in parallel processes into the cache; {op: error} of failures."""
    from vitrail.tune.tuner import compile_all
    failures = compile_all([(op, op.compile_kwargs(arch)) for op in ops], max_workers=max_workers,
                           verbose=verbose, label="gemm")
    return failures
