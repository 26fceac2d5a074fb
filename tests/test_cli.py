"""The ``vitrail`` command on a machine with no GPU: cache info/ls/prune/clear, bench, and the
knobs' documentation.

Kernels are built for real with NVRTC (~0.1 s each); the autouse fixture of tests/conftest.py
gives every test its own VITRAIL_CACHE_DIR and VITRAIL_ARCH=90a.
"""
from __future__ import annotations

import re
import tokenize
from pathlib import Path

import pytest

import vitrail
import vitrail.jit as jit
from tests.conftest import requires_nvrtc
from vitrail import bench, knobs
from vitrail.cli import main
from vitrail.jit import housekeeping as hk
from vitrail.jit.cache import KernelCache, dir_size

REPO = Path(vitrail.__file__).resolve().parents[1]
PACKAGE = REPO / "vitrail"



KERNEL = r"""
extern "C" __global__ void %s(float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = %d.0f;
}
"""


def build(name: str, value: int = 1) -> jit.Module:
    jit.clear_memory_cache()
    return jit.compile(KERNEL % (name, value), name=name, backend="nvrtc")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -------------------------------------------------------------------------------------- cache
def test_cache_info_on_an_empty_cache(capsys, cache_dir):
    code, out, err = run(capsys, "cache", "info")
    assert code == 0 and err == ""
    lines = dict(re.findall(r"^([^:]+):\s+(.*)$", out, re.M))
    assert lines["directory"] == str(cache_dir)
    assert lines["kernels"] == "0"
    assert lines["failed builds kept"] == "0"
    assert lines["size"] == hk.format_size(dir_size(cache_dir))
    code, out, _ = run(capsys, "cache", "ls")
    assert code == 0 and out.strip() == "the cache is empty"


@requires_nvrtc
def test_cache_ls_prune_and_clear(capsys, cache_dir):
    alpha, beta = build("alpha"), build("beta", 2)
    code, out, err = run(capsys, "cache", "ls")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["key", "name", "backend", "arch", "size"]
    rows = {line.split()[1]: line.split() for line in lines[1:]}
    assert set(rows) == {"alpha", "beta"}
    for mod in (alpha, beta):
        assert rows[mod.name][0] == mod.key[:12]
        assert rows[mod.name][2:4] == ["nvrtc", "sm_90a"]

    code, out, _ = run(capsys, "cache", "info")
    assert re.search(r"^kernels:\s+2$", out, re.M)

    code, out, err = run(capsys, "cache", "prune", "--max-size", "1")
    assert code == 0 and err == ""
    assert out.startswith("removed 2 kernels; the cache now holds ")
    assert not alpha.dir.exists() and not beta.dir.exists()
    assert run(capsys, "cache", "ls")[1].strip() == "the cache is empty"


@requires_nvrtc
def test_prune_removes_the_least_recently_used_first(capsys, cache_dir):
    old, recent = build("old"), build("recent", 2)
    assert build("old").how == "disk"  # a disk hit counts as a use: now "recent" is the oldest
    total = dir_size(cache_dir)
    code, out, _ = run(capsys, "cache", "prune", "--max-size", str(total - 1))
    assert code == 0 and out.startswith("removed 1 kernels")
    assert old.dir.is_dir() and not recent.dir.exists()
    assert [r["name"] for r in hk.entries()] == ["old"]
    # already small enough: nothing goes
    code, out, _ = run(capsys, "cache", "prune", "--max-size", "1T")
    assert code == 0 and out.startswith("removed 0 kernels") and old.dir.is_dir()


@requires_nvrtc
def test_cache_clear_removes_kernels_and_failed_builds(capsys, cache_dir):
    build("alpha"), build("beta", 2)
    with pytest.raises(jit.CompileError):
        jit.compile('extern "C" __global__ void broken() { this is not C++ }', name="broken",
                    backend="nvrtc")
    code, out, _ = run(capsys, "cache", "info")
    assert re.search(r"^kernels:\s+2$", out, re.M)
    assert re.search(r"^failed builds kept:\s+1$", out, re.M)

    before = dir_size(cache_dir)
    code, out, err = run(capsys, "cache", "clear")
    after = dir_size(cache_dir)
    assert code == 0 and err == ""
    assert before - after > 0
    assert out.strip() == f"removed {hk.format_size(before - after)}"
    root = KernelCache().root
    assert list((root / "kernels").glob("*/*")) == []
    assert list((root / "failed").iterdir()) == []
    assert run(capsys, "cache", "ls")[1].strip() == "the cache is empty"
    code, out, _ = run(capsys, "cache", "info")
    assert re.search(r"^kernels:\s+0$", out, re.M)
    assert re.search(r"^failed builds kept:\s+0$", out, re.M)


