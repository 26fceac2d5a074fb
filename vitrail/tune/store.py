"""The tuning store: which config won for which problem on which GPU, kept across restarts.

A record is keyed by the op, a hash of its kernel source, the problem key (shape buckets, dtypes,
majorness, alignment: see :func:`problem_key`), the GPU's name and SM count, and the vitrail
version; it holds the winning config and every candidate's timing (or why it failed). The store
is a sqlite file beside the kernel cache (``<cache dir>/tuning.sqlite``), shared by every process
of the user: a second process tuning the same problem finds the record and times nothing.
``vitrail tune export FILE`` / ``import FILE`` move records between machines and releases; a
lookup that misses the user's store reads the shared caches' stores after it (VITRAIL_SHARED_CACHE,
then the layers installed packages ship: vitrail.jit.shared.layers), read-only.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

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

_GET = ("SELECT config, timings, created FROM records WHERE op=? AND source_hash=? AND problem=? "
        "AND gpu=? AND sms=? AND vitrail=?")


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
        """A record from its JSON form, every field checked (``validated``)."""
        return validated(data)


class TuningStore:
    def __init__(self, path: str | Path | None = None):
        self.shared = path is None  # the user's own store: shared ones are read after it
        if path is None:
            from vitrail.jit.cache import cache_dir
            path = cache_dir() / "tuning.sqlite"
        self.path = Path(path)

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """A connection (WAL, busy timeout); a damaged file is moved aside and replaced, also
        when a query finds the damage (vitrail.jit.database)."""
        db = database.connect(self.path, _SCHEMA, "the tuning store",
                              table=("records", _COLUMNS + ("config", "timings", "created")),
                              precious=True)
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
                row = db.execute(_GET, key.as_tuple()).fetchone()
            if row is not None:
                return Record(key, Config.from_json(row[0]), json.loads(row[1]), row[2])
        except (OSError, sqlite3.Error, ValueError, TypeError) as e:
            _warn_once(self.path, f"vitrail: the tuning store {self.path} cannot be read ({e}); "
                                  "configs come from shared stores or the heuristics")
        return self._get_shared(key) if self.shared else None

    def _get_shared(self, key: RecordKey) -> Record | None:
        """key's record in the first shared read-only cache's store that has it
        (VITRAIL_SHARED_CACHE; opened as vitrail.jit.shared says)."""
        from vitrail.jit import shared
        roots = shared.roots()
        if not roots:
            return None
        with shared.stores() as found:
            for path, db in found:
                try:
                    row = db.execute(_GET, key.as_tuple()).fetchone()
                    if row is not None:
                        return Record(key, Config.from_json(row[0]), json.loads(row[1]), row[2])
                except (sqlite3.Error, ValueError, TypeError) as e:
                    _warn_once(Path(path), f"vitrail: the shared tuning store {path} cannot be "
                                           f"read ({e})")
        return _exported(tuple(roots)).get(key)

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
        write_export(path, records)
        return len(records)

    def import_(self, path: str | Path, *, overwrite: bool = False,
                ops: Mapping[str, Any] | None = None) -> tuple[int, int]:
        """Read records from a file written by export(); returns (added, kept as they were).

        The whole file is checked first (``validated``: types, ranges, finite numbers, sizes;
        with ``ops``, a registry name -> Op, each record's op is known and its config inside
        the op's space) and imported in one transaction, all or nothing; a bad file raises
        ValueError naming the first bad record. A record already here for the same key is kept
        unless overwrite is set: a team's shipped results do not replace what this machine
        measured itself."""
        records = read_export(path, ops)
        added = kept = 0
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                for record in records:
                    if not overwrite and db.execute(
                            "SELECT 1 FROM records WHERE op=? AND source_hash=? AND problem=? "
                            "AND gpu=? AND sms=? AND vitrail=?",
                            record.key.as_tuple()).fetchone():
                        kept += 1
                        continue
                    db.execute("INSERT OR REPLACE INTO records VALUES (?,?,?,?,?,?,?,?,?)",
                               (*record.key.as_tuple(), record.config.to_json(),
                                json.dumps(record.timings), record.created))
                    added += 1
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return added, kept


@functools.lru_cache(maxsize=4)
def _exported(roots: tuple[str, ...]) -> dict[RecordKey, Record]:
    """The records of the shared caches' tuning.json files (the shipped layers' form), read and
    checked once per process: the first root holding a key wins."""
    from vitrail.jit import shared
    found: dict[RecordKey, Record] = {}
    for path, text in shared.tuning_exports(list(roots)):
        try:
            for record in parse_export(text, path):
                found.setdefault(record.key, record)
        except ValueError as e:
            _warn_once(Path(path), f"vitrail: the shared tuning records {path} are not used: {e}")
    return found


def write_export(path: str | Path, records: list[Record]) -> None:
    """Write records as an export file (what import_ and the shared layers read)."""
    doc = {"format": FORMAT, "version": FORMAT_VERSION,
           "records": [r.to_json() for r in records]}
    Path(path).write_text(json.dumps(doc, indent=1, default=_json_safe) + "\n")


MAX_EXPORT_BYTES = 64 << 20  # an export of every record of a busy machine is a few MB
_TEXT = 4096  # the longest key field, error or config value kept


def read_export(path: str | Path, ops: Mapping[str, Any] | None = None) -> list[Record]:
    """The records of an export file, every one checked (``validated``); ValueError (one line,
    naming the file and the first bad record) for anything else."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_EXPORT_BYTES:
            raise ValueError(f"{size} bytes, more than the {MAX_EXPORT_BYTES} an export may have")
        text = Path(path).read_bytes()
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable tuning export ({e})") from None
    return parse_export(text, path, ops)


