"""The sqlite files vitrail keeps (the kernel index, the tuning store), opened so that damage is
repaired instead of failing every call.

``connect`` opens a file in WAL mode (readers never wait for a writer) with a busy timeout for
many processes. A file that is not a database, or a malformed one, is moved aside as
``<name>.corrupt-<unix time>`` (kept, for whoever wants to look at it), a warning names it, and
a new, empty one takes its place; ``recovering`` does the same for damage found by a query.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Iterator

log = logging.getLogger("vitrail")


def is_corrupt(e: BaseException) -> bool:
    """Whether a sqlite error says the file itself is damaged (not busy, not read-only)."""
    text = str(e)
    return isinstance(e, sqlite3.DatabaseError) and (
        "not a database" in text or "malformed" in text or "file is encrypted" in text)


def move_aside(path: Path, what: str, error: BaseException) -> Path:
    """Rename a damaged database (and its WAL files) out of the way; returns its new name."""
    aside = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.replace(f"{path}{suffix}", f"{aside}{suffix}")
    log.warning("vitrail: %s %s is damaged (%s); kept it as %s and started a new one", what, path,
                error, aside)
    return aside


def connect(path: Path, schema: str, what: str, timeout: float = 60.0,
            table: tuple[str, tuple[str, ...]] | None = None,
            precious: bool = False) -> sqlite3.Connection:
    """A connection to the database at path with schema (autocommit: one statement, or an
    explicit transaction, at a time); a damaged file, or one whose table (name, columns) has
    other columns (another program's), is moved aside and replaced. precious: records nothing
    can rebuild, so a table with all of our columns and more (another version of vitrail's) is
    left as it is, and the connection refused (sqlite3.DatabaseError)."""
    for attempt in (0, 1):
        try:
            db = sqlite3.connect(path, timeout=timeout, isolation_level=None)
        except sqlite3.Error as e:  # a read-only or missing directory
            raise OSError(f"cannot open {what} {path}: {e}") from e
        try:
            with contextlib.suppress(sqlite3.OperationalError):  # read-only: as it is
                db.execute("PRAGMA journal_mode=WAL")
            db.execute(schema)
            if table is not None:
                found = tuple(r[1] for r in db.execute(f"PRAGMA table_info({table[0]})"))
                if found != table[1] and precious and set(table[1]) < set(found):
                    raise sqlite3.DatabaseError(f"{what} {path} was written by another version "
                                                f"of vitrail (columns {found}); left as it is")
                if found != table[1]:
                    raise sqlite3.DatabaseError(f"not a database of ours: table {table[0]} has "
                                                f"columns {found}")
            return db
        except sqlite3.DatabaseError as e:
            db.close()
            if attempt or not (is_corrupt(e) or "not a database of ours" in str(e)):
                raise
            move_aside(Path(path), what, e)
    raise AssertionError("unreachable")


@contextlib.contextmanager
def recovering(path: Path, what: str) -> Iterator[None]:
    """Damage a query found moves the file aside (the next connect starts a new one); the
    error is raised again for the caller to retry or give up."""
    try:
        yield
    except sqlite3.DatabaseError as e:
        if is_corrupt(e) and Path(path).exists():
            move_aside(Path(path), what, e)
        raise
