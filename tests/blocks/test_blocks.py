"""Device unit tests of the C++ building blocks (vitrail/include/vitrail): compiled for sm_90a in
CI (one translation unit holds every block's test kernel), values checked on the GPU."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import requires_gpu, requires_nvcc

pytestmark = pytest.mark.warm_cache


SOURCE = (Path(__file__).parent / "blocks_test.cu").read_text()


def build():
    from vitrail import jit
    return jit.compile(SOURCE, name="blocks_test", flags=["-std=c++17"])


@pytest.mark.slow
@requires_nvcc
def test_blocks_compile_for_sm90a(monkeypatch):
    monkeypatch.setenv("VITRAIL_ARCH", "90a")
    mod = build()
    res = mod.resources()
    names = " ".join(res)
    for kernel in ("frg_kernel", "frg_window_kernel", "tile_kernel", "reduce_kernel",
                   "pipe_kernel"):
        assert kernel in names
    assert not any(r.spills for r in res.values())
    ptx = mod.ptx
    assert "ld.global.v4" in ptx or "ld.global.nc.v4" in ptx  # 16-byte loads
    assert "cp.async.bulk.shared::cluster.global" in ptx  # TMA bulk load on an mbarrier
    assert "cp.async.cg.shared.global" in ptx  # cp.async multistage
    assert "mapa" in ptx or "shared::cluster" in ptx  # distributed shared memory


@pytest.fixture(scope="module")
def mod():
    return build()


@requires_gpu
@pytest.mark.parametrize("n", [1, 7, 8, 1000, 4099])
def test_frg_ragged(n):
    import torch
    m = build()
    x = torch.randn(n, device="cuda", dtype=torch.float16)
    out = torch.full((n + 64,), float("nan"), device="cuda", dtype=torch.float16)
    m.test_frg(out, x, n)
    torch.testing.assert_close(out[:n], 2 * x)
    assert out[n:].isnan().all()  # nothing written past the edge


@requires_gpu
@pytest.mark.parametrize("lo,hi", [(0, 8), (3, 8), (3, 5), (7, 9), (5, 1001), (9, 4099), (0, 1)])
def test_frg_window(lo, hi):
    """The windowed load_frg / store_frg: elements [lo, hi) only, whole vectors in between."""
    import torch
    m = build()
    x = torch.randn(hi + 64, device="cuda", dtype=torch.float16)
    out = torch.full((hi + 64,), float("nan"), device="cuda", dtype=torch.float16)
    m.test_frg_window(out, x, lo, hi)
    torch.testing.assert_close(out[lo:hi], 2 * x[lo:hi])
    assert out[:lo].isnan().all() and out[hi:].isnan().all()  # nothing written outside


@requires_gpu
@pytest.mark.parametrize("rows,cols", [(32, 64), (45, 100), (7, 4)])
def test_tile_copy_async(rows, cols):
    import torch
    m = build()
    ld = cols + 12
    x = torch.randn(rows, ld, device="cuda")
    out = torch.full_like(x, float("nan"))
    m.test_tile(out, x, rows, cols, ld)
    torch.testing.assert_close(out[:, :cols], x[:, :cols] + 1)
    assert out[:, cols:].isnan().all()


@requires_gpu
def test_smart_reduce_warp_cta_cluster():
    import torch
    m = build()
    ctas = 6
    x = torch.randn(ctas * 256, device="cuda")
    s8, mx, cs = (torch.full_like(x, float("nan")) for _ in range(3))
    m.test_reduce(s8, mx, cs, x, ctas)
    xd = x.double()
    torch.testing.assert_close(s8.double(), xd.view(-1, 8).sum(1).repeat_interleave(8),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mx, x.view(-1, 256).amax(1).repeat_interleave(256))
    torch.testing.assert_close(cs.double(), xd.view(-1, 512).sum(1).repeat_interleave(512),
                               rtol=1e-5, atol=1e-4)


PIPE = """
import sys, torch
sys.path.insert(0, {root!r})
from tests.blocks.test_blocks import build
m = build()
for chunks in (1, 3, 10):
    x = torch.randn(chunks * 256, device="cuda")
    out = torch.full_like(x, float("nan"))
    bulk = torch.full((256,), float("nan"), device="cuda")
    m.test_pipeline(out, bulk, x, chunks)
    torch.testing.assert_close(out, 3 * x + 1)
    torch.testing.assert_close(bulk, x[-256:])
print("pipeline ok")
"""


@requires_gpu
def test_pipeline_tma():
    """In a subprocess: a fault in the TMA/mbarrier kernel must not poison the other tests."""
    import subprocess
    import sys
    root = str(Path(__file__).resolve().parents[2])
    r = subprocess.run([sys.executable, "-c", PIPE.format(root=root)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "pipeline ok" in r.stdout, r.stderr[-2000:]


@requires_gpu
def test_launch_errors_surface():
    import torch

    from vitrail.jit import LaunchError
    m = build()
    p = torch.zeros(1, device="cuda")
    m.test_bad_launch(p, 32)
    with pytest.raises(LaunchError, match="test_bad_launch"):
        m.test_bad_launch(p, 2048)
    with pytest.raises(LaunchError, match="cudaErrorInvalidValue|InvalidValue|1"):
        m.test_bad_launch(0, 32)
