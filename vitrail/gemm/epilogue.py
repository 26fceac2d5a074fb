"""Epilogue functors: what a GEMM does to its accumulators before they reach D.

``LinearCombination`` is  D = clamp(act(alpha * scale_a * scale_b * acc + beta * C + bias)),
every part optional except alpha. It is emitted as a CUTLASS 3 epilogue visitor tree (EVT: the
sm90 fusion callbacks: ``Sm90EVT``, ``Sm90Compute``, ``Sm90AccFetch``, ``Sm90SrcFetch``,
``Sm90ScalarBroadcast``, ``Sm90RowBroadcast``/``Sm90ColBroadcast``), so each variant is a new
type for the stock TMA warp-specialized epilogue, not a new kernel.

Static (in the type): which parts exist, the activation, the element types. Runtime (kernel
arguments): alpha, beta, the leaky_relu slope, the clamp bounds, the bias, scale and C pointers,
the bias batch stride.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from vitrail.gemm.descriptions import check_dtype, cpp_type

ACTIVATIONS = ("relu", "leaky_relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh",
               "hardswish")
ACT_IDS = {name: i + 1 for i, name in enumerate(ACTIVATIONS)}

# The activations on one fp32 value (ACT_IDS numbers them; 0: none): plain CUDA, so kernels
# outside CUTLASS (the depthwise convolution's) compute exactly what the GEMM epilogues do.
ACTIVATION_MATH = r"""
namespace vitrail_act {
// max and min that return NaN where either operand is NaN (torch's relu and clamp keep NaN),
// one instruction each on sm_80+; a ternary chain compiles to two branches per element,
// which kept ptxas from interleaving the epilogue's elements
__device__ __forceinline__ float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a != a ? a : fmaxf(a, b);
#endif
}
__device__ __forceinline__ float min_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a != a ? a : fminf(a, b);
#endif
}
// torch.clamp's: min(max(x, lo), hi), so hi wins where lo > hi
__device__ __forceinline__ float clamp(float x, float lo, float hi) {
  return min_nan(max_nan(x, lo), hi);
}

