"""What a wheel carries: every file of the package that is not Python (the kernels' .cuh
sources, the C++ hit path, the selection data) matches a package-data pattern of pyproject.toml,
so an installed (not editable) vitrail finds what its ops compile and read."""
from __future__ import annotations

import fnmatch
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _patterns() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["package-data"]["vitrail"]


def _matches(rel: str, pattern: str) -> bool:
    """setuptools' glob: '**' spans folders, '*' stays within one."""
    if "**" in pattern:
        head, tail = pattern.split("**", 1)
        return rel.startswith(head) and fnmatch.fnmatch(rel[len(head):].split("/")[-1],
                                                        tail.lstrip("/") or "*")
    return len(rel.split("/")) == len(pattern.split("/")) and fnmatch.fnmatch(rel, pattern)


def test_every_non_python_file_of_the_package_is_package_data():
    try:
        listed = subprocess.run(["git", "ls-files", "vitrail"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    data = [f[len("vitrail/"):] for f in listed
            if not f.endswith(".py") and not f.endswith("README.md")]
    assert any(f.endswith(".cuh") for f in data)  # the kernels' sources are among them
    patterns = _patterns()
    missing = [f for f in data if not any(_matches(f, p) for p in patterns)]
    assert not missing, f"not in pyproject.toml's package-data (a wheel would lack them): {missing}"


def test_the_pattern_matcher():
    assert _matches("ops/attention/sm90_attention_fwd.cuh", "ops/*/*.cuh")
    assert not _matches("ops/attention/x/y.cuh", "ops/*/*.cuh")
    assert _matches("include/vitrail/tile_mma.cuh", "include/**/*")
    assert not _matches("plan/hit.cpp", "ops/*/*.cuh")
