"""The one template of vitrail's CUTLASS 3 GEMM kernels, and the fragments its modes share.

Every GEMM translation unit is ``TEMPLATE`` (as CUTLASS's own ``EmitGemmUniversal3xInstance``
emits one template for every kernel): a title and the includes, the element types, the tile
and cluster, the epilogue and mainloop collectives, ``GemmKernel`` (a ``GemmUniversal``), the
function that makes its arguments, the entry points, and the launch every mode shares
(``LAUNCH``). A mode (plain.py, array.py, grouped.py; split_k.py wraps plain's) fills those
sections with its ``Hooks``: ``Hooks.template()`` is the mode's template, whose ``@KEY@``
placeholders ``fill`` then replaces with one operation's values.

The sources include only what the kernel uses (like DeepGEMM's generated kernels): the sm90
mainloop collective and its builder, the epilogue builder, the one kernel schedule, the tile
scheduler and ``cutlass/device_kernel.h``; not ``gemm_universal_adapter.h`` (which pulls in
every kernel of every arch and CUTLASS 2's device layer): the launch is ``cudaLaunchKernelEx``
with the cluster dimension attribute.
"""
from __future__ import annotations

from dataclasses import dataclass

# entry point check codes (negative; positive values are cudaError_t)
CODES = {-1: "an operand's address is not 16-byte aligned (TMA needs it)",
         -2: "a leading or batch stride is not a multiple of 16 bytes (TMA needs it)",
         -3: "a size is not positive",
         -4: "the workspace is smaller than vitrail_gemm_workspace() says",
         -5: "CUTLASS could not set up the kernel's parameters"}

# The sections a mode fills are @{NAME}@; the operation's values, filled afterwards, @NAME@.
TEMPLATE = r"""// vitrail @{TITLE}@: @NAME@
@{HEAD}@
namespace vitrail_@{IMPL}@_impl {
using namespace cute;
@{TYPES}@
using TileShape = Shape<@TILE@>;
using ClusterShape = Shape<@CLUSTER@>;

@{COLLECTIVES}@

using GemmKernel = @{KERNEL}@;
@{ARGUMENTS}@
}  // namespace vitrail_@{IMPL}@_impl
using namespace vitrail_@{IMPL}@_impl;

@{ENTRIES}@
@LAUNCH@
}
"""


@dataclass(frozen=True)
class Hooks:
    """One mode's sections of TEMPLATE: ``title`` (the first line's), ``impl`` (the namespace
    ``vitrail_<impl>_impl``), ``head`` (includes), ``types`` (element types, layouts,
    alignments, problem shape), ``collectives`` (epilogue and mainloop), ``kernel`` (the
    ``GemmUniversal`` type), ``arguments`` (what follows it: strides, ``make_arguments``) and
    ``entries`` (the ``extern "C"`` functions, up to the shared launch)."""
    title: str
    impl: str
    head: str
    types: str
    collectives: str
    kernel: str
    arguments: str
    entries: str

    def template(self) -> str:
        """TEMPLATE with this mode's sections in (its @KEY@ placeholders still open)."""
        text = TEMPLATE
        for key, value in vars(self).items():
            text = text.replace(f"@{{{key.upper()}}}@", value)
        return text


# The end of every entry point (plain and grouped): the thread's CUDA context (BIND), workspace,
# parameters, and the launch with the cluster shape as a launch attribute (no
# GemmUniversalAdapter: it pulls in far more code).
BIND = r"""  // A thread that has made no CUDA call yet has no current context (torch's autograd engine
  // thread on device 0 runs a backward's GEMMs so), and encoding the TMA descriptors fails
  // without one (CUDA_ERROR_INVALID_CONTEXT): make the current device's primary context
  // current, once per thread.
  static thread_local bool bound = false;
  if (!bound) {
    int device = 0;
    cudaError_t bind = cudaGetDevice(&device);
    if (bind == cudaSuccess) bind = cudaSetDevice(device);
    if (bind != cudaSuccess) return static_cast<int>(bind);
    bound = true;
  }
"""


