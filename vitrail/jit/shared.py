"""Shared read-only caches (``VITRAIL_SHARED_CACHE=DIR[:DIR...]``): kernels and tuning records
prebuilt by an administrator or a team (``VITRAIL_CACHE_DIR=DIR vitrail precompile``, then made
read-only), consulted after a miss of the user's own cache and before compiling. vitrail never
writes to them.

Kernels run as the user, so a shared artifact is loaded only where no untrusted user could have
planted or swapped it: every directory from ``/`` to the artifact is opened one level at a time
relative to the last (``openat`` with O_NOFOLLOW: no symlink or rename can redirect the walk) and
checked on its open descriptor (``fstat``): from the shared root down, owned by a trusted owner
(root, the current user, and the uids of ``VITRAIL_SHARED_CACHE_OWNERS``) and writable by neither
group nor others; above the root, owned by a trusted owner and writable by others only with the
sticky bit (``/tmp``). The artifact and its meta.json are then opened in the checked directory,
checked the same way on their descriptors, and read through them; the checksum in meta.json must
hold. A shared library is loaded by path (dlopen), so it is not loaded from the shared directory
at all: the checked bytes are published as a private copy in the user's own cache (0700, the
user's), and that copy is what loads (no window between the check and the load). An artifact that
fails a check is skipped with one warning and compiled privately.

The tuning store of a shared cache (``DIR/tuning.sqlite``) is opened the same way and then through
``/proc/self/fd/N`` (the checked file itself, not its path again) with ``mode=ro&immutable=1``:
sqlite neither writes nor locks it (checkpoint the WAL before making the directory read-only).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import pwd
import sqlite3
import stat
from typing import Iterator

from vitrail import knobs
from vitrail.jit.cache import writable_by_others

log = logging.getLogger("vitrail.jit")
LAYOUT = "v1"
_WARNED: set[str] = set()


class Untrusted(Exception):
    """A shared file or a directory above it that an untrusted user could have written."""


ENTRY_POINTS = "vitrail.caches"  # installed packages' read-only layers (see layers())
SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shipped")


def roots() -> list[str]:
    """The shared caches' directories (absolute), in the order searched: VITRAIL_SHARED_CACHE's,
    then the layers installed packages ship (``layers()``)."""
    raw = knobs.SHARED_CACHE.get()
    given = [os.path.realpath(os.path.expanduser(d)) for d in raw.split(":") if d.strip()]
    return given + [d for d in layers() if d not in given]


@functools.lru_cache(maxsize=1)
def layers() -> tuple[str, ...]:
    """Read-only layers shipped inside installed packages, found once per process: each entry
    point of the group ``vitrail.caches`` names a package (``mypkg.vitrail_cache``) whose
    directory is laid out as a cache (``v1/kernels/...`` from ``vitrail precompile`` run with
    VITRAIL_CACHE_DIR there, ``tuning.json`` from ``vitrail tune export``), in name order; then
    vitrail's own (``vitrail/shipped``). They are checked and read like VITRAIL_SHARED_CACHE's."""
    found = []
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINTS), key=lambda e: e.name):
        try:
            spec = importlib.util.find_spec(ep.value)
            where = (list(spec.submodule_search_locations or []) if spec else []) or (
                [os.path.dirname(spec.origin)] if spec and spec.origin else [])
            if not where:
                raise ImportError(f"no package {ep.value!r}")
            found.append(os.path.realpath(where[0]))
        except (ImportError, ValueError, AttributeError) as e:
            _warn_once(f"layer:{ep.name}", f"vitrail: the cache layer {ep.name} = {ep.value!r} "
                                           f"({ENTRY_POINTS}) is not used: {e}")
    if os.path.isdir(SHIPPED):
        found.append(os.path.realpath(SHIPPED))
    return tuple(dict.fromkeys(found))


def owners() -> set[int]:
    """Trusted owners: root, this user, and VITRAIL_SHARED_CACHE_OWNERS (uids or user names)."""
    found = {0, os.geteuid()}
    for word in knobs.SHARED_CACHE_OWNERS.get().replace(",", " ").split():
        if word.isdigit():
            found.add(int(word))
        else:
            try:
                found.add(pwd.getpwnam(word).pw_uid)
            except KeyError:
                _warn_once(f"owner:{word}", f"vitrail: VITRAIL_SHARED_CACHE_OWNERS names "
                                            f"{word!r}, no user of this machine; ignored")
    return found


def _check(fd: int, path: str, trusted: set[int], below_root: bool) -> None:
    """A trusted owner, and no one else able to write (cache.writable_by_others: from the root
    down, no group or others; above it, others only with the sticky bit, so that no one renames
    what is not theirs)."""
    st = os.fstat(fd)
    if st.st_uid not in trusted or writable_by_others(st, above_root=not below_root):
        raise Untrusted(f"{path} (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}) "
                        f"could be written by a user not trusted to give you code (trusted: uids "
                        f"{', '.join(map(str, sorted(trusted)))}; VITRAIL_SHARED_CACHE_OWNERS adds "
                        f"others)")


@contextlib.contextmanager
def _open_dir(root: str, parts: list[str], trusted: set[int]) -> Iterator[int]:
    """A descriptor of root/parts..., every level opened relative to the last and checked."""
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    try:
        _check(fd, "/", trusted, root == "/")
        path = ""
        above = [p for p in root.split("/") if p]
        for i, name in enumerate(above + parts):
            path += "/" + name
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
            _check(fd, path, trusted, i >= len(above) - 1)
        yield fd
    finally:
        os.close(fd)


def _read(dir_fd: int, name: str, path: str, trusted: set[int]) -> bytes:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Untrusted(f"{path}/{name} is not a regular file")
        _check(fd, f"{path}/{name}", trusted, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def find(key: str) -> tuple[dict, dict[str, bytes]] | None:
    """(meta, {file name: bytes}) of key's entry in the first shared cache that holds a trusted
    one whose checksum holds (every regular file of the entry, read through checked
    descriptors), else None; a refused entry is one warning."""
    trusted = None
    for root in roots():
        parts = [LAYOUT, "kernels", key[:2], key]
        where = os.path.join(root, *parts)
        if not os.path.isdir(where):  # nothing there (the checked walk decides what loads)
            continue
        trusted = trusted or owners()
        try:
            with _open_dir(root, parts, trusted) as fd:
                files = {}
                for name in os.listdir(fd):
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        files[name] = _read(fd, name, where, trusted)
            meta = json.loads(files["meta.json"])
            data = files[meta["artifact"]]
        except Untrusted as e:
            _warn_once(key, f"vitrail: the shared cache's kernel {where} is not trusted: {e}; "
                            f"compiling it privately")
            continue
        except (OSError, ValueError, KeyError, TypeError) as e:
            _warn_once(key, f"vitrail: the shared cache's kernel {where} is unreadable ({e}); "
                            f"compiling it privately")
            continue
        if meta.get("key") != key or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            _warn_once(key, f"vitrail: the shared cache's kernel {where} failed its checksum; "
                            f"compiling it privately")
            continue
        return meta, files
    return None


@contextlib.contextmanager
def stores() -> Iterator[list[tuple[str, sqlite3.Connection]]]:
    """(path, read-only connection) of each shared cache's tuning store that passes the checks
    (closed on exit); a refused one is one warning."""
    conns, fds = [], []
    try:
        for root, path, trusted in _present("tuning.sqlite"):
            try:
                with _open_dir(root, [], trusted) as dir_fd:
                    fd = os.open("tuning.sqlite", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
                    fds.append(fd)
                    _check(fd, path, trusted, True)
                db = sqlite3.connect(f"file:/proc/self/fd/{fd}?mode=ro&immutable=1", uri=True)
                conns.append((path, db))
            except (Untrusted, OSError, sqlite3.Error) as e:
                _warn_once(path, f"vitrail: the shared tuning store {path} is not used: {e}")
        yield conns
    finally:
        for _, db in conns:
            db.close()
        for fd in fds:
            os.close(fd)


def tuning_exports(where: list[str] | None = None) -> list[tuple[str, bytes]]:
    """(path, bytes) of each shared cache's ``tuning.json`` (a ``vitrail tune export`` file),
    in the order of roots(), read through checked descriptors; a refused one is one warning."""
    found = []
    for root, path, trusted in _present("tuning.json", where):
        try:
            with _open_dir(root, [], trusted) as fd:
                found.append((path, _read(fd, "tuning.json", root, trusted)))
        except (Untrusted, OSError) as e:
            _warn_once(path, f"vitrail: the shared tuning records {path} are not used: {e}")
    return found


def _present(name: str, where: list[str] | None = None) -> Iterator[tuple[str, str, set[int]]]:
    """(root, its file name's path, the trusted owners) for each shared cache (of roots(), or
    where) that holds the file; what is read from it is checked as _open_dir and _check say."""
    trusted = None
    for root in roots() if where is None else where:
        path = os.path.join(root, name)
        if os.path.isfile(path):
            trusted = trusted or owners()
            yield root, path, trusted


def _warn_once(what: str, message: str) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        log.warning(message)
