"""grouped_mm: a list of GEMMs, or the packed MoE form (rows of a split by group offsets, one
weight matrix per group), in one launch of the grouped kernel (GemmOperation mode 'grouped':
vitrail/gemm/emit/grouped.py).

The packed form builds the per-group sizes, pointers and strides on the GPU from the offsets
(no host sync) in one small NVRTC kernel, which also zeroes the rows after the last offset and
checks the offsets (invalid ones trap on the device, as torch's own async asserts do).
Operands the grouped kernel cannot take (not 16-byte aligned, fp32, fp8) run as a loop of
``gemm`` launches (with a host sync for the offsets).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from vitrail.device import ctype, sm_count
from vitrail.gemm import GemmOperation, MathInstruction, TensorDescription, TileDescription
from vitrail.gemm.arguments import describe
from vitrail.gemm.emit import CODES
from vitrail.jit.errors import ArgumentError, LaunchError
from vitrail.ops.common import EAGER, GRAD, call_mode, check_tensor
from vitrail.device import is_hopper
from vitrail.plan import GENERAL, Plans, scratch, signature
from vitrail.plan.native import front

ELEMENTS = {torch.bfloat16: "bf16", torch.float16: "f16"}
_MODULES: dict = {}
# The packed form's one preparation launch (the GEMM is the other): each group's size, pointers
# and strides from the offsets on the device (no host sync), the offsets' check (a device-side
# trap, as torch's async asserts), and the zeroing of the rows after the last offset, in place
# of a chain of small torch ops (docs/ops/gemm.md#grouped-preparation).
_PREP = r"""
template <typename E>
__global__ void vitrail_grouped_prep(
    const E* ends, int groups, long long rows, int N, int K, const char* a, long long a_ld,
    const char* b, long long b_group, long long b_ld, const char* d, long long d_ld, int es,
    int* sizes, long long* ptr_a, long long* ptr_b, long long* ptr_d, long long* lda,
    long long* ldb, long long* ldd, uint4* out, long long row_chunks) {
  long long last = (long long)ends[groups - 1];
  if (blockIdx.x == 0) {
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
      long long end = (long long)ends[g], start = g ? (long long)ends[g - 1] : 0;
      if (start > end || start < 0 || end > rows) {
        printf("vitrail.ops.grouped_mm: offsets must be non-decreasing and at most a.shape[0]="
               "%lld; group %d ends at %lld after %lld\n", rows, g, end, start);
        __trap();
      }
      sizes[3 * g] = (int)(end - start); sizes[3 * g + 1] = N; sizes[3 * g + 2] = K;
      ptr_a[g] = (long long)(a + start * a_ld * es);
      ptr_b[g] = (long long)(b + g * b_group * es);
      ptr_d[g] = (long long)(d + start * d_ld * es);
      lda[g] = a_ld; ldb[g] = b_ld; ldd[g] = d_ld;
    }
  }
  long long total = rows * row_chunks;
  for (long long i = (last < 0 ? 0 : last) * row_chunks + blockIdx.x * (long long)blockDim.x +
                     threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x)
    out[i] = make_uint4(0, 0, 0, 0);
}
"""


def operation(dtype: torch.dtype, layout_b: str) -> GemmOperation:
    el = ELEMENTS[dtype]
    return GemmOperation(A=TensorDescription(el, "row"), B=TensorDescription(el, layout_b),
                         D=TensorDescription(el, "row"), math=MathInstruction(el, el),
                         tile=TileDescription((128, 256, 64), (2, 1, 1)), mode="grouped")


def _module(op: GemmOperation):
    mod = _MODULES.get(op)
    if mod is None:
        mod = _MODULES[op] = op.compile()
    return mod


def _aligned(ptr: int, *strides_bytes: int) -> bool:
    return ptr % 16 == 0 and all(s % 16 == 0 for s in strides_bytes)


def _launch(op, sizes, ptr_a, ptr_b, ptr_d, lda, ldb, ldd, groups: int, device) -> None:
    mod = _module(op)
    sm = sm_count(device.index)
    ws = mod.function("vitrail_grouped_gemm_workspace")(groups, sm)
    buf = scratch(max(ws, 1), torch.uint8, device)
    code = mod.function("vitrail_grouped_gemm")(groups, sizes, ptr_a, ptr_b, ptr_d, lda, ldb, ldd,
                                                1.0, buf, ws, sm)
    if code:
        raise LaunchError(f"{op.name}: {CODES.get(code) or f'CUDA error {code}'}")


def _packed_kernel(a: Tensor, b: Tensor, ends: Tensor, out: Tensor) -> bool:
    """Run the packed form on the grouped kernel; False when it cannot take these operands."""
    if a.dtype not in ELEMENTS or not is_hopper(a.device):
        return False
    G, K, N = b.shape
    es = a.element_size()
    info = describe(b, "b")
    if (a.stride(1) != 1 or info.layout is None or b.stride(0) == 0
            or not _aligned(a.data_ptr(), a.stride(0) * es)
            or not _aligned(b.data_ptr(), info.ld * es, b.stride(0) * es)
            or not _aligned(out.data_ptr(), out.stride(0) * es)):
        return False
    dev, rows = a.device, a.shape[0]
    chunks = out.stride(0) * es // 16
    sizes = scratch(G * 3, torch.int32, dev)
    arrays = scratch(6 * G, torch.int64, dev).view(6, G)  # ptr a, b, d; ld a, b, d
    name = f"vitrail_grouped_prep<{ctype(ends.dtype)}>"  # int32 or int64 offsets
    from vitrail import jit
    kernel = _MODULES.get(name) or _MODULES.setdefault(name, jit.RawKernel(
        _PREP, name, signature="const void*, int, long long, int, int, const void*, long long, "
        "const void*, long long, long long, const void*, long long, int, int*, long long*, "
        "long long*, long long*, long long*, long long*, long long*, void*, long long"))
    blocks = min(1024, max(1, (rows * chunks + 255) // 256))
    # strided a or b (a row stride past K, b transposed) as an address (the launcher refuses a
    # strided tensor for a raw pointer); their strides follow
    a_ptr, b_ptr = (t if t.is_contiguous() else t.data_ptr() for t in (a, b))
    kernel[blocks, 256](ends.contiguous(), G, rows, N, K, a_ptr, a.stride(0), b_ptr, b.stride(0),
                        info.ld, out, out.stride(0), es, sizes, *arrays, out, chunks)
    _launch(operation(a.dtype, info.layout), sizes, *arrays, G, dev)
    return True


def _list_kernel(xs, ys) -> Optional[list]:
    """The list form on the grouped kernel; None when it cannot take these operands."""
    if not xs or xs[0].dtype not in ELEMENTS or not is_hopper(xs[0].device):
        return None
    dtype, dev = xs[0].dtype, xs[0].device
    es = xs[0].element_size()
    infos_b = [describe(y, "b") for y in ys]
    layout_b = infos_b[0].layout
    outs = [torch.empty(x.shape[0], y.shape[1], dtype=dtype, device=dev) for x, y in zip(xs, ys)]
    for x, y, ib, o in zip(xs, ys, infos_b, outs):
        if (x.dtype != dtype or y.dtype != dtype or x.dim() != 2 or y.dim() != 2
                or x.shape[1] != y.shape[0] or x.stride(1) != 1 or ib.layout != layout_b
                or not _aligned(x.data_ptr(), x.stride(0) * es)
                or not _aligned(y.data_ptr(), ib.ld * es)
                or not _aligned(o.data_ptr(), o.stride(0) * es) or min(x.shape[0], y.shape[1],
                                                                       x.shape[1]) == 0):
            return None
    host = torch.tensor([[x.shape[0], y.shape[1], x.shape[1]] for x, y in zip(xs, ys)],
                        dtype=torch.int32)
    ptrs = torch.tensor([[x.data_ptr(), y.data_ptr(), o.data_ptr(), x.stride(0), ib.ld,
                          o.stride(0)] for x, y, o, ib in zip(xs, ys, outs, infos_b)],
                        dtype=torch.int64)
    sizes = host.to(dev, non_blocking=False)
    p = ptrs.to(dev).t().contiguous()
    _launch(operation(dtype, layout_b), sizes, p[0], p[1], p[2], p[3], p[4], p[5], len(xs), dev)
    return outs


class _GroupedList(torch.autograd.Function):
    """Autograd of the list form: d a_i = g_i @ b_i^T, d b_i = a_i^T @ g_i (grouped_mm lists:
    one grouped launch where the operands allow it, gemm launches otherwise)."""

    @staticmethod
    def forward(ctx, n: int, out_dtype, *tensors):
        a, b = list(tensors[:n]), list(tensors[n:])
        ctx.save_for_backward(*tensors)
        ctx.n = n
        with torch.no_grad():
            return tuple(grouped_mm(a, b, out_dtype=out_dtype))

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.n
        saved = ctx.saved_tensors
        a, b = saved[:n], saved[n:]
        g = [torch.zeros(x.shape[0], y.shape[1], dtype=x.dtype, device=x.device)
             if gi is None else gi.to(x.dtype) for gi, x, y in zip(grads, a, b)]
        ga = gb = [None] * n
        with torch.no_grad():
            if any(ctx.needs_input_grad[2:2 + n]):
                ga = grouped_mm(g, [y.t() for y in b])
            if any(ctx.needs_input_grad[2 + n:]):
                gb = grouped_mm([x.t() for x in a], g)
        return (None, None, *ga, *gb)


class _GroupedPacked(torch.autograd.Function):
    """Autograd of the packed form: d a = grouped_mm(g, b^T, offsets) (one grouped launch, no
    host sync), d b[i] = a[rows of i]^T @ g[rows of i] (gemm launches, one host sync for the
    offsets; groups with no rows get zeros)."""

    @staticmethod
    def forward(ctx, a, b, offsets, out_dtype):
        ctx.save_for_backward(a, b, offsets)
        with torch.no_grad():
            return grouped_mm(a, b, offsets, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, g):
        from vitrail.gemm.ops.dense import gemm
        a, b, offsets = ctx.saved_tensors
        g = g.to(a.dtype)
        ga = gb = None
        with torch.no_grad():
            if ctx.needs_input_grad[0]:
                ga = grouped_mm(g, b.transpose(1, 2), offsets)
            if ctx.needs_input_grad[1]:
                gb = torch.zeros_like(b)
                start = 0
                for i, end in enumerate(offsets.tolist()):
                    if end > start:
                        gb[i] = gemm(a[start:end].t(), g[start:end])
                    start = end
        return ga, gb, None, None


# Plans (vitrail.plan) of the packed form: the preparation kernel and the grouped GEMM with this
# call's pointers (its arrays and workspace are scratch); the loop of gemm launches, which syncs
# on the offsets, takes the general path.
PLANS = Plans("grouped_mm")


@front(PLANS)
def grouped_mm(a, b, offsets: Optional[Tensor] = None, *,
               out_dtype: Optional[torch.dtype] = None):
    """Grouped GEMM, two forms:

    - lists: ``grouped_mm([a0, a1, ...], [b0, b1, ...])`` -> ``[a0 @ b0, a1 @ b1, ...]``;
    - packed (MoE): ``grouped_mm(a, b, offsets)`` with a (total_M, K), b (G, K, N) and
      offsets (G,) int32/int64 on the device, the cumulative row ends of the groups in a;
      returns (total_M, N) whose rows offsets[g-1]:offsets[g] are a[those rows] @ b[g] and
      whose rows after offsets[-1] are zero.

    bf16/fp16 with 16-byte aligned rows run one grouped kernel launch; anything else runs a
    loop of ``gemm`` launches. Autograd (both forms): gradients of a through grouped_mm (one
    grouped launch for the packed form), of b through gemm launches (the packed form syncs on
    the offsets once in backward); offsets get none.
    """
    from vitrail.gemm.ops.dense import gemm
    name = "vitrail.ops.grouped_mm"
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            raise ArgumentError(f"{name}: with a list a, b must be a list of the same length")
        if offsets is not None:
            raise ArgumentError(f"{name}: offsets are for the packed form, not lists")
        for i, (x, y) in enumerate(zip(a, b)):
            check_tensor(name, f"a[{i}]", x, ndim=2)
            check_tensor(name, f"b[{i}]", y, ndim=2)
            if x.shape[1] != y.shape[0]:
                raise ArgumentError(f"{name}: a[{i}] {tuple(x.shape)} and b[{i}] "
                                    f"{tuple(y.shape)} cannot be multiplied")
        same = not a or out_dtype in (None, a[0].dtype)
        grads = torch.is_grad_enabled() and any(t.requires_grad for t in (*a, *b))
        if grads:
            return list(_GroupedList.apply(len(a), out_dtype, *a, *b))
        if a and same:
            outs = _list_kernel(list(a), list(b))
            if outs is not None:
                return outs
        return [gemm(x, y, out_dtype=out_dtype) for x, y in zip(a, b)]
    mode = call_mode(a, b, offsets)
    if mode == EAGER:  # a signature that passed the checks before: its plan
        key = (signature(a), signature(b), signature(offsets), out_dtype)
        hit = PLANS.get(key)
        if hit is not None and hit is not GENERAL:
            return hit(a, b, offsets)[0]
    check_tensor(name, "a", a, ndim=2)
    check_tensor(name, "b", b, ndim=3)
    if offsets is None:
        raise ArgumentError(f"{name}: the packed form needs offsets (G,) of group row ends")
    check_tensor(name, "offsets", offsets, dtypes=(torch.int32, torch.int64), ndim=1)
    if offsets.shape[0] != b.shape[0]:
        raise ArgumentError(f"{name}: offsets has {offsets.shape[0]} groups, b has {b.shape[0]}")
    if a.shape[1] != b.shape[1]:
        raise ArgumentError(f"{name}: a {tuple(a.shape)} and b {tuple(b.shape)}: K differs")
    if a.dtype != b.dtype:
        raise ArgumentError(f"{name}: a and b must have one dtype, got {a.dtype} and {b.dtype}")
    if mode == GRAD or (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
        return _GroupedPacked.apply(a, b, offsets, out_dtype)
    if mode == EAGER:
        return PLANS.run(key, (a, b, offsets), _new_packed, _packed_into, (out_dtype,))[0]
    return _grouped_op(a, b, offsets, out_dtype)


@torch.library.custom_op("vitrail::grouped_mm", mutates_args=())
def _grouped_op(a: Tensor, b: Tensor, offsets: Tensor,
                out_dtype: Optional[torch.dtype]) -> Tensor:
    """The packed form for what traces, compiles or transforms (checked by grouped_mm)."""
    out = _new_packed(a, b, offsets, out_dtype)[0]
    _packed_into(a, b, offsets, out, out_dtype)
    return out


@_grouped_op.register_fake
def _(a, b, offsets, out_dtype):
    return a.new_empty(a.shape[0], b.shape[2], dtype=out_dtype or a.dtype)


def _new_packed(a: Tensor, b: Tensor, offsets: Tensor, out_dtype) -> tuple[Tensor]:
    return (torch.empty(a.shape[0], b.shape[2], dtype=out_dtype or a.dtype, device=a.device),)


def _packed_into(a: Tensor, b: Tensor, offsets: Tensor, out: Tensor, out_dtype) -> None:
    """out = the packed form of a, b and offsets (checked): the grouped kernel where it takes
    the operands, else a loop of gemm launches."""
    from vitrail.gemm.ops.dense import gemm
    name = "vitrail.ops.grouped_mm"
    if (out.dtype == a.dtype and b.shape[0] and a.shape[1] and b.shape[2]
            and _packed_kernel(a, b, offsets, out)):
        return
    ends = offsets.tolist()
    if any(e2 < e1 for e1, e2 in zip([0] + ends, ends)) or (ends and ends[-1] > a.shape[0]):
        raise ArgumentError(f"{name}: offsets must be non-decreasing and at most {a.shape[0]}, "
                            f"got {ends}")
    out[ends[-1] if ends else 0:].zero_()
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            out[start:end] = gemm(a[start:end], b[g], out_dtype=out_dtype)
        start = end
