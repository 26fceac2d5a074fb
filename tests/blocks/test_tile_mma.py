"""Device unit tests of TileMMA (vitrail/include/vitrail/tile_mma.cuh): compiled by NVRTC for
sm_90a in CI (wgmma without serialization, no spills), values and the SASS checked on the GPU."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import requires_gpu

pytestmark = pytest.mark.warm_cache

SOURCE = (Path(__file__).parent / "tile_mma_test.cu").read_text()
KERNELS = ("tile_mma_ss_bf16", "tile_mma_ss_f16_mn", "tile_mma_rs_bf16", "tile_mma80_f16")


def build(arch: str | None = None):
    from vitrail import jit
    return jit.compile(SOURCE, name="tile_mma_test", backend="nvrtc", arch=arch,
                       flags=["-default-device"])


def _nvrtc_available() -> bool:
    from vitrail.jit import toolchain
    try:
        toolchain.nvrtc()
    except Exception:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _nvrtc_available(), reason="needs NVRTC")
def test_tile_mma_compiles_for_sm90a_without_spills_or_serialized_wgmma():
    from vitrail.jit import compiler
    entry, _ = compiler.build_entry(SOURCE, name="tile_mma_test", backend="nvrtc", arch="90a",
                                    flags=["-default-device"])
    res = entry.meta["resources"]
    assert set(KERNELS) <= set(res)
    for name in KERNELS:
        assert res[name]["spill_stores"] == 0 and res[name]["stack"] == 0, (name, res[name])
    log = (entry.dir / "build.log").read_text() if (entry.dir / "build.log").exists() else ""
    assert "C7515" not in log  # wgmma.mma_async serialized


def _inputs(*shapes, dtype):
    import torch
    return [torch.randn(s, device="cuda").to(dtype) for s in shapes]


@requires_gpu
def test_ss_k_major_two_warpgroups_accumulates_over_k_steps():
    import torch
    mod = build()
    a, b = _inputs((128, 3 * 64), (128, 3 * 64), dtype=torch.bfloat16)
    out = torch.full((128, 128), float("nan"), device="cuda")
    mod.kernel("tile_mma_ss_bf16")[1, 256](out, a, b, shared_mem=(128 + 128) * 64 * 2)
    ref = a.double() @ b.double().T
    torch.testing.assert_close(out.double(), ref, rtol=1e-3, atol=1e-3)


@requires_gpu
def test_ss_mn_major_b_fp16_n192():
    import torch
    mod = build()
    a, b = _inputs((64, 2 * 32), (2 * 32, 192), dtype=torch.float16)  # b: B^T, N contiguous
    out = torch.full((64, 192), float("nan"), device="cuda")
    mod.kernel("tile_mma_ss_f16_mn")[1, 128](out, a, b, shared_mem=(64 + 192) * 32 * 2)
    torch.testing.assert_close(out.double(), a.double() @ b.double(), rtol=1e-3, atol=1e-3)


@requires_gpu
def test_rs_takes_the_previous_product_from_registers():
    """S = Q K^T (SS), then O = bf16(S) V with S's accumulators as the A fragment (RS)."""
    import torch
    mod = build()
    q, k, v = _inputs((64, 64), (64, 64), (64, 64), dtype=torch.bfloat16)
    out = torch.full((64, 64), float("nan"), device="cuda")
    s_out = torch.full((64, 64), float("nan"), device="cuda")
    mod.kernel("tile_mma_rs_bf16")[1, 128](out, s_out, q, k, v, shared_mem=3 * 64 * 64 * 2)
    s = q.double() @ k.double().T
    torch.testing.assert_close(s_out.double(), s, rtol=1e-3, atol=1e-3)
    p = s_out.to(torch.bfloat16).double()  # the kernel rounds S to bf16 before P V
    torch.testing.assert_close(out.double(), p @ v.double(), rtol=1e-3, atol=1e-2)


@requires_gpu
def test_mma_sync_tile():
    import torch
    mod = build()
    a, b = _inputs((64, 64), (64, 64), dtype=torch.float16)
    out = torch.full((64, 64), float("nan"), device="cuda")
    mod.kernel("tile_mma80_f16")[1, 128](out, a, b, shared_mem=2 * 64 * 64 * 2)
    torch.testing.assert_close(out.double(), a.double() @ b.double().T, rtol=1e-3, atol=1e-3)


@requires_gpu
def test_sass_has_hgmma_and_no_register_hazard():
    import torch
    from vitrail.jit.sass import kernel_sass, wgmma_register_hazards
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs sm_90")
    listing = build().sass
    for name in ("tile_mma_ss_bf16", "tile_mma_rs_bf16"):
        code = kernel_sass(listing, name)
        assert "HGMMA" in code, name
        assert not wgmma_register_hazards(code), name
    assert "HMMA" in kernel_sass(listing, "tile_mma80_f16")


@pytest.mark.skipif(not _nvrtc_available(), reason="needs NVRTC")
def test_rows_of_a_temporary_fragment_is_refused_at_compile_time():
    """TileMMA::rows is a view: a fragment that owns its registers must outlive it (a view of a
    local array that died is what broke as_a once); coordinates() and named fragments pass."""
    from vitrail import jit
    from vitrail.jit.errors import CompileError
    body = """#include <vitrail/tile_mma.cuh>
using M = vitrail::TileMMA<__nv_bfloat16, 64, 64, 64, 1>;
extern "C" __global__ void rows_views(float* out) {
  M m(threadIdx.x);
  auto acc = m.accumulators();
  M::zero(acc);
  auto named = M::rows(acc);
  auto where = M::rows(m.coordinates());
  out[threadIdx.x] = named(0, 0) + cute::get<0>(where(0, 0));
  %s
}
"""
    jit.compile(body % "", name="rows_views", backend="nvrtc", arch="90a",
                flags=["-default-device"])
    with pytest.raises(CompileError, match="a view of a temporary fragment would dangle"):
        jit.compile(body % "out[0] += M::rows(m.accumulators())(0, 0);", name="rows_temporary",
                    backend="nvrtc", arch="90a", flags=["-default-device"])