def cluster_launch(kernel: str, params: str, grid: str) -> str:
    """The end of an entry point: ``kernel``'s shared memory attribute set once, then its launch
    on ``params`` with the cluster shape as a launch attribute; ``grid``: the statements setting
    ``config.gridDim``."""
    return f"""  constexpr int smem = GemmKernel::SharedStorageSize;
  static cudaError_t attr = cudaFuncSetAttribute(
      {kernel}, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (attr != cudaSuccess) return static_cast<int>(attr);
  cudaLaunchConfig_t config{{}};
  {grid}
  config.blockDim = GemmKernel::get_block_shape();
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = cute::size<0>(ClusterShape{{}});
  attribute[0].val.clusterDim.y = cute::size<1>(ClusterShape{{}});
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return static_cast<int>(cudaLaunchKernelEx(&config, {kernel}, {params}));"""


LAUNCH = BIND + r"""  if (static_cast<int64_t>(GemmKernel::get_workspace_size(args)) > workspace_bytes) return -4;
  if (GemmKernel::initialize_workspace(args, workspace, stream) != cutlass::Status::kSuccess)
    return -5;
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, workspace);
""" + cluster_launch("cutlass::device_kernel<GemmKernel>", "params",
                     "config.gridDim = GemmKernel::get_grid_shape(params);")


# The plain GEMM entry point's parameters, which split_k.py's entry point shares (one ABI for
# arguments.launch), and the includes of the pointer-array kernels (array.py, grouped.py).
ENTRY_PARAMS = """    const void* A, const void* B, const void* C, void* D, const void* bias,
    const void* scale_a, const void* scale_b, int M, int N, int K, int L,
    int64_t lda, int64_t batch_a, int64_t ldb, int64_t batch_b, int64_t ldc, int64_t batch_c,
    int64_t ldd, int64_t batch_d, int64_t bias_batch_stride, float alpha, float beta,
    float slope, float lo, float hi, int splits, int swizzle, int raster, void* workspace,
    int64_t workspace_bytes, int sm_count, cudaStream_t stream"""
# CuTe's wgmma selectors pick, for a tile N outside STANDARD_WGMMA_N, the largest of those that
# divides it unless CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED is defined: a 144-wide tile would run 9
# m64n16 instructions (a fraction of the rate of one m64n144) where wgmma itself takes any
# multiple of 8. The extended shapes' headers are a third of a kernel's preprocessed source and
# most of the host front end's time (cudafe++), so a source defines it only where it needs one.
STANDARD_WGMMA_N = frozenset({8, 16, 32, 64, 96, 128, 192, 256})


def extended_shapes(wgmma_n) -> str:
    """The line enabling CuTe's extended wgmma shapes where one of the N widths the kernel's
    MMAs take (wgmma_n) is not a standard one; else nothing."""
    return ("#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED"
            if any(n not in STANDARD_WGMMA_N for n in wgmma_n) else "")


PTR_ARRAY_INCLUDES = """@EXTENDED_SHAPES@
#include <cuda_runtime.h>
#include <cstdint>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cute/tensor.hpp>
#include <cutlass/gemm/gemm.h>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/collective/collective_mma_decl.hpp>
@MAINLOOP_INCLUDES@
#include <cutlass/gemm/collective/builders/sm90_gmma_builder.inl>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>
#include <cutlass/gemm/kernel/@KERNEL_HEADER@>
#include <cutlass/device_kernel.h>"""
SHARED = {"LAUNCH": LAUNCH, "BIND": BIND, "ENTRY_PARAMS": ENTRY_PARAMS,
          "PTR_ARRAY_INCLUDES": PTR_ARRAY_INCLUDES}


def fill(template: str, subs: dict[str, str], wgmma_n=()) -> str:
    """template with the shared fragments (SHARED: @PTR_ARRAY_INCLUDES@, @ENTRY_PARAMS@,
    @LAUNCH@, @BIND@) spliced in, @EXTENDED_SHAPES@ as the N widths of the kernel's wgmma
    (wgmma_n) need, then every @KEY@ replaced by subs[KEY]."""
    for k, v in {**SHARED, "EXTENDED_SHAPES": extended_shapes(wgmma_n), **subs}.items():
        template = template.replace(f"@{k}@", v)
    return template
