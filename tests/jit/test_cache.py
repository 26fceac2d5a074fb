"""The kernel cache on a machine with no GPU: keys, locking, crash safety, verification, memo, index.

Everything here compiles for real (nvcc to a shared library, NVRTC to a cubin) and nothing runs
on a GPU. NVRTC compiles take ~0.1 s, nvcc ones ~1-3 s, so most key tests use NVRTC. The
multi-process tests drive nvcc through a wrapper script (``_nvcc_wrapper``) that passes the
toolchain probes straight to the real nvcc but can sleep before a real compile (to widen race
windows), report another version, and record the pid of every real compile.

The autouse fixture of tests/conftest.py gives each test its own VITRAIL_CACHE_DIR (the
``cache_dir`` fixture) and VITRAIL_ARCH=90a.
"""
from __future__ import annotations

import builtins
import dataclasses
import fcntl
import hashlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import vitrail
import vitrail.jit as jit
from vitrail.jit import cache as cache_module, compiler, toolchain
from vitrail.jit.cache import KernelCache, dir_size
from vitrail.jit.index import Index

REPO = Path(vitrail.__file__).resolve().parents[1]


def _has_nvrtc() -> bool:
    try:
        toolchain.nvrtc()
        return True
    except jit.ToolchainError:
        return False


def _real_nvcc() -> str | None:
    try:
        return toolchain.nvcc().path
    except jit.ToolchainError:
        return None


REAL_NVCC = _real_nvcc()
needs_nvrtc = pytest.mark.skipif(not _has_nvrtc(), reason="needs NVRTC (cuda-bindings)")
needs_nvcc = pytest.mark.skipif(REAL_NVCC is None, reason="needs nvcc")

# A device-only kernel for NVRTC; SCALE comes from a define or from cfg.h.
SAXPY = r"""
#ifndef SCALE
#define SCALE 1
#endif
extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] * SCALE + y[i];
}
"""
SAXPY_WITH_HEADER = '#include "cfg.h"\n' + SAXPY

# A shared library for nvcc: a kernel, and a host entry point that runs without a GPU.
ADD_ONE = r"""
__global__ void fill(int* out, int v) { out[threadIdx.x] = v; }
extern "C" int add_one(int x) { return x + 1; }
"""


# --------------------------------------------------------------------------------------- helpers
def fresh(source: str, **kw) -> jit.Module:
    """compile() as a new process would do it: the in-memory memo forgotten first."""
    jit.clear_memory_cache()
    return jit.compile(source, **kw)


def nvrtc(source: str = SAXPY, name: str = "saxpy", **kw) -> jit.Module:
    return fresh(source, name=name, backend="nvrtc", **kw)


class _KeyOnly(Exception):
    pass


def key_of(monkeypatch, source: str, **kw) -> str:
    """The key compile() computes for these arguments, without compiling anything."""
    seen: list[str] = []
    real = compiler.make_key

    def spy(**parts):
        seen.append(real(**parts))
        raise _KeyOnly

    jit.clear_memory_cache()
    with monkeypatch.context() as m:
        m.setattr(compiler, "make_key", spy)
        with pytest.raises(_KeyOnly):
            jit.compile(source, **kw)
    return seen[0]


def assert_verified(mod: jit.Module) -> dict:
    """The published artifact of mod matches its meta.json, and the cache accepts it."""
    meta = json.loads((mod.dir / "meta.json").read_text())
    data = mod.path.read_bytes()
    assert meta["key"] == mod.key
    assert len(data) == meta["size"] > 0
    assert hashlib.sha256(data).hexdigest() == meta["sha256"]
    assert data[:4] == b"\x7fELF"  # a cubin and a shared library are both ELF files
    assert KernelCache().lookup(mod.key, read_artifact=False) is not None
    return meta


