"""The runtime side of a GEMM: arguments from arrays, the checks TMA imposes, and the launch.

``GemmArguments.from_tensors`` takes torch tensors, CuPy arrays (``__cuda_array_interface__``),
DLPack-capable CUDA arrays (zero-copy views) and NumPy arrays (copied to the GPU; an output
given as a NumPy array is copied back by ``args.sync()``). Matrices are 2-D (M x K) or 3-D
batched (L x M x K); layouts and strides are read from the arrays, never assumed.

``reasons(op, args)`` is ``GemmOperation.can_implement``: each reason names the operand and
what to change (a layout, an alignment, a dtype). Mode 'array' takes ``ArrayArguments`` (lists
of tensors: ``array_reasons``, ``array_launch``); ``RUNTIME`` maps each mode's runtime side
(descriptions.ModeRules.arguments) to its checks and launch.

The order in which the persistent and stream-K schedulers hand out output tiles is a runtime
choice (CUTLASS's ``max_swizzle_size`` and ``raster_order``): ``swizzle`` tiles along the raster's
minor dimension are taken before moving on, so the CTAs running at once share rows of A and
columns of B in L2. ``scheduler_order`` picks it when the arguments leave it open (the largest
swizzle halved the bytes read from DRAM: docs/ops/gemm.md#tile-order-swizzle).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from vitrail.device import sm_count
from vitrail.gemm.descriptions import DTYPES, bits
from vitrail.gemm.emit import array as array_entries
from vitrail.gemm.emit.template import CODES
from vitrail.jit.errors import ArgumentError, LaunchError

_TORCH_NAMES = {v[2]: k for k, v in DTYPES.items() if k != "tf32"}


def dtype_name(t: torch.Tensor) -> str:
    return _TORCH_NAMES.get(str(t.dtype).removeprefix("torch."), str(t.dtype))


def as_cuda_tensor(x: Any, name: str, what: str = "gemm") -> tuple[torch.Tensor, Any]:
    """(a CUDA tensor viewing or holding x, the NumPy array to copy results back to or None);
    errors name ``what`` (the operation family) and argument ``name``."""
    if x is None or isinstance(x, torch.Tensor):
        if x is not None and x.device.type != "cuda":
            raise ArgumentError(f"{what}: {name} is a tensor on {x.device}; pass a CUDA tensor "
                                f"(or a NumPy array, which is copied)")
        return x, None
    if hasattr(x, "__cuda_array_interface__"):
        return torch.as_tensor(x, device="cuda"), None
    if hasattr(x, "__dlpack__"):
        dev_type = int(x.__dlpack_device__()[0]) if hasattr(x, "__dlpack_device__") else 2
        if dev_type in (2, 13):
            return torch.from_dlpack(x), None
    import numpy as np
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x)).cuda(), x
    raise ArgumentError(f"{what}: {name} got {type(x).__name__}; expected a torch tensor, a CuPy, "
                        f"DLPack or NumPy array")


@dataclass
class Operand:
    """One matrix operand as the kernel sees it."""
    ptr: int
    dtype: str
    rows: int
    cols: int
    layout: Optional[str]  # 'row', 'col', or None (neither dimension is contiguous)
    ld: int
    batch_stride: int
    strides: tuple


def describe(t: torch.Tensor, name: str, want: str | None = None) -> Operand:
    """Layout and strides of a 2-D or 3-D tensor; ``want`` breaks ties of degenerate shapes."""
    if t.dim() not in (2, 3):
        raise ArgumentError(f"gemm: {name} must be 2-D (rows x cols) or 3-D (batch x rows x "
                            f"cols), got shape {tuple(t.shape)}")
    rows, cols = t.shape[-2], t.shape[-1]
    sr, sc = t.stride(-2), t.stride(-1)
    align = max(1, 128 // bits(dtype_name(t))) if dtype_name(t) in DTYPES else 1
    options = {}  # layout -> leading stride, for each layout the strides allow
    if sc == 1 or cols == 1:
        options["row"] = sr if rows > 1 else round_up(max(cols, 1), align)
    if sr == 1 or rows == 1:
        options["col"] = sc if cols > 1 else round_up(max(rows, 1), align)
    order = ("col", "row") if want == "col" else ("row", "col")
    ranked = [o for o in order if o in options and options[o] % align == 0] + \
        [o for o in order if o in options]
    layout = ranked[0] if ranked else None
    ld = options.get(layout, 0)
    L = t.shape[0] if t.dim() == 3 else 1
    if L > 1:
        batch = t.stride(0)
    else:  # never used to address anything; keep it aligned and non-zero for TMA
        batch = round_up(max(ld * (rows if layout == "row" else cols), 1), align)
    return Operand(t.data_ptr(), dtype_name(t), rows, cols, layout, ld, batch, tuple(t.stride()))


def round_up(x: int, m: int) -> int:
    """x rounded up to a multiple of m."""
    return (x + m - 1) // m * m


@dataclass
class GemmArguments:
    """Everything one launch needs besides the compiled operation (all runtime values)."""
    A: Operand
    B: Operand
    D: Operand
    M: int
    N: int
    K: int
    L: int
    C: Optional[Operand] = None
    bias: Optional[torch.Tensor] = None
    bias_batch_stride: int = 0
    scale_a: Optional[torch.Tensor] = None
    scale_b: Optional[torch.Tensor] = None
    alpha: float = 1.0
    beta: float = 0.0
    slope: float = 0.01
    lo: float = float("-inf")
    hi: float = float("inf")
    splits: int = 1
    swizzle: Optional[int] = None  # 1, 2, 4 or 8; None: scheduler_order() picks
    raster: str = "heuristic"  # or "along_m" / "along_n" (CUTLASS's RasterOrderOptions)
    device: int = 0
    keep: list = field(default_factory=list, repr=False)  # tensors that must outlive the launch
    host_out: Any = field(default=None, repr=False)  # (NumPy D, CUDA D) for sync()

    @classmethod
    def from_tensors(cls, op, a, b, d=None, *, c=None, bias=None, scale_a=None, scale_b=None,
                     alpha: float = 1.0, beta: float = 0.0, slope: float = 0.01,
                     lo: float = float("-inf"), hi: float = float("inf"),
                     splits: int = 1, swizzle: Optional[int] = None,
                     raster: str = "heuristic") -> "GemmArguments":
        """Arguments for ``op`` on a (M x K), b (K x N), d (M x N; allocated when None), and
        optionally c (M x N), bias (M or N values) and FP8 scales; batched when 3-D.
        ``swizzle`` and ``raster`` set the tile scheduler's order (see the module docstring)."""
        a, _ = as_cuda_tensor(a, "a")
        b, _ = as_cuda_tensor(b, "b")
        c, _ = as_cuda_tensor(c, "c")
        bias, _ = as_cuda_tensor(bias, "bias")
        scale_a, _ = as_cuda_tensor(scale_a, "scale_a")
        scale_b, _ = as_cuda_tensor(scale_b, "scale_b")
        if a.shape[-1] != b.shape[-2]:
            raise ArgumentError(f"gemm: a is {tuple(a.shape)} and b is {tuple(b.shape)}: a's "
                                f"columns must equal b's rows")
        M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
        L = max(a.shape[0] if a.dim() == 3 else 1, b.shape[0] if b.dim() == 3 else 1)
        for name, t in (("a", a), ("b", b)):
            if t.dim() == 3 and t.shape[0] != L:
                raise ArgumentError(f"gemm: {name} has batch {t.shape[0]}, expected {L}")
        if L > 1:  # a 2-D operand of a batched problem is shared: batch stride 0
            a = a if a.dim() == 3 else a.expand(L, *a.shape)
            b = b if b.dim() == 3 else b.expand(L, *b.shape)
        host = None
        if d is None:
            dtype = getattr(torch, DTYPES[op.D.element][2])
            shape = (L, M, N) if L > 1 else (M, N)
            d = torch.empty(shape, dtype=dtype, device=a.device)
            if op.D.layout == "col":
                d = d.transpose(-1, -2).contiguous().transpose(-1, -2)
        else:
            d, np_d = as_cuda_tensor(d, "d")
            if np_d is not None:
                host = (np_d, d)
        if tuple(d.shape[-2:]) != (M, N):
            raise ArgumentError(f"gemm: d has shape {tuple(d.shape)}, expected (..., {M}, {N})")
        args = cls(A=describe(a, "a", op.A.layout), B=describe(b, "b", op.B.layout),
                   D=describe(d, "d", op.D.layout), M=M, N=N, K=K, L=L,
                   alpha=float(alpha), beta=float(beta), slope=float(slope), lo=float(lo),
                   hi=float(hi), splits=int(splits), swizzle=swizzle, raster=raster,
                   device=a.device.index or 0,
                   keep=[a, b, d], host_out=host)
        if c is not None:
            if L > 1 and c.dim() == 2:
                c = c.expand(L, *c.shape)
            args.C = describe(c, "c", op.D.layout)
            args.keep.append(c)
        if bias is not None:
            args.bias = bias
            args.bias_batch_stride = bias.stride(0) if bias.dim() == 2 and L > 1 else 0
            args.keep.append(bias)
        args.scale_a, args.scale_b = scale_a, scale_b
        args.keep += [s for s in (scale_a, scale_b) if s is not None]
        return args

    @property
    def output(self) -> torch.Tensor:
        return self.keep[2]

    def sync(self):
        """Wait for the GPU; copy a NumPy output back. Returns the output (array or tensor)."""
        torch.cuda.synchronize(self.device)
        if self.host_out is not None:
            np_d, d = self.host_out
            np_d[...] = d.cpu().numpy()
            return np_d
        return self.output


