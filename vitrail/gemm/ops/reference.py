"""Plain-torch GEMM references, computed in fp64 (or fp32), and the activations' derivatives.

``gemm_reference`` is what the tests compare with and what the fallback paths run;
``activation`` and ``activation_grad`` are shared with the autograd formulas, so the backward
of a fused epilogue is the same math the forward reference does.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


def activation(z: torch.Tensor, name: Optional[str], slope: float = 0.01) -> torch.Tensor:
    if name is None:
        return z
    if name == "relu":
        return torch.relu(z)
    if name == "leaky_relu":
        return F.leaky_relu(z, slope)
    if name == "gelu":
        return F.gelu(z)
    if name == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if name == "silu":
        return F.silu(z)
    if name == "sigmoid":
        return torch.sigmoid(z)
    if name == "tanh":
        return torch.tanh(z)
    if name == "hardswish":
        return F.hardswish(z)
    raise ValueError(f"activation={name!r} is unknown")


def activation_grad(z: torch.Tensor, name: Optional[str], slope: float = 0.01) -> torch.Tensor:
    """d act(z) / dz, elementwise (in z's dtype; pass fp32 for accuracy)."""
    if name is None:
        return torch.ones_like(z)
    if name == "relu":
        return (z > 0).to(z.dtype)
    if name == "leaky_relu":
        return torch.where(z > 0, torch.ones_like(z), torch.full_like(z, slope))
    if name == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * (1.0 / math.sqrt(2.0))))
        pdf = torch.exp(-0.5 * z * z) * (1.0 / math.sqrt(2.0 * math.pi))
        return cdf + z * pdf
    if name == "gelu_tanh":
        k = math.sqrt(2.0 / math.pi)
        u = k * (z + 0.044715 * z ** 3)
        t = torch.tanh(u)
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * z * z)
    if name == "silu":
        s = torch.sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    if name == "sigmoid":
        s = torch.sigmoid(z)
        return s * (1.0 - s)
    if name == "tanh":
        t = torch.tanh(z)
        return 1.0 - t * t
    if name == "hardswish":
        return torch.where(z < -3, torch.zeros_like(z),
                           torch.where(z > 3, torch.ones_like(z), (2 * z + 3) / 6))
    raise ValueError(f"activation={name!r} is unknown")


def grad_from_output(name: Optional[str], slope: float = 0.01) -> bool:
    """Whether act's derivative is a function of its output y (as torch's own backward formulas
    use it): then the backward needs y, not z recomputed."""
    return name in (None, "relu", "sigmoid", "tanh") or (name == "leaky_relu" and slope >= 0)


_ATEN_BACKWARD = {name: getattr(torch.ops.aten, f"{name}_backward").default
                  for name in ("threshold", "leaky_relu", "sigmoid", "tanh", "gelu", "silu",
                               "hardswish")}


def activation_backward(grad: torch.Tensor, t: torch.Tensor, name: Optional[str],
                        slope: float = 0.01) -> torch.Tensor:
    """grad * act'(z), one aten backward kernel: t is act's output y where grad_from_output(name,
    slope), else z (pass fp32 z and grad for accuracy)."""
    if name is None:
        return grad
    aten = _ATEN_BACKWARD  # the ops' overloads, looked up once: a gradient rule's host time
    if name == "relu":
        return aten["threshold"](grad, t, 0)
    if name == "leaky_relu":
        return aten["leaky_relu"](grad, t, slope, grad_from_output(name, slope))
    if name == "sigmoid":
        return aten["sigmoid"](grad, t)
    if name == "tanh":
        return aten["tanh"](grad, t)
    if name in ("gelu", "gelu_tanh"):
        return aten["gelu"](grad, t, approximate="tanh" if name == "gelu_tanh" else "none")
    if name == "silu":
        return aten["silu"](grad, t)
    if name == "hardswish":
        return aten["hardswish"](grad, t)
    raise ValueError(f"activation={name!r} is unknown")


def gemm_reference(a: torch.Tensor, b: torch.Tensor, c: Optional[torch.Tensor] = None, *,
                   alpha: float = 1.0, beta: float = 0.0, bias: Optional[torch.Tensor] = None,
                   activation_name: Optional[str] = None, slope: float = 0.01,
                   clamp_min: Optional[float] = None, clamp_max: Optional[float] = None,
                   scale_a: Optional[torch.Tensor] = None, scale_b: Optional[torch.Tensor] = None,
                   out_dtype: Optional[torch.dtype] = None,
                   compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """clamp(act(alpha * scale_a * scale_b * (a @ b) + beta * c + bias)) in compute_dtype,
    cast to out_dtype (default a's dtype; bf16 for FP8 inputs). bias: (N,) per column or
    (M, 1) per row; scales: () / (1,) per tensor, (M, 1) and (1, N) row-wise."""
    x = a.to(compute_dtype) @ b.to(compute_dtype)
    if scale_a is not None:
        x = x * scale_a.to(compute_dtype)
    if scale_b is not None:
        x = x * scale_b.to(compute_dtype)
    z = alpha * x
    if c is not None and beta != 0:
        z = z + beta * c.to(compute_dtype)
    if bias is not None:
        z = z + bias.to(compute_dtype)
    y = activation(z, activation_name, slope)
    if clamp_min is not None or clamp_max is not None:
        y = torch.clamp(y, clamp_min, clamp_max)
    if out_dtype is None:
        out_dtype = torch.bfloat16 if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) \
            else a.dtype
    return y.to(out_dtype)