@requires_nvrtc
def test_damaged_entries_are_listed_and_pruned(capsys, cache_dir):
    garbage, nulls, good = build("garbage"), build("nulls", 2), build("good", 3)
    (garbage.dir / "meta.json").write_bytes(b"\x00not json")
    (nulls.dir / "meta.json").write_text('{"name": null, "backend": null, "arch": null}')
    (KernelCache().root / "index.sqlite").unlink()  # rebuilt from the entries on disk
    code, out, _ = run(capsys, "cache", "ls")  # a null field used to crash the table
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert rows[garbage.key[:12]][1:4] == ["?", "?", "?"]
    assert rows[nulls.key[:12]][1:4] == ["?", "?", "?"]
    assert rows[good.key[:12]][1:4] == ["good", "nvrtc", "sm_90a"]
    code, out, _ = run(capsys, "cache", "prune", "--max-size", "1")
    assert code == 0 and out.startswith("removed 3 kernels")
    assert not any(m.dir.exists() for m in (garbage, nulls, good))


def test_prune_needs_a_valid_max_size(capsys):
    code, out, err = run(capsys, "cache", "prune")
    assert code == 2 and out == ""
    assert "--max-size SIZE is required" in err
    code, out, err = run(capsys, "cache", "prune", "--max-size", "lots")
    assert code == 2 and out == ""
    assert "'lots'" in err and "500M" in err


@pytest.mark.parametrize("text, size", [
    ("500M", 500 * 2**20), ("2G", 2 * 2**30), ("1.5GB", 3 * 2**29), ("100k", 100 * 1024),
    ("1048576", 1048576), ("2GiB", 2 * 2**30), (" 7 K ", 7 * 1024), ("0", 0), ("3B", 3),
])
def test_parse_size(text, size):
    assert hk.parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "", "-1G", "1.5.2M", "2X", "M"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="expected a size such as 500M"):
        hk.parse_size(text)


def test_format_size():
    assert hk.format_size(0) == "0 B"
    assert hk.format_size(1023) == "1023 B"
    assert hk.format_size(1536) == "1.5 KiB"
    assert hk.format_size(5 * 2**30) == "5.0 GiB"
    assert hk.format_size(3 * 2**40) == "3.0 TiB"


def test_an_unknown_cache_action_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["cache", "shred"])
    assert e.value.code == 2
    assert "invalid choice: 'shred'" in capsys.readouterr().err


# -------------------------------------------------------------------------------------- bench
def test_bench_list(capsys):
    code, out, err = run(capsys, "bench", "--list")
    assert code == 0 and err == ""
    names = [line.split()[0] for line in out.splitlines()]
    assert "jit.launch_overhead" in names
    assert "host µs per cached call" in out


def test_bench_unknown_name(capsys):
    code, out, _ = run(capsys, "bench", "no.such.bench")
    assert code == 2
    assert "unknown benchmark(s) no.such.bench" in out and "jit.launch_overhead" in out


def test_bench_without_a_gpu_builds_instead(capsys, tmp_path, monkeypatch, cache_dir):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: bench would time for real")
    try:
        jit.toolchain.nvcc()
        jit.toolchain.nvrtc()
    except jit.ToolchainError as e:
        pytest.skip(f"needs nvcc and NVRTC: {e}")
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "bench", "jit.launch_overhead", "--out", str(tmp_path / "results"))
    assert code == 0
    assert "no GPU is visible" in out and "--compile-only" in out
    assert re.search(r"^\[1/1\] built jit\.launch_overhead in \d+\.\d s$", out, re.M)
    last = out.strip().splitlines()[-3:]  # what was built, where, and what to run next
    assert re.match(r"built 1 of 1 benchmarks for sm_\w+ in \d+ s: jit\.launch_overhead$", last[0])
    assert last[1].startswith(f"kernels cached in {cache_dir}") and "vitrail bench" in last[2]
    assert not (tmp_path / "results").exists()  # nothing timed, nothing written
    built = {r["name"]: r for r in hk.entries()}
    assert {(n, r["backend"]) for n, r in built.items()} == {("vitrail_noop", "nvrtc"),
                                                             ("vitrail_noop_launch", "nvcc")}


