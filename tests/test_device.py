"""vitrail.device on the CPU: per-index caches (a fake GPU's properties), the build target's limits
with the default SM count, C type names and vector widths."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from vitrail import device
from vitrail.tune import Limits


@pytest.fixture
def fake_gpus(monkeypatch):
    """Two fake GPUs (index -> SM count), current device 1; returns the properties queries."""
    queries: list[int] = []

    def properties(index):
        queries.append(index)
        return SimpleNamespace(multi_processor_count={0: 132, 1: 114}[index])
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(device, "_SMS", {})
    monkeypatch.setattr(device, "_LIMITS", {})
    return queries


def test_sm_count_is_read_once_per_index(fake_gpus):
    assert [device.sm_count(i) for i in (0, 1, 0, 1, 0)] == [132, 114, 132, 114, 132]
    assert fake_gpus == [0, 1]
    assert device.sm_count() == 114  # the current device, from its index's entry
    assert fake_gpus == [0, 1] and None not in device._SMS


def test_gpu_limits_are_read_once_per_index(fake_gpus, monkeypatch):
    read: list[int] = []

    def fake_limits(index):
        read.append(index)
        return _limits(sm_count=100 + index, source=f"GPU Fake {index}")
    monkeypatch.setattr(device, "_limits", fake_limits)
    first = device.gpu_limits(0)
    assert device.gpu_limits(0) is first and first.sm_count == 100
    assert device.gpu_limits().source == "GPU Fake 1"  # the current device
    assert device.gpu_limits(1) is device.gpu_limits()
    assert read == [0, 1] and None not in device._LIMITS


def _limits(**changes) -> Limits:
    from vitrail.jit.toolchain import Arch
    lim = Limits(arch=Arch.parse("90a"), max_threads_per_block=1024,
                 max_shared_per_block=227 << 10, shared_per_sm=228 << 10,
                 registers_per_sm=64 << 10, max_registers_per_thread=255, max_cluster_size=8,
                 sm_count=None, source="arch table")
    return dataclasses.replace(lim, **changes)


def test_default_sm_count_only_where_no_gpu_gave_one():
    table = _limits()
    filled = device.with_sm_count(table)
    assert filled.sm_count == device.DEFAULT_SM_COUNT == 132
    assert dataclasses.replace(filled, sm_count=None) == table  # nothing else changes
    gpu = _limits(sm_count=78, source="GPU Fake")
    assert device.with_sm_count(gpu) is gpu


def test_target_limits_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device, "_TARGETS", {})
    monkeypatch.setenv("VITRAIL_ARCH", "90a")
    lim = device.target_limits()
    assert (lim.arch.name, lim.sm_count, lim.source) == ("90a", 132, "arch table")
    assert lim.max_shared_per_block == 227 << 10
    monkeypatch.setenv("VITRAIL_ARCH", "80")  # the build target is read at each call
    assert device.target_limits().arch.name == "80"
    named = device.target_limits("90a")
    assert device.target_limits("90a") is named and named.sm_count == 132
    assert named.arch.name == "90a"


def test_c_type_names_are_the_kernel_sources_spellings():
    assert [device.ctype(d) for d in (torch.float32, torch.float16, torch.bfloat16)] == \
        ["float", "__half", "__nv_bfloat16"]
    assert device.ctype(torch.float8_e4m3fn) == "__nv_fp8_e4m3"
    assert device.ctype(torch.float8_e5m2) == "__nv_fp8_e5m2"
    assert (device.ctype(torch.int32), device.ctype(torch.int64)) == ("int", "long long")
    with pytest.raises(KeyError, match="float64"):
        device.ctype(torch.float64)


def test_vector_width_is_16_bytes_of_elements():
    widths = {torch.float32: 4, torch.float16: 8, torch.bfloat16: 8, torch.float8_e4m3fn: 16,
              torch.float8_e5m2: 16, torch.int32: 4, torch.int64: 2, torch.float64: 2}
    for dtype, v in widths.items():
        assert device.vector(dtype) == v == 16 // torch.empty((), dtype=dtype).element_size()
