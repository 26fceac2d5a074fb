"""A shared read-only cache (VITRAIL_SHARED_CACHE): a trusted artifact is used without compiling,
one that another user owns or could write (the file or any directory above it) is refused with
one warning and compiled privately, and vitrail never writes into the shared directory. The
shared cache is built as an administrator would (``VITRAIL_CACHE_DIR=DIR``, then read-only);
another user is simulated by chown to an unused uid (the tests run as root where they can)."""
from __future__ import annotations

import importlib.metadata
import logging
import os
import sqlite3
import stat
from pathlib import Path

import pytest

import vitrail.jit as jit
from tests.jit.test_cache import ADD_ONE, SAXPY, needs_nvcc, needs_nvrtc
from vitrail.jit import shared
from vitrail.tune.space import Config
from vitrail.tune.store import Record, RecordKey, TuningStore

OTHER = 4321  # a uid no one uses here
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def compile_saxpy() -> jit.Module:
    jit.clear_memory_cache()
    return jit.compile(SAXPY, name="saxpy", backend="nvrtc")


def snapshot(root: Path) -> dict:
    """Every path under root with its mode, owner, size and mtime (what a write would change)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in [".", *dirs, *files]:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.join(dirpath, name)] = (st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns)
    return out


def read_only(root: Path) -> None:
    for dirpath, dirs, files in os.walk(root):
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o444)
        os.chmod(dirpath, 0o555)


@pytest.fixture
def team(tmp_path, monkeypatch, cache_dir):
    """A shared cache holding saxpy (built as its administrator would), read-only, and this
    user's own cache empty: (shared root, the saxpy entry's directory)."""
    root = tmp_path / "team-cache"
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(root))
    built = compile_saxpy()
    assert built.how == "compiled"
    entry = built.dir
    read_only(root)
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("VITRAIL_SHARED_CACHE", str(root))
    monkeypatch.setattr(shared, "_WARNED", set())
    yield root, entry
    for dirpath, _, _ in os.walk(root):  # let pytest remove it
        os.chmod(dirpath, 0o755)


@needs_nvrtc
def test_a_trusted_shared_kernel_is_used_and_the_shared_dir_is_not_written(team, cache_dir):
    root, entry = team
    before = snapshot(root)
    mod = compile_saxpy()
    assert mod.how == "shared"  # no compile
    assert mod.dir.is_relative_to(cache_dir) and mod.key == entry.name  # a private copy loads
    assert (mod.dir / mod.meta["artifact"]).read_bytes() == (entry /
                                                             mod.meta["artifact"]).read_bytes()
    assert compile_saxpy().how == "disk"  # the copy is the user's cache entry from now on
    assert snapshot(root) == before


@needs_nvrtc
def test_without_the_knob_the_shared_cache_is_not_read(team, monkeypatch):
    monkeypatch.delenv("VITRAIL_SHARED_CACHE")
    assert compile_saxpy().how == "compiled"


def _levels(root: Path, entry: Path) -> list[Path]:
    """The artifact, its entry directory, the directories above it, up to the shared root."""
    meta = entry / "meta.json"
    out, p = [meta, entry / "kernel.cubin"], entry
    while p != root.parent:
        out.append(p)
        p = p.parent
    return out


@as_root
@needs_nvrtc
@pytest.mark.parametrize("damage", ["foreign owner", "group-writable", "world-writable"])
@pytest.mark.parametrize("level", range(7))
def test_an_untrusted_file_or_directory_is_refused_and_compiled_privately(team, caplog, damage,
                                                                            level):
    root, entry = team
    levels = _levels(root, entry)
    if level >= len(levels):
        pytest.skip("fewer levels")
    target = levels[level]
    assert (entry / "kernel.cubin").exists()
    if damage == "foreign owner":
        os.chown(target, OTHER, OTHER)
    else:
        os.chmod(target, stat.S_IMODE(os.stat(target).st_mode)
                 | (0o020 if damage == "group-writable" else 0o002))
    before = snapshot(root)
    with caplog.at_level(logging.WARNING, logger="vitrail.jit"):
        mod = compile_saxpy()
    assert mod.how == "compiled"
    warnings = [r.getMessage() for r in caplog.records if "shared cache" in r.getMessage()]
    assert len(warnings) == 1 and str(target) in warnings[0] and "compiling it privately" in \
        warnings[0]
    assert snapshot(root) == before


@as_root
@needs_nvrtc
def test_listed_owners_are_trusted(team, monkeypatch):
    root, entry = team
    for p in _levels(root, entry):
        os.chown(p, OTHER, OTHER)
    assert compile_saxpy().how == "compiled"
    jit.clear_memory_cache()
    import shutil
    shutil.rmtree(Path(os.environ["VITRAIL_CACHE_DIR"]) / "v1" / "kernels")
    monkeypatch.setenv("VITRAIL_SHARED_CACHE_OWNERS", f"nobody-here-{OTHER}, {OTHER}")
    assert compile_saxpy().how == "shared"


@as_root
@needs_nvrtc
def test_a_planted_symlink_in_the_shared_cache_is_not_followed(team, tmp_path):
    root, entry = team
    elsewhere = tmp_path / "elsewhere"
    os.chmod(entry.parent, 0o755)
    os.rename(entry, elsewhere)
    os.symlink(elsewhere, entry)
    os.chmod(entry.parent, 0o555)
    assert compile_saxpy().how == "compiled"


@needs_nvcc
def test_a_shared_library_loads_from_a_private_copy(tmp_path, monkeypatch, cache_dir):
    root = tmp_path / "team-cache"
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(root))
    jit.clear_memory_cache()
    built = jit.compile(ADD_ONE, name="add_one")
    read_only(root)
    before = snapshot(root)
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(cache_dir))
    monkeypatch.setenv("VITRAIL_SHARED_CACHE", f"{tmp_path / 'absent'}:{root}")
    jit.clear_memory_cache()
    mod = jit.compile(ADD_ONE, name="add_one")
    assert mod.how == "shared" and mod.add_one(41) == 42
    assert Path(mod.path).is_relative_to(cache_dir) and mod.key == built.key
    assert snapshot(root) == before
    for dirpath, _, _ in os.walk(root):
        os.chmod(dirpath, 0o755)


def _record() -> Record:
    key = RecordKey("tests.scale", "abc", "n1024", "NVIDIA H100 80GB HBM3", 132, "0")
    return Record(key, Config([("BLOCK", 256)]), [{"config": {"BLOCK": 256}, "ms": 0.01}])


def test_a_shared_tuning_store_is_read_only_and_after_the_users(tmp_path, monkeypatch):
    root = tmp_path / "team-cache"
    root.mkdir(mode=0o755)
    TuningStore(root / "tuning.sqlite").put(_record())
    assert sorted(p.name for p in root.iterdir()) == ["tuning.sqlite"]  # WAL checkpointed
    read_only(root)
    before = snapshot(root)
    monkeypatch.setattr(shared, "_WARNED", set())
    assert TuningStore().get(_record().key) is None
    monkeypatch.setenv("VITRAIL_SHARED_CACHE", str(root))
    got = TuningStore().get(_record().key)
    assert got is not None and dict(got.config) == {"BLOCK": 256}
    assert snapshot(root) == before
    if os.geteuid() == 0:  # another user's store is not read
        os.chown(root / "tuning.sqlite", OTHER, OTHER)
        assert TuningStore().get(_record().key) is None
    os.chmod(root, 0o755)


def test_a_shared_tuning_store_is_read_where_the_users_own_cannot_be(tmp_path, monkeypatch,
                                                                     caplog):
    from vitrail.tune import store
    root = tmp_path / "team-cache"
    root.mkdir(mode=0o755)
    TuningStore(root / "tuning.sqlite").put(_record())
    read_only(root)
    monkeypatch.setattr(shared, "_WARNED", set())
    monkeypatch.setenv("VITRAIL_SHARED_CACHE", str(root))
    mine = TuningStore()  # the user's own, which cannot be opened
    monkeypatch.setattr(TuningStore, "_db", _unreadable)
    monkeypatch.setattr(store, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="vitrail"):
        got = mine.get(_record().key)
    assert got is not None and dict(got.config) == {"BLOCK": 256}
    assert "cannot be read" in caplog.text
    os.chmod(root, 0o755)


def _unreadable(self):
    raise sqlite3.OperationalError("unable to open database file")


def test_the_knobs_are_read_as_documented(monkeypatch, tmp_path):
    monkeypatch.setenv("VITRAIL_SHARED_CACHE", f"{tmp_path}/a::{tmp_path}/b")
    assert shared.roots() == [f"{tmp_path}/a", f"{tmp_path}/b", *shared.layers()]
    monkeypatch.setenv("VITRAIL_SHARED_CACHE_OWNERS", "0, root 12")
    assert shared.owners() == {0, os.geteuid(), 12}


# ------------------------------------------------------------- layers shipped in packages
def _layer_package(tmp_path: Path, monkeypatch, name: str, records: list[Record]) -> Path:
    """An importable package `name` whose directory holds a tuning.json export of records, and
    an installed entry point of the group vitrail.caches naming it."""
    pkg = tmp_path / "site" / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    own = TuningStore(tmp_path / f"{name}.sqlite")
    for r in records:
        own.put(r)
    assert own.export(pkg / "tuning.json") == len(records)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return pkg


def _with_layers(monkeypatch, *points: tuple[str, str]) -> None:
    from vitrail.tune import store
    eps = [importlib.metadata.EntryPoint(n, v, shared.ENTRY_POINTS) for n, v in points]
    monkeypatch.setattr(shared.importlib.metadata, "entry_points",
                        lambda group: [e for e in eps if e.group == group])
    monkeypatch.setattr(shared, "SHIPPED", "/nonexistent/vitrail/shipped")
    monkeypatch.setattr(shared, "_WARNED", set())
    shared.layers.cache_clear()
    store._exported.cache_clear()


@pytest.fixture
def fresh_layers():
    from vitrail.tune import store
    yield
    shared.layers.cache_clear()
    store._exported.cache_clear()


def test_a_package_ships_tuning_records_read_after_the_users_and_the_knobs(
        tmp_path, monkeypatch, cache_dir, fresh_layers, caplog):
    """A package's layer (entry point vitrail.caches -> its directory, holding an export) is
    searched after the user's own store and VITRAIL_SHARED_CACHE's; a broken entry point or
    export is one warning and is skipped, never a failed lookup."""
    base = _record()
    pkg = _layer_package(tmp_path, monkeypatch, "demo_layer", [base])
    bad = tmp_path / "site" / "bad_layer"
    bad.mkdir()
    (bad / "__init__.py").write_text("")
    (bad / "tuning.json").write_text('{"format": "something else"}')
    _with_layers(monkeypatch, ("a_bad", "bad_layer"), ("b_demo", "demo_layer"),
                 ("c_gone", "no_such_package_here"))
    assert shared.layers() == (os.path.realpath(bad), os.path.realpath(pkg))
    with caplog.at_level(logging.WARNING, logger="vitrail"):
        got = TuningStore().get(base.key)
    assert got is not None and dict(got.config) == {"BLOCK": 256}
    assert "c_gone" in caplog.text and "bad_layer" in caplog.text

    team = tmp_path / "team-cache"  # the knob's directories come first
    team.mkdir(mode=0o755)
    TuningStore(team / "tuning.sqlite").put(Record(base.key, Config([("BLOCK", 512)])))
    monkeypatch.setenv("VITRAIL_SHARED_CACHE", str(team))
    assert shared.roots()[0] == str(team.resolve())
    assert dict(TuningStore().get(base.key).config) == {"BLOCK": 512}
    TuningStore().put(Record(base.key, Config([("BLOCK", 128)])))  # the user's own: first
    assert dict(TuningStore().get(base.key).config) == {"BLOCK": 128}
    assert sorted(p.name for p in pkg.iterdir()) == ["__init__.py", "tuning.json"]


@needs_nvrtc
def test_a_package_ships_kernels(tmp_path, monkeypatch, cache_dir, fresh_layers):
    """A layer's v1/kernels (vitrail precompile with VITRAIL_CACHE_DIR in the package) loads
    without compiling, from a private copy."""
    pkg = _layer_package(tmp_path, monkeypatch, "kernels_layer", [])
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(pkg))
    assert compile_saxpy().how == "compiled"
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(cache_dir))
    _with_layers(monkeypatch, ("kernels", "kernels_layer"))
    mod = compile_saxpy()
    assert mod.how == "shared" and Path(mod.path).is_relative_to(cache_dir)


def test_one_rule_says_who_else_can_write_for_own_and_shared_caches(tmp_path):
    """cache.writable_by_others, the rule of this user's cache (trusted) and of shared ones
    (shared._check): at the root and below, no group or others may write; above it, others
    only with the sticky bit, a group only where it is this user's own or with the sticky bit."""
    from vitrail.jit.cache import writable_by_others
    d = tmp_path / "d"
    d.mkdir()
    groups = [(os.getegid(), True)] + ([(OTHER, False)] if os.geteuid() == 0 else [])
    for gid, mine in groups:
        os.chown(d, -1, gid)
        for mode, below, above in ((0o755, False, False), (0o775, True, not mine),
                                   (0o757, True, True), (0o1777, True, False),
                                   (0o1775, True, False)):
            os.chmod(d, mode)
            st = os.stat(d)
            assert writable_by_others(st, above_root=False) == below, (oct(mode), gid)
            assert writable_by_others(st, above_root=True) == above, (oct(mode), gid)
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
            try:
                for is_below, refused in ((True, below), (False, above)):
                    if refused:
                        with pytest.raises(shared.Untrusted):
                            shared._check(fd, str(d), shared.owners(), is_below)
                    else:
                        shared._check(fd, str(d), shared.owners(), is_below)
            finally:
                os.close(fd)
    os.chmod(d, 0o755)