def sub_env(**changes: str | None) -> dict[str, str]:
    """This process's environment (with the fixture's VITRAIL_*), vitrail importable, + changes."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for k, v in changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def py(code: str, *args: object, env: dict | None = None, timeout: float = 120) -> dict:
    """Run code in a fresh interpreter (sys.argv[1] is json of args); its last line, as json."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), json.dumps(args)],
                          env=env or sub_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"subprocess failed ({done.returncode}):\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _nvcc_wrapper(tmp_path: Path, version: str | None = None) -> Path:
    """A VITRAIL_NVCC script over the real nvcc.

    --version / --list-gpu-code / --dryrun (the toolchain probes) go straight to the real nvcc
    (--version reports ``version`` instead, if given). A real compile first records the
    wrapper's pid in $VT_PIDDIR, then sleeps $VT_SLEEP seconds, then execs the real nvcc, so the
    compiler keeps the wrapper's pid (and its process group, which vitrail creates for it).
    """
    fake = ""
    if version:
        major, minor, patch = version.split(".")
        fake = (f'if [ "$a" = --version ]; then echo "nvcc: NVIDIA (R) Cuda compiler driver"; '
                f'echo "Cuda compilation tools, release {major}.{minor}, V{version}"; exit 0; fi')
    script = tmp_path / f"nvcc-wrapper-{version or 'real'}"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        for a in "$@"; do
            {fake}
            case "$a" in --version|--list-gpu-code|--dryrun) exec "{REAL_NVCC}" "$@";; esac
        done
        if [ -n "$VT_PIDDIR" ]; then echo $$ > "$VT_PIDDIR/$$"; fi
        sleep "${{VT_SLEEP:-0}}"
        exec "{REAL_NVCC}" "$@"
        """))
    script.chmod(0o755)
    return script


def _wait_for(what: str, predicate, timeout: float, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}")
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------- 1. key stability
@needs_nvrtc
def test_same_inputs_give_the_same_key(monkeypatch):
    first = nvrtc(defines={"SCALE": 2}, flags=["--use_fast_math"])
    again = nvrtc(defines={"SCALE": 2}, flags=["--use_fast_math"])
    assert first.how == "compiled" and again.how == "disk"
    assert again.key == first.key and again.path == first.path
    assert len(first.key) == 64 and int(first.key, 16) >= 0
    # the default arch (VITRAIL_ARCH=90a) and the same arch spelled out agree
    assert nvrtc(defines={"SCALE": 2}, flags=["--use_fast_math"], arch="sm_90a").key == first.key
    # key_of (used below for nvcc keys) computes exactly the key compile() uses
    assert key_of(monkeypatch, SAXPY, name="saxpy", backend="nvrtc", defines={"SCALE": 2},
                  flags=["--use_fast_math"]) == first.key


@needs_nvrtc
def test_key_is_stable_across_processes(tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "cfg.h").write_text("#define SCALE 3\n")
    parts = [f"part{i}.h" for i in range(8)]  # several headers: their order must not vary
    for p in parts:
        (inc / p).write_text(f"// {p}\n")
    source = "".join(f'#include "{p}"\n' for p in parts) + SAXPY_WITH_HEADER
    kw = dict(name="saxpy", backend="nvrtc", include_dirs=[str(inc)],
              defines={"B": 2, "A": None, "C": "x"}, flags=["--use_fast_math"])
    here = fresh(source, **kw)
    code = """
        import json, sys
        import vitrail.jit as jit
        source, kw = json.loads(sys.argv[1])
        m = jit.compile(source, **kw)
        print(json.dumps({"key": m.key, "how": m.how}))
    """
    keys = []
    for seed in ("1", "2"):  # different hash seeds: no set or dict order may leak into the key
        cache = tmp_path / f"cache-{seed}"  # a cold cache each: each process compiles for itself
        out = py(code, source, kw,
                 env=sub_env(PYTHONHASHSEED=seed, VITRAIL_CACHE_DIR=str(cache)))
        assert out["how"] == "compiled"
        keys.append(out["key"])
    assert keys == [here.key, here.key]


def _bump_nvrtc_version(monkeypatch):
    real = toolchain.nvrtc()
    newer = dataclasses.replace(real, version=(real.version[0], real.version[1] + 1),
                                full_version=f"{real.version[0]}.{real.version[1] + 1}.0")
    monkeypatch.setattr(toolchain, "nvrtc", lambda: newer)
    return {}


def _bump_nvrtc_patch(monkeypatch):  # a patch release may allocate registers differently
    real = toolchain.nvrtc()
    patched = dataclasses.replace(real, full_version=real.version_text + ".1")
    monkeypatch.setattr(toolchain, "nvrtc", lambda: patched)
    return {}


def _bump_vitrail_version(monkeypatch):
    monkeypatch.setattr(compiler, "__version__", compiler.__version__ + ".post1")
    return {}


BASE = dict(source=SAXPY, defines={"SCALE": 2}, flags=[])
CHANGES = {
    "source": lambda mp: dict(source=SAXPY.replace("a * x[i]", "x[i] * a")),
    "source whitespace": lambda mp: dict(source=SAXPY + "\n"),
    "flags": lambda mp: dict(flags=["--use_fast_math"]),
    "define value": lambda mp: dict(defines={"SCALE": 3}),
    "define added": lambda mp: dict(defines={"SCALE": 2, "EXTRA": None}),
    "define removed": lambda mp: dict(defines={}),
    "arch": lambda mp: dict(arch="80"),
    "nvrtc version": _bump_nvrtc_version,
    "nvrtc patch": _bump_nvrtc_patch,
    "vitrail version": _bump_vitrail_version,
}


@needs_nvrtc
@pytest.mark.parametrize("change", list(CHANGES))
def test_every_input_changes_the_key(change, monkeypatch):
    base = nvrtc(**BASE)
    args = {**BASE, **CHANGES[change](monkeypatch)}
    changed = nvrtc(**args)
    assert changed.how == "compiled"
    assert changed.key != base.key
    assert changed.dir != base.dir
    assert_verified(changed)
    if change == "arch":
        assert (base.arch, changed.arch) == ("sm_90a", "sm_80")


@needs_nvcc
def test_backend_and_nvcc_version_change_the_key(monkeypatch, tmp_path):
    kw = dict(source=SAXPY, name="saxpy", defines={"SCALE": 2})
    by_nvrtc = key_of(monkeypatch, backend="nvrtc", **kw)
    by_nvcc = key_of(monkeypatch, backend="nvcc", **kw)
    assert by_nvcc != by_nvrtc

    real_version = toolchain.nvcc().version_text
    other = "13.1.80" if not real_version.startswith("13.1") else "13.0.88"
    monkeypatch.setenv("VITRAIL_NVCC", str(_nvcc_wrapper(tmp_path, version=other)))
    assert toolchain.nvcc().version_text == other
    assert key_of(monkeypatch, backend="nvcc", **kw) != by_nvcc

    # the same nvcc under another path (a wrapper reporting the real version): the same key
    monkeypatch.setenv("VITRAIL_NVCC", str(_nvcc_wrapper(tmp_path)))
    assert toolchain.nvcc().version_text == real_version
    assert key_of(monkeypatch, backend="nvcc", **kw) == by_nvcc


@pytest.fixture
def inc(tmp_path) -> Path:
    """An include dir: cfg.h includes detail/impl.h (found relative to cfg.h)."""
    d = tmp_path / "inc"
    (d / "detail").mkdir(parents=True)
    (d / "cfg.h").write_text('#include "detail/impl.h"\n#define SCALE IMPL_SCALE\n')
    (d / "detail" / "impl.h").write_text("#define IMPL_SCALE 2\n")
    return d


@needs_nvrtc
def test_editing_an_included_header_changes_the_key(inc):
    before = nvrtc(SAXPY_WITH_HEADER, include_dirs=[inc])
    (inc / "cfg.h").write_text('#include "detail/impl.h"\n#define SCALE (IMPL_SCALE + 1)\n')
    edited = nvrtc(SAXPY_WITH_HEADER, include_dirs=[inc])
    assert edited.how == "compiled" and edited.key != before.key
    # the same content again is the same entry (keys hash content, not timestamps)
    (inc / "cfg.h").write_text('#include "detail/impl.h"\n#define SCALE IMPL_SCALE\n')
    back = nvrtc(SAXPY_WITH_HEADER, include_dirs=[inc])
    assert back.how == "disk" and back.key == before.key


@needs_nvrtc
def test_editing_a_transitively_included_header_changes_the_key(inc):
    before = nvrtc(SAXPY_WITH_HEADER, include_dirs=[inc])
    (inc / "detail" / "impl.h").write_text("#define IMPL_SCALE 3\n")
    after = nvrtc(SAXPY_WITH_HEADER, include_dirs=[inc])
    assert after.how == "compiled" and after.key != before.key


@needs_nvrtc
@pytest.mark.parametrize("remembered", [False, True], ids=["fresh-header", "remembered-scan"])
def test_same_size_header_rewrite_with_its_old_mtime_changes_the_key(inc, remembered,
                                                                     monkeypatch):
    # What `cp -p`, `tar x` or a filesystem with coarse timestamps leave behind: new content of
    # the same size in the same inode, with the old mtime. Only the content may decide the key.
    if remembered:  # let the per-process scan memo keep even a just-written header
        monkeypatch.setattr(cache_module, "_RACY_NS", -1)
    impl = inc / "detail" / "impl.h"
    old = os.stat(impl)
    before = nvrtc(SAXPY_WITH_HEADER, include_dirs=[inc])
    impl.write_text("#define IMPL_SCALE 7\n")
    os.utime(impl, ns=(old.st_atime_ns, old.st_mtime_ns))
    new = os.stat(impl)
    assert (new.st_ino, new.st_size, new.st_mtime_ns) == (old.st_ino, old.st_size, old.st_mtime_ns)
    after = nvrtc(SAXPY_WITH_HEADER, include_dirs=[inc])
    assert after.key != before.key and after.how == "compiled"


@needs_nvrtc
def test_unrelated_files_in_the_include_dir_keep_the_key(inc):
    before = nvrtc(SAXPY_WITH_HEADER, include_dirs=[inc])
    (inc / "unrelated.h").write_text("#define NOT_USED 1\n")
    (inc / "detail" / "notes.txt").write_text("hello\n")
    after = nvrtc(SAXPY_WITH_HEADER, include_dirs=[inc])
    assert after.key == before.key and after.how == "disk"


# ------------------------------------------------------------------- 2. no absolute path in keys
@needs_nvrtc
def test_a_copied_include_dir_gives_the_same_key(inc, tmp_path):
    before = nvrtc(SAXPY_WITH_HEADER, include_dirs=[inc])
    elsewhere = shutil.copytree(inc, tmp_path / "somewhere" / "else" / "inc")
    after = nvrtc(SAXPY_WITH_HEADER, include_dirs=[elsewhere])
    assert after.key == before.key and after.how == "disk"


@pytest.mark.parametrize("backend", ["nvrtc", "nvcc"])
def test_a_copied_cache_dir_still_hits(backend, cache_dir, tmp_path, monkeypatch):
    if (backend == "nvcc" and REAL_NVCC is None) or (backend == "nvrtc" and not _has_nvrtc()):
        pytest.skip(f"needs {backend}")
    source = SAXPY if backend == "nvrtc" else ADD_ONE
    name = "saxpy" if backend == "nvrtc" else "add_one"
    built = fresh(source, name=name, backend=backend)
    assert built.how == "compiled"
    moved = tmp_path / "moved" / "cache"
    shutil.copytree(cache_dir, moved)
    shutil.rmtree(cache_dir)  # nothing may still point into the old location
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(moved))
    hit = fresh(source, name=name, backend=backend)
    assert hit.how == "disk" and hit.key == built.key
    assert hit.dir.is_relative_to(moved)
    assert not cache_dir.exists()
    assert_verified(hit)
    if backend == "nvcc":
        assert hit.add_one(41) == 42  # the library was loaded from the new location


# -------------------------------------------------------------------------------- 3. concurrency
_RACER = """
    import ctypes, json, os, sys, threading, time
    import vitrail.jit as jit
    source, ready, go = json.loads(sys.argv[1])
    jit.toolchain.nvcc()  # the probes happen before the race
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.005)
    barrier, results = threading.Barrier(2), [None, None]
    def work(i):
        barrier.wait()
        try:
            m = jit.compile(source, name="race")
            lib = ctypes.CDLL(str(m.path))
            results[i] = dict(how=m.how, key=m.key, path=str(m.path), obj=id(m),
                              has_symbol=hasattr(lib, "add_one"), value=m.add_one(41))
        except BaseException as e:
            results[i] = dict(error=repr(e))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(json.dumps(dict(pid=os.getpid(), results=results)))
