"""Mode 'array': a batch of equal-shaped GEMMs whose matrices live anywhere (arrays of pointers),
D_i = alpha * A_i @ B_i (+ beta * C_i), on CUTLASS 3's pointer-array kernel
(``KernelPtrArrayTmaWarpSpecialized*`` with ``cutlass::gemm::ArrayProblemShape``: one M, N, K,
L for all, one leading stride per operand, the TMA descriptors re-pointed per batch on the
device).

Where 'batched' needs the batch at a fixed stride in one allocation, 'array' takes lists of
tensors (the layers of a model, the heads cut from different buffers) with no copy. The
pointer arrays are built on the host and copied to the device with each call.

    op = GemmOperation(A=TensorDescription("bf16", "row"), B=TensorDescription("bf16", "col"),
                       D=TensorDescription("bf16", "row"), math=MathInstruction("bf16", "bf16"),
                       mode="array")
    args = ArrayArguments.from_tensors(op, [a0, a1, a2], [b0, b1, b2])   # d: a new list
    op.run(args); d0, d1, d2 = args.sync()

Epilogue: alpha, and beta * C with ``LinearCombination(element_source=...)``; bias,
activation, clamp and FP8 scales are not available in this mode (CUTLASS's pointer-array
epilogue takes no per-batch broadcast pointers here): ``check_epilogue`` says so.
Entry points: ``vitrail_array_gemm`` and ``vitrail_array_gemm_workspace``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from vitrail.gemm.descriptions import FP8, cpp_type

ENTRY = "vitrail_array_gemm"
WORKSPACE_ENTRY = "vitrail_array_gemm_workspace"

_TEMPLATE = r"""// vitrail array-of-pointers GEMM: @NAME@
@PTR_ARRAY_INCLUDES@

namespace vitrail_array_impl {
using namespace cute;
using ProblemShape = cutlass::gemm::ArrayProblemShape<Shape<int, int, int, int>>;
using ElementA = @ELEMENT_A@;
using ElementB = @ELEMENT_B@;
using ElementC = @ELEMENT_C@;
using ElementD = @ELEMENT_D@;
using TileShape = Shape<@TILE@>;
using ClusterShape = Shape<@CLUSTER@>;

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    ElementC, @LAYOUT_D@, @ALIGN_C@, ElementD, @LAYOUT_D@, @ALIGN_D@,
    @EPILOGUE_SCHEDULE@, cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC,
    float>>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementA, @LAYOUT_A@, @ALIGN_A@, ElementB, @LAYOUT_B@, @ALIGN_B@, float,
    TileShape, ClusterShape, @STAGES@, @KERNEL_SCHEDULE@>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                        CollectiveEpilogue>;
static_assert(!GemmKernel::IsGroupedGemmKernel, "one stride per operand (array, not grouped)");

template <class Stride>
Stride make_stride_of(int64_t ld, int64_t batch) {
  Stride s{};
  if constexpr (cute::is_static_v<decltype(cute::get<0>(s))>) cute::get<1>(s) = ld;
  else cute::get<0>(s) = ld;
  cute::get<2>(s) = batch;  // one pointer per batch: never used to address, kept aligned
  return s;
}

typename GemmKernel::Arguments make_arguments(const void* ptr_a, const void* ptr_b,
    const void* ptr_c, const void* ptr_d, int M, int N, int K, int L, int64_t lda, int64_t ldb,
    int64_t ldc, int64_t ldd, float alpha, float beta, int sm_count) {
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sm_count;
  typename GemmKernel::Arguments args{
      cutlass::gemm::GemmUniversalMode::kArray, {{M, N, K, L}},
      {static_cast<ElementA const**>(const_cast<void*>(ptr_a)),
       make_stride_of<typename GemmKernel::StrideA>(lda, lda * 16),
       static_cast<ElementB const**>(const_cast<void*>(ptr_b)),
       make_stride_of<typename GemmKernel::StrideB>(ldb, ldb * 16)},
      {{}, static_cast<ElementC const**>(const_cast<void*>(ptr_c)),
       make_stride_of<typename GemmKernel::StrideC>(ldc, ldc * 16),
       static_cast<ElementD**>(const_cast<void*>(ptr_d)),
       make_stride_of<typename GemmKernel::StrideD>(ldd, ldd * 16)},
      hw};
  args.epilogue.thread.alpha = alpha;
  args.epilogue.thread.beta = beta;
  return args;
}
}  // namespace vitrail_array_impl
using namespace vitrail_array_impl;

extern "C" int64_t vitrail_array_gemm_workspace(int M, int N, int K, int L, int sm_count) {
  auto args = make_arguments(nullptr, nullptr, nullptr, nullptr, M, N, K, L, 8, 8, 8, 8, 1.f,
                             0.f, sm_count);
  return static_cast<int64_t>(GemmKernel::get_workspace_size(args));
}