def _operand_reasons(name: str, x: Operand | None, want_dtype: str, want_layout: str,
                     L: int) -> list[str]:
    if x is None:
        return [f"{name} is missing"]
    why = []
    mem = "f32" if want_dtype == "tf32" else want_dtype
    if x.dtype != mem:
        why.append(f"{name} has dtype {x.dtype}, the operation takes {mem}")
        return why
    if x.layout != want_layout:
        found = x.layout or f"neither (strides {x.strides})"
        why.append(f"{name} is {found}-major in memory, the operation takes '{want_layout}' "
                   f"(transpose, or use an operation with {name}.layout='{x.layout}')")
        return why
    align = 128 // bits(mem)
    if x.ptr % 16:
        why.append(f"{name}'s address is not 16-byte aligned (TMA needs it): copy it to an "
                   f"aligned buffer")
    if x.ld % align:
        why.append(f"{name}'s leading stride {x.ld} is not a multiple of {align} elements "
                   f"(16 bytes, TMA needs it): pad the leading dimension")
    if L > 1 and x.batch_stride == 0:
        why.append(f"{name} is broadcast over the batch (batch stride 0), which the TMA "
                   f"descriptors here do not take: materialize it")
    elif x.batch_stride % align:
        why.append(f"{name}'s batch stride {x.batch_stride} is not a multiple of {align} "
                   f"elements (16 bytes)")
    return why