"""


@needs_nvcc
def test_processes_and_threads_racing_for_one_kernel_compile_it_once(tmp_path, cache_dir,
                                                                      monkeypatch):
    n = 4
    piddir = tmp_path / "compiles"
    piddir.mkdir()
    env = sub_env(VITRAIL_NVCC=str(_nvcc_wrapper(tmp_path)), VT_SLEEP="2", VT_PIDDIR=str(piddir),
                  VITRAIL_LOCK_TIMEOUT="120")
    go = tmp_path / "go"
    procs = []
    try:
        for i in range(n):
            args = json.dumps([ADD_ONE, str(tmp_path / f"ready{i}"), str(go)])
            procs.append(subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(_RACER), args], env=env, cwd=REPO,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True))
        _wait_for("every process to be ready",
                  lambda: all((tmp_path / f"ready{i}").exists() for i in range(n)), 60)
        go.touch()
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                _killpg(p.pid)
                p.wait()

    results = [r for o in outs for r in o["results"]]
    assert len(results) == 2 * n
    assert not [r for r in results if "error" in r], results
    # one process compiled (both of its threads hold that one module); all others loaded it
    compiled = [o for o in outs if any(r["how"] == "compiled" for r in o["results"])]
    assert len(compiled) == 1, outs
    assert sum(r["how"] == "compiled" for r in results) == 2
    assert sum(r["how"] == "disk" for r in results) == 2 * (n - 1)
    for o in outs:
        a, b = o["results"]
        assert a["obj"] == b["obj"] and a["how"] == b["how"]  # threads of a process: one module
    assert len(os.listdir(piddir)) == 1  # nvcc really ran once
    assert {r["key"] for r in results} == {key_of(monkeypatch, ADD_ONE, name="race")}
    assert len({r["path"] for r in results}) == 1
    assert all(r["has_symbol"] and r["value"] == 42 for r in results)

    path = Path(results[0]["path"])
    meta = json.loads((path.parent / "meta.json").read_text())
    assert hashlib.sha256(path.read_bytes()).hexdigest() == meta["sha256"]
    assert meta["key"] == results[0]["key"]
    assert os.listdir(cache_dir / "v1" / "tmp") == []
    assert [p.name for p in (cache_dir / "v1" / "kernels").glob("*/*")] == [meta["key"]]


# ------------------------------------------------------------------------------------ 4. SIGKILL
@needs_nvcc
def test_sigkill_during_a_compile_publishes_nothing_and_a_new_call_recovers(
        tmp_path, cache_dir, monkeypatch):
    piddir = tmp_path / "compiles"
    piddir.mkdir()
    env = sub_env(VITRAIL_NVCC=str(_nvcc_wrapper(tmp_path)), VT_SLEEP="120",
                  VT_PIDDIR=str(piddir))
    code = "import json, sys, vitrail.jit as j; j.compile(json.loads(sys.argv[1])[0], name='victim')"
    tmp_dir = cache_dir / "v1" / "tmp"
    proc = subprocess.Popen([sys.executable, "-c", code, json.dumps([ADD_ONE])], env=env,
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    compiler_pids: list[int] = []
    try:
        build = _wait_for("the victim to start compiling under the lock",
                          lambda: tmp_dir.is_dir() and os.listdir(piddir) and os.listdir(tmp_dir),
                          60, proc)
        compiler_pids = [int(p) for p in os.listdir(piddir)]
        key = build[0].split(".")[0]
        lock = cache_dir / "v1" / "locks" / f"{key}.lock"
        assert lock.read_text().strip() == str(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL
        # the flock died with its holder, though the orphaned compiler (its own process group)
        # may live on: nothing may keep the lock held
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        if proc.poll() is None:
            _killpg(proc.pid)
            proc.wait()
        for pid in compiler_pids:  # the wrapper leads the compiler's process group
            _killpg(pid)

    assert len(key) == 64
    assert KernelCache().lookup(key, read_artifact=False) is None
    assert not KernelCache().entry_dir(key).exists()
    assert [p.name for p in tmp_dir.iterdir()] == build  # the dead build's dir is left over

    monkeypatch.setenv("VITRAIL_LOCK_TIMEOUT", "30")  # a held lock fails the test, not hangs it
    start = time.monotonic()
    mod = fresh(ADD_ONE, name="victim")
    assert time.monotonic() - start < 60
    assert mod.how == "compiled" and mod.key == key
    assert mod.add_one(1) == 2
    assert_verified(mod)
    assert os.listdir(tmp_dir) == []  # the stale build dir is gone


# --------------------------------------------------------------------------------- 5. corruption
def _truncate_artifact(mod_dir: Path, meta: dict) -> None:
    artifact = mod_dir / meta["artifact"]
    with open(artifact, "r+b") as f:
        f.truncate(meta["size"] // 2)


def _garbage_meta(mod_dir: Path, meta: dict) -> None:
    (mod_dir / "meta.json").write_bytes(b"\x00garbage{{not json")


def _flipped_byte(mod_dir: Path, meta: dict) -> None:
    artifact = mod_dir / meta["artifact"]
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0xFF
    artifact.write_bytes(bytes(data))


@needs_nvrtc
@pytest.mark.parametrize("damage", [_truncate_artifact, _garbage_meta, _flipped_byte],
                         ids=["truncated-artifact", "garbage-meta", "flipped-byte"])
def test_a_corrupted_entry_is_detected_and_rebuilt(damage):
    built = nvrtc()
    meta = assert_verified(built)
    damage(built.dir, meta)
    assert KernelCache().lookup(built.key, read_artifact=True) is None
    rebuilt = nvrtc()
    assert rebuilt.how == "compiled" and rebuilt.key == built.key
    new_meta = assert_verified(rebuilt)
    assert new_meta["sha256"] == meta["sha256"]  # the same build again
    assert hashlib.sha256(rebuilt._entry.artifact_bytes).hexdigest() == meta["sha256"]
    assert nvrtc().how == "disk"


@needs_nvcc
def test_a_truncated_shared_library_is_rebuilt(cache_dir):
    # built by another process: truncating a library mapped into this one could crash it
    code = """
        import json, sys, vitrail.jit as jit
        m = jit.compile(json.loads(sys.argv[1])[0], name="add_one")
        print(json.dumps({"key": m.key, "how": m.how}))
    """
    built = py(code, ADD_ONE)
    assert built["how"] == "compiled"
    entry = KernelCache().entry_dir(built["key"])
    meta = json.loads((entry / "meta.json").read_text())
    _truncate_artifact(entry, meta)
    rebuilt = py(code, ADD_ONE)  # and rebuilt by another process, should the check fail
    assert rebuilt == {"key": built["key"], "how": "compiled"}
    new_meta = json.loads((entry / "meta.json").read_text())
    data = (entry / "kernel.so").read_bytes()
    assert len(data) == new_meta["size"] > meta["size"] // 2
    assert hashlib.sha256(data).hexdigest() == new_meta["sha256"]
    loaded = fresh(ADD_ONE, name="add_one")
    assert loaded.how == "disk" and loaded.add_one(2) == 3
    assert_verified(loaded)


# ------------------------------------------------------------------------------- 6. lock timeout
@needs_nvrtc
def test_lock_timeout_names_the_lock_and_its_holder(cache_dir):
    mod = nvrtc(name="held")
    meta = assert_verified(mod)
    lock = cache_dir / "v1" / "locks" / f"{mod.key}.lock"
    code = """
        import json, sys, time, vitrail.jit as jit
        start = time.monotonic()
        try:
            jit.compile(json.loads(sys.argv[1])[0], name="held", backend="nvrtc")
            print(json.dumps({"error": None}))
        except Exception as e:
            print(json.dumps({"error": type(e).__name__, "message": str(e),
                              "waited": time.monotonic() - start}))
    """
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        out = py(code, SAXPY, env=sub_env(VITRAIL_FORCE_RECOMPILE="1", VITRAIL_LOCK_TIMEOUT="1"),
                 timeout=60)
    finally:
        os.close(fd)
    assert out["error"] == "CacheLockTimeout", out
    assert str(lock) in out["message"]
    assert f"pid {os.getpid()}" in out["message"]
    assert 1.0 <= out["waited"] < 30
    # the entry it could not rebuild is untouched
    assert assert_verified(nvrtc(name="held"))["sha256"] == meta["sha256"]


# ---------------------------------------------------------------------- 7. where the cache lives
def test_a_read_only_home_does_not_matter(tmp_path):
    if REAL_NVCC is None or not _has_nvrtc():
        pytest.skip("needs nvcc and NVRTC")
    home = tmp_path / "home"
    home.mkdir()
    cache = tmp_path / "elsewhere" / "cache"
    code = """
        import json, sys, vitrail.jit as jit
        saxpy, add_one = json.loads(sys.argv[1])
        a = jit.compile(saxpy, name="saxpy", backend="nvrtc")
        b = jit.compile(add_one, name="add_one")
        print(json.dumps({"how": [a.how, b.how], "paths": [str(a.path), str(b.path)],
                          "value": b.add_one(9)}))
    """
    home.chmod(0o555)
    try:
        out = py(code, SAXPY, ADD_ONE,
                 env=sub_env(HOME=str(home), XDG_CACHE_HOME=None, VITRAIL_CACHE_DIR=str(cache)))
    finally:
        home.chmod(0o755)
    assert out["how"] == ["compiled", "compiled"] and out["value"] == 10
    assert all(Path(p).is_relative_to(cache) for p in out["paths"])
    # root may write to a 0555 dir: check nothing did. ~/.nv is the CUDA driver's own JIT
    # cache, made when the driver starts on a machine with a GPU: not vitrail's.
    assert [p for p in home.iterdir() if p.name != ".nv"] == []


@needs_nvrtc
def test_the_cache_dir_is_created_with_mode_0700(tmp_path, monkeypatch):
    root = tmp_path / "not" / "yet" / "cache"
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(root))
    mod = nvrtc()
    assert mod.dir.is_relative_to(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for sub in ("kernels", "locks", "tmp"):
        assert stat.S_IMODE((root / "v1" / sub).stat().st_mode) == 0o700


@needs_nvrtc
def test_without_vitrail_cache_dir_the_cache_goes_under_xdg_cache_home(tmp_path, monkeypatch):
    xdg, home, cwd = tmp_path / "xdg", tmp_path / "home", tmp_path / "cwd"
    for d in (xdg, home, cwd):
        d.mkdir()
    monkeypatch.delenv("VITRAIL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    mod = nvrtc()
    assert mod.how == "compiled"
    assert mod.dir.is_relative_to(xdg / "vitrail")
    assert stat.S_IMODE((xdg / "vitrail").stat().st_mode) == 0o700
    assert list(cwd.iterdir()) == [] and list(home.iterdir()) == []
    assert_verified(mod)


# ---------------------------------------------------------------------------- 8. force recompile
@needs_nvrtc
def test_force_recompile_rebuilds_an_existing_entry(monkeypatch):
    first = nvrtc()
    meta = assert_verified(first)
    monkeypatch.setenv("VITRAIL_FORCE_RECOMPILE", "1")
    forced = nvrtc()
    assert forced.how == "compiled" and forced.key == first.key
    new_meta = assert_verified(forced)
    assert new_meta["created"] > meta["created"]
    assert jit.compile(SAXPY, name="saxpy", backend="nvrtc") is forced  # once per process
    monkeypatch.delenv("VITRAIL_FORCE_RECOMPILE")
    assert nvrtc().how == "disk"


# ------------------------------------------------------------------------------------- 9. memo
@needs_nvrtc
def test_a_repeated_call_touches_no_file_and_hashes_nothing(cache_dir, inc, monkeypatch):
    kw = dict(name="saxpy", backend="nvrtc", include_dirs=[inc], defines={"X": 1},
              flags=["--use_fast_math"])
    first = fresh(SAXPY_WITH_HEADER, **kw)
    shutil.rmtree(cache_dir)
    shutil.rmtree(inc)
    calls: list[str] = []

    def forbidden(what):
        def f(*a, **k):
            calls.append(what)
            raise AssertionError(f"a memo hit called {what}")
        return f

    with monkeypatch.context() as m:
        m.setattr(hashlib, "sha256", forbidden("hashlib.sha256"))
        m.setattr(builtins, "open", forbidden("open"))
        m.setattr(io, "open", forbidden("io.open"))
        for fn in ("stat", "lstat", "open", "listdir", "scandir", "mkdir"):
            m.setattr(os, fn, forbidden(f"os.{fn}"))
        again = jit.compile(SAXPY_WITH_HEADER, **kw)
    assert calls == []
    assert again is first
    assert not cache_dir.exists()


# ------------------------------------------------------------------------------------ 10. index
@needs_nvrtc
def test_the_index_lists_entries_and_forgets_removed_ones():
    start = time.time()
    a = nvrtc(name="alpha")
    b = nvrtc(SAXPY + "// b\n", name="beta", arch="80")
    rows = {r["name"]: r for r in Index(KernelCache()).sync()}
    assert set(rows) == {"alpha", "beta"}
    for mod, arch in ((a, "sm_90a"), (b, "sm_80")):
        row = rows[mod.name]
        assert row["key"] == mod.key
        assert (row["backend"], row["arch"]) == ("nvrtc", arch)
        assert row["size"] == dir_size(mod.dir) > mod.path.stat().st_size > 0
        assert row["compile_seconds"] == mod.compile_seconds >= 0
        assert start <= row["created"] <= row["last_used"] <= time.time()

    used = rows["beta"]["last_used"]
    assert nvrtc(SAXPY + "// b\n", name="beta", arch="80").how == "disk"
    rows = {r["name"]: r for r in Index(KernelCache()).sync()}
    assert rows["beta"]["last_used"] > used  # a disk hit counts as a use

    shutil.rmtree(a.dir)
    rows = Index(KernelCache()).sync()
    assert [r["name"] for r in rows] == ["beta"]


@needs_nvrtc
def test_a_disk_hit_writes_no_index_and_sync_reads_its_use(cache_dir, monkeypatch):
    """A warm load marks its entry used by the directory's mtime, not an index transaction;
    sync() carries the mark into last_used, and lists an entry the index never saw (a copied
    cache) with it."""
    from vitrail.jit import database
    a = nvrtc(name="alpha")
    (cache_dir / "v1" / "index.sqlite").unlink()  # as a cache copied without its index
    long_ago = time.time() - 3600
    os.utime(a.dir, (long_ago, long_ago))
    row, = Index(KernelCache()).sync()
    assert row["key"] == a.key and row["last_used"] == max(row["created"], long_ago)

    def no_index(*args, **kwargs):
        raise AssertionError("a disk hit opened the index")
    with monkeypatch.context() as m:
        m.setattr(database, "connect", no_index)
        assert nvrtc(name="alpha").how == "disk"
    row, = Index(KernelCache()).sync()
    assert row["last_used"] == a.dir.stat().st_mtime > long_ago + 3000
    Index.touch(a.dir / "gone")  # an entry it cannot mark (removed, read-only): no error


@needs_nvrtc
def test_a_corrupt_index_breaks_neither_compile_nor_sync(cache_dir):
    a = nvrtc(name="alpha")
    index = cache_dir / "v1" / "index.sqlite"
    assert index.is_file()
    index.write_bytes(os.urandom(64) + b"this is not an sqlite database" * 100)
    b = nvrtc(SAXPY + "// b\n", name="beta")
    assert b.how == "compiled"
    assert_verified(b)
    assert nvrtc(name="alpha").how == "disk"
    assert {r["key"] for r in Index(KernelCache()).sync()} == {a.key, b.key}

    # a corrupt index met first by sync() (`vitrail cache ls`) is rebuilt from the disk too
    index.write_bytes(b"\xff" * 4096)
    assert {r["name"] for r in Index(KernelCache()).sync()} == {"alpha", "beta"}


# ------------------------------------------------------------------ 9. a cache no one else writes
def _trust_afresh(monkeypatch):
    from vitrail.jit import cache
    monkeypatch.setattr(cache, "_TRUSTED", set())


def test_the_cache_is_made_private_at_every_level(tmp_path, monkeypatch):
    from vitrail.jit.cache import cache_dir
    _trust_afresh(monkeypatch)
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(tmp_path / "a" / "b" / "c"))
    root = cache_dir()
    for d in (tmp_path / "a", tmp_path / "a" / "b", root):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_cache_others_can_write_is_refused(tmp_path, monkeypatch, mode):
    """Another user who can write the cache (or rename it away) could plant a kernel.so that
    runs as us: refused with one line that says what to do."""
    from vitrail.jit.cache import cache_dir
    from vitrail.jit.errors import CacheError
    _trust_afresh(monkeypatch)
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(mode)
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(root))
    with pytest.raises(CacheError, match="can be written by other users.*chmod go-w"):
        cache_dir()
    root.chmod(0o700)
    above = tmp_path / "open"  # a parent anyone may write: the cache could be swapped
    (above / "cache").mkdir(parents=True)
    (above / "cache").chmod(0o700)
    above.chmod(0o777)
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(above / "cache"))
    with pytest.raises(CacheError, match="above the cache, can be changed by other users"):
        cache_dir()
    above.chmod(0o1777)  # sticky, as /tmp: no one renames what is not theirs
    assert cache_dir() == above / "cache"


@pytest.mark.skipif(os.geteuid() != 0, reason="making files of another user needs root")
def test_another_users_cache_or_planted_artifact_is_never_loaded(tmp_path, monkeypatch, caplog):
    """As root, files of another uid stand in for another user's: a cache root of theirs is
    refused; an artifact of theirs inside ours is not loaded but rebuilt (nvrtc)."""
    from vitrail.jit.cache import KernelCache, cache_dir
    from vitrail.jit.errors import CacheError
    _trust_afresh(monkeypatch)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 4321, 4321)
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(theirs))
    with pytest.raises(CacheError, match="owned by uid 4321, not by you"):
        cache_dir()
    ours = tmp_path / "ours"
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(ours))
    if not _has_nvrtc():
        pytest.skip("needs NVRTC to build an artifact")
    first = nvrtc(name="planted")
    os.chown(first.path, 4321, 4321)  # as if another user had put it there
    with caplog.at_level("WARNING", logger="vitrail.jit"):
        assert KernelCache().lookup(first.key, read_artifact=True) is None
        again = nvrtc(name="planted")
    assert "is not yours" in caplog.text and again.how == "compiled"
    assert os.stat(again.path).st_uid == os.geteuid()


@pytest.mark.skipif(os.geteuid() != 0, reason="making files of another user needs root")
def test_a_directory_of_another_user_inside_our_cache_is_refused(tmp_path, monkeypatch):
    """A directory planted inside our cache while its root was open to others stays theirs
    after the root is closed: v1 (or its kernels, locks, tmp) of theirs is refused when the
    cache opens; a kernels/<ab> folder of theirs when an entry below it is looked up."""
    from vitrail.jit.cache import KernelCache
    from vitrail.jit.errors import CacheError
    _trust_afresh(monkeypatch)
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(ours))
    (ours / "v1").mkdir(mode=0o755)
    os.chown(ours / "v1", 4321, 4321)
    with pytest.raises(CacheError, match="v1 inside the cache is not yours alone .owner uid 4321"):
        KernelCache()
    os.chown(ours / "v1", os.geteuid(), os.getegid())
    cache = KernelCache()
    key = "ab" + "0" * 62
    (cache.root / "kernels" / "ab").mkdir(mode=0o700)
    os.chown(cache.root / "kernels" / "ab", 4321, 4321)
    with pytest.raises(CacheError, match="kernels/ab inside the cache is not yours alone"):
        cache.lookup(key, read_artifact=False)
    os.chown(cache.root / "kernels" / "ab", os.geteuid(), os.getegid())
    assert cache.lookup(key, read_artifact=False) is None  # ours again, and empty


@pytest.mark.parametrize("kind", ["file", "dangling link", "relative"])
def test_a_cache_path_that_cannot_be_a_cache_is_one_line(tmp_path, monkeypatch, kind):
    from vitrail.jit.cache import cache_dir
    from vitrail.jit.errors import CacheError
    _trust_afresh(monkeypatch)
    path = tmp_path / "c"
    if kind == "file":
        path.write_text("x")
    elif kind == "dangling link":
        path.symlink_to(tmp_path / "nowhere")
    else:
        path = Path("relative/cache")
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(path))
    with pytest.raises(CacheError, match="VITRAIL_CACHE_DIR") as error:
        cache_dir()
    assert "\n" not in str(error.value)


@needs_nvrtc
def test_a_group_writable_umask_still_publishes_loadable_artifacts(monkeypatch):
    """Under umask 002 (a group per user, as many distributions set) the artifact is published
    writable by its owner alone, so the ownership check loads it instead of rebuilding it."""
    old = os.umask(0o002)
    try:
        first = nvrtc(name="umask")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(first.path).st_mode) & 0o022 == 0
    assert nvrtc(name="umask").how == "disk"
