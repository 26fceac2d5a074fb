"""What a GEMM kernel is made of, described in Python: math instruction, tiles, operands, mode.

The descriptions follow CUTLASS 3's concepts (and PyCUTLASS's names) so that someone who knows
CUTLASS reads them at once, and each one validates itself when built: a description that cannot
become a working sm_90a kernel raises ``ValueError`` saying which field to change. Everything
here is static (template arguments); sizes, strides, pointers and scalars stay runtime arguments
of the compiled kernel (see ``GemmOperation.can_implement`` for the runtime checks).

Operand layouts use BLAS terms on the logical matrices A (M x K), B (K x N), C and D (M x N):
``row`` means the last index is contiguous (A row-major is K-major, B row-major is N-major).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# name -> (C++ type, bits, torch dtype name)
DTYPES: dict[str, tuple[str, int, str]] = {
    "bf16": ("cutlass::bfloat16_t", 16, "bfloat16"),
    "f16": ("cutlass::half_t", 16, "float16"),
    "f32": ("float", 32, "float32"),
    "tf32": ("float", 32, "float32"),  # fp32 in memory, TF32 on the tensor cores
    "e4m3": ("cutlass::float_e4m3_t", 8, "float8_e4m3fn"),
    "e5m2": ("cutlass::float_e5m2_t", 8, "float8_e5m2"),
}
FP8 = ("e4m3", "e5m2")
LAYOUTS = ("row", "col")
KERNEL_SCHEDULES = ("cooperative", "pingpong", "warpspecialized")
GEMM_SCHEDULES = ("cooperative", "pingpong")  # the GEMM kernels' (persistent) schedules
TILE_SCHEDULERS = ("persistent", "stream_k")
FP8_PROMOTIONS = ("auto", "overlapped", "stock")
MODES = ("gemm", "batched", "split_k_serial", "split_k_parallel", "array", "grouped")
SMEM_BYTES_SM90 = 227 * 1024  # opt-in shared memory per CTA on sm_90


def check_dtype(what: str, name: str, allowed=tuple(DTYPES)) -> None:
    if name not in allowed:
        raise ValueError(f"{what}: expected one of {', '.join(allowed)}, got {name!r}")


def bits(dtype: str) -> int:
    return DTYPES[dtype][1]


def cpp_type(dtype: str) -> str:
    return DTYPES[dtype][0]


@dataclass(frozen=True)
class MathInstruction:
    """The tensor-core instruction family: operand and accumulator types, op class, math op.

    On sm_90 the CollectiveBuilder picks the wgmma shape from the tile (64 x tile_N x K-step);
    ``instruction_shape`` may be given to state it, and is checked against that rule.
    ``math_operation``: "multiply_add" (exact accumulation), or "multiply_add_fast_accum"
    (FP8 only: accumulate in the tensor core's reduced-precision mode, as cuBLAS's fast mode).
    """
    element_a: str
    element_b: str
    element_accumulator: str = "f32"
    opcode_class: str = "tensorop"
    math_operation: str = "multiply_add"
    instruction_shape: Optional[tuple[int, int, int]] = None

    def __post_init__(self):
        check_dtype("MathInstruction.element_a", self.element_a)
        check_dtype("MathInstruction.element_b", self.element_b)
        check_dtype("MathInstruction.element_accumulator", self.element_accumulator, ("f32",))
        if self.opcode_class != "tensorop":
            raise ValueError(f"MathInstruction.opcode_class={self.opcode_class!r}: only "
                             f"'tensorop' (wgmma) kernels are emitted for sm_90; SIMT is not "
                             f"implemented")
        if self.math_operation not in ("multiply_add", "multiply_add_fast_accum"):
            raise ValueError(f"MathInstruction.math_operation={self.math_operation!r}: expected "
                             f"'multiply_add' or 'multiply_add_fast_accum'")
        a, b = self.element_a, self.element_b
        if (a in FP8) != (b in FP8) or (a not in FP8 and a != b):
            raise ValueError(f"MathInstruction: element_a={a} and element_b={b} do not pair: "
                             f"both must be the same 16/32-bit type, or both FP8")
        if a == "f32":
            raise ValueError("MathInstruction: element 'f32' has no wgmma; use 'tf32' (fp32 in "
                             "memory, TF32 multiplies)")
        if self.math_operation == "multiply_add_fast_accum" and a not in FP8:
            raise ValueError("MathInstruction: 'multiply_add_fast_accum' is for FP8 operands")
        if self.instruction_shape is not None:
            m, n, k = self.instruction_shape
            if m != 64 or n % 8 or not 8 <= n <= 256 or k * bits(a) != 256:
                raise ValueError(f"MathInstruction.instruction_shape={self.instruction_shape}: "
                                 f"wgmma is 64 x N x (32 bytes of K) with N a multiple of 8 "
                                 f"up to 256; for {a} that is 64 x N x {256 // bits(a)}")

    @property
    def k_step(self) -> int:
        return 256 // bits(self.element_a)


@dataclass(frozen=True)
class TileDescription:
    """The CTA tile (M, N, K), the cluster, the pipeline stages (0: as many as fit), the kernel
    schedule (warp-specialized 'cooperative' or 'pingpong', the persistent GEMM kernels; or
    'warpspecialized': one producer and one consumer warpgroup, one CTA per output tile, the
    schedule of CUTLASS's sm90 implicit-GEMM convolutions: conv.py) and the tile scheduler
    ('persistent' or 'stream_k', which also serves split-K; 'warpspecialized' takes
    'persistent', which there means one CTA per tile).

    ``fp8_promotion`` (FP8 with exact accumulation only; other kernels ignore it): the mainloop
    that adds each k-tile's wgmma sums into the fp32 accumulators. 'overlapped' is vitrail's
    (include/vitrail/sm90_fp8_mainloop.cuh: the tile's N in slices, each promoted while the next
    one's wgmma run; tile N at least 128), 'stock' CUTLASS's (the tensor cores idle at every
    promotion), 'auto' the overlapped one where the tile allows it. Both give the same bits."""
    tile_shape: tuple[int, int, int] = (128, 128, 64)
    cluster_shape: tuple[int, int, int] = (1, 1, 1)
    stages: int = 0
    kernel_schedule: str = "cooperative"
    tile_scheduler: str = "persistent"
    fp8_promotion: str = "auto"

    def __post_init__(self):
        tm, tn, tk = self.tile_shape
        if self.kernel_schedule not in KERNEL_SCHEDULES:
            raise ValueError(f"TileDescription.kernel_schedule={self.kernel_schedule!r}: expected "
                             f"one of {', '.join(KERNEL_SCHEDULES)}")
        if self.tile_scheduler not in TILE_SCHEDULERS:
            raise ValueError(f"TileDescription.tile_scheduler={self.tile_scheduler!r}: expected "
                             f"one of {', '.join(TILE_SCHEDULERS)}")
        if self.kernel_schedule == "cooperative" and tm not in (128, 256):
            raise ValueError(f"TileDescription.tile_shape={self.tile_shape}: the cooperative "
                             f"schedule splits tile M over 2 warpgroups of 64 rows: tile M must "
                             f"be 128 or 256")
        if self.kernel_schedule == "warpspecialized" and tm not in (64, 128):
            raise ValueError(f"TileDescription.tile_shape={self.tile_shape}: the "
                             f"'warpspecialized' schedule computes the tile in one warpgroup: "
                             f"tile M must be 64 or 128")
        if self.kernel_schedule == "pingpong" and tm not in (64, 128):
            raise ValueError(f"TileDescription.tile_shape={self.tile_shape}: the pingpong "
                             f"schedule gives each warpgroup a whole tile: tile M must be 64 "
                             f"or 128")
        if tn % 16 or not 16 <= tn <= 256:
            raise ValueError(f"TileDescription.tile_shape={self.tile_shape}: tile N must be a "
                             f"multiple of 16 from 16 to 256 (a wgmma N)")
        if tk <= 0 or tk % 16:
            raise ValueError(f"TileDescription.tile_shape={self.tile_shape}: tile K must be a "
                             f"positive multiple of 16")
        cm, cn, ck = self.cluster_shape
        if ck != 1 or cm < 1 or cn < 1 or cm & (cm - 1) or cn & (cn - 1) or cm * cn > 8:
            raise ValueError(f"TileDescription.cluster_shape={self.cluster_shape}: expected "
                             f"(m, n, 1) with powers of two and m * n <= 8")
        if self.tile_scheduler == "stream_k" and self.kernel_schedule != "cooperative":
            raise ValueError("TileDescription: the stream-K scheduler needs the cooperative "
                             "kernel schedule")
        if self.stages < 0 or self.stages == 1:
            raise ValueError(f"TileDescription.stages={self.stages}: expected 0 (auto) or >= 2")
        if self.fp8_promotion not in FP8_PROMOTIONS:
            raise ValueError(f"TileDescription.fp8_promotion={self.fp8_promotion!r}: expected "
                             f"one of {', '.join(FP8_PROMOTIONS)}")
        if self.fp8_promotion == "overlapped" and not self.promotion_slices:
            raise ValueError(f"TileDescription.tile_shape={self.tile_shape}: the overlapped FP8 "
                             f"promotion cuts tile N into at least two slices: tile N must be "
                             f"at least 128 (or use fp8_promotion='stock')")

    @property
    def promotion_slices(self) -> int:
        """The slices an FP8 exact-accumulation kernel of this tile promotes one by one on the
        overlapped mainloop: 64 columns each where tile N is a multiple of 64, else two halves
        (a multiple of 8 columns: a wgmma N); 0 where it takes the stock one (tile N below 128).
        Halves, not thirds, where N is no multiple of 64: docs/ops/gemm.md#fp8-promotion-slices."""
        tn = self.tile_shape[1]
        if self.fp8_promotion == "stock" or tn < 128:
            return 0
        return tn // 64 if tn % 64 == 0 else 2

    @property
    def threads(self) -> int:
        """One producer warpgroup and two consumer warpgroups (one for 'warpspecialized')."""
        return 256 if self.kernel_schedule == "warpspecialized" else 384


def check_gemm_schedule(what: str, tile: TileDescription) -> None:
    """Refuse a schedule the GEMM kernels are not emitted for ('warpspecialized': conv.py)."""
    if tile.kernel_schedule not in GEMM_SCHEDULES:
        raise ValueError(f"{what}: kernel_schedule={tile.kernel_schedule!r} is the schedule of "
                         f"the convolutions (ConvOperation); GEMMs take one of "
                         f"{', '.join(GEMM_SCHEDULES)}")


def check_tile_k(tile: TileDescription, element: str) -> None:
    """Tile K must fill whole 64-byte rows of the shared memory swizzle atom."""
    tk = tile.tile_shape[2]
    if tk * bits(element) % 512:
        raise ValueError(f"TileDescription.tile_shape={tile.tile_shape}: tile K of {tk} "
                         f"{element} elements is not a multiple of 64 bytes (the smem swizzle "
                         f"atom); use a multiple of {512 // bits(element)}")


def check_stages(tile: TileDescription, smem_bytes) -> None:
    """The tile's stages (or, left to CUTLASS, at least two) must fit in shared memory;
    smem_bytes(stages) is the operation's estimate."""
    if tile.stages:
        need = smem_bytes(tile.stages)
        if need > SMEM_BYTES_SM90:
            raise ValueError(f"TileDescription: {tile.stages} stages of {tile.tile_shape} take "
                             f"about {need} B of shared memory > {SMEM_BYTES_SM90} B; use "
                             f"fewer stages or a smaller tile")
    elif smem_bytes(2) > SMEM_BYTES_SM90:
        raise ValueError(f"TileDescription: even 2 stages of {tile.tile_shape} do not fit in "
                         f"{SMEM_BYTES_SM90} B of shared memory; use a smaller tile")


@dataclass(frozen=True)
class TensorDescription:
    """One operand in global memory: element type, layout ('row' or 'col') and alignment in
    elements (the guaranteed divisor of leading strides and base addresses; TMA needs 16
    bytes)."""
    element: str
    layout: str = "row"
    alignment: int = 0  # 0: 16 bytes' worth

    def __post_init__(self):
        check_dtype("TensorDescription.element", self.element)
        if self.layout not in LAYOUTS:
            raise ValueError(f"TensorDescription.layout={self.layout!r}: expected 'row' or 'col'")
        full = 128 // bits(self.element)
        if self.alignment == 0:
            object.__setattr__(self, "alignment", full)
        elif self.alignment != full:
            raise ValueError(f"TensorDescription.alignment={self.alignment}: the TMA kernels need "
                             f"16-byte alignment, {full} elements of {self.element}; operands "
                             f"with less are copied to aligned buffers by the torch ops")

    @property
    def cpp_layout(self) -> str:
        return "cutlass::layout::RowMajor" if self.layout == "row" else \
            "cutlass::layout::ColumnMajor"


def k_major(operand: str, desc: TensorDescription) -> bool:
    """Whether operand 'a' (M x K) or 'b' (K x N) is contiguous along K."""
    return desc.layout == ("row" if operand == "a" else "col")


@dataclass(frozen=True)
class ModeRules:
    """What a mode asks of a GemmOperation (GemmOperation reads this table, never the mode's
    name): ``scheduler``, the tile scheduler it runs on (None: either); ``pointer_array``,
    whether it runs CUTLASS's pointer-array collectives (the stock FP8 mainloop, an epilogue of
    alpha * acc and at most beta * C); ``source``, whether its epilogue may read C; ``tag``, the
    kernel name's suffix; ``arguments``, its runtime side (arguments.RUNTIME: 'gemm' for
    GemmArguments, 'array' for ArrayArguments, 'grouped' for the device arrays of
    vitrail.gemm.ops.grouped)."""
    scheduler: Optional[str] = None
    pointer_array: bool = False
    source: bool = True
    tag: str = ""
    arguments: str = "gemm"


# How the problem maps to the kernel: 'gemm' and 'batched' (one kernel: the batch count L is a
# runtime argument), 'split_k_serial' (stream-K scheduler with a split count at run time,
# partial tiles reduced in a workspace), 'split_k_parallel' (K slices as a batched GEMM into an
# fp32 workspace, then a reduction applying the epilogue: emit/split_k.py), 'array' (a batch
# given as arrays of pointers to equal-shaped matrices: emit/array.py) and 'grouped' (G
# problems of their own sizes, strides and pointers, all given as device arrays:
# emit/grouped.py).
MODE_RULES: dict[str, ModeRules] = {
    "gemm": ModeRules(),
    "batched": ModeRules(),
    "split_k_serial": ModeRules(scheduler="stream_k"),
    "split_k_parallel": ModeRules(scheduler="persistent", tag="_skp"),
    "array": ModeRules(scheduler="persistent", pointer_array=True, tag="_array",
                       arguments="array"),
    "grouped": ModeRules(scheduler="persistent", pointer_array=True, source=False,
                         arguments="grouped"),
}
