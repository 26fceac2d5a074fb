"""The cache index (sqlite): name, size, compile seconds, created and last used, per key.

The index is advisory: the directories under ``kernels/`` are the truth. A lost or corrupt index
is rebuilt from them, an index write that fails (a read-only or busy cache) is logged and
ignored, and :meth:`Index.sync` reconciles the two before ``vitrail cache ls`` or ``prune``.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sqlite3
import time
from pathlib import Path
from typing import Iterator

from vitrail.jit import database
from vitrail.jit.cache import KernelCache, dir_size

log = logging.getLogger("vitrail.jit")
_SCHEMA = """CREATE TABLE IF NOT EXISTS kernels (
    key TEXT PRIMARY KEY, name TEXT, backend TEXT, arch TEXT, size INTEGER,
    compile_seconds REAL, created REAL, last_used REAL)"""
COLUMNS = ("key", "name", "backend", "arch", "size", "compile_seconds", "created", "last_used")


class Index:
    def __init__(self, cache: KernelCache):
        self.cache = cache
        self.path = cache.root / "index.sqlite"

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """A connection; a damaged index is moved aside and a new one started (the disk is the
        truth: sync() fills it again)."""
        db = database.connect(self.path, _SCHEMA, "the cache index", timeout=30,
                              table=("kernels", COLUMNS))
        try:
            db.execute("PRAGMA synchronous=OFF")
            with database.recovering(self.path, "the cache index"):
                yield db
        finally:
            db.close()

    def _write(self, sql: str, args: tuple) -> None:
        try:
            with self._db() as db:
                db.execute(sql, args)
        except (OSError, sqlite3.Error) as e:
            log.debug("vitrail: cache index update skipped: %s", e)

    def record(self, key: str, meta: dict, size: int) -> None:
        now = time.time()
        self._write("INSERT OR REPLACE INTO kernels VALUES (?,?,?,?,?,?,?,?)",
                    (key, meta.get("name"), meta.get("backend"), meta.get("arch"), size,
                     meta.get("compile_seconds"), meta.get("created", now), now))

    @staticmethod
    def touch(dir: Path) -> None:
        """Mark an entry used now: its directory's mtime, one system call, where an index write
        (a connection and a transaction) took longer than the rest of a warm load. sync()
        reads it back into last_used, and inserts an entry the index does not know (a copied
        cache)."""
        try:
            os.utime(dir)
        except OSError as e:  # a read-only cache: its uses are not recorded
            log.debug("vitrail: cache use not recorded: %s", e)

    def sync(self) -> list[dict]:
        """Reconcile with the disk; returns one dict per published entry, oldest use first."""
        try:
            return self._sync()
        except sqlite3.DatabaseError as e:
            if not database.is_corrupt(e):
                raise
            return self._sync()  # _db moved the damaged file aside: rebuild it from the disk

    def _sync(self) -> list[dict]:
        on_disk = {key: (d, meta) for key, d, meta in self.cache.entries()}
        with self._db() as db:
            rows = {r[0]: dict(zip(COLUMNS, r)) for r in db.execute("SELECT * FROM kernels")}
            for key in rows.keys() - on_disk.keys():
                db.execute("DELETE FROM kernels WHERE key=?", (key,))
                del rows[key]
            for key, (d, meta) in on_disk.items():
                with contextlib.suppress(OSError):
                    used = d.stat().st_mtime  # touch()'s mark, or the entry's publication
                    row = rows.get(key)
                    if row is None:
                        created = meta.get("created", used)
                        row = rows[key] = dict(
                            key=key, name=meta.get("name", "?"),
                            backend=meta.get("backend", "?"), arch=meta.get("arch", "?"),
                            size=dir_size(d), compile_seconds=meta.get("compile_seconds"),
                            created=created, last_used=max(created, used))
                        db.execute("INSERT OR REPLACE INTO kernels VALUES (?,?,?,?,?,?,?,?)",
                                   tuple(row[c] for c in COLUMNS))
                    elif used > (row["last_used"] or 0):
                        row["last_used"] = used
                        db.execute("UPDATE kernels SET last_used=? WHERE key=?", (used, key))
        return sorted(rows.values(), key=lambda r: (r["last_used"] or 0, r["key"]))

    def typical_seconds(self, name: str, backend: str) -> float | None:
        """The median compile time of the last builds (at most 20) whose names start as name's
        does (its first word: gemm, softmax, ...) with this backend; None where there are none
        or the index cannot be read."""
        stem = _stem(name)
        like = stem.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        try:
            with self._db() as db:
                rows = db.execute(
                    "SELECT name, compile_seconds FROM kernels WHERE backend=? AND name LIKE ? "
                    "ESCAPE '\\' AND compile_seconds IS NOT NULL ORDER BY created DESC "
                    "LIMIT 200", (backend, like)).fetchall()
        except (OSError, sqlite3.Error):
            return None
        times = sorted([t for n, t in rows if _stem(n) == stem][:20])
        return times[len(times) // 2] if times else None

    def forget(self, key: str) -> None:
        self._write("DELETE FROM kernels WHERE key=?", (key,))


def _stem(name: str) -> str:
    """A kernel name's first word (gemm_bf16_... -> gemm, softmax.fwd... -> softmax)."""
    return re.split(r"[._\-]", name, maxsplit=1)[0]
