"""The tuning store: which config won for which problem on which GPU, kept across restarts.

A record is keyed by the op, a hash of its kernel source, the problem key (shape buckets, dtypes,
majorness, alignment: see :func:`problem_key`), the GPU's name and SM count, and the vitrail
version; it holds the winning config and every candidate's timing (or why it failed). The store
is a sqlite file beside the kernel cache (``<cache dir>/tuning.sqlite``), shared by every process
of the user: a second process tuning the same problem finds the record and times nothing.
``vitrail tune export FILE`` / ``import FILE`` move records between machines and releases.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from vitrail.jit import database
from vitrail.tune.space import Config

log = logging.getLogger("vitrail")

FORMAT = "vitrail-tuning"
FORMAT_VERSION = 1
_COLUMNS = ("op", "source_hash", "problem", "gpu", "sms", "vitrail")
_SCHEMA = """CREATE TABLE IF NOT EXISTS records (
    op TEXT, source_hash TEXT, problem TEXT, gpu TEXT, sms INTEGER, vitrail TEXT,
    config TEXT, timings TEXT, created REAL,
    PRIMARY KEY (op, source_hash, problem, gpu, sms, vitrail))"""


@dataclass(frozen=True)
class RecordKey:
    op: str
    source_hash: str
    problem: str
    gpu: str
    sms: int
    vitrail: str

    def as_tuple(self) -> tuple:
        return tuple(getattr(self, c) for c in _COLUMNS)


@dataclass
class Record:
    key: RecordKey
    config: Config
    timings: list[dict] = field(default_factory=list)  # {"config", "ms" or None, "error"}
    created: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        return {**{c: getattr(self.key, c) for c in _COLUMNS}, "config": dict(self.config),
                "timings": self.timings, "created": self.created}

    @classmethod
    def from_json(cls, data: dict) -> "Record":
        try:
            key = RecordKey(*(data[c] for c in _COLUMNS))
            return cls(key, Config.from_json(data["config"]), list(data.get("timings", [])),
                       float(data.get("created", time.time())))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a tuning record ({e}): {json.dumps(data)[:200]}") from None


class TuningStore:
    def __init__(self, path: str | Path | None = None):
        if path is None:
            from vitrail.jit.cache import cache_dir
            path = cache_dir() / "tuning.sqlite"
        self.path = Path(path)

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """A connection (WAL, busy timeout); a damaged file is moved aside and replaced, also
        when a query finds the damage (vitrail.jit.database)."""
        db = database.connect(self.path, _SCHEMA, "the tuning store",
                              table=("records", _COLUMNS + ("config", "timings", "created")))
        try:
            with database.recovering(self.path, "the tuning store"):
                yield db
        finally:
            db.close()

    def get(self, key: RecordKey) -> Record | None:
        """The record of key, or None: also where the store cannot be read (every op call
        looks here; a damaged or unreadable store must not fail it: a warning says why)."""
        try:
            with self._db() as db:
                row = db.execute("SELECT config, timings, created FROM records WHERE op=? AND "
                                 "source_hash=? AND problem=? AND gpu=? AND sms=? AND "
                                 "vitrail=?", key.as_tuple()).fetchone()
            if row is None:
                return None
            return Record(key, Config.from_json(row[0]), json.loads(row[1]), row[2])
        except (OSError, sqlite3.Error, ValueError, TypeError) as e:
            _warn_once(self.path, f"vitrail: the tuning store {self.path} cannot be read ({e}); "
                                  "configs come from the heuristics")
            return None

    def put(self, record: Record) -> None:
        """Keep a record (a failed write is a warning: the tuned config is still used now)."""
        try:
            with self._db() as db:
                db.execute("INSERT OR REPLACE INTO records VALUES (?,?,?,?,?,?,?,?,?)",
                           (*record.key.as_tuple(), record.config.to_json(),
                            json.dumps(record.timings), record.created))
        except (OSError, sqlite3.Error) as e:
            _warn_once(self.path, f"vitrail: the tuning store {self.path} cannot be written "
                                  f"({e}); the tuned config is not kept")

    def records(self, op: str | None = None) -> list[Record]:
        query, args = "SELECT * FROM records", ()
        if op is not None:
            query, args = query + " WHERE op=?", (op,)
        with self._db() as db:
            rows = db.execute(query + " ORDER BY op, problem", args).fetchall()
        return [Record(RecordKey(*r[:6]), Config.from_json(r[6]), json.loads(r[7]), r[8])
                for r in rows]

    def export(self, path: str | Path, op: str | None = None) -> int:
        """Write the records (of one op, or all) to a JSON file; returns how many."""
        records = self.records(op)
        doc = {"format": FORMAT, "version": FORMAT_VERSION,
               "records": [r.to_json() for r in records]}
        Path(path).write_text(json.dumps(doc, indent=1, default=_json_safe))
        return len(records)

    def import_(self, path: str | Path, *, overwrite: bool = False) -> tuple[int, int]:
        """Read records from a file written by export(); returns (added, kept as they were).

        A record already here for the same key is kept unless overwrite is set: a team's
        shipped results do not replace what this machine measured itself.
        """
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a readable tuning export ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"{path}: not a vitrail tuning export (no \"format\": \"{FORMAT}\")")
        if doc.get("version", 0) > FORMAT_VERSION:
            raise ValueError(f"{path}: export format version {doc.get('version')} is newer than "
                             f"this vitrail reads ({FORMAT_VERSION}); upgrade vitrail")
        added = kept = 0
        for data in doc.get("records", []):
            record = Record.from_json(data)
            if not overwrite and self.get(record.key) is not None:
                kept += 1
                continue
            self.put(record)
            added += 1
        return added, kept


_WARNED: set[tuple[str, str]] = set()


def _warn_once(path: Path, message: str) -> None:
    key = (str(path), message.split(" (")[0])
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("%s", message)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return None
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


# ------------------------------------------------------------------------------------ problems
def bucket(n: int, per_octave: int = 1) -> int:
    """Sizes up to 16 stay exact; larger ones round up to a power of two, or with per_octave
    (a power of two) to one of that many even steps an octave (4: ..., 96, 112, 128, 160, ...)."""
    if n <= 16:
        return n
    if per_octave < 1 or per_octave & (per_octave - 1):
        raise ValueError(f"per_octave: expected a power of two >= 1, got {per_octave!r}")
    step = 1 << max(0, (n - 1).bit_length() - per_octave.bit_length())
    return -(-n // step) * step


def problem_key(*args: Any, **extra: Any) -> str:
    """A canonical description of a problem: per tensor its dtype, shape buckets, majorness
    (dims by increasing stride) and alignment class (bytes dividing the address and strides);
    other arguments by value. Problems with the same key share a tuned config."""
    parts = [_describe(a) for a in args]
    parts += [f"{k}={_describe(v)}" for k, v in sorted(extra.items())]
    return ";".join(parts)


def _describe(value: Any) -> str:
    import torch
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        shape = ",".join(str(bucket(d)) for d in value.shape)
        strides = value.stride()
        order = "".join(str(i) for i in sorted(range(value.dim()), key=lambda i: (strides[i], -i)))
        size = value.element_size()
        align = 16
        for amount in [value.data_ptr()] + [s * size for s, d in zip(strides, value.shape)
                                            if d > 1 and s != 1]:
            while align > 1 and amount % align:
                align //= 2
        return f"{dtype}[{shape}]o{order}a{align}"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_describe(v) for v in value) + ")"
    return repr(value)
