"""The on-disk kernel cache: keys, per-key locks, atomic publish, verification.

Layout under :func:`cache_dir` (all paths relative, so a copied cache still hits)::

    v1/kernels/ab/<key>/   one published build: the artifact, meta.json (with its sha256),
                           the source, the compiler log and, for nvcc, the PTX (or the
                           precompiled header of torch's that extensions use: pch.py)
    v1/locks/<key>.lock    flock'd while a process builds <key>; holds the holder's pid
    v1/tmp/<key>.<pid>.*   private build directories, renamed into kernels/ when complete
    v1/failed/<name>-<key> the source and log of a failed compile, for reproduction
    v1/index.sqlite        name, size, compile seconds, created, last used (see index.py; a
                           load marks a use by its entry's mtime, which sync() reads in)
    v1/tools.json          compilers' --version per binary (path, size, mtime; extension.py),
                           a GPU model's compute capability (toolchain.py)

A key hashes everything that decides the artifact: the source, the content of every header it
includes (found by scanning #include lines over the include path, so a header edit invalidates
its users), the compiler and its version, the host compiler, flags, defines, arch, backend and
the vitrail version. Never an absolute path.

Crash safety: a build happens in a private temp dir, is fsync'd, and appears under kernels/ by
one rename; the per-key lock is an flock, which the kernel drops when its holder dies. A reader
checks meta.json's sha256 of the artifact before it loads anything, so a truncated or corrupted
entry is rebuilt instead of loaded.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from vitrail import knobs
from vitrail.jit.errors import CacheError, CacheLockTimeout

log = logging.getLogger("vitrail.jit")
LAYOUT = "v1"
META = "meta.json"


def cache_dir() -> Path:
    """The cache root for this user, created with mode 0700 at every level it creates (never
    the working directory), and trusted only where no other user can write to it: see
    ``trusted``."""
    explicit = knobs.CACHE_DIR.get()
    if explicit:
        root = Path(explicit).expanduser()
        where = f"VITRAIL_CACHE_DIR={explicit}"
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
        root = base / "vitrail"
        where = f"the default cache directory {root}"
    if not root.is_absolute():
        raise CacheError(f"VITRAIL_CACHE_DIR={explicit!r} must be an absolute path")
    make_private_dirs(root, where)
    trusted(root, where)
    return root


def make_private_dirs(path: Path, where: str = "") -> None:
    """Create path and every missing directory above it with mode 0700 (pathlib gives the
    parents the umask's mode)."""
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise CacheError(f"{where or path}: cannot create {d} ({e.strerror}); set "
                             f"VITRAIL_CACHE_DIR to a directory of yours") from None
    if not path.is_dir():
        raise CacheError(f"{where or path}: {path} is not a directory (a file, or a link to "
                         f"nothing); set VITRAIL_CACHE_DIR to a directory of yours")


_TRUSTED: set[str] = set()  # roots checked in this process


def trusted(root: Path, where: str = "") -> None:
    """Refuse a cache another user could plant code in (as ssh does for its keys): the root
    (its real path) must be owned by this user and writable by no one else; every directory
    above it owned by this user or root, and writable by others only with the sticky bit (so
    that no one renames the cache away and puts another in its place) or by this user's own
    group."""
    real = os.path.realpath(root)
    if real in _TRUSTED:
        return
    uid = os.geteuid()
    fix = "(chmod go-w, or set VITRAIL_CACHE_DIR to a directory only you can write)"
    st = os.stat(real)
    if st.st_uid != uid:
        raise CacheError(f"{where or root}: {real} is owned by uid {st.st_uid}, not by you "
                         f"(uid {uid}): kernels loaded from it would run as you; set "
                         f"VITRAIL_CACHE_DIR to a directory of yours")
    if st.st_mode & 0o022:
        raise CacheError(f"{where or root}: {real} can be written by other users (mode "
                         f"{stat.S_IMODE(st.st_mode):o}); they could plant kernels that run as "
                         f"you {fix}")
    parent = os.path.dirname(real)
    while True:
        st = os.stat(parent)
        if st.st_uid not in (uid, 0) or writable_by_others(st, above_root=True):
            raise CacheError(f"{where or root}: {parent}, above the cache, can be changed by "
                             f"other users (owner uid {st.st_uid}, mode "
                             f"{stat.S_IMODE(st.st_mode):o}): they could put another cache in "
                             f"its place {fix}")
        if parent == os.path.dirname(parent):
            break
        parent = os.path.dirname(parent)
    _TRUSTED.add(real)


def own_directory(path: Path, where: str = "") -> None:
    """Refuse a directory inside a cache that is not this user's alone (owned by another user,
    writable by a group or others, or a symlink): whoever can change it could swap what is
    loaded from below it, whatever the root's mode (a directory planted while the root was
    open to others stays theirs after the root is closed)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid() or \
            writable_by_others(st, above_root=False):
        raise CacheError(f"{where + ': ' if where else ''}{path} inside the cache is not yours "
                         f"alone (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"
                         f"{', a symlink' if stat.S_ISLNK(st.st_mode) else ''}): someone else "
                         f"could swap the kernels below it; remove it (vitrail recreates it) "
                         f"or set VITRAIL_CACHE_DIR to a directory of yours")


def writable_by_others(st: os.stat_result, above_root: bool) -> bool:
    """Whether users other than this one could change what a directory or file holds: at a
    cache's root and below it, a group or others may not write at all; above it (where
    writing lets one rename the cache away and put another in its place), others may write
    only with the sticky bit (as /tmp), and a group only where it is this user's own (a user
    private group) or with the sticky bit. The one rule of this user's cache (``trusted``) and
    of shared ones (vitrail.jit.shared)."""
    if not above_root:
        return bool(st.st_mode & 0o022)
    if st.st_mode & stat.S_ISVTX:
        return False
    return bool(st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != os.getegid()))


# ----------------------------------------------------------------------------------------- keys
_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\n]+)[>"]', re.M)
# path -> ((mtime_ns, ctime_ns, size, ino), sha256 hex, [(kind, spelled), ...]) for this process
_scanned: dict[str, tuple[tuple[int, int, int, int], str, list[tuple[bytes, str]]]] = {}
_RACY_NS = 2_000_000_000  # a file changed this recently may change again within one timestamp tick


def _scan(path: str) -> tuple[str, list[tuple[bytes, str]]]:
    st = os.stat(path)
    # ctime as well as mtime: `cp -p`, `tar x` and `touch -r` put an old mtime on new content
    sig = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
    hit = _scanned.get(path)
    if hit and hit[0] == sig:
        return hit[1], hit[2]
    data = Path(path).read_bytes()
    includes = [(m.group(1), m.group(2).decode(errors="replace").strip())
                for m in _INCLUDE.finditer(data)]
    digest = hashlib.sha256(data).hexdigest()
    if time.time_ns() - st.st_ctime_ns > _RACY_NS:  # else a same-size rewrite in the same
        _scanned[path] = (sig, digest, includes)     # tick (coarse timestamps) would look unchanged
    return digest, includes


def header_closure(source: str, include_dirs: list[str]) -> list[tuple[str, str]]:
    """(spelled include name, sha256 of content) for every header the source may include.

    Conditional includes are all followed (a superset is safe: it can only make a key more
    specific). Headers not found on the include path (libc, libstdc++, NVRTC built-ins) are keyed
    by name; the host compiler's and NVRTC's versions are in the key for them.
    """
    seen: dict[str, str] = {}
    found: set[tuple[str, str]] = set()
    todo = [(None, kind, name) for kind, name in
            ((m.group(1), m.group(2).decode(errors="replace").strip())
             for m in _INCLUDE.finditer(source.encode()))]
    while todo:
        parent, kind, name = todo.pop()
        path = _resolve(parent, kind, name, include_dirs)
        if path is None:
            found.add((name, "<not on include path>"))
            continue
        if path in seen:
            found.add((name, seen[path]))
            continue
        digest, includes = _scan(path)
        seen[path] = digest
        found.add((name, digest))
        parent_dir = os.path.dirname(path)
        todo.extend((parent_dir, k, n) for k, n in includes)
    return sorted(found)


def _resolve(parent: str | None, kind: bytes, name: str, include_dirs: list[str]) -> str | None:
    dirs = ([parent] if parent and kind == b'"' else []) + include_dirs
    for d in dirs:
        path = os.path.join(d, name)
        if os.path.isfile(path):
            return os.path.normpath(path)
    return None


def make_key(**parts: object) -> str:
    """sha256 over a canonical JSON of the parts (sorted keys; lists keep their order)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


