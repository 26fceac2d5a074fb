"""measure, peaks and trace on a real GPU (an H100 for the ranges below). Skipped where no GPU is
visible; run on an H100 before the profiling toolkit is called done."""
from __future__ import annotations

import importlib
import json

import pytest
import torch

from tests.conftest import requires_gpu
from vitrail.profile import measure, peaks, roofline, trace

pytestmark = [requires_gpu, pytest.mark.gpu]
peaks_mod = importlib.import_module("vitrail.profile.peaks")


def test_a_copy_has_a_plausible_bandwidth():
    src = torch.randn(64 << 20, device="cuda")  # 256 MiB
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), warmup=5, rep=30)
    gbps = 2 * src.numel() * 4 / (t.median * 1e-3) / 1e9
    assert gbps > 100, f"{gbps:.0f} GB/s for a 256 MiB copy: {t}"
    assert t.min <= t.median <= t.max and t.min > 0
    assert t.rep == len(t.samples) == 30 and t.spread >= 0
    assert torch.equal(dst, src)


def test_flushing_the_l2_makes_a_small_repeated_read_no_faster():
    x = torch.randn(2 << 20, device="cuda")  # 8 MiB: fits in the L2 when not flushed
    out = torch.empty((), device="cuda")
    cached = measure(lambda: torch.sum(x, dim=0, out=out), flush_l2=False)
    flushed = measure(lambda: torch.sum(x, dim=0, out=out), flush_l2=True)
    assert flushed.median >= 0.9 * cached.median, f"flushed {flushed}, cached {cached}"


def test_bench_on_an_explicit_device_and_with_one_rep():
    x = torch.randn(1 << 20, device="cuda:0")
    for device in (0, "cuda:0", torch.device("cuda", 0)):
        t = measure(lambda: x.mul_(1.0), warmup=0, rep=1, device=device)
        assert t.rep == 1 and t.median > 0 and t.spread == 0.0


def test_peaks_are_plausible_and_measured_once(cache_dir, monkeypatch):
    p = peaks()
    assert 500 < p.copy_gbps < 5000, p
    assert 100 < p.bf16_tflops < 2000, p
    assert p.device == torch.cuda.get_device_name() and p.torch == torch.__version__
    assert (cache_dir / "peaks.json").is_file()

    def no_measuring(device):
        raise AssertionError("peaks() measured again although they are cached")
    monkeypatch.setattr(peaks_mod, "_measure", no_measuring)
    assert peaks() == p


def test_a_large_copy_reaches_most_of_the_measured_bandwidth():
    src = torch.randn(128 << 20, device="cuda")  # 512 MiB
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), warmup=5, rep=30, flush_l2=False)
    r = roofline(bytes=2 * src.numel() * 4, ms=t.median, peaks=peaks())
    assert r.bound == "memory" and 50 < r.pct_memory < 120, r


def test_a_gpu_trace_holds_the_kernels(tmp_path):
    a = torch.randn(1024, 1024, device="cuda")
    path = trace(lambda: a @ a, tmp_path / "mm.json", warmup=2, steps=3)
    events = json.loads(path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert len(kernels) >= 3, sorted({e.get("cat") for e in events})