// ptr_a, ptr_b, ptr_c, ptr_d: device arrays of L pointers (ptr_c null without a source)
extern "C" int vitrail_array_gemm(const void* ptr_a, const void* ptr_b, const void* ptr_c,
    const void* ptr_d, int M, int N, int K, int L, int64_t lda, int64_t ldb, int64_t ldc,
    int64_t ldd, float alpha, float beta, void* workspace, int64_t workspace_bytes,
    int sm_count, cudaStream_t stream) {
  if (M <= 0 || N <= 0 || K <= 0 || L <= 0) return -3;
  constexpr int64_t ea = 128 / cutlass::sizeof_bits<ElementA>::value;
  constexpr int64_t eb = 128 / cutlass::sizeof_bits<ElementB>::value;
  constexpr int64_t ed = 128 / cutlass::sizeof_bits<ElementD>::value;
  if (lda % ea || ldb % eb || ldd % ed@C_STRIDES@) return -2;
  auto args = make_arguments(ptr_a, ptr_b, ptr_c, ptr_d, M, N, K, L, lda, ldb, ldc, ldd, alpha,
                             beta, sm_count);
@LAUNCH@
}
"""


def check_epilogue(epi) -> None:
    """ValueError unless the epilogue is alpha * acc (+ beta * C), what array mode emits."""
    extra = [n for n, v in (("bias", epi.bias), ("activation", epi.activation),
                            ("clamp", epi.clamp), ("scale_a", epi.scale_a),
                            ("scale_b", epi.scale_b)) if v]
    if extra:
        raise ValueError(f"GemmOperation: mode 'array' emits D = alpha * A @ B (+ beta * C); "
                         f"the epilogue's {', '.join(extra)} is not available in this mode (use "
                         f"mode 'batched' on stacked tensors, or apply it afterwards)")


def emit(op) -> str:
    """The translation unit of a GemmOperation of mode 'array'."""
    from vitrail.gemm.emitter import fill
    t, epi = op.tile, op.epilogue
    schedule = {"cooperative": "KernelPtrArrayTmaWarpSpecializedCooperative",
                "pingpong": "KernelPtrArrayTmaWarpSpecializedPingpong"}[t.kernel_schedule]
    if op.math.math_operation == "multiply_add_fast_accum":
        schedule += "FP8FastAccum"
    mainloops = ["sm90_mma_array_tma_gmma_ss_warpspecialized.hpp"]
    if op.math.element_a in FP8:
        mainloops.append("sm90_mma_array_tma_gmma_ss_warpspecialized_fp8.hpp")
    tm, tn, tk = t.tile_shape
    cm, cn, ck = t.cluster_shape
    has_c = epi.has_source
    c = op.C if has_c else op.D
    stages = (f"cutlass::gemm::collective::StageCount<{t.stages}>" if t.stages else
              "cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof("
              "typename CollectiveEpilogue::SharedStorage))>")
    subs = {
        "NAME": op.name,
        "MAINLOOP_INCLUDES": "\n".join(f"#include <cutlass/gemm/collective/{h}>"
                                       for h in mainloops),
        "KERNEL_HEADER": f"sm90_gemm_array_tma_warpspecialized_{t.kernel_schedule}.hpp",
        "ELEMENT_A": cpp_type(op.math.element_a), "ELEMENT_B": cpp_type(op.math.element_b),
        "ELEMENT_C": cpp_type(epi.element_source) if has_c else "void",
        "ELEMENT_D": cpp_type(op.D.element),
        "LAYOUT_A": op.A.cpp_layout, "LAYOUT_B": op.B.cpp_layout, "LAYOUT_D": op.D.cpp_layout,
        "ALIGN_A": str(op.A.alignment), "ALIGN_B": str(op.B.alignment),
        "ALIGN_C": str(c.alignment), "ALIGN_D": str(op.D.alignment),
        "TILE": f"_{tm}, _{tn}, _{tk}", "CLUSTER": f"_{cm}, _{cn}, _{ck}", "STAGES": stages,
        "KERNEL_SCHEDULE": f"cutlass::gemm::{schedule}",
        "EPILOGUE_SCHEDULE": {"cooperative": "cutlass::epilogue::"
                                             "PtrArrayTmaWarpSpecializedCooperative",
                              "pingpong": "cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong"
                              }[t.kernel_schedule],
        "C_STRIDES": " || ldc % (128 / cutlass::sizeof_bits<ElementC>::value)" if has_c else "",
    }
    return fill(_TEMPLATE, subs, op.wgmma_n)


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
        from vitrail.gemm.arguments import as_cuda_tensor
        from vitrail.gemm.descriptions import DTYPES
        from vitrail.jit.errors import ArgumentError
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
    from vitrail.gemm.arguments import describe
    if xs is None:
        return 0, None
    infos = [describe(x, "operand", want) for x in xs]
    first = infos[0]
    if any(i.layout != first.layout or i.ld != first.ld for i in infos):
        return 0, "mixed"
    return first.ld, first.layout


def reasons(op, args: ArrayArguments) -> list[str]:
    """Why op (mode 'array') cannot run args; [] when it can."""
    from vitrail.gemm.arguments import dtype_name
    from vitrail.gemm.descriptions import bits
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


def launch(op, module, args: ArrayArguments, stream=None) -> None:
    """Copy the pointer arrays to the device and call the entry point (checks done)."""
    import torch
    from vitrail.device import sm_count
    from vitrail.gemm.arguments import scratch
    from vitrail.gemm.emitter import CODES
    from vitrail.jit.errors import LaunchError
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
    ws = module.function(WORKSPACE_ENTRY)(args.M, args.N, args.K, args.L, sm)
    buf = scratch(max(ws, 1), torch.uint8, args.device, stream)
    lda, ldb, ldc, ldd = args.lds
    code = module.function(ENTRY)(ptrs[0], ptrs[1], ptrs[2] if args.C else 0, ptrs[3], args.M,
                                  args.N, args.K, args.L, lda, ldb, ldc or ldd, ldd, args.alpha,
                                  args.beta, buf, ws, sm, stream=stream)
    if code:
        raise LaunchError(f"{op.name}: {CODES.get(code) or f'CUDA error {code}'}")