def parse_export(text: bytes | str, path: str | Path,
                 ops: Mapping[str, Any] | None = None) -> list[Record]:
    """The records of an export's text (read from path), every one checked."""
    if len(text) > MAX_EXPORT_BYTES:
        raise ValueError(f"{path}: {len(text)} bytes, more than the {MAX_EXPORT_BYTES} an export "
                         f"may have")
    try:
        doc = json.loads(text)
    except RecursionError:
        raise ValueError(f"{path}: not a tuning export (nested too deeply)") from None
    except ValueError as e:
        raise ValueError(f"{path}: not a readable tuning export ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not a vitrail tuning export (no \"format\": \"{FORMAT}\")")
    version = doc.get("version", 0)
    if type(version) is not int or version < 0:
        raise ValueError(f"{path}: \"version\" must be a non-negative integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise ValueError(f"{path}: export format version {version} is newer than this vitrail "
                         f"reads ({FORMAT_VERSION}); upgrade vitrail")
    records = doc.get("records", [])
    if not isinstance(records, list):
        raise ValueError(f"{path}: \"records\" must be a list")
    out = []
    for i, data in enumerate(records):
        try:
            out.append(validated(data, ops))
        except ValueError as e:
            raise ValueError(f"{path}: record {i}: {e}; nothing was imported") from None
    return out


def validated(data: Any, ops: Mapping[str, Any] | None = None) -> Record:
    """A record from its JSON form, every field checked; ValueError says the first problem."""
    if not isinstance(data, dict):
        raise ValueError(f"expected an object, got {type(data).__name__}")
    allowed = set(_COLUMNS) | {"config", "timings", "created"}
    extra = set(data) - allowed
    if extra:
        raise ValueError(f"unknown field(s) {sorted(map(str, extra))[:3]}")
    missing = [c for c in (*_COLUMNS, "config") if c not in data]
    if missing:
        raise ValueError(f"missing field(s) {missing}")
    for c in _COLUMNS:
        v = data[c]
        if c == "sms":
            if type(v) is not int or not 1 <= v <= 100_000:
                raise ValueError(f"sms must be an integer from 1 to 100000, got {v!r:.60}")
        elif not isinstance(v, str) or not 0 < len(v) <= _TEXT:
            raise ValueError(f"{c} must be a string of 1 to {_TEXT} characters, got "
                             f"{type(v).__name__}")
    config = _config(data["config"], "config")
    if ops is not None:  # an op of a known family not built in this process: no space to check
        op = ops.get(data["op"])
        if op is None and data["op"].split(".")[0] not in {n.split(".")[0] for n in ops}:
            raise ValueError(f"op {data['op']!r:.80} is of no family known here")
        try:
            if op is not None:
                op.space.config(**config)
        except (ValueError, TypeError) as e:
            raise ValueError(f"config {config} is not in {data['op']}'s space: {e}") from None
    timings = data.get("timings", [])
    if not isinstance(timings, list) or len(timings) > 100_000:
        raise ValueError("timings must be a list of at most 100000 entries")
    for t in timings:
        if not isinstance(t, dict) or set(t) - {"config", "ms", "error", "device", "raw_ms"}:
            raise ValueError(f"a timing must be an object of config, ms, error (and with several "
                             f"GPUs device, raw_ms), got {t!r:.80}")
        device = t.get("device")
        if device is not None and (type(device) is not int or not 0 <= device < 1 << 16):
            raise ValueError(f"a timing's device must be a GPU index, got {device!r:.40}")
        raw = t.get("raw_ms")
        if raw is not None and (type(raw) not in (int, float) or not math.isfinite(raw) or raw < 0):
            raise ValueError(f"a timing's raw_ms must be a finite number >= 0, got {raw!r:.40}")
        if t.get("config") is not None:
            _config(t["config"], "a timing's config")
        ms = t.get("ms")
        if ms is not None and (type(ms) not in (int, float) or not math.isfinite(ms) or ms < 0):
            raise ValueError(f"a timing's ms must be a finite number >= 0 or null, got {ms!r:.40}")
        error = t.get("error")
        if error is not None and (not isinstance(error, str) or len(error) > 64 * _TEXT):
            raise ValueError("a timing's error must be a string (at most 256 KiB) or null")
    created = data.get("created", time.time())
    if type(created) not in (int, float) or not math.isfinite(created) or created < 0:
        raise ValueError(f"created must be a finite time >= 0, got {created!r:.40}")
    return Record(RecordKey(*(data[c] for c in _COLUMNS)), Config.from_json(config), timings,
                  float(created))


def _config(value: Any, what: str) -> dict:
    if not isinstance(value, dict) or not 0 < len(value) <= 256:
        raise ValueError(f"{what} must be an object of 1 to 256 parameters")
    for k, v in value.items():
        ok = isinstance(v, (bool, int, str)) or (type(v) is float and math.isfinite(v))
        if not isinstance(k, str) or len(k) > 256 or not ok or \
                (isinstance(v, int) and abs(v) > 1 << 62) or (isinstance(v, str) and len(v) > 256):
            raise ValueError(f"{what}: {k!r:.40} = {v!r:.40} is not a name and a number, "
                             f"bool or short string")
    return value


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