def test_bench_without_a_gpu_or_arch_builds_for_hopper(capsys, tmp_path, monkeypatch, cache_dir):
    """The README's main command on a machine with no GPU and no VITRAIL_ARCH: it says which
    target it builds for (sm_90a) instead of failing."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: bench would time for real")
    try:
        jit.toolchain.nvrtc()
    except jit.ToolchainError as e:
        pytest.skip(f"needs NVRTC: {e}")
    for name in ("VITRAIL_ARCH", "TORCH_CUDA_ARCH_LIST"):  # recorded, so the default the run
        monkeypatch.setenv(name, "")                      # sets is undone after the test
        monkeypatch.delenv(name)
    target = []
    monkeypatch.setattr(bench, "load", lambda: {"probe": bench.Benchmark(
        "probe", "the arch a build sees", lambda: [],
        lambda: target.append(jit.toolchain.target_arch().sm))})
    code, out, _ = run(capsys, "bench")
    assert code == 0 and target == ["sm_90a"], out
    assert "building for sm_90a (Hopper" in out and "VITRAIL_ARCH" in out
    assert out.strip().splitlines()[-3].startswith("built 1 of 1 benchmarks for sm_90a")


# -------------------------------------------------------------------------------------- knobs
def test_every_knob_has_its_row_in_the_knobs_page():
    """docs/knobs.md's table is knobs.ALL's entries (the README links it; tests/test_docs.py
    checks that no page names a knob that does not exist)."""
    page = (REPO / "docs" / "knobs.md").read_text()
    assert len(knobs.ALL) >= 7
    for knob in knobs.ALL:
        row = re.search(rf"^\| `{knob.name}` \| `(.*?)` \| (.*) \|$", page, re.M)
        assert row, f"{knob.name} has no row in docs/knobs.md's table"
        assert row.group(1) == repr(knob.default), knob.name
        assert row.group(2) == knob.doc, knob.name
    rows = re.findall(r"^\| `(VITRAIL_[A-Z_]+)` \|", page, re.M)
    assert sorted(rows) == sorted(k.name for k in knobs.ALL)


def _env_names_in(path: Path) -> set[str]:
    """VITRAIL_* names in the strings and comments of a Python file: where an environment
    variable is read or mentioned. Python identifiers (toolchain.VITRAIL_INCLUDE, a path
    constant) are not environment variables and are left out."""
    names = set()
    with path.open("rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type in (tokenize.STRING, tokenize.COMMENT) or (
                    tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1)):
                names.update(re.findall(r"\bVITRAIL_[A-Z_]+\b", tok.string))
    return names


def test_no_undeclared_vitrail_variable_in_the_package():
    declared = {k.name for k in knobs.ALL}
    seen: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "knobs.py" and path.parent == PACKAGE:
            continue
        for name in _env_names_in(path):
            seen.setdefault(name, set()).add(str(path.relative_to(REPO)))
    undeclared = {n: sorted(files) for n, files in seen.items() if n not in declared}
    assert undeclared == {}
    # the scan does find the knobs where they are mentioned
    assert {"VITRAIL_ARCH", "VITRAIL_NVCC", "VITRAIL_CACHE_DIR"} <= set(seen)


def test_the_env_name_scan_sees_strings_and_comments_not_identifiers(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('VITRAIL_INCLUDE = 1\nx = os.environ["VITRAIL_SECRET"]  # VITRAIL_NOTE\n'
                      'y = f"set VITRAIL_FSTRING={x}"\n')
    assert _env_names_in(sample) == {"VITRAIL_SECRET", "VITRAIL_NOTE", "VITRAIL_FSTRING"}


def test_no_module_reads_the_environment_for_a_vitrail_name_directly():
    pattern = re.compile(r"(os\.environ(?:\.get)?\s*[\[(]|os\.getenv\s*\()\s*f?[\"']VITRAIL_")
    offenders = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
                 if p.name != "knobs.py" and pattern.search(p.read_text())]
    assert offenders == []


def test_knob_parsing(monkeypatch):
    monkeypatch.delenv("VITRAIL_LOCK_TIMEOUT", raising=False)
    assert knobs.LOCK_TIMEOUT.get() == 900.0
    monkeypatch.setenv("VITRAIL_LOCK_TIMEOUT", "2.5")
    assert knobs.LOCK_TIMEOUT.get() == 2.5
    monkeypatch.setenv("VITRAIL_LOCK_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="VITRAIL_LOCK_TIMEOUT='soon'"):
        knobs.LOCK_TIMEOUT.get()
    for raw, want in (("1", True), ("yes", True), ("off", False), ("", False)):
        monkeypatch.setenv("VITRAIL_FORCE_RECOMPILE", raw)
        assert knobs.FORCE_RECOMPILE.get() is want
    monkeypatch.setenv("VITRAIL_FORCE_RECOMPILE", "maybe")
    with pytest.raises(ValueError, match="VITRAIL_FORCE_RECOMPILE"):
        knobs.FORCE_RECOMPILE.get()


# ------------------------------------------------------------ families, typos, pipes, errors
def test_precompile_lists_families_and_names_the_nearest_on_a_typo(capsys):
    assert main(["precompile", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert {line.split()[0] for line in listed} >= {"softmax", "log_softmax", "copy", "gemm"}
    with pytest.raises(SystemExit, match="unknown op or family 'softmx'; did you mean softmax") \
            as typo:
        main(["precompile", "softmx"])
    assert str(typo.value).count("softmax,") <= 1  # each name suggested once
    from vitrail.cli import _load_ops, _select_ops
    registry = _load_ops([])
    family = _select_ops(["copy"], registry, "precompile")
    assert family and all(op.name.startswith("copy.") for op in family)


def test_every_op_has_default_configs_for_precompile():
    """precompile builds each op's defaults: none may fail to have one (copy.rows had none)."""
    from vitrail.cli import _load_ops
    from vitrail.tune import limits
    lim = limits(arch="90a")
    for name, op in _load_ops([]).items():
        assert op.default_configs(lim), name


