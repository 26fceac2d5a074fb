"""The runtime side of a convolution: arguments from tensors, the checks TMA im2col and
CUTLASS's sm90 kernels impose, and the launch (the GEMM's helpers: arguments.py).

Tensors are 4-D and indexed channels-last, as CUTLASS indexes them: activations N x H x W x C,
filters K x R x S x C, outputs N x P x Q x K (a channels-last torch tensor of shape (N, C, H, W)
is ``t.permute(0, 2, 3, 1)``, a view). Their strides are read from the tensors: any strides
whose channel stride is 1 and whose others are multiples of 16 bytes (wgrad: dy and dw
packed).

Which tensor plays which operand (conv.py's table): fprop a = x, b = w, d = y; dgrad a = dy,
b = w, d = dx; wgrad a = dy, b = x, d = dw.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from vitrail.device import sm_count
from vitrail.gemm.arguments import as_cuda_tensor, call_entry, dtype_name, epilogue_reasons
from vitrail.gemm.descriptions import DTYPES, bits
from vitrail.gemm.emit import CODES
from vitrail.jit.errors import ArgumentError

WHAT = "conv2d"

ENTRY = "vitrail_conv"
# the entry point's check codes: the GEMM's, and these
CONV_CODES = {**CODES,
              -3: "a size is not positive, or a padding is negative",
              -6: "CUTLASS's can_implement refused the problem (the TMA im2col limits)",
              -7: "dgrad takes a traversal stride of 1 only",
              -8: "a channel count (C or K) is not a multiple of 16 bytes (TMA needs it)",
              -9: "splits: 1 and no phase table, or for a chunked wgrad up to MAX_CHUNKS, "
                  "each chunk of the batch non-empty, or for a phased dgrad up to MAX_CHUNKS "
                  "phases and their table"}
# TMA im2col limits of a 2-D convolution (CUTLASS's collective checks the same): padding in
# [0, 256], the im2col box corners in [-128, 127], the filter's extent (R-1)*dilation < 255
PADDING_LIMIT = 256
CORNER_LIMIT = 128
OFFSET_LIMIT = 255
# the most batch chunks one chunked wgrad launch takes (and stride phases one phased dgrad launch
# does): every chunk's parameters (1,536 bytes for CUTLASS 4.2's 128x128 kernel) are the
# kernel's, whose parameters take at most 32,764 bytes
MAX_CHUNKS = 20
# a phased dgrad's table: these int64 values a phase (conv.py's _PHASES)
PHASE_VALUES = ("filter offset", "dx offset", "h", "w", "r", "s", "pad_h", "pad_w", "pad_h_hi",
                "pad_w_hi")


@dataclass(frozen=True)
class Conv2dProblem:
    """A 2-D convolution's sizes, as the forward pass sees them (runtime values).

    x is N x H x W x C, w is K x R x S x C, y is N x P x Q x K; padding (top, left) and, for
    asymmetric padding, (bottom, right) in pad_hi (default: the same as pad)."""
    N: int
    H: int
    W: int
    C: int
    K: int
    R: int
    S: int
    pad: tuple[int, int] = (0, 0)
    stride: tuple[int, int] = (1, 1)
    dilation: tuple[int, int] = (1, 1)
    pad_hi: Optional[tuple[int, int]] = None
    groups: int = 1

    def __post_init__(self):
        for name in ("pad", "stride", "dilation", "pad_hi"):
            v = getattr(self, name)
            if v is not None:
                object.__setattr__(self, name, tuple(int(x) for x in v))
        if self.pad_hi is None:
            object.__setattr__(self, "pad_hi", self.pad)

    @property
    def P(self) -> int:
        return _out_extent(self.H, self.R, self.pad[0] + self.pad_hi[0], self.stride[0],
                           self.dilation[0])

    @property
    def Q(self) -> int:
        return _out_extent(self.W, self.S, self.pad[1] + self.pad_hi[1], self.stride[1],
                           self.dilation[1])

    def gemm_shape(self, kind: str) -> tuple[int, int, int]:
        """(M, N, K) of the implicit GEMM of ``kind`` (the module docstring's table)."""
        npq, nhw, rs = self.N * self.P * self.Q, self.N * self.H * self.W, self.R * self.S
        return {"fprop": (npq, self.K, rs * self.C), "dgrad": (nhw, self.C, rs * self.K),
                "wgrad": (self.K, rs * self.C, npq)}[kind]


def _out_extent(size: int, filt: int, pad_total: int, stride: int, dilation: int) -> int:
    return (size + pad_total - (filt - 1) * dilation - 1) // stride + 1


def pair(v, name: str) -> tuple[int, int]:
    """An int or a pair of ints as a pair (torch's conventions for stride, padding...)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return (v, v)
    try:
        a, b = v
        if all(isinstance(x, int) and not isinstance(x, bool) for x in (a, b)):
            return (int(a), int(b))
    except (TypeError, ValueError):
        pass
    raise ArgumentError(f"{WHAT}: {name} must be an int or a pair of ints, got {v!r}")


@dataclass
class ConvArguments:
    """Everything one launch needs besides the compiled operation (all runtime values).
    x, w, y: the activation, filter and output tensors of the forward convolution's shapes
    (for dgrad, x is dx and y is dy; for wgrad, w is dw and y is dy)."""
    problem: Conv2dProblem
    x: torch.Tensor
    w: torch.Tensor
    y: torch.Tensor
    C: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    alpha: float = 1.0
    beta: float = 0.0
    slope: float = 0.01
    lo: float = float("-inf")
    hi: float = float("inf")
    kind: str = "fprop"
    splits: int = 1
    phases: Optional[torch.Tensor] = None
    device: int = 0
    keep: list = field(default_factory=list, repr=False)

    @classmethod
    def from_tensors(cls, op, a, b, d=None, *, c=None, bias=None, padding=0, stride=1,
                     dilation=1, pad_hi=None, input_hw=None, filter_rs=None,
                     alpha: float = 1.0, beta: float = 0.0, slope: float = 0.01,
                     lo: float = float("-inf"), hi: float = float("inf"),
                     splits: int = 1,
                     phases: Optional[torch.Tensor] = None) -> "ConvArguments":
        """Arguments for ``op`` (a ConvOperation) on its operands a and b (the module
        docstring's roles) and output d (allocated, packed, when None); c: the epilogue's source
        (D's shape), bias: one value per column of D. padding, stride, dilation: an int or
        (h, w), as torch's conv2d; pad_hi: (bottom, right) padding where it differs from
        padding. An allocated dgrad output needs ``input_hw`` (H, W), a wgrad output
        ``filter_rs`` (R, S): dy does not determine them. splits (wgrad): the batch runs in
        that many chunks of whole images, chunk i's partial dw written to d's rows [i K,
        (i + 1) K): d is (splits K) x R x S x C, and the caller sums the partials. phases
        (dgrad): a strided dx's stride phases in one launch (ConvOperation.phased), a CPU int64
        tensor of a row of PHASE_VALUES a phase; a, b and d are then the first phase's views,
        whose strides every phase shares."""
        kind = op.kind
        a, _ = as_cuda_tensor(a, "a", WHAT)
        b, _ = as_cuda_tensor(b, "b", WHAT)
        d, np_d = as_cuda_tensor(d, "d", WHAT)
        if np_d is not None:
            raise ArgumentError(f"{WHAT}: d must be a CUDA tensor (or None), got a NumPy array")
        c, _ = as_cuda_tensor(c, "c", WHAT)
        bias, _ = as_cuda_tensor(bias, "bias", WHAT)
        for name, t in (("a", a), ("b", b), ("d", d), ("c", c)):
            if t is not None and t.dim() != 4:
                raise ArgumentError(f"{WHAT}: {name} must be 4-D (channels-last: NHWC, KRSC or "
                                    f"NPQK), got shape {tuple(t.shape)}")
        pad, st, dil = pair(padding, "padding"), pair(stride, "stride"), pair(dilation, "dilation")
        hi_pad = pad if pad_hi is None else pair(pad_hi, "pad_hi")
        if kind == "fprop":
            x, w = a, b
            N, H, W, C = x.shape
            K, R, S, Cw = w.shape
            if Cw != C:
                raise ArgumentError(f"{WHAT}: x has {C} channels and w {Cw}: they must match "
                                    f"(groups are not implemented)")
        elif kind == "dgrad":
            dy, w = a, b
            N, P, Q, K = dy.shape
            Kw, R, S, C = w.shape
            if Kw != K:
                raise ArgumentError(f"{WHAT}: dy has {K} channels and w {Kw} filters: they "
                                    f"must match")
            if d is not None:
                H, W = d.shape[1], d.shape[2]
            elif input_hw is not None:
                H, W = pair(input_hw, "input_hw")
            else:
                raise ArgumentError(f"{WHAT}: dgrad without d needs input_hw=(H, W): dy's "
                                    f"size does not determine x's")
        else:
            dy, x = a, b
            N, P, Q, K = dy.shape
            Nx, H, W, C = x.shape
            if Nx != N:
                raise ArgumentError(f"{WHAT}: dy has batch {N} and x {Nx}: they must match")
            if d is not None:
                R, S = d.shape[1], d.shape[2]
            elif filter_rs is not None:
                R, S = pair(filter_rs, "filter_rs")
            else:
                raise ArgumentError(f"{WHAT}: wgrad without d needs filter_rs=(R, S): dy and "
                                    f"x do not determine the filter's size")
        if not isinstance(splits, int) or isinstance(splits, bool) or splits < 1 or \
                splits > 1 and kind != "wgrad":
            raise ArgumentError(f"{WHAT}: splits must be a positive int, and 1 but for wgrad, "
                                f"got {splits!r} ({kind})")
        if phases is not None:
            if kind != "dgrad" or not isinstance(phases, torch.Tensor) or \
                    phases.dtype != torch.int64 or phases.device.type != "cpu" or \
                    phases.dim() != 2 or phases.shape[1] != len(PHASE_VALUES) or \
                    not phases.shape[0] or not phases.is_contiguous():
                raise ArgumentError(f"{WHAT}: phases must be a packed CPU int64 tensor of "
                                    f"{len(PHASE_VALUES)} values a phase ({', '.join(PHASE_VALUES)}"
                                    f"), for dgrad only; got {phases!r:.80}")
            splits = phases.shape[0]
        problem = Conv2dProblem(N, H, W, C, K, R, S, pad, st, dil, hi_pad)
        if problem.P < 1 or problem.Q < 1:
            raise ArgumentError(f"{WHAT}: the output would be {problem.P} x {problem.Q}: the "
                                f"dilated filter is larger than the padded input")
        chunks = splits if kind == "wgrad" else 1
        shapes = {"x": (N, H, W, C), "w": (K * chunks, R, S, C),
                  "y": (N, problem.P, problem.Q, K)}
        roles = {"fprop": ("x", "w", "y"), "dgrad": ("y", "w", "x"), "wgrad": ("y", "x", "w")}
        ra, rb, rd = roles[kind]
        for name, t, role in (("a", a, ra), ("b", b, rb)):
            if tuple(t.shape) != shapes[role]:
                raise ArgumentError(f"{WHAT}: {name} ({_ROLE_NAMES[kind][name]}) has shape "
                                    f"{tuple(t.shape)}, expected {shapes[role]}")
        if d is None:
            dtype = getattr(torch, DTYPES[op.D.element][2])
            d = torch.empty(shapes[rd], dtype=dtype, device=a.device)
        elif tuple(d.shape) != shapes[rd]:
            raise ArgumentError(f"{WHAT}: d ({_ROLE_NAMES[kind]['d']}) has shape "
                                f"{tuple(d.shape)}, expected {shapes[rd]}")
        if c is not None and tuple(c.shape) != shapes[rd]:
            raise ArgumentError(f"{WHAT}: c has shape {tuple(c.shape)}, expected D's "
                                f"{shapes[rd]}")
        named = dict(zip((ra, rb, rd), (a, b, d)))
        args = cls(problem, named["x"], named["w"], named["y"], C=c, bias=bias,
                   alpha=float(alpha), beta=float(beta), slope=float(slope), lo=float(lo),
                   hi=float(hi), kind=kind, splits=splits, phases=phases,
                   device=a.device.index or 0,
                   keep=[a, b, d] + [t for t in (c, bias, phases) if t is not None])
        return args

    @property
    def operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(A, B, D) of the implicit GEMM."""
        return {"fprop": (self.x, self.w, self.y), "dgrad": (self.y, self.w, self.x),
                "wgrad": (self.y, self.x, self.w)}[self.kind]

    @property
    def output(self) -> torch.Tensor:
        return self.operands[2]


_ROLE_NAMES = {"fprop": {"a": "x", "b": "w", "d": "y"},
               "dgrad": {"a": "dy", "b": "w", "d": "dx"},
               "wgrad": {"a": "dy", "b": "x", "d": "dw"}}


def strides(t: torch.Tensor) -> tuple[int, ...]:
    """t's strides with those of size-1 dimensions made what a packed tensor's would be: torch
    leaves them as they came (a (K, C, 1, 1) filter in channels_last keeps the strides of its
    contiguous NCHW form), and no element is ever addressed through them, but TMA checks every
    stride it is given."""
    out = list(t.stride())
    for i in range(t.dim() - 2, -1, -1):
        if t.shape[i] == 1:
            out[i] = out[i + 1] * max(t.shape[i + 1], 1)
    return tuple(out)


def _packed(t: torch.Tensor) -> bool:
    return t.is_contiguous()  # 4-D, indexed NHWC/KRSC: packed means contiguous


def _tensor_reasons(name: str, t: Optional[torch.Tensor], dtype: str) -> list[str]:
    if t is None:
        return [f"{name} is missing"]
    mem = "f32" if dtype == "tf32" else dtype  # TF32's operands are fp32 in memory
    if dtype_name(t) != mem:
        return [f"{name} has dtype {dtype_name(t)}, the operation takes {mem}"]
    why = []
    align = 128 // bits(dtype)
    if t.stride(3) != 1 and t.shape[3] > 1:
        why.append(f"{name}'s channels (last index) are not contiguous (strides {t.stride()}): "
                   f"make it channels-last")
    if t.data_ptr() % 16:
        why.append(f"{name}'s address is not 16-byte aligned (TMA needs it): copy it to an "
                   f"aligned buffer")
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        why.append(f"{name} has a stride of 0 (strides {t.stride()}, an expanded tensor): TMA "
                   f"takes no zero stride; pass a copy")
    if any(s % align for s in strides(t)[:3]):
        why.append(f"{name}'s strides {strides(t)} are not multiples of {align} elements (16 "
                   f"bytes, TMA needs it)")
    return why


def reasons(op, args: ConvArguments) -> list[str]:
    """Why op (a ConvOperation) cannot run args; [] when it can."""
    why = []
    p = args.problem
    if args.kind != op.kind:
        return [f"the arguments are for {args.kind}, the operation is {op.kind}"]
    a_el, d_el = op.math.element_a, op.D.element
    A, B, D = args.operands
    align = min(128 // bits(a_el), 128 // bits(d_el))
    for name, v in (("C (input channels)", p.C), ("K (output channels)", p.K)):
        if v > 0 and v % align:
            why.append(f"{name}={v} is not a multiple of {align} (16 bytes of {a_el}; TMA "
                       f"reads whole 16-byte channel vectors): pad the channels with zeros")
    why += _tensor_reasons("A", A, a_el)
    why += _tensor_reasons("B", B, a_el)
    why += _tensor_reasons("D", D, d_el)
    epi = op.epilogue
    if epi.has_source:
        why += _tensor_reasons("C", args.C, epi.element_source)
    elif args.C is not None:
        why.append("C is given but the operation's epilogue reads no source")
    M, N, K = p.gemm_shape(op.kind)
    why += epilogue_reasons(epi, M, N, args.bias, None, None)
    if p.groups != 1:
        why.append(f"groups={p.groups}: grouped convolutions are not implemented (CUTLASS's "
                   f"sm90 kernels take groups=1)")
    for name, v in (("N", p.N), ("H", p.H), ("W", p.W), ("C", p.C), ("K", p.K), ("R", p.R),
                    ("S", p.S)):
        if v < 1:
            why.append(f"{name}={v} must be positive (empty problems are the caller's)")
    if why:
        return why
    for i, dim in enumerate("hw"):
        lo_pad, hi_pad = p.pad[i], p.pad_hi[i]
        if not (0 <= lo_pad <= PADDING_LIMIT and 0 <= hi_pad <= PADDING_LIMIT):
            why.append(f"padding ({lo_pad}, {hi_pad}) along {dim} is outside [0, "
                       f"{PADDING_LIMIT}] (TMA im2col)")
        if p.stride[i] < 1 or p.dilation[i] < 1:
            why.append(f"stride {p.stride[i]} and dilation {p.dilation[i]} along {dim} must be "
                       f"positive")
            continue
        extent = ((p.R, p.S)[i] - 1) * p.dilation[i]
        if extent >= OFFSET_LIMIT:
            why.append(f"the dilated filter spans {extent + 1} pixels along {dim}; TMA im2col "
                       f"takes filter offsets below {OFFSET_LIMIT}")
        lower, upper = _corners(op.kind, p, i, extent)
        if not all(-CORNER_LIMIT <= v < CORNER_LIMIT for v in (lower, upper)):
            why.append(f"the im2col box corners ({lower}, {upper}) along {dim} are outside "
                       f"[-{CORNER_LIMIT}, {CORNER_LIMIT - 1}] (TMA im2col): less padding or "
                       f"a smaller dilated filter")
    if op.kind == "dgrad" and p.stride != (1, 1):
        why.append(f"dgrad at stride {p.stride}: CUTLASS's sm90 dgrad runs (and is tested) at "
                   f"unit stride only; strided dgrad is not implemented yet")
    if op.kind == "wgrad":
        for name, t in (("dy (A)", A), ("dw (D)", D)):
            if not _packed(t):
                why.append(f"{name} must be packed (contiguous NPQK / KRSC) for wgrad, got "
                           f"strides {t.stride()}")
        if args.C is not None and not _packed(args.C):
            why.append(f"C must be packed for wgrad, got strides {args.C.stride()}")
    why += _split_reasons(op, args)
    gemm_m = p.N * p.P * p.Q if op.kind != "dgrad" else p.N * p.H * p.W
    if gemm_m >= 2**31:
        why.append(f"N*P*Q (or N*H*W) = {gemm_m} exceeds 2^31 - 1 (CUTLASS's int32 extents)")
    return why


def _split_reasons(op, args: ConvArguments) -> list[str]:
    """Why op cannot run args in args.splits batch chunks (conv.py's wgrad kernel)."""
    splits, n = args.splits, args.problem.N
    if args.phases is not None or op.phased:
        if args.phases is None:
            return ["a phased dgrad kernel runs a table of stride phases (phases=)"]
        if not op.phased:
            return ["phases: only a phased dgrad kernel (ConvOperation.phased) runs them"]
        why = [] if splits <= MAX_CHUNKS else \
            [f"{splits} phases: one launch takes at most {MAX_CHUNKS}"]
        align = 128 // bits(op.math.element_a)
        for name, t in (("x", args.x), ("w", args.w), ("y", args.y)):
            if any(v % align for v in t.stride()[:3]):
                why.append(f"{name}'s strides {t.stride()} (every phase's) are not multiples of "
                           f"{align} elements")
        return why
    if splits == 1:
        return []
    why = []
    if not op.chunked:
        why.append(f"splits={splits}: only a chunked wgrad kernel (ConvOperation.chunked) runs "
                   f"the batch in chunks")
    if splits > MAX_CHUNKS:
        why.append(f"splits={splits}: one launch takes at most {MAX_CHUNKS} chunks")
    chunk = -(-n // max(splits, 1))
    if (splits - 1) * chunk >= n:
        why.append(f"splits={splits} of a batch of {n}: chunks of {chunk} images leave the last "
                   f"empty")
    if args.output.shape[0] != splits * args.problem.K:
        why.append(f"D has {args.output.shape[0]} rows; {splits} chunks of K={args.problem.K} "
                   f"take {splits * args.problem.K}")
    return why


def _corners(kind: str, p: Conv2dProblem, i: int, extent: int) -> tuple[int, int]:
    """The TMA im2col box's lower and upper corners along spatial dimension i (h: 0, w: 1),
    as CUTLASS's collective computes them."""
    if kind == "dgrad":
        lower = p.pad[i] - extent
        out = (p.P, p.Q)[i]
        return lower, lower + (p.H, p.W)[i] - out
    return -p.pad[i], p.pad_hi[i] - extent


def launch(op, module, args: ConvArguments, stream=None) -> None:
    """Call the compiled entry point (checks already done by can_implement)."""
    p = args.problem
    if stream is None:
        stream = torch._C._cuda_getCurrentRawStream(args.device)
    C = args.C
    D = args.output
    cs = strides(C if C is not None else D)[:3]
    # a phased dgrad's phases share the first one's strides: its own, as torch keeps them (a
    # phase's size-1 dimension keeps the stride the others step by)
    st = strides if args.phases is None else (lambda t: t.stride())
    ptr = (lambda t: 0 if t is None else t.data_ptr())
    A, B, D = args.operands
    values = (A.data_ptr(), B.data_ptr(), ptr(C), D.data_ptr(), ptr(args.bias),
              p.N, p.H, p.W, p.C, p.K, p.R, p.S, *p.pad, *p.pad_hi, *p.stride, *p.dilation,
              *st(args.x)[:3], *st(args.w)[:3], *st(args.y)[:3], *cs,
              args.alpha, args.beta, args.slope, args.lo, args.hi, args.splits,
              ptr(args.phases), 0, 0,
              sm_count(args.device))
    call_entry(module.function(ENTRY), values, args.device, stream, op.name, CONV_CODES)