template <int Act>
__device__ __forceinline__ float apply(float x, float slope) {
  if constexpr (Act == 1) return max_nan(x, 0.f);
  else if constexpr (Act == 2) return x > 0.f ? x : x * slope;
  else if constexpr (Act == 3) return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
  // gelu_tanh: 0.5 x (1 + tanh(u)) = x / (1 + e^(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3),
  // e^(-2u) = 2^(x (a + b x^2)): one exp2 and one fast division, no tanhf and its branches,
  // and no cancellation where tanh(u) nears -1 (x e^(2u) keeps its relative accuracy)
  else if constexpr (Act == 4) {
    constexpr float a = -2.f * 0.7978845608028654f * 1.4426950408889634f, b = a * 0.044715f;
    return __fdividef(x, 1.f + exp2f(x * fmaf(b, x * x, a)));
  }
  // silu, sigmoid: the fast division (no branch to the IEEE slow path per element, which
  // kept ptxas from interleaving the elements); 1 + e^-x = inf gives 0 as it should
  else if constexpr (Act == 5) return __fdividef(x, 1.f + __expf(-x));
  else if constexpr (Act == 6) return __fdividef(1.f, 1.f + __expf(-x));
  else if constexpr (Act == 7) return tanhf(x);
  else if constexpr (Act == 8) return x * fminf(fmaxf(x + 3.f, 0.f), 6.f) * (1.f / 6.f);
  else return x;
}
}  // namespace vitrail_act
"""

# Elementwise activation, then optional clamp, on a fragment of the compute type. Runtime
# parameters arrive through the functor's Arguments (Sm90Compute passes them to operator()).
ACTIVATION_FUNCTOR = ACTIVATION_MATH + r"""
namespace vitrail_epi {
struct ActArguments { float slope = 0.01f; float lo = -INFINITY; float hi = INFINITY; };

template <int Act, bool Clamp>
struct ActClamp {
  template <class T>
  struct Fn {
    using Arguments = ActArguments;
    CUTLASS_DEVICE T operator()(T const& x, Arguments const& a) const {
      T y;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < int(T::kElements); ++i) {
        float v = vitrail_act::apply<Act>(float(x[i]), a.slope);
        if constexpr (Clamp) v = vitrail_act::clamp(v, a.lo, a.hi);
        y[i] = v;
      }
      return y;
    }
  };
};
}  // namespace vitrail_epi
"""


@dataclass(frozen=True)
class LinearCombination:
    """D = clamp(act(alpha * [scale_a] * [scale_b] * acc + beta * C + bias)).

    Args:
        element_output: D's type.
        element_source: C's type, or None for no C (then beta is not used and C is not read).
        bias: None, 'row' (one value per row of D: M values) or 'col' (one per column: N values,
            what nn.Linear adds).
        element_bias: the bias's type (default: element_output).
        activation: None or one of ACTIVATIONS.
        clamp: clamp the result to [lo, hi] given at run time.
        scale_a: None, 'tensor' (one fp32 on the device) or 'row' (M fp32 values): FP8 scales.
        scale_b: None, 'tensor' or 'col' (N fp32 values).
    """
    element_output: str
    element_source: Optional[str] = None
    bias: Optional[str] = None
    element_bias: Optional[str] = None
    activation: Optional[str] = None
    clamp: bool = False
    scale_a: Optional[str] = None
    scale_b: Optional[str] = None
    element_compute: str = "f32"

    def __post_init__(self):
        check_dtype("LinearCombination.element_output", self.element_output,
                     ("bf16", "f16", "f32"))
        if self.element_source is not None:
            check_dtype("LinearCombination.element_source", self.element_source,
                         ("bf16", "f16", "f32"))
        check_dtype("LinearCombination.element_compute", self.element_compute, ("f32",))
        if self.bias not in (None, "row", "col"):
            raise ValueError(f"LinearCombination.bias={self.bias!r}: expected None, 'row' (M "
                             f"values) or 'col' (N values)")
        if self.bias is None and self.element_bias is not None:
            raise ValueError("LinearCombination.element_bias is given but bias is None")
        if self.bias is not None and self.element_bias is None:
            object.__setattr__(self, "element_bias", self.element_output)
        if self.element_bias is not None:
            check_dtype("LinearCombination.element_bias", self.element_bias,
                         ("bf16", "f16", "f32"))
        if self.activation is not None and self.activation not in ACTIVATIONS:
            raise ValueError(f"LinearCombination.activation={self.activation!r}: expected None "
                             f"or one of {', '.join(ACTIVATIONS)}")
        if self.scale_a not in (None, "tensor", "row"):
            raise ValueError(f"LinearCombination.scale_a={self.scale_a!r}: expected None, "
                             f"'tensor' or 'row'")
        if self.scale_b not in (None, "tensor", "col"):
            raise ValueError(f"LinearCombination.scale_b={self.scale_b!r}: expected None, "
                             f"'tensor' or 'col'")

    @property
    def has_source(self) -> bool:
        return self.element_source is not None

    @property
    def tag(self) -> str:
        """A short name for logs and kernel names."""
        parts = ["lincomb"]
        if self.scale_a or self.scale_b:
            parts.append(f"s{(self.scale_a or '-')[0]}{(self.scale_b or '-')[0]}")
        if self.has_source:
            parts.append("c")
        if self.bias:
            parts.append(f"bias{self.bias}")
        if self.activation:
            parts.append(self.activation)
        if self.clamp:
            parts.append("clamp")
        return "_".join(parts)

    def emit(self, tile: str) -> tuple[str, str, str]:
        """(C++ preamble, the callbacks type, the expression of its Arguments).

        The arguments expression uses the entry point's parameter names: alpha, beta, slope,
        lo, hi, bias, bias_batch_stride, scale_a, scale_b.
        """
        F = cpp_type(self.element_compute)
        D = cpp_type(self.element_output)
        fusion = "cutlass::epilogue::fusion"
        RN = "cutlass::FloatRoundStyle::round_to_nearest"

        def compute(fn: str, out: str) -> str:
            return f"{fusion}::Sm90Compute<{fn}, {out}, {F}, {RN}>"

        # (type, args) of each node; built inside out. The outermost compute writes D's type.
        n_scalars = 1 + (self.scale_a == "tensor") + (self.scale_b == "tensor")
        alpha_t = f"{fusion}::Sm90ScalarBroadcast<{F}, cute::Stride<cute::_0, cute::_0, int64_t>, " \
                  f"{n_scalars}>"
        ptrs = ["nullptr"] + (["scale_a"] if self.scale_a == "tensor" else []) + \
            (["scale_b"] if self.scale_b == "tensor" else [])
        vals = ["alpha"] + ["1.f"] * (n_scalars - 1)
        alpha_a = "{{" + ", ".join(vals) + "}, {" + ", ".join(
            f"static_cast<{F} const*>({p})" for p in ptrs) + "}}"
        layers: list[tuple[str, list[tuple[str, str]], str]] = []  # (fn, children, fn args)
        node = ("mul", [(alpha_t, alpha_a), (f"{fusion}::Sm90AccFetch", "{}")], "{}")
        layers.append(node)
        if self.scale_a == "row":
            col = (f"{fusion}::Sm90ColBroadcast<0, {tile}, {F}, {F}, "
                   f"cute::Stride<cute::_1, cute::_0, int64_t>, 1>",
                   f"{{static_cast<{F} const*>(scale_a), {F}(0), "
                   f"{{cute::_1{{}}, cute::_0{{}}, int64_t(0)}}}}")
            layers.append(("mul", [col, None], "{}"))
        if self.scale_b == "col":
            row = (f"{fusion}::Sm90RowBroadcast<0, {tile}, {F}, {F}, "
                   f"cute::Stride<cute::_0, cute::_1, int64_t>, 1>",
                   f"{{static_cast<{F} const*>(scale_b), {F}(0), "
                   f"{{cute::_0{{}}, cute::_1{{}}, int64_t(0)}}}}")
            layers.append(("mul", [row, None], "{}"))
        if self.bias is not None:
            B = cpp_type(self.element_bias)
            if self.bias == "row":  # one value per row of D: a column vector broadcast along N
                bt = (f"{fusion}::Sm90ColBroadcast<0, {tile}, {B}, {F}, "
                      f"cute::Stride<cute::_1, cute::_0, int64_t>, 1>")
                ba = (f"{{static_cast<{B} const*>(bias), {B}(0), "
                      f"{{cute::_1{{}}, cute::_0{{}}, bias_batch_stride}}}}")
            else:
                bt = (f"{fusion}::Sm90RowBroadcast<0, {tile}, {B}, {F}, "
                      f"cute::Stride<cute::_0, cute::_1, int64_t>, 1>")
                ba = (f"{{static_cast<{B} const*>(bias), {B}(0), "
                      f"{{cute::_0{{}}, cute::_1{{}}, bias_batch_stride}}}}")
            layers.append(("plus", [None, (bt, ba)], "{}"))
        if self.has_source:
            beta_t = f"{fusion}::Sm90ScalarBroadcast<{F}, cute::Stride<cute::_0, cute::_0, int64_t>>"
            src_t = f"{fusion}::Sm90SrcFetch<{cpp_type(self.element_source)}>"
            layers.append(("fma", [(beta_t, "{{beta}}"), (src_t, "{}"), None], "{}"))
        act = self.activation is not None or self.clamp
        preamble = ""
        if act:
            act_id = ACT_IDS.get(self.activation, 0) if self.activation else 0
            fn = f"vitrail_epi::ActClamp<{act_id}, {'true' if self.clamp else 'false'}>::Fn"
            layers.append((fn, [None], "{slope, lo, hi}"))
            preamble = ACTIVATION_FUNCTOR
        fns = {"mul": "cutlass::multiplies", "plus": "cutlass::plus",
               "fma": "cutlass::homogeneous_multiply_add"}
        cur_t = cur_a = None
        for i, (fn, children, fn_args) in enumerate(layers):
            out = D if i == len(layers) - 1 else F
            kids = [(cur_t, cur_a) if c is None else c for c in children]
            cur_t = (f"{fusion}::Sm90EVT<{compute(fns.get(fn, fn), out)},\n    "
                     + ",\n    ".join(t for t, _ in kids) + ">")
            cur_a = "{" + ", ".join(a for _, a in kids) + ", " + fn_args + "}"
        return preamble, cur_t, cur_a
