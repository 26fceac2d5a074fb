"""From torch tensors to a GEMM launch: layouts read from strides, aligned copies where TMA
cannot read an operand, the kind's Op, and the fallbacks.

Layouts: each operand's majorness comes from its strides (a transposed view is read as a
column-major operand, no copy). An operand TMA cannot take (no unit stride, an address or a
leading/batch stride that is not a multiple of 16 bytes, a batch broadcast with stride 0) is
copied into an aligned buffer (leading dimension padded to 16 bytes) and the kernel runs on the
copy; a one-time warning says so. An output row whose length is not a multiple of 16 bytes is
computed into a padded buffer and copied out (torch returns contiguous results).

fp32 inputs run the TF32 kernel when torch allows TF32, and the accurate 3xTF32 kernel
(accurate.py, on CUTLASS 2's sm80 path) when torch.get_float32_matmul_precision() is 'highest'.
Fallback to torch, with a one-time warning: GPUs other than Hopper (sm_90).
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

from vitrail.device import is_hopper, vector
from vitrail.gemm import LinearCombination
from vitrail.gemm.emit import plain as plain_kernel
from vitrail.gemm import arguments as gargs
from vitrail.gemm.arguments import round_up as _round_up
from vitrail.gemm.epilogue import ACT_IDS, ACTIVATION_FUNCTOR
from vitrail.op import Op, OpFamily, Shaped
from vitrail.plan import GENERAL, Plans, native, provisional, signature
from vitrail.gemm.ops import configs, model
from vitrail.gemm.ops.configs import Kind, Problem
from vitrail.gemm.ops.operands import aligned, warn_once
from vitrail.gemm.ops.reference import gemm_reference
from vitrail.tune import bucket
from vitrail.tune.settings import current

ELEMENTS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "tf32",
            torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
OUT_ELEMENTS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
# test hooks, set only by vitrail.gemm.ops.testing's context managers: outputs start as NaN;
# a list: run records (kind, problem, operands) into it and launches nothing
poisoned = False
recording: Optional[list] = None


def forget_choices() -> None:
    """Forget the configs and plans chosen so far: each signature chooses afresh at its next
    call (after a change of what the heuristic or the store answers)."""
    for op in FAMILY.made().values():
        op.forget_configs()
    PLANS.clear()


def _variant(kind: Kind) -> dict:
    """The Op of one kind (tensors' dtypes, layouts, epilogue): its space of CUTLASS configs and
    torch's matmul (model.TORCH: nothing to compile)."""
    ops_of = {}

    def gemm_operation(config):
        g = ops_of.get(config)
        if g is None:
            g = ops_of[config] = configs.operation(kind, config)
        return g

    def render(config):
        if config["backend"] == model.TORCH:
            return None  # nothing to compile
        return gemm_operation(config).compile_kwargs()

    def launch(module, config, a, b, c, d, bias, scale_a, scale_b, alpha, beta, slope, lo,
               hi, splits):
        if config["backend"] == model.TORCH:  # torch's matmul, and its epilogue's ops
            e = kind.epilogue
            row_bias = bias is not None and e.bias == "row"  # launched flat: (M, 1) again
            torch_fused(d, a, b, c, bias.view(-1, 1) if row_bias else bias, alpha, beta,
                        e.activation, slope, lo if e.clamp else None, hi if e.clamp else None)
            return
        g = gemm_operation(config)
        args = gargs.GemmArguments.from_tensors(
            g, a, b, d, c=c, bias=bias, scale_a=scale_a, scale_b=scale_b, alpha=alpha,
            beta=beta, slope=slope, lo=lo, hi=hi, splits=splits)
        why = g.can_implement(args)
        if why:  # the caller prepared the operands; this is a bug, say what
            raise RuntimeError(f"vitrail gemm: {g.name} cannot run the prepared operands: "
                               + "; ".join(why))
        gargs.launch(g, module, args)

    return dict(name=kind.name, space=configs.space(kind),
                kernel_source=plain_kernel.HOOKS.template() + ACTIVATION_FUNCTOR + kind.name,
                render=render, launch=launch, examples=configs.DEFAULT_PROBLEMS,
                make_problem=lambda shape, dtype=None: make_problem(kind, shape), shape=SHAPE)


# The kinds (configs.Kind), made on first use; the CLI knows the default kinds (what `vitrail
# precompile` builds) and those made so far
FAMILY = OpFamily("gemm", _variant, listed=configs.default_kinds())


def op_for(kind: Kind) -> Op:
    """The Op of one kind (tensors' dtypes, layouts, epilogue), built on first use."""
    return FAMILY[kind]


_INPLACE = {"relu": lambda d, slope: d.relu_(),
            "leaky_relu": lambda d, slope: torch.nn.functional.leaky_relu_(d, slope),
            "gelu": lambda d, slope: torch.ops.aten.gelu_(d),
            "gelu_tanh": lambda d, slope: torch.ops.aten.gelu_(d, approximate="tanh"),
            "silu": lambda d, slope: torch.nn.functional.silu(d, inplace=True),
            "sigmoid": lambda d, slope: d.sigmoid_(),
            "tanh": lambda d, slope: d.tanh_(),
            "hardswish": lambda d, slope: torch.nn.functional.hardswish(d, inplace=True)}


def torch_fused(d: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor],
                bias: Optional[torch.Tensor], alpha: float, beta: float,
                activation: Optional[str], slope: float, lo: Optional[float],
                hi: Optional[float]) -> None:
    """d = clamp(act(alpha * a @ b + beta * c + bias)) by torch's ops, as a user writes it: one
    cuBLAS addmm (baddbmm for a batched d) taking C, or else the bias, as its addend; the bias
    beside C, the activation and the clamp in place on d (configs.Kind.torch_passes counts
    them). 16-bit a, b and d of one dtype; c (read when given) broadcastable to d; bias (N,) or
    (M, 1)."""
    if d.dim() == 3:
        if a.dim() == 3 and b.dim() == 2 and c is None and (bias is None or bias.dim() == 1):
            L, M, K = a.shape  # a batch of rows against one b: one addmm over all of them
            torch_fused(d.view(L * M, -1), a.reshape(L * M, K), b, None, bias, alpha, beta,
                        activation, slope, lo, hi)
            return
        a, b = a.expand(d.shape[0], *a.shape[-2:]), b.expand(d.shape[0], *b.shape[-2:])
        product = torch.baddbmm
    else:
        product = torch.addmm
    if c is not None:
        product(c.to(d.dtype), a, b, beta=beta, alpha=alpha, out=d)
        if bias is not None:
            d.add_(bias)
    elif bias is not None:
        product(bias.to(d.dtype), a, b, alpha=alpha, out=d)
    else:  # beta 0: d's contents not read
        product(d, a, b, beta=0, alpha=alpha, out=d)
    if activation is not None:
        _INPLACE[activation](d, slope)
    if lo is not None or hi is not None:
        d.clamp_(lo, hi)


