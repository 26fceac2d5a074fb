"""A precompiled header (gcc's .gch) of torch/extension.h for torch extensions' C++ units.

Parsing torch/extension.h is most of the compile of a torch extension's .cpp file (about 22 of
26 s on two cores). vitrail.jit.extension compiles such a unit against a precompiled header of
it, built once per torch, compiler and flags, kept in the cache and used by every extension:
the unit then takes about 10 s. Not less: gcc still instantiates, in each unit, the templates
that torch's inline functions use (the PCH holds them pending; gcc has nothing like clang's
``-fpch-instantiate-templates``), and emits their code.

Which units: a .cpp unit whose first line of code (after comments and blank lines) is
``#include <torch/extension.h>`` or ``#include <torch/torch.h>`` (which is torch/extension.h
where TORCH_API_INCLUDE_EXTENSION_H is defined, as it is in every extension build): every
``load_inline`` main.cpp, and the usual first line of a ``load`` source. It is compiled with
``-include <entry>/torch_extension.h -Winvalid-pch``; gcc reads the .gch beside that header,
and the unit's own #include then does nothing (#pragma once). A unit that starts with another
header (torch/library.h, ATen/ATen.h) or with a #define is compiled as it is: seeing all of
torch/extension.h first could change what it means. So is a unit whose extra_cflags hold
``-include``, ``-imacros`` or ``-x``, or whose own include directories (its folder,
extra_include_paths) hold a name that torch's, Python's or CUDA's include directories hold
(c10/, Python.h...): a header of torch's could be found there first, and the PCH was built
without them. Only gcc: another CXX (clang) gets none.

The key: the compiler (its path and ``--version``), every flag of the unit's command line but
its own -- the defines (TORCH_EXTENSION_NAME aside: no torch header uses it), -std, -fPIC, the
user's extra_cflags (-O3...), the include directories of torch, Python and, with CUDA, the
toolkit --, torch's version and ABI, Python's, and the size and mtime of a few of torch's and
Python's headers (a reinstall in place changes them). gcc refuses a PCH whose defines, -O, -std
or compiler differ: the key keeps them apart, and ``-Winvalid-pch`` would say so.

Built: the first time a unit could use it and it is missing, a detached, niced process builds
it (about 40 s, 2 GB of memory and 0.8 GB of disk here) under the cache's per-key lock, while
the build that wanted it compiles without it (beside it where cores are plenty, else after it):
it never makes a build wait, is built by one process however many want it, and outlives the
process that started it, so that the next extension finds it. :func:`build` builds it in the
foreground (``vitrail.jit.extension.build_torch_pch``: CI images, benchmarks). It is an entry
of the cache like a kernel: listed, pruned least-recently-used first, cleared.

Used safely: the entry's meta holds the .gch's size, checked before each use, and its sha256,
checked beside the compile (once per process and file). gcc itself refuses a PCH made with
other flags or by another gcc (-Winvalid-pch) and then compiles the header's text: slower,
correct (logged at debug level). A unit whose compile fails in a way that names the PCH or
crashes gcc, or whose PCH fails its sha256, is compiled again without it (logged at debug
level); a PCH that failed its sha256 or its size is removed, and built again next time.
VITRAIL_TORCH_PCH=0 turns all of this off. VITRAIL_FORCE_RECOMPILE rebuilds extensions, not
their PCH: ``vitrail cache clear`` (or prune) removes it.

CUDA: a .cu unit gets no PCH, as nvcc has none to give: its host side compiles the output of
cudafe++ (torch's headers already expanded and rewritten, where a gcc PCH cannot apply), its
device side is cicc (EDG's front end, not gcc), and ``--pch`` is NVRTC's alone. The .cu units
compile beside the .cpp ones instead: each unit by its own process at once, and within nvcc
the host and device chains at once (vitrail.jit.compiler.run_nvcc).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vitrail import __version__, knobs
from vitrail.jit.cache import LAYOUT, Entry, KernelCache, make_key, safe_name
from vitrail.jit.index import Index

log = logging.getLogger("vitrail.jit")
NAME = "torch/extension.h"
BACKEND = "pch"
WRAPPER = "torch_extension.h"  # the header the units -include; gcc reads WRAPPER.gch instead
GCH = WRAPPER + ".gch"
RETRY_SECONDS = 3600.0  # a PCH whose build failed is not tried again before this
_LEADING = re.compile(r"(?:\s+|//[^\n]*|/\*.*?\*/)*", re.S)
_FIRST = re.compile(r'[ \t]*#[ \t]*include[ \t]*[<"]torch/(?:extension|torch)\.h[>"]'
                    r'[ \t]*(?://[^\n]*|/\*.*?\*/)?[ \t]*(?:\n|$)', re.S)
_NOT_WITH = ("-include", "-imacros", "-x")


@dataclass(frozen=True)
class Spec:
    """What one PCH is: its key, the compiler and the flags it is built with."""
    key: str
    cxx: str
    flags: tuple[str, ...]


def applies(text: str) -> bool:
    """Whether a C++ unit's first line of code includes torch/extension.h or torch/torch.h."""
    return _FIRST.match(text, _LEADING.match(text).end()) is not None


