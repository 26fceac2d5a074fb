"""vitrail.ops.conv: 2-D convolution on CUTLASS 3's sm90 implicit GEMM (vitrail.gemm.conv).

    conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *, activation=None)
        = act(torch.nn.functional.conv2d(x, weight, bias, stride, padding, dilation, groups))

x (N, C, H, W) and weight (K, C, R, S) are read channels-last (NHWC, KRSC in memory: tensors
in torch.channels_last); the result is (N, K, P, Q) in channels_last. bf16 or fp16, or fp32
run as TF32 (as torch runs it with torch.backends.cudnn.allow_tf32, its default); fp32
accumulation, the bias and the activation fused in the kernel's epilogue. Custom ops in the
``vitrail`` namespace (torch.library: ``conv2d``, ``conv2d_dgrad``, ``conv2d_wgrad``) with fake
implementations (torch.compile, meta tensors) and autograd: dx by the dgrad kernel, dw by the
wgrad kernel, the bias's gradient summed in fp32.

Grouped convolutions run the implicit-GEMM kernels once per group, on the group's channel
slices read and written in place (strided views; wgrad copies each group's dy, which it reads
packed). That takes groups whose C / groups and K / groups are multiples of 8. Depthwise
convolutions (a group an input channel, any multiplier K / C) run direct kernels of their own
(vitrail.ops.conv.depthwise); other narrow groups are refused (torch.nn.functional.conv2d runs
them).

What is refused (NotImplementedError, saying why and what is supported), never computed another
way: GPUs other than Hopper (the kernels are sm_90a), dtypes other than bf16/fp16/fp32, fp32
with torch.backends.cudnn.allow_tf32 off (full fp32 products: torch's), fp32 depthwise
convolutions, channel counts per group (C / groups, K / groups) that are not multiples of 8 in
more than one group (but depthwise), padding, dilation or filters beyond the TMA im2col limits
(conv_arguments.reasons). A convolution of one group whose C or K is not a multiple of 8 (the
3-channel stem of an image network) runs on copies of its operands with zero channels appended
up to whole 16-byte vectors (_zero_padded), its outputs' extra channels left out; but with
fewer than 8 input channels, fprop and wgrad run as GEMMs over x's patches (runs_patches).
Inputs that are not channels-last are copied to channels-last first (a one-time warning says
so). CUTLASS's sm90 dgrad runs at unit stride only, so a strided convolution's dx runs as
stride_h * stride_w unit-stride dgrads, one a phase (the pixels at (i, j) + stride * (a, b),
written in place), each with the filter taps that reach its pixels: the convolution's own work
(dgrad_phases), all in one launch (the phased dgrad kernel, from a table of the phases:
_phase_table).

1x1 convolutions without padding (one group) at unit stride are GEMMs over pixels and run
vitrail's GEMM (vitrail.ops.gemm, with its selection: split-K, stream-K and torch's own
matmul among its candidates): fprop y = x W^T with the bias and activation in its epilogue,
dgrad dx = dy W, wgrad dw = dy^T x (fp32 as TF32 there too, whatever torch's fp32 matmul
precision: a convolution's follows torch.backends.cudnn.allow_tf32). Their channel counts need
not be multiples of 8 (the GEMM copies what TMA cannot read, with a one-time warning). A
strided one runs the implicit-GEMM kernels, which read the pixels the stride keeps in place
(its dx: one stride phase, the others zeros); only where its channels are not multiples of 8
does it run the GEMM, on a copy of the kept pixels of x, with dx scattered into zeros.

wgrad's GEMM runs over the batch's pixels (its K is N*P*Q), so a small dw (K x R*S*C: a few
128x128 tiles) would leave most SMs idle: the batch then runs in chunks of whole images in one
launch (wgrad_chunks: as many as fill the idle SMs), each chunk's dw summed in fp32 into dw.

fp32's dgrad and wgrad (but a 1x1's, vitrail's GEMM) run torch's convolution backward
(torch.nn.grad; cuDNN, TF32 as torch.backends.cudnn.allow_tf32 says): TF32's wgmma reads both
operands K-major, and dgrad's filter and wgrad's dy and x are not (ConvOperation refuses them).

Eager calls replay plans (vitrail.plan): a signature's first call of conv2d, its dgrad or its
wgrad checks, routes and launches; later calls repeat the launches on the new tensors, from one
C++ call. Autograd calls run an autograd.Function straight to those plans; torch.compile,
functorch transforms and double backward go through the custom ops.

Kernel choice: the implicit-GEMM kernels are an op family (``FAMILY``, vitrail.op.OpFamily),
a variant (configs.Variant: kind, dtype, epilogue, wgrad's partials, dgrad's phases) an Op whose
space is its CTA tile, pipeline stages and kernel (configs.space): the heuristic's 128x128x64,
or a 64-wide side where the GEMM's side is at most 64 channels, each with as many stages as
fit, on CUTLASS's non-persistent kernel; PickBest also times the narrow tile with few stages,
two CTAs an SM, and tiles of 128 rows on the persistent cooperative kernel (but not for the
phased dgrad, whose phase table a scratch copy cannot hold: the heuristic's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from vitrail.device import is_hopper, sm_count
from vitrail.gemm import (Conv2dProblem, ConvArguments, ConvOperation, LinearCombination,
                          MathInstruction, TensorDescription, TileDescription)
from vitrail.gemm.arguments import round_up
from vitrail.gemm.conv import KERNEL_SOURCE
from vitrail.gemm.conv_arguments import MAX_CHUNKS, launch
from vitrail.gemm.epilogue import ACTIVATIONS
from vitrail.gemm.ops.launch import run_into
from vitrail.gemm.ops.operands import warn_once
from vitrail.jit.errors import ArgumentError, LaunchError
from vitrail.op import OpFamily
from vitrail.ops.conv import configs, depthwise
from vitrail.ops.conv.configs import Problem, Variant
from vitrail.ops.conv.partials import sum_partials
from vitrail.ops.common import (DISPATCH, EAGER, autograd_apply, call_mode, check_same_device,
                                check_tensor)
from vitrail.plan import Plans, keep, scratch, setup, signature
from vitrail.plan.native import ARG, GRAD, INPUT, OUTPUT, VALUE, front
from vitrail.tune import limits
from vitrail.gemm.ops.reference import activation as _act
from vitrail.gemm.ops.reference import activation_backward, grad_from_output

NAME = "vitrail.ops.conv2d"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CHANNEL_VECTOR = 8  # channels in TMA's 16-byte vector (bf16, fp16): the kernels' C, K unit
ELEMENTS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "tf32"}
_OPS: dict[tuple, ConvOperation] = {}


# ------------------------------------------------------------------------------- kernels
def operation(kind: str, dtype: torch.dtype, bias: bool = False,
              activation: Optional[str] = None, partials: bool = False,
              tile: tuple[int, int, int] = (128, 128, 64), phased: bool = False,
              stages: int = 0, schedule: str = "warpspecialized") -> ConvOperation:
    """The ConvOperation of ``kind`` on ``dtype`` tensors with this epilogue, tile and pipeline
    stages (0: as many as fit; built once) and kernel (configs.SCHEDULES); partials: wgrad's
    chunked kernel, writing fp32 partial sums (wgrad_chunks); phased: dgrad's stride phases in
    one launch. The tile's K is in 16-bit elements (128 bytes at 64): fp32's (TF32) takes half
    as many."""
    key = (kind, dtype, bias, activation, partials, tile, phased, stages, schedule)
    op = _OPS.get(key)
    if op is None:
        el = ELEMENTS[dtype]
        out = "f32" if partials or el == "tf32" else el
        shape = (tile[0], tile[1], tile[2] * 2 // dtype.itemsize)
        op = _OPS[key] = ConvOperation(
            kind, TensorDescription(el), TensorDescription(el), TensorDescription(out),
            MathInstruction(el, el),
            TileDescription(shape, stages=stages, kernel_schedule=schedule),
            LinearCombination(out, bias="col" if bias else None, activation=activation),
            chunked=partials, phased=phased)
    return op


def kernel(kind: str, dtype: torch.dtype, problem: Problem, *, bias: bool = False,
           activation: Optional[str] = None, chunks: int = 1,
           phased: bool = False) -> ConvOperation:
    """The heuristic's kernel (configs.heuristic) for ``kind`` on ``problem`` (kernel_problem:
    what the call hands the heuristic); chunks > 1: wgrad's batch in chunks (wgrad_chunks);
    phased: a strided dgrad's stride phases in one launch."""
    variant = Variant(kind, dtype, bias, activation, chunks > 1, phased)
    return _operation(variant, FAMILY[variant].space.default(problem, limits()))


