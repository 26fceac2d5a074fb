"""A cache_dir fixture for GPU-heavy op tests: where VITRAIL_SHARED_CACHE names a directory (a
warmed cache: kernels built in parallel beforehand), every test uses it instead of a fresh one."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    shared = os.environ.get("VITRAIL_SHARED_CACHE")
    root = shared or str(tmp_path / "vitrail-cache")
    monkeypatch.setenv("VITRAIL_CACHE_DIR", root)
    if not os.environ.get("VITRAIL_ARCH"):
        from tests.conftest import has_gpu
        if not has_gpu():
            monkeypatch.setenv("VITRAIL_ARCH", "90a")
    yield root
