"""The peaks cache on a machine with no GPU: the measurement is replaced by a stand-in, so these
tests check what is measured when, what is stored where, and how a damaged file is handled."""
from __future__ import annotations

import importlib
import json
import logging

import pytest
import torch

from vitrail.profile import Peaks, peaks, roofline

peaks_mod = importlib.import_module("vitrail.profile.peaks")
H100 = ("NVIDIA H100 80GB HBM3", 132, "2.13.0")


@pytest.fixture
def gpu(monkeypatch):
    """A stand-in GPU: its identity is settable, and each measurement is counted."""
    state = {"identity": H100, "measured": [], "values": {"copy_gbps": 2900.0,
                                                          "bf16_tflops": 710.0}}
    monkeypatch.setattr(peaks_mod, "_identity", lambda device: state["identity"])

    def measure(device):
        state["measured"].append(device)
        return dict(state["values"])
    monkeypatch.setattr(peaks_mod, "_measure", measure)
    return state


def test_measured_once_then_read_from_the_cache(gpu, cache_dir, monkeypatch):
    first = peaks()
    assert (first.copy_gbps, first.bf16_tflops) == (2900.0, 710.0)
    assert (first.device, first.sms, first.torch) == H100 and first.measured
    assert len(gpu["measured"]) == 1
    path = cache_dir / "peaks.json"
    data = json.loads(path.read_text())
    assert data["format"] == 1
    assert data["entries"]["NVIDIA H100 80GB HBM3 | 132 SMs | torch 2.13.0"]["copy_gbps"] == 2900.0

    def no_measuring(device):
        raise AssertionError("measured again although the peaks are cached")
    monkeypatch.setattr(peaks_mod, "_measure", no_measuring)
    assert peaks() == first
    assert peaks(0) == first  # the key is the GPU, not how the device is spelled


def test_refresh_measures_again_and_replaces_the_entry(gpu, cache_dir):
    peaks()
    gpu["values"] = {"copy_gbps": 3000.0, "bf16_tflops": 750.0}
    again = peaks(refresh=True)
    assert (again.copy_gbps, again.bf16_tflops) == (3000.0, 750.0)
    assert len(gpu["measured"]) == 2
    assert peaks() == again
    assert len(json.loads((cache_dir / "peaks.json").read_text())["entries"]) == 1


def test_another_gpu_or_torch_version_is_measured_and_both_are_kept(gpu, cache_dir):
    h100 = peaks()
    gpu["identity"] = ("NVIDIA H100 80GB HBM3", 132, "2.14.0")
    gpu["values"] = {"copy_gbps": 2950.0, "bf16_tflops": 720.0}
    newer = peaks()
    gpu["identity"] = ("NVIDIA H100 PCIe", 114, "2.13.0")
    pcie = peaks()
    assert len(gpu["measured"]) == 3
    assert newer.torch == "2.14.0" and pcie.sms == 114
    entries = peaks_mod.load(cache_dir / "peaks.json")
    assert sorted(e.device + e.torch for e in entries.values()) == [
        "NVIDIA H100 80GB HBM32.13.0", "NVIDIA H100 80GB HBM32.14.0", "NVIDIA H100 PCIe2.13.0"]
    gpu["identity"] = H100
    assert peaks() == h100 and len(gpu["measured"]) == 3


@pytest.mark.parametrize("content", ["{not json", '{"format": 99, "entries": {}}', "[]",
                                     '{"format": 1, "entries": {"k": {"bogus": 1}}}'])
def test_a_damaged_or_foreign_cache_file_is_measured_over(gpu, cache_dir, caplog, content):
    path = peaks_mod.cache_path()  # creates the cache directory
    assert path == cache_dir / "peaks.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="vitrail.profile"):
        p = peaks()
    assert len(gpu["measured"]) == 1 and p.copy_gbps == 2900.0
    assert peaks_mod.load(path) == {peaks_mod.cache_key(*H100): p}
    if content == "{not json":
        assert "unreadable peaks cache" in caplog.text


def test_the_file_is_replaced_atomically_and_no_temporary_is_left(gpu, cache_dir):
    peaks()
    peaks(refresh=True)
    assert sorted(p.name for p in cache_dir.iterdir() if p.name.startswith("peaks")) == [
        "peaks.json", "peaks.lock"]


def test_peaks_work_with_roofline(gpu):
    r = roofline(bytes=2.9e9, ms=2.0, peaks=peaks())
    assert r.pct_memory == pytest.approx(50.0) and r.bound == "memory"
    assert "2900 GB/s" in str(peaks())


def test_without_a_gpu_peaks_is_a_runtime_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="peaks needs a CUDA GPU"):
        peaks()


def test_peaks_is_a_frozen_dataclass():
    p = Peaks(copy_gbps=1.0, bf16_tflops=2.0)
    with pytest.raises(AttributeError):
        p.copy_gbps = 3.0