def kernel_problem(kind: str, n: int, c: int, hw: tuple[int, int], k: int,
                   rs: tuple[int, int], pad, pad_hi, stride, dilation,
                   groups: int = 1) -> tuple[Problem, bool]:
    """The Problem a kind's kernel gets (what _run hands the heuristic) for N images of C x H x W
    through K filters of R x S in ``groups`` groups (channels as kernel_channels), and whether
    the kind runs phased (a strided dgrad whose stride phases with taps are more than one). A
    strided dgrad's pixels are those of its launch (its phases' together), its taps the first
    phase's."""
    (h, w), (r, s) = hw, rs
    p, q = _out_hw(h, w, r, s, pad, pad_hi, stride, dilation)
    c, k = kernel_channels(c, k, groups)
    cg, kg = c // groups, k // groups
    if kind != "dgrad":
        return Problem(kind, kg, cg, r * s, n * p * q), False
    active = [ph for ph in dgrad_phases((h, w), (p, q), (r, s), pad, pad_hi, stride, dilation)
              if all(ph.rows)]
    if not active:  # no tap reaches dx (it is zeros): no launch
        return Problem(kind, kg, cg, 0, 0), False
    (th, tw), pixels = active[0].taps, n * sum(ph.rows[0] * ph.rows[1] for ph in active)
    return Problem(kind, kg, cg, len(th) * len(tw), pixels), len(active) > 1


def _operation(variant: Variant, config) -> ConvOperation:
    """The ConvOperation of a variant of the family at a config (its tile and stages)."""
    kind, dtype, bias, activation, partials, phased = variant
    return operation(kind, dtype, bias, activation, partials=partials,
                     tile=configs.tile(config), phased=phased, stages=config["stages"],
                     schedule=config["schedule"])


def prepared_operation(variant: Variant, config, a, b, d, bias, padding, stride, dilation, pad_hi,
                       splits, phases) -> tuple[ConvOperation, ConvArguments, list[str]]:
    """The operation of a variant's config, its arguments on these operands, and the reasons it
    cannot run them (none: it can)."""
    op = _operation(variant, config)
    args = ConvArguments.from_tensors(op, a, b, d, bias=bias, padding=padding, stride=stride,
                                      dilation=dilation, pad_hi=pad_hi, splits=splits,
                                      phases=phases)
    return op, args, op.can_implement(args)


def _variant(key: Variant) -> dict:
    """The Op of a variant: a tile its space, the operation of a config its render, and a launch
    that PickBest times on scratch copies of the call's operands."""
    def render(config) -> dict:
        return _operation(key, config).compile_kwargs()

    def run(module, config, *operands) -> None:
        op, args, why = prepared_operation(key, config, *operands)
        if why:
            raise LaunchError(_refused(key.kind, why))
        launch(op, module, args)
    return dict(name=key.name, space=configs.space(key.kind, not (key.partials or key.phased)),
                kernel_source=KERNEL_SOURCE,
                render=render, launch=run, examples=configs.examples(key.kind),
                shape=configs.SHAPE)  # make_problem: problems.py's (vitrail.ops.load_all)


# The implicit-GEMM kernels (configs.Variant), made on first use; the CLI knows the defaults
# (what `vitrail precompile conv2d` builds) and those made so far
FAMILY = OpFamily("conv2d", _variant, listed=configs.DEFAULTS)


# wgrad_chunks' model, in units of one CTA's 64-deep k-block of a 128x128 tile: a CTA's own cost
# beside its k-blocks (prologue, storing its fp32 tile), the bytes of partials moved in that
# time, and the sum's two launches
CHUNK_CTA_BLOCKS = 6
CHUNK_BYTES_PER_BLOCK = 1.0e6
CHUNK_SUM_BLOCKS = 15