_TORCH = {"bf16": torch.bfloat16, "f16": torch.float16, "tf32": torch.float32,
          "f32": torch.float32, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


SHAPE = "MxNxK[xL]"


def problem_key(M: int, N: int, K: int, L: int) -> str:
    """The tuning store's key of a GEMM problem: its sizes bucketed, and ";unaligned" where N or
    K is not a multiple of 8 (the selection's other class: torch is far slower there, and the
    kernels run on aligned copies), so that 4095^3 and 4096^3 do not share a choice."""
    unaligned = ";unaligned" if N % 8 or K % 8 else ""
    return f"M{bucket(M)}N{bucket(N)}K{bucket(K)}L{bucket(L)}{unaligned}"


def make_problem(kind: Kind, shape: tuple) -> Shaped:
    """The problem of ``vitrail tune`` on the kind's Op (shape M x N x K, or M x N x K x L);
    its arguments: random operands of the kind's dtypes and layouts, made when timed."""
    M, N, K = shape[:3]
    L = shape[3] if len(shape) == 4 else 1

    def args() -> tuple:
        dev = "cuda"
        lead = (L,) if L > 1 else ()

        def matrix(rows, cols, el, layout):
            t = torch.randn(*lead, rows, cols, device=dev).to(_TORCH[el])
            return t if layout == "row" else t.transpose(-1, -2).contiguous().transpose(-1, -2)
        epi = kind.epilogue
        a = matrix(M, K, kind.element, kind.layout_a)
        b = matrix(K, N, kind.element_b, kind.layout_b)
        d = torch.empty(*lead, M, N, device=dev, dtype=_TORCH[epi.element_output])
        c = matrix(M, N, epi.element_source, "row") if epi.has_source else None
        bias = None
        if epi.bias:
            bias = torch.randn(M if epi.bias == "row" else N, device=dev).to(
                _TORCH[epi.element_bias or epi.element_output])
        sa = None if epi.scale_a is None else torch.rand(1 if epi.scale_a == "tensor" else M,
                                                         device=dev)
        sb = None if epi.scale_b is None else torch.rand(1 if epi.scale_b == "tensor" else N,
                                                         device=dev)
        return (a, b, c, d, bias, sa, sb, 1.0, 0.5, 0.01, float("-inf"), float("inf"), 1)
    return Shaped(op_for(kind), problem_key(M, N, K, L), Problem(M, N, K, L), args)


def out_shape(a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...]:
    """D's shape: (M, N), or (L, M, N) where a or b is batched."""
    M, N = a.shape[-2], b.shape[-1]
    if a.dim() == 3 or b.dim() == 3:
        return (max(a.shape[0] if a.dim() == 3 else 1, b.shape[0] if b.dim() == 3 else 1), M, N)
    return (M, N)


def run(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor], bias: Optional[torch.Tensor],
        alpha: float, beta: float, activation: Optional[str], slope: float,
        clamp_min: Optional[float], clamp_max: Optional[float], out_dtype: torch.dtype, *,
        scale_a: Optional[torch.Tensor] = None, scale_b: Optional[torch.Tensor] = None,
        fast_accum: bool = False, splits: int = 1) -> torch.Tensor:
    """D = clamp(act(alpha * [scales] * a @ b + beta * c + bias)) on checked operands.

    a: (M, K) or (L, M, K); b: (K, N) or (L, K, N); c broadcastable to D; bias (N,) per
    column or (M, 1) per row. Returns a new contiguous D of dtype out_dtype."""
    d = torch.empty(out_shape(a, b), dtype=out_dtype, device=a.device)
    run_into(d, a, b, c, bias, alpha, beta, activation, slope, clamp_min, clamp_max,
             scale_a=scale_a, scale_b=scale_b, fast_accum=fast_accum, splits=splits)
    return d


