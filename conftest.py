"""Shared by every test folder (tests/, examples/): the kernel cache each test runs with."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import vitrail.jit as jit
from vitrail.tune import reset_defaults
from tests.conftest import has_gpu


def pytest_addoption(parser):
    parser.addoption(
        "--kernel-cache", metavar="DIR", default=None,
        help="kernel cache for tests marked warm_cache (op and block tests): a directory built "
             "beforehand (e.g. by `vitrail precompile`), so they do not recompile per test; every "
             "other test keeps a private cache")


def pytest_configure(config):
    config.addinivalue_line("markers", "warm_cache: may use the --kernel-cache directory")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch, request):
    """A fresh VITRAIL_CACHE_DIR per test (or --kernel-cache for tests marked warm_cache);
    VITRAIL_ARCH=90a when no GPU is present; VITRAIL_TORCH_PCH=0."""
    shared = request.config.getoption("--kernel-cache")
    warm = shared and request.node.get_closest_marker("warm_cache") is not None
    root = Path(shared) if warm else tmp_path / "vitrail-cache"
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(root))
    monkeypatch.delenv("VITRAIL_FORCE_RECOMPILE", raising=False)
    # no precompiled header of torch's built in the background (vitrail.jit.pch) into a cache
    # removed when the test ends: the tests of it turn it on
    monkeypatch.setenv("VITRAIL_TORCH_PCH", "0")
    if not has_gpu() and not os.environ.get("VITRAIL_ARCH"):
        monkeypatch.setenv("VITRAIL_ARCH", "90a")
    jit.clear_memory_cache()
    yield root
    jit.clear_memory_cache()
    reset_defaults()  # the tuning settings are read from the environment once: again next test
    if not warm:
        shutil.rmtree(root, ignore_errors=True)