def reasons(op, args: GemmArguments) -> list[str]:
    """Why op cannot run args; [] when it can."""
    why = []
    for name, v in (("M", args.M), ("N", args.N), ("K", args.K), ("L", args.L)):
        if not 1 <= v < 2**31:
            why.append(f"{name}={v} is outside [1, 2^31) (empty problems are the caller's "
                       f"to handle)")
    why += _operand_reasons("A", args.A, op.math.element_a, op.A.layout, args.L)
    why += _operand_reasons("B", args.B, op.math.element_b, op.B.layout, args.L)
    why += _operand_reasons("D", args.D, op.D.element, op.D.layout, args.L)
    epi = op.epilogue
    if epi.has_source:
        why += _operand_reasons("C", args.C, epi.element_source, op.D.layout, args.L)
    elif args.C is not None:
        why.append("C is given but the operation's epilogue reads no source")
    if args.D is not None and args.D.layout is not None and args.L > 1 and args.D.batch_stride \
            == 0:
        pass  # reported above
    why += epilogue_reasons(epi, args.M, args.N, args.bias, args.scale_a, args.scale_b)
    split_k = op.mode == "split_k_parallel"
    if args.splits != 1 and op.tile.tile_scheduler != "stream_k" and not split_k:
        why.append(f"splits={args.splits} needs the stream-K tile scheduler or mode "
                   f"'split_k_parallel'")
    if split_k and args.L != 1:
        why.append(f"mode 'split_k_parallel' takes one problem (L=1), got L={args.L}: use an "
                   f"operation of mode 'batched' for batches")
    if args.splits < 1:
        why.append(f"splits={args.splits} must be >= 1 (1: the stream-K scheduler's own "
                   f"heuristic; more: split K into that many parts)")
    if args.swizzle not in (None, *SWIZZLES):
        why.append(f"swizzle={args.swizzle!r} must be one of {SWIZZLES} (or None: picked from "
                   f"the problem)")
    if args.raster not in RASTERS:
        why.append(f"raster={args.raster!r} must be one of {list(RASTERS)}")
    return why