# ------------------------------------------------------------------ plans of eager calls
# vitrail.plan: a signature's kind, config, layouts and launch arguments, fixed at its first
# call; a call that needs aligned copies, a padded output, a conversion or torch's fallback
# takes the general path every time (the plan would skip that work).
PLANS = Plans("gemm")
_ROUTE = threading.local()  # .torch: the last run_into of this thread ran torch's ops


def _sig(t: Optional[torch.Tensor]):
    return None if t is None else signature(t)


def _new_output(a, b, c, bias, sa, sb, shape, out_dtype, *_) -> tuple[torch.Tensor]:
    return (a.new_empty(shape, dtype=out_dtype),)


def _general(a, b, c, bias, sa, sb, d, shape, out_dtype, alpha, beta, activation, slope, lo, hi,
             fast) -> None:
    run_into(d, a, b, c, bias, alpha, beta, activation, slope, lo, hi, scale_a=sa, scale_b=sb,
             fast_accum=fast)


def eager(a, b, c, bias, alpha, beta, activation, slope, clamp_min, clamp_max, out_dtype, *,
          scale_a=None, scale_b=None, fast_accum=False, check=None) -> torch.Tensor:
    """``run`` of a plain eager call (vitrail.ops.common.plain_eager) through its plan. check():
    the public function's checks, run on a miss (a hit's signature passed them before)."""
    key = (signature(a), signature(b), _sig(c), _sig(bias), _sig(scale_a), _sig(scale_b), alpha,
           beta, activation, slope, clamp_min, clamp_max, out_dtype, fast_accum, poisoned,
           a.dtype is torch.float32 and torch.get_float32_matmul_precision())
    hit = PLANS.get(key)
    if hit is not None and hit is not GENERAL and recording is None:
        return hit(a, b, c, bias, scale_a, scale_b)[0]
    if check is not None:
        check()
    out_dtype = out_dtype or a.dtype
    if recording is not None:
        return run(a, b, c, bias, alpha, beta, activation, slope, clamp_min, clamp_max, out_dtype,
                   scale_a=scale_a, scale_b=scale_b, fast_accum=fast_accum)
    _ROUTE.torch = False
    d = PLANS.run(key, (a, b, c, bias, scale_a, scale_b), _new_output, _general,
                  (out_shape(a, b), out_dtype, alpha, beta, activation, slope, clamp_min,
                   clamp_max, fast_accum))[0]
    if _ROUTE.torch:  # torch's ops run this signature: call them directly
        plain = (c is None or beta == 0) and bias is None and activation is None and \
            clamp_min is None and clamp_max is None and out_dtype == a.dtype
        PLANS.put(key, _torch_plan if plain and alpha == 1.0 else _FusedPlan(
            a, b, c if beta != 0 else None, bias, out_dtype, alpha, beta, activation, slope,
            clamp_min, clamp_max))
    return d