@lru_cache(maxsize=1024)
def wgrad_chunks(k: int, rsc: int, batch: int, pixels: int, sms: int) -> int:
    """The chunks (of whole images) to run a wgrad's batch in: dw is k x rsc, the batch `batch`
    images of `pixels` output pixels each. One launch of s chunks runs tiles * s CTAs (a 128x128
    tile of dw each), each over its chunk's pixels (ceil(batch / s) * pixels of them, 64 a
    k-block) plus CHUNK_CTA_BLOCKS; chunks add their fp32 partials' traffic (written, then read
    by the sum) and the sum. Chunks only fill SMs that one pass leaves idle, never adding a wave
    (tiles * s <= sms: where CTAs share the SMs, each runs slower than the model's, and a second
    wave lost on the H100); of those counts (1 to MAX_CHUNKS, none empty), the fewest within 3%
    of the modeled best: a dw of a few tiles over a large batch runs in many chunks, one that
    fills half the GPU or more in one."""
    tiles = -(-k // 128) * -(-rsc // 128)

    def time(s: int) -> float:
        cost = -(-batch // s) * pixels / 64 + CHUNK_CTA_BLOCKS
        if s > 1:
            cost += s * k * rsc * 8 / CHUNK_BYTES_PER_BLOCK + CHUNK_SUM_BLOCKS
        return cost
    most = min(batch, MAX_CHUNKS, max(1, sms // tiles))
    counts = sorted({-(-batch // -(-batch // s)) for s in range(1, most + 1)})
    best = min(time(s) for s in counts)
    return next(s for s in counts if time(s) <= 1.03 * best)


def nhwc(t: Tensor) -> Tensor:
    """A (N, C, H, W) tensor's NHWC view (no copy)."""
    return t.permute(0, 2, 3, 1)


def _channels_last(t: Tensor, name: str) -> Tensor:
    """t itself where its memory is channels-last (NHWC / KRSC), else a channels-last copy; an
    expanded tensor (stride 0 along a dimension of more than one element) is copied too, as TMA
    takes no zero stride."""
    expanded = any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))
    if (nhwc(t).stride(3) == 1 or t.shape[1] == 1) and not expanded:
        return t
    why = "is expanded (a stride of 0)" if expanded else "is not channels-last in memory"
    warn_once(f"conv2d:{name}:{expanded}", f"{NAME}: {name} {why}; it is copied to "
                                           f"torch.channels_last before the kernel reads it "
                                           f"(pass channels_last tensors to avoid the copy)")
    return t.contiguous(memory_format=torch.channels_last)


def empty_nchw(shape: Sequence[int], like: Tensor) -> Tensor:
    """A new (N, C, H, W) tensor in channels_last memory."""
    n, c, h, w = shape
    return like.new_empty((n, h, w, c)).permute(0, 3, 1, 2)


def _run(kind: str, a: Tensor, b: Tensor, d: Tensor, bias: Optional[Tensor],
         activation: Optional[str], padding, stride, dilation, pad_hi, splits: int = 1,
         phases: Optional[Tensor] = None) -> None:
    """Run the kernel of ``kind`` on NHWC-indexed views a, b, d (conv_arguments' roles), or
    raise NotImplementedError with the reasons it cannot; splits > 1: wgrad's batch in that
    many chunks, d their fp32 partials; phases: dgrad's table of stride phases (a, b and d the
    first phase's views: _phase_table)."""
    _require_hopper(a.device)
    problem = launch_problem(kind, a, b, d, phases)
    variant = Variant(kind, a.dtype, bias is not None, activation, splits > 1, phases is not None)
    family_op = FAMILY[variant]
    operands = (a, b, d, bias, padding, stride, dilation, pad_hi, splits, phases)
    if phases is None:
        config = family_op.config(configs.problem_key(problem), problem, operands)
    else:  # the phase table's offsets reach past the first phase's views, which is all a
        # scratch copy would hold: PickBest cannot time it, the heuristic chooses
        config = family_op.space.default(problem, limits())
    op, args, why = prepared_operation(variant, config, *operands)
    if why:
        raise NotImplementedError(_refused(kind, why))
    if any(t.numel() == 0 for t in (a, b, d)):
        return
    launch(op, family_op.module(config), args)  # checked above (op.run would check again)


def launch_problem(kind: str, a: Tensor, b: Tensor, d: Tensor,
                   phases: Optional[Tensor]) -> Problem:
    """The Problem of a launch on _run's views (kernel_problem gives it from the geometry): a
    phased dgrad's pixels are every phase's (their rows in the table), its taps the first's."""
    wgrad = kind == "wgrad"
    k, c = (a.shape[3], b.shape[3]) if wgrad else (b.shape[0], b.shape[3])
    taps = d.shape[1] * d.shape[2] if wgrad else b.shape[1] * b.shape[2]
    pixels = a.shape[0] * a.shape[1] * a.shape[2] if wgrad else d.shape[0] * d.shape[1] * d.shape[2]
    if phases is not None:  # read from the kept table: no op for a plan to repeat
        pixels = d.shape[0] * sum(rows * cols for _, _, rows, cols, *_ in phases.tolist())
    return Problem(kind, k, c, taps, pixels)


def _require_hopper(device: torch.device) -> None:
    if not is_hopper(device):
        raise NotImplementedError(
            f"{NAME}: the convolution kernels are sm_90a (Hopper); "
            f"{torch.cuda.get_device_name(device)} is not one: use "
            f"torch.nn.functional.conv2d there")


def _require_tf32(dtype: torch.dtype) -> None:
    """fp32 runs as TF32, as torch's convolutions do unless torch.backends.cudnn.allow_tf32 is
    off: then refused."""
    if dtype is torch.float32 and not torch.backends.cudnn.allow_tf32:
        raise NotImplementedError(
            f"{NAME}: fp32 runs as TF32 (10-bit mantissas, as torch runs it by default), and "
            f"torch.backends.cudnn.allow_tf32 is False: use torch.nn.functional.conv2d for full "
            f"fp32 products, or allow TF32")


def _refused(kind: str, why: list[str]) -> str:
    """The NotImplementedError's message of a problem the kernel of ``kind`` cannot run."""
    return (f"{NAME} ({kind}): not supported: " + "; ".join(why) + ". Supported: bf16/fp16 "
            "(fp32 as TF32), C / groups and K / groups multiples of 8, padding <= 256 and "
            "dilated filters under 255 pixels")


# -------------------------------------------------------------------------------- checks
def _pair(v, name: str) -> tuple[int, int]:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v, v)
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) for x in v):
        return (int(v[0]), int(v[1]))
    raise ArgumentError(f"{NAME}: {name} must be an int or a pair of ints, got {v!r}")


def _padding(padding, weight: Tensor, stride, dilation) -> tuple[tuple[int, int],
                                                                  tuple[int, int]]:
    """((top, left), (bottom, right)) of torch's padding argument (ints, or 'valid'/'same')."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0), (0, 0)
        if padding == "same":
            if stride != (1, 1):
                raise ArgumentError(f"{NAME}: padding='same' needs stride 1 (as torch), got "
                                    f"stride={stride}")
            totals = [d * (k - 1) for d, k in zip(dilation, weight.shape[2:])]
            lo = tuple(t // 2 for t in totals)
            return lo, tuple(t - low for t, low in zip(totals, lo))
        raise ArgumentError(f"{NAME}: padding must be an int, a pair, 'valid' or 'same', got "
                            f"{padding!r}")
    pad = _pair(padding, "padding")
    if min(pad) < 0:
        raise ArgumentError(f"{NAME}: padding must be non-negative, got {pad}")
    return pad, pad


def _check(x, weight, bias, stride, dilation, groups, activation, cuda: bool = True) -> None:
    check_tensor(NAME, "x", x, dtypes=DTYPES, ndim=4, cuda=cuda)
    check_tensor(NAME, "weight", weight, dtypes=DTYPES, ndim=4, cuda=cuda)
    check_same_device(NAME, x=x, weight=weight, bias=bias)
    if weight.dtype != x.dtype:
        raise ArgumentError(f"{NAME}: x and weight must have one dtype, got {x.dtype} and "
                            f"{weight.dtype}")
    _require_tf32(x.dtype)
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ArgumentError(f"{NAME}: groups must be a positive int, got {groups!r}")
    c, k = x.shape[1], weight.shape[0]
    if c % groups or k % groups:
        raise ArgumentError(f"{NAME}: groups={groups} must divide x's {c} input channels and "
                            f"weight's {k} output channels")
    if weight.shape[1] * groups != c:
        raise ArgumentError(f"{NAME}: weight {tuple(weight.shape)} expects "
                            f"{weight.shape[1] * groups} input channels ({weight.shape[1]} per "
                            f"group, groups={groups}), x {tuple(x.shape)} has {c}")
    if (groups > 1 and ((c // groups) % _CHANNEL_VECTOR or (k // groups) % _CHANNEL_VECTOR)
            and not depthwise.is_depthwise(c, weight.shape, groups)):
        raise NotImplementedError(
            f"{NAME}: groups={groups} gives {c // groups} input and {k // groups} output "
            f"channels a group; the implicit-GEMM kernels run groups of multiples of 8 "
            f"(16 bytes of channels for TMA), the depthwise kernels groups of one input "
            f"channel: use torch.nn.functional.conv2d for this one")
    if x.dtype is torch.float32 and depthwise.is_depthwise(c, weight.shape, groups):
        raise NotImplementedError(
            f"{NAME}: groups={groups} is depthwise, whose kernels are bf16/fp16 only: use "
            f"torch.nn.functional.conv2d for fp32 ones")
    if bias is not None:
        check_tensor(NAME, "bias", bias, dtypes=(x.dtype,), ndim=1, cuda=cuda)
        if bias.shape[0] != weight.shape[0]:
            raise ArgumentError(f"{NAME}: bias must have {weight.shape[0]} values (one per "
                                f"output channel), got {tuple(bias.shape)}")
    if activation is not None and activation not in ACTIVATIONS:
        raise ArgumentError(f"{NAME}: activation must be None or one of "
                            f"{', '.join(ACTIVATIONS)}, got {activation!r}")
    for name, v in (("stride", stride), ("dilation", dilation)):
        if min(v) < 1:
            raise ArgumentError(f"{NAME}: {name} must be positive, got {v}")


def _out_hw(h, w, r, s, pad, pad_hi, stride, dilation) -> tuple[int, int]:
    p = (h + pad[0] + pad_hi[0] - dilation[0] * (r - 1) - 1) // stride[0] + 1
    q = (w + pad[1] + pad_hi[1] - dilation[1] * (s - 1) - 1) // stride[1] + 1
    return p, q


def _unaligned(*channels: int) -> bool:
    """Whether a channel count is not a whole number of TMA's 16-byte vectors (8 channels)."""
    return any(n % _CHANNEL_VECTOR for n in channels)


def is_gemm(weight_or_rs, pad, pad_hi, groups: int, stride, channels) -> bool:
    """Whether the convolution is a GEMM over pixels: 1x1 filters, no padding, one group, and
    either unit stride (the pixels are the GEMM's rows as they lie) or channels (C, K) that the
    implicit-GEMM kernels cannot read (not multiples of 8: the GEMM's copies make them
    aligned). It runs vitrail's GEMM (vitrail.ops.gemm and mm: their selection, with split-K,
    stream-K and torch's own matmul among the candidates). A strided 1x1 of aligned channels
    runs the implicit-GEMM kernels, which read the pixels the stride keeps in place, where the
    GEMM needs a copy of them (fprop, wgrad) or a scatter of dx (dgrad)."""
    rs = (tuple(weight_or_rs.shape[2:]) if isinstance(weight_or_rs, Tensor)
          else tuple(weight_or_rs))
    if rs != (1, 1) or groups != 1 or any(pad) or any(pad_hi):
        return False
    return tuple(stride) == (1, 1) or _unaligned(*channels)


def _gemm_ready(t: Tensor, weight_or_rs, pad, pad_hi, groups: int, stride, channels) -> bool:
    """is_gemm, on a Hopper GPU (else refused, as the kernels are)."""
    if not is_gemm(weight_or_rs, pad, pad_hi, groups, stride, channels):
        return False
    _require_hopper(t.device)
    return True


def _pixels(t: Tensor, stride) -> Tensor:
    """A channels-last (N, C, H, W) tensor's pixels as rows: (N H' W', C), the pixels a stride
    keeps (a copy where it skips some; else a view)."""
    t = nhwc(t)
    if tuple(stride) != (1, 1):
        t = t[:, ::stride[0], ::stride[1]].contiguous()
    return t.reshape(-1, t.shape[3])


def runs_patches(kind: str, c: int, weight_or_rs, pad, pad_hi, groups: int, stride) -> bool:
    """Whether the kind (fprop or wgrad) runs as a GEMM over x's patches: one group of fewer
    input channels than one 16-byte vector (an image's 3), not a GEMM over pixels already
    (is_gemm). The implicit-GEMM kernels read a tap's channels 64 at a time, so 3 of them
    would cost 21 times the products; the patches (N P Q x R S C, copied once: _patches) are
    a GEMM's operand on whole tiles instead. dgrad runs the kernels on zero-padded channels."""
    rs = (tuple(weight_or_rs.shape[2:]) if isinstance(weight_or_rs, Tensor)
          else tuple(weight_or_rs))
    return (kind in ("fprop", "wgrad") and groups == 1 and c < _CHANNEL_VECTOR
            and not is_gemm(rs, pad, pad_hi, groups, stride, (c, _CHANNEL_VECTOR)))


def _patches(x: Tensor, rs, g) -> Tensor:
    """x's patches as the rows of a matrix: (N P Q, R S C), row j the R x S x C pixels output
    pixel j reads (zeros in the padding), copied into a buffer whose rows are whole 16-byte
    vectors long (a GEMM's TMA reads it as it lies; the columns past R S C are not part of the
    view)."""
    stride, pad, pad_hi, dilation = _split(g)
    (r, s), xs = rs, nhwc(x)
    n, c = xs.shape[0], xs.shape[3]
    xs = torch.nn.functional.pad(xs, (0, 0, pad[1], pad_hi[1], pad[0], pad_hi[0]))
    span = [d * (t - 1) + 1 for d, t in zip(dilation, (r, s))]
    windows = xs.unfold(1, span[0], stride[0]).unfold(2, span[1], stride[1])  # N P Q C R' S'
    windows = windows[..., ::dilation[0], ::dilation[1]].permute(0, 1, 2, 4, 5, 3)
    p, q, cols = windows.shape[1], windows.shape[2], r * s * c
    rows = x.new_empty((n * p * q, round_up(cols, _CHANNEL_VECTOR)))[:, :cols]
    rows.view(n, p, q, r, s, c).copy_(windows)
    return rows


def _filter_rows(weight: Tensor) -> Tensor:
    """The filter (K, C, R, S) as the rows of a matrix, (K, R S C), in a buffer whose rows are
    whole 16-byte vectors long (_patches' columns, in the same order)."""
    k, cols = weight.shape[0], weight[0].numel()
    rows = weight.new_empty((k, round_up(cols, _CHANNEL_VECTOR)))[:, :cols]
    rows.view(k, *nhwc(weight).shape[1:]).copy_(nhwc(weight))
    return rows


def kernel_channels(c: int, k: int, groups: int = 1) -> tuple[int, int]:
    """The input and output channels (C, K) the implicit-GEMM kernels get for a convolution of
    c and k channels: one group's zero-padded to whole 16-byte vectors (_zero_padded), a
    group's own where there are several (whose counts _check requires to be whole vectors)."""
    if groups > 1:
        return c, k
    return round_up(c, _CHANNEL_VECTOR), round_up(k, _CHANNEL_VECTOR)


def _zero_padded(t: Tensor, sizes: tuple[int, ...]) -> Tensor:
    """t (channels-last (N, C, H, W) or (K, C, R, S), or a bias) with zeros appended along its
    channel dimensions to ``sizes``: C for an activation, (K, C) for a filter, (K,) for a bias;
    t itself where it has them. A convolution whose channels are not whole 16-byte vectors runs
    on such copies: the zero channels add nothing to the products, and the padded outputs'
    extra channels are left out."""
    shape = list(t.shape)
    if t.dim() == 1:
        shape[0] = sizes[0]
    elif len(sizes) == 1:
        shape[1] = sizes[0]
    else:
        shape[0], shape[1] = sizes
    if shape == list(t.shape):
        return t
    layout = {} if t.dim() == 1 else {"memory_format": torch.channels_last}
    out = torch.empty(shape, dtype=t.dtype, device=t.device, **layout).zero_()
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


# ------------------------------------------------------------- each kind's work, and its plan
# A call's general path (vitrail.plan): it checks operands, routes and launches the kernels on
# views of the inputs and of a new output. Where that is all it does (channels-last operands,
# no zero fill or copy, no chunk partials to sum), the signature's later calls replay the
# launches: one C++ call from the public function (native.front) or one generated Python one.
PLANS = Plans("conv2d")


def _geometry(stride, pad, pad_hi, dilation) -> tuple[int, ...]:
    """The 8 ints of a convolution's geometry, as the fronts take them."""
    return (*stride, *pad, *pad_hi, *dilation)


def _split(g: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(stride, pad, pad_hi, dilation) of a _geometry."""
    return g[0:2], g[2:4], g[4:6], g[6:8]


def _sig(t: Optional[Tensor]):
    return None if t is None else signature(t)


def _fp32_route(t: Tensor) -> Optional[bool]:
    """What of torch's settings routes an fp32 call (part of its plan's key): whether TF32 is
    allowed (else the call is refused)."""
    return torch.backends.cudnn.allow_tf32 if t.dtype is torch.float32 else None


def _native_ok(t: Tensor, *_) -> bool:
    """Whether a front's call may have a C++ plan: its key cannot see _fp32_route's setting."""
    return t.dtype is not torch.float32


def _new_y(x, weight, bias, g, activation, groups) -> tuple[Tensor]:
    n, _, h, w = x.shape
    k, _, r, s = weight.shape
    stride, pad, pad_hi, dilation = _split(g)
    return (empty_nchw((n, k, *_out_hw(h, w, r, s, pad, pad_hi, stride, dilation)), x),)


def _fprop_into(x, weight, bias, y, g, activation, groups) -> None:
    """y = act(conv2d(x, weight) + bias)."""
    _require_tf32(x.dtype)  # (a call through the custom op skips conv2d's checks)
    x = _channels_last(x, "x")
    weight = _channels_last(weight, "weight")
    stride, pad, pad_hi, dilation = _split(g)
    k = weight.shape[0]
    if depthwise.is_depthwise(x.shape[1], weight.shape, groups):
        _require_hopper(x.device)
        depthwise.fprop(nhwc(x), weight, bias, nhwc(y), stride, pad, dilation, activation,
                        lambda n, dtype: scratch(n, dtype, x.device))
        return
    if _gemm_ready(x, weight, pad, pad_hi, groups, stride, (x.shape[1], k)):  # y = x W^T
        run_into(nhwc(y).reshape(-1, k), _pixels(x, stride), nhwc(weight).reshape(k, -1).t(),
                 None, bias, 1.0, 0.0, activation, 0.01, None, None, tf32=True)
        return
    if runs_patches("fprop", x.shape[1], weight, pad, pad_hi, groups, stride):  # y = X W^T
        _require_hopper(x.device)
        run_into(nhwc(y).reshape(-1, k), _patches(x, weight.shape[2:], g),
                 _filter_rows(weight).t(), None, bias, 1.0, 0.0, activation, 0.01, None, None,
                 tf32=True)
        return
    if _unaligned(x.shape[1], k):  # one group (_check): run on zero-padded channels
        cp, kp = kernel_channels(x.shape[1], k)
        yp = empty_nchw((y.shape[0], kp, *y.shape[2:]), y)
        _fprop_into(_zero_padded(x, (cp,)), _zero_padded(weight, (kp, cp)),
                    None if bias is None else _zero_padded(bias, (kp,)), yp, g, activation, 1)
        y.copy_(yp[:, :k])
        return
    biases = bias.chunk(groups) if bias is not None else [None] * groups
    for xg, wg, yg, bg in zip(nhwc(x).chunk(groups, 3), nhwc(weight).chunk(groups, 0),
                              nhwc(y).chunk(groups, 3), biases):  # a group's channels
        _run("fprop", xg, wg, yg, bg, activation, pad, stride, dilation, pad_hi)


def _new_dx(dy, weight, h, w, g, groups) -> tuple[Tensor]:
    return (empty_nchw((dy.shape[0], weight.shape[1] * groups, h, w), dy),)


def _dgrad_into(dy, weight, dx, h, w, g, groups) -> None:
    """dx of conv2d from dy."""
    dy = _channels_last(dy, "dy")
    weight = _channels_last(weight, "weight")
    stride, pad, pad_hi, dilation = _split(g)
    n, k, p, q = dy.shape
    _, cg, r, s = weight.shape
    rows = nhwc(dx)
    if depthwise.is_depthwise(dx.shape[1], weight.shape, groups):  # every pixel written
        _require_hopper(dy.device)
        depthwise.dgrad(nhwc(dy), weight, rows, stride, pad, dilation,
                        lambda n, dtype: scratch(n, dtype, dy.device))
        return
    if _gemm_ready(dy, weight, pad, pad_hi, groups, stride, (cg, k)):  # dx = dy W
        wk = nhwc(weight).reshape(k, -1)
        if stride == (1, 1):
            run_into(rows.reshape(-1, cg), _pixels(dy, (1, 1)), wk, None, None, 1.0, 0.0, None,
                     0.01, None, None, tf32=True)
            return
        kept = dy.new_empty((n * p * q, cg))  # the pixels the stride kept, scattered into zeros
        run_into(kept, _pixels(dy, (1, 1)), wk, None, None, 1.0, 0.0, None, 0.01, None, None,
                 tf32=True)
        dx.zero_()
        rows[:, ::stride[0], ::stride[1]] = kept.view(n, p, q, cg)
        return
    if dy.dtype is torch.float32:  # TF32 cannot read the filter (K, R, S, C) along K
        _torch_dgrad(dx, dy, weight, g, groups)
        return
    if _unaligned(cg, k):  # one group (_check): run on zero-padded channels
        cp, kp = kernel_channels(cg, k)
        dxp = empty_nchw((n, cp, h, w), dx)
        _dgrad_into(_zero_padded(dy, (kp,)), _zero_padded(weight, (kp, cp)), dxp, h, w, g, 1)
        dx.copy_(dxp[:, :cg])
        return
    phases = dgrad_phases((h, w), (p, q), (r, s), pad, pad_hi, stride, dilation)
    if not all(ph.rows == ph.extent or not all(ph.extent) for ph in phases):
        dx.zero_()  # pixels that no filter tap reaches
    active = [ph for ph in phases if all(ph.rows)]
    views = [phase_views(ph, dy, weight, rows, stride) for ph in active]
    table = None
    if len(active) > 1:  # every phase in one launch, from the first one's views
        table = _phase_table(active, views)
        active, views = active[:1], views[:1]
    for ph, (a, wt, d) in zip(active, views):
        for ag, wg, dg in zip(a.chunk(groups, 3), wt.chunk(groups, 0), d.chunk(groups, 3)):
            _run("dgrad", ag, wg, dg, None, None, ph.pad, (1, 1), ph.dilation, ph.pad_hi,
                 phases=table)


def _high_padding(g) -> list[int]:
    """The rows and columns to pad x with at its bottom and right, so that torch's convolution
    backward (which pads both sides alike) runs an asymmetric padding ('same' of an even
    filter): pad_hi - pad."""
    _, pad, pad_hi, _ = _split(g)
    extra = [hi - lo for lo, hi in zip(pad, pad_hi)]
    if min(extra) < 0:
        raise AssertionError(f"{NAME}: padding {pad} over {pad_hi}: more below than above")
    return extra


def _torch_dgrad(dx: Tensor, dy: Tensor, weight: Tensor, g, groups: int) -> None:
    """dx of conv2d by torch's convolution backward (fp32's, which TF32 cannot run): that of x
    padded by _high_padding, the padding's pixels left out."""
    stride, pad, _, dilation = _split(g)
    (eh, ew), (n, c, h, w) = _high_padding(g), dx.shape
    got = torch.nn.grad.conv2d_input((n, c, h + eh, w + ew), weight, dy, stride, pad, dilation,
                                     groups)
    dx.copy_(got[:, :, :h, :w])


def _torch_wgrad(dw: Tensor, dy: Tensor, x: Tensor, g, groups: int) -> None:
    """dw of conv2d by torch's convolution backward (fp32's, which TF32 cannot run), on x
    padded by _high_padding."""
    stride, pad, _, dilation = _split(g)
    eh, ew = _high_padding(g)
    x = torch.nn.functional.pad(x, (0, ew, 0, eh)) if eh or ew else x
    dw.copy_(torch.nn.grad.conv2d_weight(x, dw.shape, dy, stride, pad, dilation, groups))


def phase_views(ph: "_Phase", dy: Tensor, weight: Tensor, rows: Tensor, stride) -> tuple:
    """A stride phase's dy, filter taps and dx pixels: NHWC-indexed views."""
    (th, tw), (sh, sw), (kh, kw) = ph.taps, stride, ph.skip
    a = nhwc(dy)[:, :ph.dy[0], :ph.dy[1]]
    wt = nhwc(weight)[:, th.start:th.stop:th.step, tw.start:tw.stop:tw.step]  # its taps
    d = rows[:, ph.phase[0] + kh * sh::sh, ph.phase[1] + kw * sw::sw]
    return a, wt, d[:, :ph.rows[0], :ph.rows[1]]


def _phase_table(active: list["_Phase"], views: list[tuple]) -> Tensor:
    """The phased dgrad's table (conv_arguments.PHASE_VALUES a phase) of the phases with pixels
    to write (their views: phase_views): each one's filter and dx offsets from the first one's
    views, in elements (the views share their strides: the step of the taps and of the pixels
    is every phase's), its pixels, taps and padding. A CPU tensor that a plan keeps
    (vitrail.plan.keep): the same for every call of a signature."""
    if len({ph.dilation for ph in active}) != 1:
        raise AssertionError(f"{NAME}: stride phases of different dilations: {active}")
    (_, w0, d0), es = views[0], views[0][1].element_size()
    values = [((wt.data_ptr() - w0.data_ptr()) // es, (d.data_ptr() - d0.data_ptr()) // es,
               *ph.rows, len(ph.taps[0]), len(ph.taps[1]), *ph.pad, *ph.pad_hi)
              for ph, (_, wt, d) in zip(active, views)]
    with setup():  # made once a signature: no reason to refuse the plan
        table = torch.tensor(values, dtype=torch.int64)
    keep(table)
    return table


def _new_dw(dy, x, r, s, g, groups) -> tuple[Tensor]:
    return (empty_nchw((dy.shape[1], x.shape[1] // groups, r, s), x),)


def _wgrad_into(dy, x, dw, r, s, g, groups) -> None:
    """dw of conv2d from dy and x."""
    x = _channels_last(x, "x")
    stride, pad, pad_hi, dilation = _split(g)
    k, c = dy.shape[1], x.shape[1]
    if depthwise.is_depthwise(c, dw.shape, groups):
        _require_hopper(x.device)
        depthwise.wgrad(nhwc(_channels_last(dy, "dy")), nhwc(x), dw, stride, pad, dilation,
                        lambda n: scratch(n, torch.float32, dy.device))
        return
    if _gemm_ready(x, (r, s), pad, pad_hi, groups, stride, (c, k)):  # dw = dy^T x
        run_into(nhwc(dw).reshape(k, c), nhwc(dy).reshape(-1, k).t(), _pixels(x, stride),
                 None, None, 1.0, 0.0, None, 0.01, None, None, tf32=True)
        return
    if x.dtype is torch.float32:  # TF32 cannot read dy and x along their pixels
        _torch_wgrad(dw, dy, x, g, groups)
        return
    if runs_patches("wgrad", c, (r, s), pad, pad_hi, groups, stride):  # dw = dy^T X
        _require_hopper(x.device)
        rows = dw.new_empty((k, round_up(r * s * c, _CHANNEL_VECTOR)))[:, :r * s * c]
        dy_rows = nhwc(_channels_last(dy, "dy")).reshape(-1, k)
        run_into(rows, dy_rows.t(), _patches(x, (r, s), g), None, None, 1.0, 0.0, None, 0.01,
                 None, None, tf32=True)
        nhwc(dw).copy_(rows.view(k, r, s, c))
        return
    if _unaligned(c, k):  # one group (_check): run on zero-padded channels
        cp, kp = kernel_channels(c, k)
        dwp = empty_nchw((kp, cp, r, s), dw)
        _wgrad_into(_zero_padded(dy, (kp,)), _zero_padded(x, (cp,)), dwp, r, s, g, 1)
        dw.copy_(dwp[:k, :c])
        return
    for dyg, xg, dwg in zip(nhwc(dy).chunk(groups, 3), nhwc(x).chunk(groups, 3),
                            nhwc(dw).chunk(groups, 0)):
        _wgrad(dyg.contiguous(), xg, dwg, pad, stride, dilation,
               pad_hi)  # wgrad reads dy packed (NPQK): a copy a group (none for one)


@front(PLANS, when=_native_ok)
def _fprop(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride_h: int, stride_w: int,
           pad_h: int, pad_w: int, pad_h_hi: int, pad_w_hi: int, dilation_h: int,
           dilation_w: int, activation: Optional[str], groups: int) -> Tensor:
    """conv2d's y of checked operands, through its plan (each argument a value the C++ keys
    take: the geometry as ints)."""
    g = (stride_h, stride_w, pad_h, pad_w, pad_h_hi, pad_w_hi, dilation_h, dilation_w)
    return PLANS.run(("fprop", signature(x), signature(weight), _sig(bias), g, activation,
                      groups, _fp32_route(x)), (x, weight, bias), _new_y, _fprop_into,
                     (g, activation, groups))[0]


@front(PLANS, when=_native_ok)
def _dgrad(dy: Tensor, weight: Tensor, h: int, w: int, stride_h: int, stride_w: int, pad_h: int,
           pad_w: int, pad_h_hi: int, pad_w_hi: int, dilation_h: int, dilation_w: int,
           groups: int) -> Tensor:
    """conv2d's dx (x of h x w pixels) through its plan."""
    g = (stride_h, stride_w, pad_h, pad_w, pad_h_hi, pad_w_hi, dilation_h, dilation_w)
    return PLANS.run(("dgrad", signature(dy), signature(weight), h, w, g, groups,
                      _fp32_route(dy)), (dy, weight), _new_dx, _dgrad_into, (h, w, g, groups))[0]


@front(PLANS, when=_native_ok)
def _wgrad_of(dy: Tensor, x: Tensor, r: int, s: int, stride_h: int, stride_w: int, pad_h: int,
              pad_w: int, pad_h_hi: int, pad_w_hi: int, dilation_h: int, dilation_w: int,
              groups: int) -> Tensor:
    """conv2d's dw (an r x s filter) through its plan."""
    g = (stride_h, stride_w, pad_h, pad_w, pad_h_hi, pad_w_hi, dilation_h, dilation_w)
    return PLANS.run(("wgrad", signature(dy), signature(x), r, s, g, groups, _fp32_route(x)),
                     (dy, x), _new_dw, _wgrad_into, (r, s, g, groups))[0]


# ------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("vitrail::conv2d", mutates_args=())
def _conv2d(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: list[int],
            pad: list[int], pad_hi: list[int], dilation: list[int],
            activation: Optional[str], groups: int = 1) -> Tensor:
    return _fprop(x, weight, bias, *_geometry(stride, pad, pad_hi, dilation), activation,
                  groups)


@_conv2d.register_fake
def _conv2d_fake(x, weight, bias, stride, pad, pad_hi, dilation, activation, groups=1):
    n, _, h, w = x.shape
    k, _, r, s = weight.shape
    p, q = _out_hw(h, w, r, s, pad, pad_hi, stride, dilation)
    return empty_nchw((n, k, p, q), x)


@torch.library.custom_op("vitrail::conv2d_dgrad", mutates_args=())
def _conv2d_dgrad(dy: Tensor, weight: Tensor, input_hw: list[int], stride: list[int],
                  pad: list[int], pad_hi: list[int], dilation: list[int],
                  groups: int = 1) -> Tensor:
    """dx of conv2d: dy (N, K, P, Q), weight (K, C / groups, R, S) -> (N, C, H, W),
    channels_last."""
    return _dgrad(dy, weight, *input_hw, *_geometry(stride, pad, pad_hi, dilation), groups)


@dataclass(frozen=True)
class _Phase:
    """The pixels of dx at (phase + i * stride) along h and w, as a unit-stride dgrad computes
    them (each per dimension, h then w): ``extent`` such pixels, of which ``rows`` from the
    ``skip``-th on get a gradient (none: rows 0; the others are zeros); ``taps``, the filter taps
    that reach them (a range of R or S, stepping by stride / gcd(stride, dilation)); the
    unit-stride problem's ``dilation``, ``pad`` and ``pad_hi``, on dy's first ``dy`` rows."""
    phase: tuple[int, int]
    extent: tuple[int, int]
    skip: tuple[int, int]
    rows: tuple[int, int]
    taps: tuple[range, range]
    dilation: tuple[int, int]
    pad: tuple[int, int]
    pad_hi: tuple[int, int]
    dy: tuple[int, int]


def _phase_1d(size: int, out: int, taps: int, pad: int, stride: int, dilation: int,
              phi: int) -> tuple:
    """One dimension of a _Phase (phi: its first pixel): (extent, skip, rows, taps, dilation,
    pad, pad_hi, dy's rows). dx[phi + s j] = sum over k of dy[j + t0 - k d'] w[r0 + k s / g] for
    the taps r0 + k s / g whose r d - pad - phi is a multiple of s (g = gcd(s, d), d' = d / g,
    t0 = (phi + pad - r0 d) / s): a unit-stride dgrad of padding t0 and dilation d'; where t0
    is negative, the first -t0 pixels read no dy (skipped: zeros), and pixels past every tap's
    reach at the end get none either."""
    extent = len(range(phi, size, stride))
    first = [t for t in range(taps) if (t * dilation - pad - phi) % stride == 0]
    none = (extent, 0, 0, range(0), 1, 0, 0, 0)
    if not extent or not first:
        return none
    g = math.gcd(stride, dilation)
    tap = range(first[0], taps, stride // g)
    dil = dilation // g
    t0 = (phi + pad - first[0] * dilation) // stride
    skip = max(0, -t0)
    pad_lo, rows = t0 + skip, extent - skip
    used = min(out, rows + pad_lo)  # dy's rows any of these pixels reads
    if rows <= 0 or used <= 0:
        return none
    pad_hi = used - rows - pad_lo + dil * (len(tap) - 1)
    rows += min(0, pad_hi)  # pixels past every tap's reach get none
    if rows <= 0:
        return none
    return extent, skip, rows, tap, dil, pad_lo, max(0, pad_hi), used


def dgrad_phases(size, out, taps, pad, pad_hi, stride, dilation) -> list[_Phase]:
    """dx of a strided convolution as stride_h * stride_w unit-stride dgrads (one a phase: the
    pixels at (i, j) + stride * (a, b)), each of the taps that reach its pixels: the same work
    as the convolution's, where dy spread out with zeros would cost stride_h * stride_w times
    it. Unit stride: one phase, the convolution's own geometry (pad_hi: the forward's)."""
    if tuple(stride) == (1, 1):
        return [_Phase((0, 0), tuple(size), (0, 0), tuple(size),
                       (range(taps[0]), range(taps[1])), tuple(dilation), tuple(pad),
                       tuple(pad_hi), tuple(out))]
    phases = []
    for ph in range(stride[0]):
        for pw in range(stride[1]):
            dims = [_phase_1d(size[i], out[i], taps[i], pad[i], stride[i], dilation[i], phi)
                    for i, phi in enumerate((ph, pw))]
            rows = (dims[0][2], dims[1][2]) if dims[0][2] and dims[1][2] else (0, 0)
            phases.append(_Phase((ph, pw), *(tuple(d[i] for d in dims) for i in (0, 1)), rows,
                                 *(tuple(d[i] for d in dims) for i in range(3, 8))))
    return phases


@_conv2d_dgrad.register_fake
def _conv2d_dgrad_fake(dy, weight, input_hw, stride, pad, pad_hi, dilation, groups=1):
    return empty_nchw((dy.shape[0], weight.shape[1] * groups, *input_hw), dy)


@torch.library.custom_op("vitrail::conv2d_wgrad", mutates_args=())
def _conv2d_wgrad(dy: Tensor, x: Tensor, filter_rs: list[int], stride: list[int],
                  pad: list[int], pad_hi: list[int], dilation: list[int],
                  groups: int = 1) -> Tensor:
    """dw of conv2d: dy (N, K, P, Q), x (N, C, H, W) -> (K, C / groups, R, S),
    channels_last."""
    return _wgrad_of(dy, x, *filter_rs, *_geometry(stride, pad, pad_hi, dilation), groups)


def _wgrad(dy: Tensor, x: Tensor, dw: Tensor, pad, stride, dilation, pad_hi) -> None:
    """dw (K, R, S, C) of dy (N, P, Q, K) and x (N, H, W, C), NHWC-indexed views: the kernel
    writes dw itself, or the batch runs in chunks (wgrad_chunks) whose fp32 partials are summed
    into dw."""
    n, p, q, k = dy.shape
    _, r, s, c = dw.shape
    splits = wgrad_chunks(k, r * s * c, n, p * q, sm_count(dy.device.index)) if n > 1 else 1
    if splits == 1:
        _run("wgrad", dy, x, dw, None, None, pad, stride, dilation, pad_hi)
        return
    partials = scratch(splits * k * r * s * c, torch.float32, dy.device)
    partials = partials.view(splits * k, r, s, c)
    _run("wgrad", dy, x, partials, None, None, pad, stride, dilation, pad_hi, splits)
    sum_partials(partials, dw, splits)


@_conv2d_wgrad.register_fake
def _conv2d_wgrad_fake(dy, x, filter_rs, stride, pad, pad_hi, dilation, groups=1):
    return empty_nchw((dy.shape[1], x.shape[1] // groups, *filter_rs), x)


# ---------------------------------------------------------------------------------- autograd
def _gradients(x, weight, bias, y, grad, g, activation, groups, from_y, needs,
               through_ops: bool) -> tuple:
    """(dx, dw, db) of conv2d, None where needs (x's, weight's, bias's) says not; y: the output
    where the activation's derivative is taken from it (from_y), else z is computed again
    without the activation. through_ops: by the custom ops (a traced backward, or a graph of
    the gradients: create_graph), else straight to the kernels' plans."""
    geometry = [list(v) for v in _split(g)] if through_ops else None  # the custom ops' lists
    if activation is not None:
        if from_y:
            grad = activation_backward(grad, y, activation)
        else:  # z in fp32 for the derivative
            z = (_conv2d(x, weight, bias, *geometry, None, groups)
                 if through_ops else _fprop(x, weight, bias, *g, None, groups))
            grad = activation_backward(grad.float(), z.float(), activation).to(grad.dtype)
    dx = dw = db = None
    if needs[0]:
        h, w = x.shape[2:]
        dx = (_conv2d_dgrad(grad, weight, [h, w], *geometry, groups)
              if through_ops else _dgrad(grad, weight, h, w, *g, groups))
    if needs[1]:
        r, s = weight.shape[2:]
        dw = (_conv2d_wgrad(grad, x, [r, s], *geometry, groups)
              if through_ops else _wgrad_of(grad, x, r, s, *g, groups))
    if bias is not None and needs[2]:
        db = grad.sum((0, 2, 3), dtype=torch.float32).to(bias.dtype)
    return dx, dw, db


def _save(ctx, x, weight, bias, y, g, activation, groups) -> None:
    """What a backward needs (both autograd paths): the operands, y where the activation's
    derivative is taken from it, the geometry (_geometry) and the epilogue."""
    from_y = activation is not None and grad_from_output(activation)
    ctx.save_for_backward(x, weight, bias, y if from_y else None)
    ctx.g, ctx.activation, ctx.groups, ctx.from_y = g, activation, groups, from_y


def _grads(ctx, grad: Tensor, through_ops: bool) -> tuple:
    x, weight, bias, y = ctx.saved_tensors
    return _gradients(x, weight, bias, y, grad, ctx.g, ctx.activation, ctx.groups, ctx.from_y,
                      ctx.needs_input_grad[:3], through_ops)


def _setup(ctx, inputs, output):
    x, weight, bias, stride, pad, pad_hi, dilation, activation, groups = inputs
    _save(ctx, x, weight, bias, output, _geometry(stride, pad, pad_hi, dilation), activation,
          groups)


def _backward(ctx, grad: Tensor):
    return (*_grads(ctx, grad, through_ops=True), None, None, None, None, None, None)


_conv2d.register_autograd(_backward, setup_context=_setup)


class _Conv2d(torch.autograd.Function):
    """A GRAD call (vitrail.ops.common.call_mode): forward and backward straight to the kernels'
    plans, not through the custom ops' dispatch."""

    @staticmethod
    def forward(ctx, x, weight, bias, g, activation, groups):
        y = _fprop(x, weight, bias, *g, activation, groups)
        _save(ctx, x, weight, bias, y, g, activation, groups)
        return y

    @staticmethod
    def backward(ctx, grad):
        return (*_grads(ctx, grad, torch.is_grad_enabled()), None, None, None)


_CONV2D = autograd_apply(_Conv2d)


def _plan_grads(x, weight, bias, y, grad, g, activation, groups, from_y, needs) -> tuple:
    """The gradients of x, weight and bias (where given) of a call run as a C++ plan that
    records gradients (vitrail.plan.native)."""
    got = _gradients(x, weight, bias, y, grad, g, activation, groups, from_y, needs,
                     torch.is_grad_enabled())
    return got if bias is not None else got[:2]


def _rule(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, activation=None):
    """The gradient rule of conv2d's C++ plans (native.front's grad, given the front's
    arguments in order): the call's arguments passed its checks (a plan exists only for
    those). With no bias and no activation, its steps: dx and dw as the dgrad and wgrad front
    calls _gradients makes, which the C++ node makes itself."""
    stride, dilation = _pair(stride, "stride"), _pair(dilation, "dilation")
    pad, pad_hi = _padding(padding, weight, stride, dilation)
    from_y = activation is not None and grad_from_output(activation)
    tensors = (x, weight, bias)
    g = _geometry(stride, pad, pad_hi, dilation)
    needs = tuple(t is not None and t.requires_grad for t in tensors)
    args = ((INPUT, 0), (INPUT, 1), (INPUT, 2) if bias is not None else (VALUE, None),
            (OUTPUT, 0) if from_y else (VALUE, None), (GRAD, 0), (VALUE, g),
            (VALUE, activation), (VALUE, groups), (VALUE, from_y), (VALUE, needs))
    inputs = (0, 1, 2) if bias is not None else (0, 1)
    if bias is not None or activation is not None:
        return _plan_grads, args, inputs, "vitrail::Conv2dBackward"
    dy, x_arg, weight_arg = (ARG, 4), (ARG, 0), (ARG, 1)  # args' output gradient, x, weight
    tail = (*((VALUE, v) for v in g), (VALUE, groups))
    steps = []
    if needs[0]:  # _dgrad(grad, weight, h, w, *g, groups)
        steps.append((_dgrad, (dy, weight_arg, *((VALUE, v) for v in x.shape[2:]), *tail), 0))
    if needs[1]:  # _wgrad_of(grad, x, r, s, *g, groups)
        steps.append((_wgrad_of, (dy, x_arg, *((VALUE, v) for v in weight.shape[2:]), *tail), 1))
    return _plan_grads, args, inputs, "vitrail::Conv2dBackward", tuple(steps)


# -------------------------------------------------------------------------- public function
@front(PLANS, when=_native_ok, grad=_rule)
def conv2d(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
           stride: Union[int, Sequence[int]] = 1, padding: Union[int, Sequence[int], str] = 0,
           dilation: Union[int, Sequence[int]] = 1, groups: int = 1, *,
           activation: Optional[str] = None) -> Tensor:
    """act(torch.nn.functional.conv2d(x, weight, bias, stride, padding, dilation, groups)) in
    one kernel (channels-last; see the module docstring for what is supported).

    x (N, C, H, W), weight (K, C / groups, R, S), bias (K,) or None, all bf16, all fp16 or all
    fp32 (run as TF32);
    stride, padding (also 'valid' or 'same') and dilation an int or a pair; any C and K for one
    group (zero-padded to multiples of 8 where they are not), groups dividing C and K into
    multiples of 8 channels (one kernel launch a group), or depthwise; activation None
    or one of relu, leaky_relu (slope 0.01), gelu, gelu_tanh, silu, sigmoid, tanh, hardswish.
    Returns (N, K, P, Q) in torch.channels_last."""
    stride = _pair(stride, "stride")
    dilation = _pair(dilation, "dilation")
    _check(x, weight, bias, stride, dilation, groups, activation)
    pad, pad_hi = _padding(padding, weight, stride, dilation)
    mode = call_mode(x, weight, bias)
    if mode == DISPATCH:
        return _conv2d(x, weight, bias, list(stride), list(pad), list(pad_hi), list(dilation),
                       activation, groups)
    args = (x, weight, bias, _geometry(stride, pad, pad_hi, dilation), activation, groups)
    if x.get_device() != torch.cuda.current_device():  # the plans' keys hold the device
        with torch.cuda.device(x.device):
            return _forward(mode, *args)
    return _forward(mode, *args)


def _forward(mode: int, x, weight, bias, g, activation, groups) -> Tensor:
    if mode == EAGER:
        return _fprop(x, weight, bias, *g, activation, groups)
    return _CONV2D(x, weight, bias, g, activation, groups)


def reference(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, stride=1, padding=0,
              dilation=1, groups: int = 1, *, activation: Optional[str] = None) -> Tensor:
    """conv2d computed by torch (for tests: pass float64 tensors for an exact reference)."""
    y = torch.nn.functional.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return _act(y, activation)


def reasons(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
            stride: Union[int, Sequence[int]] = 1, padding: Union[int, Sequence[int], str] = 0,
            dilation: Union[int, Sequence[int]] = 1, groups: int = 1, *,
            activation: Optional[str] = None, kind: str = "fprop") -> list[str]:
    """Why conv2d's kernel of ``kind`` (fprop: the call itself; dgrad: its dx; wgrad: its dw)
    would refuse the convolution of x by weight; [] when it would run it. Nothing is compiled
    or run, and x, weight and bias may be meta tensors: only their shapes and dtypes count. The
    kernel's operands are judged as the op hands them over (channels-last and packed, channels
    zero-padded to 16-byte vectors; a strided dgrad phase by phase), so a strided view's own
    strides are not; nor is the GPU (the kernels are Hopper's). Arguments torch would reject
    raise ArgumentError, as conv2d's do."""
    if kind not in ("fprop", "dgrad", "wgrad"):
        raise ArgumentError(f"{NAME}: kind must be fprop, dgrad or wgrad, got {kind!r}")
    stride = _pair(stride, "stride")
    dilation = _pair(dilation, "dilation")
    try:
        _check(x, weight, bias, stride, dilation, groups, activation, cuda=False)
    except NotImplementedError as e:  # groups too narrow
        return [str(e)]
    pad, pad_hi = _padding(padding, weight, stride, dilation)
    n, c, h, w = x.shape
    k, _, r, s = weight.shape
    p, q = _out_hw(h, w, r, s, pad, pad_hi, stride, dilation)
    if p < 1 or q < 1:
        raise ArgumentError(f"{NAME}: the output would be {p} x {q}: the dilated filter is "
                            f"larger than the padded input")
    if (is_gemm(weight, pad, pad_hi, groups, stride, (c, weight.shape[0]))
            or runs_patches(kind, c, weight, pad, pad_hi, groups, stride)
            or depthwise.is_depthwise(c, weight.shape, groups)
            or (x.dtype is torch.float32 and kind != "fprop")):
        return []  # vitrail's GEMM, the depthwise kernels and fp32's torch backward run all

    def packed(*shape: int) -> Tensor:  # an NHWC-indexed operand as the kernel gets it
        return torch.empty(shape, dtype=x.dtype, device="meta")
    c, k = kernel_channels(c, k, groups)  # zero-padded to 16-byte vectors
    cg, kg = c // groups, k // groups  # one group's channels: the first group's views
    with_bias = bias is not None and kind == "fprop"
    problem, _ = kernel_problem(kind, n, c, (h, w), k, (r, s), pad, pad_hi, stride, dilation,
                                groups)
    op = kernel(kind, x.dtype, problem, bias=with_bias,
                activation=activation if kind == "fprop" else None)
    bias_m = torch.empty((kg,), dtype=x.dtype, device="meta") if with_bias else None
    xs, ws = packed(n, h, w, c)[..., :cg], packed(kg, r, s, cg)
    if kind == "dgrad":  # one unit-stride dgrad a phase, on its taps' view of the filter
        why: list[str] = []
        for ph in dgrad_phases((h, w), (p, q), (r, s), pad, pad_hi, stride, dilation):
            if all(ph.rows):
                (th, tw) = ph.taps
                problem = Conv2dProblem(n, *ph.rows, cg, kg, len(th), len(tw), ph.pad, (1, 1),
                                        ph.dilation, ph.pad_hi)
                args = ConvArguments(problem, packed(n, *ph.rows, cg * groups)[..., :cg],
                                     ws[:, th.start:th.stop:th.step, tw.start:tw.stop:tw.step],
                                     packed(n, *ph.dy, k)[..., :kg], kind=kind)
                why += [w for w in op.can_implement(args) if w not in why]
        return why
    ys = packed(n, p, q, kg) if kind == "wgrad" else packed(n, p, q, k)[..., :kg]  # wgrad: a copy
    args = ConvArguments(Conv2dProblem(n, h, w, cg, kg, r, s, pad, stride, dilation, pad_hi),
                         xs, ws, ys, bias=bias_m, kind=kind)
    return op.can_implement(args)


__all__ = ["conv2d", "kernel", "kernel_channels", "kernel_problem", "operation", "reasons",
           "reference", "runs_patches", "wgrad_chunks"]