def epilogue_reasons(epi, M: int, N: int, bias, scale_a, scale_b) -> list[str]:
    """Why the tensors of an epilogue (bias, FP8 scales) do not fit ``epi`` (a
    LinearCombination) on an M x N output; [] when they do. Shared by every kernel on it."""
    why = []
    if epi.bias is None and bias is not None:
        why.append("a bias is given but the operation's epilogue has none")
    if epi.bias is not None:
        n = M if epi.bias == "row" else N
        b = bias
        if b is None:
            why.append(f"the operation adds a bias ({epi.bias}) but none is given")
        elif dtype_name(b) != epi.element_bias:
            why.append(f"bias has dtype {dtype_name(b)}, the operation takes {epi.element_bias}")
        elif b.shape[-1] != n or b.stride(-1) != 1 or b.dim() > 2:
            why.append(f"bias must be {n} contiguous values ({epi.bias} bias), optionally one "
                       f"row per batch; got shape {tuple(b.shape)}, strides {b.stride()}")
    for name, kind, n, s in (("scale_a", epi.scale_a, M, scale_a),
                             ("scale_b", epi.scale_b, N, scale_b)):
        if kind is None and s is not None:
            why.append(f"{name} is given but the operation has no {name}")
        elif kind is not None:
            want = 1 if kind == "tensor" else n
            if s is None or s.dtype != torch.float32 or s.numel() != want or (
                    want > 1 and not s.is_contiguous()):
                got = "none" if s is None else f"{s.dtype} {tuple(s.shape)}"
                why.append(f"{name} must be {want} contiguous float32 value(s) ({kind}), got "
                           f"{got}")
    return why


SWIZZLES = (1, 2, 4, 8)
RASTERS = {"heuristic": 0, "along_m": 1, "along_n": 2}  # the entry point's raster codes


def _log_swizzle(blocks_m: int, blocks_n: int, swizzle: int) -> int:
    """CUTLASS's get_log_swizzle_size: the swizzle it applies is smaller on small grids."""
    least = min(blocks_m, blocks_n)
    for log, (size, dim) in ((3, (8, 6)), (2, (4, 3)), (1, (2, 2))):
        if swizzle >= size and least >= dim:
            return log
    return 0