class _FusedPlan:
    """The plan of a signature that runs on torch's ops (torch_fused): the output allocated,
    the ops called, nothing else; from C++ too where a and b are 2-D (hit.cpp's ADDMM)."""
    __slots__ = ("out_dtype", "params", "native")

    def __init__(self, a, b, c, bias, out_dtype, alpha, beta, activation, slope, lo, hi):
        self.out_dtype, self.params = out_dtype, (alpha, beta, activation, slope, lo, hi)
        self.native = None if a.dim() != 2 or b.dim() != 2 else {
            "kind": "addmm", "used": tuple(i for i, t in enumerate((a, b, c, bias))
                                           if t is not None),
            "params": (float(alpha), float(beta), ACT_IDS.get(activation, 0), float(slope),
                       lo, hi)}

    def __call__(self, a, b, c, bias, *rest) -> tuple[torch.Tensor]:
        d = a.new_empty(out_shape(a, b), dtype=self.out_dtype)
        alpha, beta, activation, slope, lo, hi = self.params
        torch_fused(d, a, b, c if beta != 0 else None, bias, alpha, beta, activation, slope,
                    lo, hi)
        out = (d,)
        if native.LEARNING[0]:
            native.saw(self, (a, b, c, bias, *rest), out)
        return out


def _torch_plan(a, b, *rest) -> tuple[torch.Tensor]:
    out = (torch.matmul(a, b),)
    if native.LEARNING[0]:
        native.saw(_torch_plan, (a, b, *rest), out)
    return out


_torch_plan.native = {"kind": "matmul", "used": (0, 1)}  # the C++ hit path calls at::matmul


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _torch_sequence(d, a, b, c, bias, alpha, beta, activation, slope, clamp_min, clamp_max,
                    scale_a, scale_b, matmul: bool = True) -> None:
    """d = what the kernel computes, by torch's ops: the reference's sequence (fp32 products of
    8- and 16-bit operands), or with matmul, one matmul for a plain product in its own dtype
    (cuBLAS, the speed the model compares the kernels with)."""
    plain = (matmul and c is None and bias is None and activation is None and clamp_min is None
             and clamp_max is None and scale_a is None and scale_b is None
             and a.dtype == b.dtype == d.dtype and a.dtype not in _FP8)
    if plain:
        torch_fused(d, a, b, None, None, alpha, 0.0, None, 0.0, None, None)
        return
    compute = torch.float32 if a.dtype in (*_FP8, torch.float16, torch.bfloat16) else a.dtype
    d.copy_(gemm_reference(a, b, c, alpha=alpha, beta=beta, bias=bias, activation_name=activation,
                           slope=slope, clamp_min=clamp_min, clamp_max=clamp_max,
                           scale_a=scale_a, scale_b=scale_b, out_dtype=d.dtype,
                           compute_dtype=compute))


def native_ok(a, *_) -> bool:
    """Whether a front function's call may have a C++ plan: its key does not see the fp32
    matmul precision (which picks the route of fp32 calls) or the tests' poisoning."""
    return a.dtype is not torch.float32 and not poisoned