# ---------------------------------------------------------------------------------------- store
@dataclass(frozen=True)
class Entry:
    """A verified, published build."""
    key: str
    dir: Path
    meta: dict
    artifact_bytes: bytes | None  # read for cubins (loaded from memory); None for shared libs

    @property
    def artifact(self) -> Path:
        return self.dir / self.meta["artifact"]


class KernelCache:
    def __init__(self, root: Path | None = None):
        self.root = (root or cache_dir()) / LAYOUT
        for sub in ("kernels", "locks", "tmp", "failed", "trash"):
            make_private_dirs(self.root / sub)
        for d in (self.root, *(self.root / sub for sub in ("kernels", "locks", "tmp"))):
            own_directory(d)

    def entry_dir(self, key: str) -> Path:
        return self.root / "kernels" / key[:2] / key

    # -- reading ------------------------------------------------------------------------------
    def lookup(self, key: str, read_artifact: bool) -> Entry | None:
        """The published entry for key if it is complete and its checksum holds, else None."""
        d = self.entry_dir(key)
        try:
            own_directory(d.parent)  # kernels/<ab>: the entry could be swapped through it
            own_directory(d)
            meta = json.loads((d / META).read_text())
            data = _read_own(d / meta["artifact"])
        except FileNotFoundError:
            return None
        except PermissionError as e:  # another user's file: never loaded
            log.warning("vitrail: cache entry %s is not yours (%s); rebuilding it", d, e)
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("vitrail: cache entry %s is unreadable (%s); rebuilding it", d, e)
            return None
        if meta.get("key") != key or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            log.warning("vitrail: cache entry %s failed its checksum (truncated or corrupted); "
                        "rebuilding it", d)
            return None
        return Entry(key, d, meta, data if read_artifact else None)

    # -- locking ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, key: str, name: str) -> Iterator[None]:
        """Hold the build lock of key; wait at most VITRAIL_LOCK_TIMEOUT seconds for it."""
        path = self.root / "locks" / f"{key}.lock"
        timeout = knobs.LOCK_TIMEOUT.get()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            start, logged = time.monotonic(), False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    waited = time.monotonic() - start
                    holder = _read_pid(fd)
                    if waited >= timeout:
                        raise CacheLockTimeout(
                            f"gave up after {waited:.0f} s waiting for the build lock of kernel "
                            f"'{name}' at {path}, held by pid {holder}. If that process is stuck, "
                            f"kill it; raise VITRAIL_LOCK_TIMEOUT to wait longer.") from None
                    if not logged and waited > 1.0:
                        log.warning("vitrail: waiting for kernel '%s': pid %s is compiling it "
                                    "(lock %s)", name, holder, path)
                        logged = True
                    time.sleep(min(0.05 + waited / 20, 0.5))
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # closing the last descriptor releases the flock

    def busy(self, key: str) -> bool:
        """Whether a live process holds key's build lock now (a glance: it may change at once)."""
        try:
            fd = os.open(self.root / "locks" / f"{key}.lock", os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    # -- building and publishing --------------------------------------------------------------
    def new_build_dir(self, key: str) -> Path:
        """A private directory for one build; stale ones of this key (dead builders) go first.

        Call it holding the key's lock: then no live process is building key.
        """
        for old in (self.root / "tmp").glob(f"{key}.*"):
            shutil.rmtree(old, ignore_errors=True)
        return Path(tempfile.mkdtemp(prefix=f"{key}.{os.getpid()}.", dir=self.root / "tmp"))

    def publish(self, key: str, build: Path, meta: dict, read_artifact: bool) -> Entry:
        """fsync the build, then make it the entry of key with one atomic rename."""
        data = (build / meta["artifact"]).read_bytes()
        meta = {**meta, "key": key, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        (build / META).write_text(json.dumps(meta, indent=1, sort_keys=True))
        for f in build.rglob("*"):
            if f.is_file():  # writable by this user alone, whatever the umask (see _read_own)
                os.chmod(f, stat.S_IMODE(f.stat().st_mode) & ~0o022)
                _fsync_path(f)
        _fsync_path(build)
        final = self.entry_dir(key)
        final.parent.mkdir(mode=0o700, exist_ok=True)
        if final.exists():  # a forced rebuild, or a corrupted entry: move it out of the way first
            self.discard(final)
        os.rename(build, final)
        _fsync_path(final.parent)
        return Entry(key, final, meta, data if read_artifact else None)

    def discard(self, path: Path) -> None:
        """Remove an entry directory: rename it away atomically, then delete it."""
        trash = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=self.root / "trash"))
        try:
            os.rename(path, trash / path.name)
        except FileNotFoundError:
            pass
        shutil.rmtree(trash, ignore_errors=True)

    def save_failure(self, name: str, key: str, build: Path) -> Path:
        """Keep a failed build's source and log for reproduction; returns where."""
        dest = self.root / "failed" / f"{safe_name(name)}-{key[:16]}"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(build, dest, ignore=shutil.ignore_patterns("keep"))
        return dest

    def entries(self) -> Iterator[tuple[str, Path, dict]]:
        """(key, dir, meta) for every published entry on disk whose meta.json reads."""
        for meta_path in (self.root / "kernels").glob(f"*/*/{META}"):
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, ValueError):
                meta = {}
            yield meta_path.parent.name, meta_path.parent, meta


def dir_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def _read_own(path: Path) -> bytes:
    """A file's bytes, read only if this user owns it and no one else can write it (checked
    on the open descriptor, so nothing can swap the file between the check and the read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PermissionError(f"{path} is not a regular file")
        if st.st_uid != os.geteuid() or writable_by_others(st, above_root=False):
            raise PermissionError(f"{path} is owned by uid {st.st_uid} with mode "
                                  f"{stat.S_IMODE(st.st_mode):o}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def _read_pid(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode().strip() or "unknown"
    except OSError:
        return "unknown"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def safe_name(name: str) -> str:
    """name as a file name: characters other than letters, digits, _ . - become _."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:80] or "kernel"