def refusal(cxx_id: str, cflags, user_dirs, system_dirs) -> str | None:
    """Why units with these flags and include directories get no PCH, or None where they may
    have one. cxx_id: the compiler's --version."""
    if "clang" in cxx_id.lower() or not re.search(r"\bg\+\+|\bgcc\b|Free Software", cxx_id):
        return f"the compiler is not gcc ({cxx_id.splitlines()[0] if cxx_id else '?'})"
    for f in cflags:
        if f.startswith(_NOT_WITH):
            return f"extra_cflags hold {f}"
    names = _names(tuple(system_dirs))
    for d in dict.fromkeys(user_dirs):
        try:
            mine = names.intersection(os.listdir(d))
        except OSError:
            continue
        if mine:
            return f"{d} holds {sorted(mine)[0]}, as torch's include directories do"
    return None


@functools.lru_cache(maxsize=8)
def _names(dirs: tuple[str, ...]) -> frozenset[str]:
    found: set[str] = set()
    for d in dirs:
        try:
            found.update(os.listdir(d))
        except OSError:
            pass
    return frozenset(found)


def spec(cxx: str, flags, stamps=(), **identity) -> Spec:
    """The PCH built by cxx with flags (every flag of the units' command lines but their own);
    identity: the rest of the key (the compiler's --version, torch's and Python's versions);
    stamps: files whose size and mtime stand for the headers' content."""
    flags = tuple(flags)
    key = make_key(layout=LAYOUT, vitrail=__version__, backend=BACKEND, header=NAME,
                   cxx=os.path.realpath(cxx), flags=flags, stamps=[_stamp(p) for p in stamps],
                   **identity)
    return Spec(key, cxx, flags)