def run_into(d: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor],
             bias: Optional[torch.Tensor], alpha: float, beta: float, activation: Optional[str],
             slope: float, clamp_min: Optional[float], clamp_max: Optional[float], *,
             scale_a: Optional[torch.Tensor] = None, scale_b: Optional[torch.Tensor] = None,
             fast_accum: bool = False, splits: int = 1, tf32: bool = False) -> None:
    """``run`` into d: a new contiguous tensor of D's shape (out_shape) and dtype. tf32: fp32
    operands run as TF32 whatever torch's fp32 matmul precision (conv2d's fp32, which follows
    torch.backends.cudnn.allow_tf32 as torch's convolutions do)."""
    out_dtype = d.dtype
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    shape = tuple(d.shape)
    L = shape[0] if len(shape) == 3 else 1
    if M == 0 or N == 0 or L == 0:
        return
    use_c = c is not None and beta != 0
    if (K != 0 and a.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"
            and not tf32 and is_hopper(a.device) and recording is None):
        from vitrail.gemm.ops import accurate  # 3xTF32: fp32-level error
        d.copy_(accurate.run(a, b, c if use_c else None, bias, alpha, beta, activation, slope,
                             clamp_min, clamp_max, out_dtype))
        return
    if K == 0 or not is_hopper(a.device):
        if K != 0:
            why = (f"{torch.cuda.get_device_name(a.device)} is not a Hopper GPU (the kernels "
                   f"are sm_90a)")
            warn_once(f"torch:{why}", f"vitrail.ops.gemm runs torch's matmul here: {why}")
        _torch_sequence(d, a, b, c if use_c else None, bias, alpha, beta, activation, slope,
                        clamp_min, clamp_max, scale_a, scale_b, matmul=False)
        return

    # a batch of A against one B: fold the batch into M (no copy of B per batch)
    fold = (a.dim() == 3 and b.dim() == 2 and (bias is None or bias.dim() == 1)
            and a.stride(-1) == 1 and a.stride(0) == M * a.stride(1))
    if fold:
        run_into(d.view(L * M, N), a.reshape(L * M, K), b,
                 None if not use_c else c.expand(shape).reshape(L * M, N), bias, alpha, beta,
                 activation, slope, clamp_min, clamp_max, scale_a=scale_a, scale_b=scale_b,
                 fast_accum=fast_accum, splits=splits)
        return

    batched = len(shape) == 3
    if batched:  # a 2-D operand of a batched product is shared by every batch: materialized
        a = a if a.dim() == 3 else a.expand(L, *a.shape)
        b = b if b.dim() == 3 else b.expand(L, *b.shape)
    element = ELEMENTS[a.dtype]
    k_major = element in ("tf32", "e4m3", "e5m2")
    a_t, la = aligned(a, "row" if k_major else None)
    b_t, lb = aligned(b, "col" if k_major else None)
    n_pad = _round_up(N, vector(d.dtype))
    out = d  # what the kernel writes: d itself, or a buffer of 16-byte rows copied into d
    if n_pad != N:
        d = torch.empty(*shape[:-1], n_pad, dtype=out_dtype, device=a.device)[..., :N]
    if poisoned:
        d.fill_(float("nan"))
    c_t = None
    if use_c:
        c_t, _ = aligned(c.expand(shape) if tuple(c.shape) != shape else c, "row")
        if c_t.dtype != out_dtype:
            c_t = c_t.to(out_dtype)
            c_t, _ = aligned(c_t, "row")
    bias_kind = bias_t = None
    if bias is not None:
        bias_kind = "col" if bias.dim() == 1 else "row"
        bias_t = bias.reshape(-1)
        if bias_t.dtype != out_dtype:
            bias_t = bias_t.to(out_dtype)
        bias_t = bias_t.contiguous()
    sa_kind = None if scale_a is None else ("tensor" if scale_a.numel() == 1 else "row")
    sb_kind = None if scale_b is None else ("tensor" if scale_b.numel() == 1 else "col")
    out_el = OUT_ELEMENTS[out_dtype]
    epi = LinearCombination(out_el, element_source=out_el if use_c else None, bias=bias_kind,
                            activation=activation,
                            clamp=clamp_min is not None or clamp_max is not None,
                            scale_a=sa_kind, scale_b=sb_kind)
    kind = Kind(element, ELEMENTS[b.dtype], la, lb, epi, fast_accum)
    problem = Problem(M, N, K, L)
    key = problem_key(M, N, K, L)
    lo = float("-inf") if clamp_min is None else float(clamp_min)
    hi = float("inf") if clamp_max is None else float(clamp_max)
    sa = None if scale_a is None else scale_a.reshape(-1).contiguous()
    sb = None if scale_b is None else scale_b.reshape(-1).contiguous()
    if recording is not None:
        recording.append((kind, problem, (a_t, b_t, c_t, d, bias_t, sa, sb)))
        out.zero_()
        return
    op = op_for(kind)
    args = (a_t, b_t, c_t, d, bias_t, sa, sb, float(alpha), float(beta), float(slope), lo, hi,
            splits)
    config = op.config(key, problem, args)
    if config["backend"] == model.TORCH:  # measured faster: cuBLAS, and the epilogue's ops
        _ROUTE.torch = True
        torch_fused(out, a, b, c if use_c else None, bias, alpha, beta, activation, slope,
                    clamp_min, clamp_max)
        return
    if current().build_behind and not op.ready(config):  # torch's ops while it compiles
        op.build_behind(config)
        provisional()  # this call's recording is not its signature's plan
        _torch_sequence(out, a, b, c if use_c else None, bias, alpha, beta, activation, slope,
                        clamp_min, clamp_max, scale_a, scale_b)
        return
    op(key, problem, *args)
    if out is not d:
        out.copy_(d)
