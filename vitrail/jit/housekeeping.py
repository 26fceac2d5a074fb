"""Looking after the cache: what it holds, clearing it, pruning it to a size.

Removal renames an entry away before deleting it, so a process loading it concurrently either
finds the whole entry or none (and then rebuilds). Build directories of live builders and the
lock files are never touched.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from vitrail.jit.cache import KernelCache, dir_size
from vitrail.jit.index import Index


@dataclass(frozen=True)
class CacheInfo:
    root: Path
    entries: int
    size: int  # bytes on disk, everything under the root
    failed: int  # saved sources of failed compiles


def info(cache: KernelCache | None = None) -> CacheInfo:
    cache = cache or KernelCache()
    rows = Index(cache).sync()
    failed = sum(1 for _ in (cache.root / "failed").iterdir())
    return CacheInfo(cache.root.parent, len(rows), dir_size(cache.root.parent), failed)


def entries(cache: KernelCache | None = None) -> list[dict]:
    """One dict per cached kernel (key, name, backend, arch, size, compile_seconds, created,
    last_used), least recently used first."""
    return Index(cache or KernelCache()).sync()


def clear(cache: KernelCache | None = None) -> int:
    """Remove every cached kernel and failed-build record; returns bytes freed."""
    cache = cache or KernelCache()
    before = dir_size(cache.root.parent)
    index = Index(cache)
    for row in index.sync():
        cache.discard(cache.entry_dir(row["key"]))
        index.forget(row["key"])
    _sweep(cache)
    for d in (cache.root / "failed").iterdir():
        shutil.rmtree(d, ignore_errors=True)
    return before - dir_size(cache.root.parent)


def prune(max_size: int, cache: KernelCache | None = None) -> list[dict]:
    """Shrink the cache to at most max_size bytes: failed builds first, then the least recently
    used kernels. Returns the kernels removed."""
    cache = cache or KernelCache()
    _sweep(cache)
    total = dir_size(cache.root.parent)
    failed = sorted((cache.root / "failed").iterdir(), key=lambda p: p.stat().st_mtime)
    for d in failed:
        if total <= max_size:
            break
        total -= dir_size(d)
        shutil.rmtree(d, ignore_errors=True)
    index = Index(cache)
    removed = []
    for row in index.sync():  # least recently used first
        if total <= max_size:
            break
        cache.discard(cache.entry_dir(row["key"]))
        index.forget(row["key"])
        total -= row["size"] or 0
        removed.append(row)
    return removed


def _sweep(cache: KernelCache) -> None:
    """Delete trash and the build directories of builders that are gone."""
    for d in (cache.root / "trash").iterdir():
        shutil.rmtree(d, ignore_errors=True)
    for d in (cache.root / "tmp").iterdir():
        parts = d.name.split(".")
        pid = int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else None
        if pid is None or not _alive(pid):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """'500M', '2G', '1.5GB', '100k' or a byte count -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not m:
        raise ValueError(f"--max-size {text!r}: expected a size such as 500M, 2G or 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