def _stamp(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return [path, None]
    return [path, st.st_size, st.st_mtime_ns]


# --------------------------------------------------------------------------------------- use
def find(pch: Spec, cache: KernelCache) -> Entry | None:
    """The published PCH of pch.key if its .gch is whole (marked used), else None; one that is
    not is removed."""
    entry = cache.lookup(pch.key, read_artifact=False)
    if entry is None:
        return None
    try:
        size = os.stat(entry.dir / GCH).st_size
    except OSError:
        size = None
    if size is None or size != entry.meta.get("gch_size"):
        log.debug("vitrail: the precompiled header %s is %s; removing it", entry.dir / GCH,
                  "missing" if size is None else "truncated")
        discard(entry, cache)
        return None
    Index.touch(entry.dir)
    return entry


_VERIFIED: dict[tuple, bool] = {}


def verify(entry: Entry) -> bool:
    """Whether the entry's .gch holds what its build wrote (its sha256; once per process and
    file: size, mtime, inode)."""
    path = entry.dir / GCH
    try:
        st = os.stat(path)
        sig = (str(path), st.st_size, st.st_mtime_ns, st.st_ino)
        if sig not in _VERIFIED:
            _VERIFIED[sig] = _sha256(path) == entry.meta.get("gch_sha256")
        return _VERIFIED[sig]
    except OSError:
        return False


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def discard(entry: Entry, cache: KernelCache) -> None:
    cache.discard(entry.dir)
    Index(cache).forget(entry.key)


def command(cmd: list[str], entry: Entry) -> list[str]:
    """A unit's compile command (``[cxx, "-c", source, ...]``) that uses the PCH."""
    return [*cmd[:2], "-include", str(entry.dir / WRAPPER), "-Winvalid-pch", *cmd[2:]]


def failed_on_it(out: str) -> bool:
    """Whether a compile that used a PCH failed because of it (unreadable, refused under
    -Werror, removed under it, or a crash of gcc reading it) rather than of the unit's code."""
    return (GCH in out or "precompiled header" in out or "internal compiler error" in out
            or f"{WRAPPER}: No such file" in out)


def refused(out: str) -> str | None:
    """gcc's reason for not using a PCH (-Winvalid-pch) in a compile's output, or None."""
    found = re.search(rf"{re.escape(GCH)}: (not used because .*|too short.*|.*not a PCH.*)",
                      out)
    return found.group(1).strip() if found else None


# ------------------------------------------------------------------------------------- build
def build(pch: Spec) -> Entry:
    """The PCH's entry: from the cache, else built now under its lock and published."""
    from vitrail.jit.compiler import cached_build
    return cached_build(pch.key, NAME, BACKEND, lambda d: _compile(d, pch))[0]


def _compile(build_dir: Path, pch: Spec) -> dict:
    from vitrail.jit.compiler import BuildFailed, run_compiler
    (build_dir / WRAPPER).write_text(f"#include <{NAME}>\n")
    cmd = [pch.cxx, "-x", "c++-header", "-c", WRAPPER, "-o", GCH, *pch.flags]
    text = shlex.join(cmd)
    start = time.time()
    try:
        out = run_compiler(cmd, build_dir, text)
    except BuildFailed as failed:
        failed.tool = os.path.basename(pch.cxx)
        raise
    (build_dir / "build.log").write_text(f"$ {text}\n{out}")
    gch = build_dir / GCH
    return {"name": NAME, "backend": BACKEND, "arch": "host", "artifact": WRAPPER,
            "compile_seconds": round(time.time() - start, 3), "created": time.time(),
            "command": text, "compiler": "", "vitrail": __version__, "source": WRAPPER,
            "resources": {}, "gch_size": gch.stat().st_size, "gch_sha256": _sha256(gch)}


_started: set[str] = set()
_children: list[subprocess.Popen] = []


def build_in_background(pch: Spec, cache: KernelCache) -> int | None:
    """Start a detached process that builds the PCH (see the module's docstring); its pid, or
    None where none was started: this process started one already, another process is building
    it, or its build failed within RETRY_SECONDS (its log: the cache's failed/ folder)."""
    if pch.key in _started or cache.busy(pch.key):
        return None
    failed = cache.root / "failed" / f"{safe_name(NAME)}-{pch.key[:16]}"
    try:
        if time.time() - failed.stat().st_mtime < RETRY_SECONDS:
            log.debug("vitrail: the precompiled header's last build failed (%s); not again yet",
                      failed)
            return None
    except OSError:
        pass
    _started.add(pch.key)
    package = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, knobs.CACHE_DIR.name: str(cache.root.parent),
           "PYTHONPATH": os.pathsep.join(p for p in (package, os.environ.get("PYTHONPATH"))
                                         if p)}
    env.pop(knobs.FORCE_RECOMPILE.name, None)  # one that another process publishes first is it
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from vitrail.jit import pch; sys.exit(pch._main())",
         json.dumps(dataclasses.asdict(pch))], env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    _children.append(proc)  # reaped by subprocess when this process starts another
    log.info("vitrail: building torch's precompiled header in the background (pid %d); "
             "extensions built after it compile faster", proc.pid)
    return proc.pid


def _main() -> int:
    """The background builder: ``python -c ... <Spec as JSON>``."""
    os.nice(10)  # the builds that someone waits for come first
    fields = json.loads(sys.argv[1])
    try:
        build(Spec(fields["key"], fields["cxx"], tuple(fields["flags"])))
    except Exception as e:  # noqa: BLE001  (no one reads this process's output: log it)
        log.warning("vitrail: building the precompiled header failed: %s", e)
        return 1
    return 0