def scheduler_order(op, M: int, N: int) -> int:
    """The largest swizzle that adds no output tiles: CUTLASS rounds the grid of CTA tiles up
    to a multiple of swizzle x cluster in both dimensions, and a padded tile runs a whole
    mainloop on TMA's zero fill (at 5000^2 with 128x256 tiles, swizzle 8 would add 20% tiles;
    4 adds none). No padding, no compute lost; only the order changes. Returns the swizzle
    CUTLASS applies (it lowers a larger one on small grids)."""
    tm, tn, _ = op.tile.tile_shape
    cm, cn, _ = op.tile.cluster_shape
    bm, bn = -(-M // tm), -(-N // tn)
    base = round_up(bm, cm) * round_up(bn, cn)
    for swizzle in (8, 4, 2):
        s = 1 << _log_swizzle(bm, bn, swizzle)
        if round_up(bm, s * cm) * round_up(bn, s * cn) == base:
            return s
    return 1


def scratch(n: int, dtype, device: int, stream: int):
    """A buffer for one launch on ``stream`` (a raw handle). Nothing needs to keep it: torch's
    caching allocator hands its memory out again only to work queued after this launch on the
    current stream, and on another stream ``record_stream`` defers that until the launch is
    done. (Keeping each launch's buffer in the arguments grew without bound when they were
    reused: a timing loop ran the GPU out of memory.)"""
    if stream == torch._C._cuda_getCurrentRawStream(device):
        from vitrail import plan
        return plan.scratch(n, dtype, torch.device("cuda", device))  # a plan allocates it again
    buf = torch.empty(n, dtype=dtype, device=f"cuda:{device}")
    buf.record_stream(torch.cuda.ExternalStream(stream, device=f"cuda:{device}"))
    return buf


def launch(op, module, args: GemmArguments, stream=None) -> None:
    """Call the compiled entry point (checks already done by can_implement)."""
    sm = sm_count(args.device)
    if stream is None:
        stream = torch._C._cuda_getCurrentRawStream(args.device)
    workspace, ws_bytes = 0, 0
    swizzle = args.swizzle if args.swizzle is not None else scheduler_order(op, args.M, args.N)
    raster = RASTERS[args.raster]
    if op.tile.tile_scheduler == "stream_k" or op.mode == "split_k_parallel":
        ws_bytes = module.function("vitrail_gemm_workspace")(args.M, args.N, args.K, args.L,
                                                              args.splits, swizzle, raster, sm)
        if ws_bytes:
            buf = scratch(ws_bytes, torch.uint8, args.device, stream)
            workspace = buf.data_ptr()
    c = args.C
    ptr = (lambda t: 0 if t is None else t.data_ptr())
    values = (args.A.ptr, args.B.ptr, c.ptr if c else 0, args.D.ptr, ptr(args.bias),
              ptr(args.scale_a), ptr(args.scale_b), args.M, args.N, args.K, args.L,
              args.A.ld, args.A.batch_stride, args.B.ld, args.B.batch_stride,
              c.ld if c else 0, c.batch_stride if c else 0, args.D.ld, args.D.batch_stride,
              args.bias_batch_stride, args.alpha, args.beta, args.slope, args.lo, args.hi,
              args.splits, swizzle, raster, workspace, ws_bytes, sm)
    call_entry(module.function("vitrail_gemm"), values, args.device, stream, op.name, CODES)


def call_entry(fn, values: tuple, device: int, stream: int, name: str, codes: dict) -> None:
    """Call entry point fn on ``device`` (made current for the call where it is not) and
    stream; a non-zero return is a LaunchError naming the operation and what the code means
    (``codes``: the entry's check codes; positive codes are cudaError_t)."""
    if torch.cuda.current_device() != device:
        with torch.cuda.device(device):
            code = fn(*values, stream=stream)
    else:
        code = fn(*values, stream=stream)
    if code:
        what = codes.get(code) or f"CUDA error {code}"
        raise LaunchError(f"{name}: {what}")


# ------------------------------------------------------------------------------ mode 'array'
@dataclass
class ArrayArguments:
    """The runtime side of mode 'array': L equal-shaped problems as lists of tensors."""
    A: list
    B: list
    D: list
    M: int
    N: int
    K: int
    C: Optional[list] = None
    alpha: float = 1.0
    beta: float = 0.0
    lds: tuple = (0, 0, 0, 0)  # lda, ldb, ldc, ldd (0: mixed, reported by reasons)
    layouts: tuple = (None, None, None, None)
    device: int = 0
    keep: list = field(default_factory=list, repr=False)

    @property
    def L(self) -> int:
        return len(self.A)

    @classmethod
    def from_tensors(cls, op, a: Sequence[Any], b: Sequence[Any], d: Optional[Sequence] = None,
                     *, c: Optional[Sequence] = None, alpha: float = 1.0,
                     beta: float = 0.0) -> "ArrayArguments":
        """Arguments for ``op`` (mode 'array') on lists: a[i] (M x K), b[i] (K x N), d[i]
        (M x N; a new list when None), c[i] (M x N) for an epilogue with a source."""
        import torch
        if op.mode != "array":
            raise ArgumentError(f"ArrayArguments: the operation's mode is {op.mode!r}, expected "
                                f"'array'")
        for name, xs in (("a", a), ("b", b), ("d", d), ("c", c)):
            if xs is not None and not isinstance(xs, (list, tuple)):
                raise ArgumentError(f"ArrayArguments: {name} must be a list or tuple of "
                                    f"matrices, got {type(xs).__name__}")
        if not a or len(a) != len(b):
            raise ArgumentError(f"ArrayArguments: a and b must be non-empty lists of one length, "
                                f"got {len(a)} and {len(b)}")
        a = [as_cuda_tensor(x, f"a[{i}]")[0] for i, x in enumerate(a)]
        b = [as_cuda_tensor(x, f"b[{i}]")[0] for i, x in enumerate(b)]
        M, K = a[0].shape[-2:] if a[0].dim() == 2 else (-1, -1)
        N = b[0].shape[-1] if b[0].dim() == 2 else -1
        for name, xs, shape in (("a", a, (M, K)), ("b", b, (K, N))):
            for i, x in enumerate(xs):
                if x.dim() != 2 or tuple(x.shape) != shape:
                    raise ArgumentError(f"ArrayArguments: {name}[{i}] has shape "
                                        f"{tuple(x.shape)}, expected {shape} (every matrix of "
                                        f"the array has {name}[0]'s shape; a[0] is M x K, b[0] "
                                        f"K x N with a[0]'s K)")
        if d is None:
            dtype = getattr(torch, DTYPES[op.D.element][2])
            d = [torch.empty(M, N, dtype=dtype, device=a[0].device) for _ in a]
            if op.D.layout == "col":
                d = [x.t().contiguous().t() for x in d]
        else:
            d = [as_cuda_tensor(x, f"d[{i}]")[0] for i, x in enumerate(d)]
        if c is not None:
            c = [as_cuda_tensor(x, f"c[{i}]")[0] for i, x in enumerate(c)]
        for name, xs in (("d", d), ("c", c)):
            if xs is None:
                continue
            if len(xs) != len(a):
                raise ArgumentError(f"ArrayArguments: {name} has {len(xs)} matrices, a has "
                                    f"{len(a)}")
            for i, x in enumerate(xs):
                if x.dim() != 2 or tuple(x.shape) != (M, N):
                    raise ArgumentError(f"ArrayArguments: {name}[{i}] has shape "
                                        f"{tuple(x.shape)}, expected ({M}, {N})")
        args = cls(A=a, B=b, D=d, C=c, M=M, N=N, K=K, alpha=float(alpha), beta=float(beta),
                   device=a[0].device.index or 0, keep=[*a, *b, *d, *(c or [])])
        lds, layouts = [], []
        for xs, want in ((a, op.A.layout), (b, op.B.layout), (c, op.D.layout), (d, op.D.layout)):
            ld, lay = _common_layout(xs, want)
            lds.append(ld)
            layouts.append(lay)
        args.lds, args.layouts = tuple(lds), tuple(layouts)
        return args

    def sync(self) -> list:
        """Wait for the GPU; returns the list of outputs."""
        import torch
        torch.cuda.synchronize(self.device)
        return self.D


def _common_layout(xs, want):
    """(leading stride, layout) shared by every matrix of xs, or (0, reason) when they differ."""
    if xs is None:
        return 0, None
    infos = [describe(x, "operand", want) for x in xs]
    first = infos[0]
    if any(i.layout != first.layout or i.ld != first.ld for i in infos):
        return 0, "mixed"
    return first.ld, first.layout


def array_reasons(op, args: ArrayArguments) -> list[str]:
    """Why op (mode 'array') cannot run args; [] when it can."""
    if not isinstance(args, ArrayArguments):
        return [f"mode 'array' takes ArrayArguments (lists of tensors), got "
                f"{type(args).__name__}"]
    why = []
    for name, v in (("M", args.M), ("N", args.N), ("K", args.K), ("L", args.L)):
        if not 1 <= v < 2**31:
            why.append(f"{name}={v} is outside [1, 2^31) (empty problems are the caller's "
                       f"to handle)")
    epi = op.epilogue
    ops = [("A", args.A, op.math.element_a, op.A.layout, 0), ("B", args.B, op.math.element_b,
                                                              op.B.layout, 1),
           ("D", args.D, op.D.element, op.D.layout, 3)]
    if epi.has_source:
        if args.C is None:
            why.append("the operation's epilogue reads C but no c list is given")
        else:
            ops.append(("C", args.C, epi.element_source, op.D.layout, 2))
    elif args.C is not None:
        why.append("c is given but the operation's epilogue reads no source")
    for name, xs, el, layout, i in ops:
        mem = "f32" if el == "tf32" else el
        dts = {dtype_name(x) for x in xs}
        if dts != {mem}:
            why.append(f"{name} has dtype(s) {', '.join(sorted(dts))}, the operation takes {mem}")
            continue
        lay, ld = args.layouts[i], args.lds[i]
        if lay == "mixed":
            why.append(f"the matrices of {name} differ in layout or leading stride; array mode "
                       f"takes one of each: make them alike")
        elif lay != layout:
            why.append(f"{name} is {lay or 'neither row nor col'}-major in memory, the "
                       f"operation takes '{layout}'")
        elif ld % (128 // bits(mem)):
            why.append(f"{name}'s leading stride {ld} is not a multiple of 16 bytes (TMA needs "
                       f"it): pad the leading dimension")
        bad = [j for j, x in enumerate(xs) if x.data_ptr() % 16]
        if bad:
            why.append(f"{name}[{bad[0]}]'s address is not 16-byte aligned (TMA needs it)")
    devices = {x.device for x in args.keep}
    if len(devices) > 1:
        why.append(f"the matrices are on several devices ({', '.join(map(str, devices))})")
    return why


def array_launch(op, module, args: ArrayArguments, stream=None) -> None:
    """Copy the pointer arrays to the device and call the entry point (checks done)."""
    import torch
    dev = torch.device("cuda", args.device)
    rows = [args.A, args.B, args.C or args.D, args.D]
    if stream is None:
        stream = torch._C._cuda_getCurrentRawStream(args.device)
    host = torch.tensor([[x.data_ptr() for x in xs] for xs in rows], dtype=torch.int64)
    ptrs = scratch(host.numel(), torch.int64, args.device, stream).view(host.shape)
    ptrs.copy_(host)  # on the current stream: ordered before the launch when it is that one
    if stream != torch._C._cuda_getCurrentRawStream(args.device):
        torch.cuda.current_stream(dev).synchronize()  # else the copy must be done first
    sm = sm_count(args.device)
    ws = module.function(array_entries.WORKSPACE_ENTRY)(args.M, args.N, args.K, args.L, sm)
    buf = scratch(max(ws, 1), torch.uint8, args.device, stream)
    lda, ldb, ldc, ldd = args.lds
    entry = module.function(array_entries.ENTRY)
    code = entry(ptrs[0], ptrs[1], ptrs[2] if args.C else 0, ptrs[3], args.M, args.N, args.K,
                 args.L, lda, ldb, ldc or ldd, ldd, args.alpha, args.beta, buf, ws, sm,
                 stream=stream)
    if code:
        raise LaunchError(f"{op.name}: {CODES.get(code) or f'CUDA error {code}'}")


def grouped_reasons(op, args) -> list[str]:
    """Mode 'grouped' runs on device arrays of sizes, pointers and strides, not on arguments
    of this module: vitrail.gemm.ops.grouped builds and launches them."""
    return ["mode 'grouped' takes device arrays of sizes, pointers and leading strides "
            "(vitrail.gemm.ops.grouped launches it), not GemmArguments"]


# each runtime side (descriptions.ModeRules.arguments): (reasons, launch)
RUNTIME = {"gemm": (reasons, launch), "array": (array_reasons, array_launch),
           "grouped": (grouped_reasons, None)}