def test_a_closed_pipe_and_a_bad_cache_are_one_line_not_a_traceback(tmp_path):
    import subprocess
    import sys
    env = {**__import__("os").environ, "VITRAIL_ARCH": "90a"}
    run = subprocess.run(f"{sys.executable} -m vitrail.cli precompile --list | head -1",
                         shell=True, capture_output=True, text=True, env=env, timeout=120,
                         cwd=REPO)
    assert run.returncode == 0 and "Traceback" not in run.stderr and run.stdout.count("\n") == 1
    (tmp_path / "f").write_text("x")
    env["VITRAIL_CACHE_DIR"] = str(tmp_path / "f")
    run = subprocess.run([sys.executable, "-m", "vitrail.cli", "cache", "info"],
                         capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.count("\n") == 1 and "is not a directory" in run.stderr


def test_a_bare_import_reaches_every_layer():
    import subprocess
    import sys
    code = ("import vitrail; print(vitrail.jit.compile.__name__, vitrail.tune.PickAny, "
            "vitrail.profile.__name__, vitrail.gemm.__name__)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr[-500:]
    assert run.stdout.split()[0] == "compile"


def test_precompile_takes_the_names_tune_takes():
    """vitrail precompile NAME: a registry family (softmax), a public function (mm builds the
    gemm ops, log_softmax its own, sympow_mma the fused sympow ops) or an op; a public function
    with no registered ops says why in one line; an unknown name gets the nearest names."""
    from vitrail.cli import _load_ops, _select_ops
    registry = _load_ops([])
    names = lambda what: [op.name for op in _select_ops(what, registry, "precompile")]  # noqa
    assert names(["mm"]) == names(["bmm"]) == names(["gemm"]) == sorted(
        n for n in registry if n.startswith("gemm."))
    assert names(["sympow_mma"]) and all(n.startswith("sympow.mma") for n in names(["sympow_mma"]))
    assert set(names(["sympow"])) >= set(names(["mma_sympow_bwd"]))
    assert all(n.startswith("log_softmax.") for n in names(["log_softmax"]))
    with pytest.raises(SystemExit, match="grouped_mm has no registered ops to build"):
        names(["grouped_mm"])
    with pytest.raises(SystemExit, match="did you mean.*sympow_mma"):
        names(["sympow_mm"])


def test_doctor_says_whether_torch_extensions_can_build_here():
    """The torch-extensions check: nvcc of another CUDA major than torch's is an error saying
    what to install, another minor a warning; a g++ too old for -std=c++20 is an error; a CPU
    torch says which headers CUDA sources may use."""
    from vitrail.doctor import torch_extensions
    from vitrail.jit.errors import ToolchainError
    gxx = "g++ (Debian 12.2.0-14) 12.2.0"
    detail, warning = torch_extensions("13.0", (13, 0, 88), gxx, 1, True)
    assert "C++11 ABI 1" in detail and "torch's CUDA 13.0" in detail and not warning
    _, warning = torch_extensions("13.1", (13, 0, 88), gxx, 1, True)
    assert "CUDA 13.1" in warning and "extensions load" in warning
    with pytest.raises(ToolchainError, match="CUDA 12.8 and nvcc is 13.0.*install a CUDA 12"):
        torch_extensions("12.8", (13, 0, 88), gxx, 1, True)
    with pytest.raises(ToolchainError, match="g\\+\\+ 10 or newer"):
        torch_extensions("13.0", (13, 0, 88), "g++ (GCC) 9.4.0", 1, True)
    detail, _ = torch_extensions(None, (13, 0, 88), gxx, 1, False)
    assert "a CPU build" in detail and "not c10/cuda" in detail
    detail, _ = torch_extensions(None, None, "clang version 17.0.6", 0, False)
    assert "c10/cuda" not in detail and "ABI 0" in detail
