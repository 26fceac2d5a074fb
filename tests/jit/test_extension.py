"""Torch extensions through the kernel cache (vitrail.jit.extension) on a machine with no GPU.

A translation unit that includes torch/extension.h takes about 20 s to compile on two cores, so
the module fixture ``built`` starts every real build at once, each in its own process, into one
cache that the tests then load from (hits): a build killed with SIGKILL half-way, then in a new
process that build again (A), another source under A's name (B), an ops-only library of
TORCH_LIBRARY (file, through ``load``) and a CUDA extension (build only where torch has no
CUDA). Everything else here builds nothing that includes torch's headers.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import vitrail
import vitrail.jit as jit
from vitrail.jit import extension, toolchain
from tests.conftest import has_nvcc

REPO = Path(vitrail.__file__).resolve().parents[1]
NAME = "vt_ext"
A = r"""
#include <torch/library.h>
at::Tensor scale_add(const at::Tensor& x, const at::Tensor& y, double alpha) {
  TORCH_CHECK(x.sizes() == y.sizes(), "x and y: expected one shape");
  return x * alpha + y;
}
at::Tensor row_softmax(const at::Tensor& x) { return at::softmax(x, -1); }
at::Tensor clamp_square(const at::Tensor& x, double hi) { return x.square().clamp_max(hi); }
TORCH_LIBRARY(vt_ext, m) {
  m.def("clamp_square(Tensor x, float hi) -> Tensor");
  m.impl("clamp_square", c10::DispatchKey::CPU, &clamp_square);
}
"""
A_FUNCTIONS = {"scale_add": "x * alpha + y", "row_softmax": "softmax over the last dim"}
B = r"""
at::Tensor scale_add(const at::Tensor& x, const at::Tensor& y, double alpha) {
  return x - alpha * y;
}
"""
OPS = r"""
#include <ATen/ATen.h>
#include <torch/library.h>
at::Tensor axpy(const at::Tensor& x, const at::Tensor& y, double a) { return a * x + y; }
TORCH_LIBRARY(vt_ext_ops, m) {
  m.def("axpy(Tensor x, Tensor y, float a) -> Tensor");
  m.impl("axpy", c10::DispatchKey::CPU, &axpy);
}
"""
CUDA_CPP = "at::Tensor square(at::Tensor x);"
CUDA = r"""
__global__ void square_kernel(const float* x, float* y, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i] * x[i];
}
at::Tensor square(at::Tensor x) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == at::kFloat, "x: expected a float CUDA tensor");
  auto y = at::empty_like(x);
  int64_t n = x.numel();
  square_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), n);
  return y;
}
"""

# Each child builds and loads one extension, checks it against torch, and prints a JSON line.
CHILD = r"""
import json, sys, time, torch
from vitrail.jit import extension
A, B, OPS, CUDA_CPP, CUDA, FUNCS, what, ops_file = json.loads(sys.argv[1])
start = time.monotonic()
out = {}
x, y = torch.randn(7, 5), torch.randn(7, 5)
if what in ("victim", "A"):
    m = extension.load_inline("vt_ext", A, functions=FUNCS)
    out["scale_add"] = torch.allclose(m.scale_add(x, y, 0.5), 0.5 * x + y)
    out["op"] = torch.equal(torch.ops.vt_ext.clamp_square(x, 1.5), x.square().clamp_max(1.5))
elif what == "B":
    m = extension.load_inline("vt_ext", B, functions=["scale_add"])
    out["scale_add"] = torch.allclose(m.scale_add(x, y, 0.5), x - 0.5 * y)
elif what == "ops":
    m = extension.load("vt_ext_ops", [ops_file])
    out["op"] = torch.allclose(torch.ops.vt_ext_ops.axpy(x, y, 3.0), 3 * x + y)
elif what == "cuda":
    out["path"] = str(extension.build_inline("vt_ext_cuda", CUDA_CPP, CUDA, functions="square"))
out["seconds"] = time.monotonic() - start
print(json.dumps(out))
"""


def _env(cache: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITRAIL_")}
    env.update(PYTHONPATH=str(REPO), VITRAIL_CACHE_DIR=str(cache), VITRAIL_ARCH="90a",
               VITRAIL_LOG="info", VITRAIL_TORCH_PCH="0")  # no PCH built into these caches
    env.update(extra)
    return env


def _child(what: str, cache: Path, ops_file: Path, **env) -> subprocess.Popen:
    args = json.dumps([A, B, OPS, CUDA_CPP, CUDA, A_FUNCTIONS, what, str(ops_file)])
    return subprocess.Popen([sys.executable, "-c", CHILD, args], env=_env(cache, **env), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for(what: str, predicate, timeout: float, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}: "
                                 f"{proc.stderr.read()}")
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _kill_compilers_in(folder: Path) -> None:
    """The killed build's compiler took SIGKILL with it (vitrail asks for that), but not the
    compiler's own children (cc1plus): stop them, so they do not slow the builds that follow."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "cwd") == str(folder):
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            pass


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Every build of this file at once, into one cache: {what: (JSON result, stderr)}, plus
    the cache ("cache"), the lock the killed build held ("lock") and the ops file ("ops_file")."""
    root = tmp_path_factory.mktemp("extensions")
    cache = root / "cache"
    ops = root / "src" / "vt_ext_ops.cpp"
    ops.parent.mkdir()
    ops.write_text(OPS)
    # 1. a build of A killed with SIGKILL while its compiler runs under the key's lock
    victim = _child("victim", cache, ops)
    tmp = cache / "v1" / "tmp"
    try:
        build = _wait_for("the victim's compiler to start",
                          lambda: tmp.is_dir() and [d for d in tmp.iterdir()
                                                    if (d / "main.cpp").is_file()], 120, victim)
        time.sleep(1.0)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
    _kill_compilers_in(build[0])
    key = build[0].name.split(".")[0]
    results = {"cache": cache, "ops_file": ops, "lock": cache / "v1" / "locks" / f"{key}.lock",
               "victim": victim.returncode, "stale": [d.name for d in tmp.iterdir()]}
    # 2. A again in a new process (a stale lock would make it wait: VITRAIL_LOCK_TIMEOUT ends
    # that as a failure), with everything else beside it
    names = ["A", "B", "ops"] + (["cuda"] if has_nvcc() else [])
    procs = {what: _child(what, cache, ops, VITRAIL_LOCK_TIMEOUT="300") for what in names}
    for what, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{what}: {err}"
        results[what] = (json.loads(out.splitlines()[-1]), err)
    results["tmp_after"] = sorted(d.name for d in tmp.iterdir())
    return results


@pytest.fixture
def shared(built, monkeypatch):
    """This process loads from the fixture's cache (built entries: hits)."""
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(built["cache"]))
    return built


# ------------------------------------------------------------------------ 1. built end to end
def test_a_cpp_extension_builds_loads_and_matches_torch(shared):
    assert shared["A"][0]["scale_add"]
    m = jit.load_inline(NAME, A, functions=A_FUNCTIONS)
    assert m is jit.load_inline(NAME, A, functions=A_FUNCTIONS)  # once per process
    x, y = torch.randn(33, 17), torch.randn(33, 17)
    torch.testing.assert_close(m.scale_add(x, y, -1.25), -1.25 * x + y)
    torch.testing.assert_close(m.scale_add(x.t(), y.t(), 2.0), 2.0 * x.t() + y.t())
    torch.testing.assert_close(m.row_softmax(x.double()), torch.softmax(x.double(), -1))
    assert "x * alpha + y" in m.scale_add.__doc__  # the dict's docstrings
    with pytest.raises(RuntimeError, match="x and y: expected one shape"):
        m.scale_add(x, y[:3], 1.0)  # a TORCH_CHECK is a Python exception, as with torch


def test_functions_as_a_name_a_list_or_a_dict_generate_torchs_bindings():
    one, listed, named = (extension.bindings(f) for f in
                          ("f", ["f", "g"], {"f": 'doc "quoted"', "ns::g": "g's doc"}))
    assert 'm.def("f", torch::wrap_pybind_function(f), "f");' in one
    assert one.startswith("PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {")
    assert 'm.def("g", torch::wrap_pybind_function(g), "g");' in listed
    assert r'm.def("f", torch::wrap_pybind_function(f), "doc \"quoted\"");' in named
    assert 'torch::wrap_pybind_function(ns::g)' in named
    for bad, match in ((5, "functions: expected a name, a list"), (["f()"], "'f\\(\\)' is not"),
                       ({"f": 3}, "docstring of f")):
        with pytest.raises((TypeError, ValueError), match=match):
            extension.bindings(bad)


# ------------------------------------------------------------------------- 2. TORCH_LIBRARY
def test_torch_library_ops_are_registered_on_load(shared):
    assert shared["A"][0]["op"] and shared["ops"][0]["op"]
    jit.load_inline(NAME, A, functions=A_FUNCTIONS)
    x = torch.randn(9, 4)
    torch.testing.assert_close(torch.ops.vt_ext.clamp_square(x, 0.7), x.square().clamp_max(0.7))
    ops = jit.load("vt_ext_ops", [str(shared["ops_file"])])  # no PYBIND11_MODULE: ops only
    assert not [n for n in vars(ops) if not n.startswith("__")]
    assert ops.__file__.endswith("kernel.so")
    y = torch.randn(9, 4)
    torch.testing.assert_close(torch.ops.vt_ext_ops.axpy(x, y, -2.0), -2.0 * x + y)


# ---------------------------------------------------------------------- 3. keys and the cache
def test_two_sources_with_one_name_are_two_extensions(shared):
    assert shared["B"][0]["scale_add"]
    a = jit.load_inline(NAME, A, functions=A_FUNCTIONS)
    b = jit.load_inline(NAME, B, functions=["scale_add"])
    assert a is not b and a.__file__ != b.__file__
    x, y = torch.randn(6), torch.randn(6)
    torch.testing.assert_close(a.scale_add(x, y, 2.0), 2.0 * x + y)
    torch.testing.assert_close(b.scale_add(x, y, 2.0), x - 2.0 * y)


def test_a_killed_build_leaves_nothing_that_stops_the_next_load(shared):
    assert shared["victim"] == -signal.SIGKILL
    assert shared["stale"], "the killed build left its build directory"
    result, err = shared["A"]
    assert result["scale_add"]
    assert "waiting for kernel" not in err  # the killed build's lock held no one up
    assert "compiled 'vt_ext'" in err  # the new process built A (nothing half-built was used)
    assert shared["tmp_after"] == []  # and removed the dead build's directory


def test_a_copied_cache_still_hits(shared, tmp_path, monkeypatch, capsys):
    copy = tmp_path / "moved"
    shutil.copytree(shared["cache"], copy)
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(copy))
    monkeypatch.setattr(extension, "_memo", {})
    start = time.monotonic()
    b = jit.load_inline(NAME, B, functions=["scale_add"], verbose=True)
    assert time.monotonic() - start < 5
    assert f"(disk) from {copy}" in capsys.readouterr().out  # a hit in the copy
    x, y = torch.randn(6), torch.randn(6)
    torch.testing.assert_close(b.scale_add(x, y, 2.0), x - 2.0 * y)


def test_the_key_holds_sources_flags_and_headers_and_no_path(tmp_path, monkeypatch):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "my.h").write_text("#define K 1\n")

    def key(src=A, cflags=(), dirs=(str(inc),), cache=None):
        units, options = extension._inline(NAME, src + '\n#include "my.h"\n', (), ["f"],
                                           cflags, (), (), dirs, None, False)
        return extension._key(NAME, units, options, jit.cache.KernelCache(cache))[0]

    first = key()
    assert key() == first
    assert key(cache=tmp_path / "elsewhere") == first  # the cache's place is not in it
    assert key(src=B) != first
    assert key(cflags=["-O3"]) != first
    (inc / "my.h").write_text("#define K 2\n")
    assert key() != first  # a user's header's content
    moved = tmp_path / "moved"
    shutil.copytree(inc, moved)
    assert key(dirs=(str(moved),)) == key()  # its folder's place is not


def test_a_warm_key_runs_no_compiler(monkeypatch, tmp_path):
    units, options = extension._inline(NAME, A, (), ["f"], (), (), (), (), None, False)
    cache = jit.cache.KernelCache(tmp_path)
    # A binary as the compiler, whatever this machine's g++ is (a wrapper script is asked anew
    # in every process, by design); it is never run: its --version is given.
    monkeypatch.setenv("CXX", os.path.realpath(sys.executable))
    monkeypatch.setattr(toolchain, "version_output", lambda tool: f"{tool} 1.0")
    monkeypatch.setattr(toolchain, "_REMEMBERED", {})
    first = extension._key(NAME, units, options, cache)[0]
    assert (cache.root / "tools.json").is_file()
    monkeypatch.setattr(toolchain, "_REMEMBERED", {})  # a new process: only tools.json remembers

    def no_compiler(tool):
        raise AssertionError(f"ran {tool} --version")
    monkeypatch.setattr(toolchain, "version_output", no_compiler)
    assert extension._key(NAME, units, options, cache)[0] == first


def test_processes_remembering_compilers_at_once_keep_every_one(monkeypatch, tmp_path):
    """tools.json is read, merged and replaced under a lock: no writer drops another's entry."""
    real = os.path.realpath(toolchain.host_cxx())
    names = []
    for i in range(8):
        (tmp_path / f"cxx{i}").symlink_to(real)
        names.append(str(tmp_path / f"cxx{i}"))
    cache = jit.cache.KernelCache(tmp_path / "cache")
    monkeypatch.setattr(toolchain, "_REMEMBERED", {})
    monkeypatch.setattr(toolchain, "version_output", lambda tool: (time.sleep(0.01), tool)[1])
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda t: extension._tool_id(t, cache), names)) == names
    known = json.loads((cache.root / "tools.json").read_text())
    assert sorted(v for v in known.values()) == sorted(names)


# ------------------------------------------------------------ 4. parallel units, errors, args
def _cxx_wrapper(tmp_path: Path) -> Path:
    """A CXX that records when each compile (not the link, not --version) starts and ends, and
    takes a second longer."""
    real = toolchain.host_cxx()
    script = tmp_path / "cxx-wrapper"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        case " $* " in *" -c "*) ;; *) exec "{real}" "$@";; esac
        echo "start $(date +%s.%N)" >> "{tmp_path}/times.$$"
        sleep 1
        "{real}" "$@"; rc=$?
        echo "end $(date +%s.%N)" >> "{tmp_path}/times.$$"
        exit $rc
        """))
    script.chmod(0o755)
    return script


def test_each_unit_is_compiled_by_its_own_process_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(_cxx_wrapper(tmp_path)))
    files = []
    for i in range(2):
        f = tmp_path / f"part{i}.cpp"
        f.write_text(f"int part{i}(int x) {{ return x + {i}; }}\n")
        files.append(str(f))
    m = jit.load("vt_parts", files)
    assert m.__file__.endswith("kernel.so")
    spans = [dict(line.split() for line in p.read_text().splitlines())
             for p in tmp_path.glob("times.*")]
    assert len(spans) == 2
    (s0, e0), (s1, e1) = ((float(s["start"]), float(s["end"])) for s in spans)
    assert s0 < e1 and s1 < e0, "the two compiles did not overlap"


def test_a_compile_error_names_the_users_file_and_line(tmp_path):
    bad = tmp_path / "bad.cpp"
    bad.write_text("int ok() { return 1; }\n\nint broken() { return undeclared_name; }\n")
    with pytest.raises(jit.CompileError) as info:
        jit.load("vt_bad", [str(bad)])
    assert f"{bad}:3:" in str(info.value)  # the user's own file, not a copy
    assert "undeclared_name" in str(info.value)
    # inline: the line of the user's text (the #include vitrail adds before it is not counted);
    # a missing header stops the compiler before it parses torch's
    with pytest.raises(jit.CompileError) as info:
        jit.load_inline("vt_bad_inline", "int a;\n#include \"no_such_header.h\"\n", functions="a")
    assert "main.cpp:2:" in str(info.value) and "no_such_header.h" in str(info.value)


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="not a name", cpp_sources="int a;"), "name='not a name': expected a Python"),
    (dict(name="e", cpp_sources=3), "cpp_sources: expected a str or a list"),
    (dict(name="e"), "cpp_sources, cuda_sources: expected some source"),
    (dict(name="e", cpp_sources="int a;", functions=5), "functions: expected a name"),
    (dict(name="e", cpp_sources="int a;", extra_cflags="-O3"), "extra_cflags: expected a list"),
    (dict(name="e", cpp_sources="int a;", extra_ldflags=[3]), "extra_ldflags: expected a list"),
    (dict(name="e", cpp_sources="int a;", extra_include_paths=["/no/such/dir"]),
     "extra_include_paths: /no/such/dir is not a directory"),
    (dict(name="e", cpp_sources="int a;", with_cuda="yes"), "with_cuda: expected True"),
])
def test_bad_arguments_are_refused_in_one_line_naming_the_argument(kwargs, match):
    with pytest.raises((TypeError, ValueError)) as info:
        jit.load_inline(**kwargs)
    assert info.match(match) and "\n" not in str(info.value)


def test_bad_source_files_are_refused_in_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("")
    for sources, match in (([str(tmp_path / "notes.txt")], "neither C\\+\\+"),
                           ([str(tmp_path / "missing.cpp")], "missing.cpp is not a file"),
                           ([], "sources: expected a list")):
        with pytest.raises((OSError, ValueError)) as info:
            jit.load("e", sources)
        assert info.match(match) and "\n" not in str(info.value)


# -------------------------------------------------------------------------------- 5. CUDA
@pytest.mark.skipif(not has_nvcc(), reason="needs nvcc")
def test_a_cuda_extension_compiles_for_sm_90a(shared):
    path = Path(shared["cuda"][0]["path"])
    assert path.is_file()
    cuobjdump = Path(toolchain.nvcc().cuda_home) / "bin" / "cuobjdump"
    if cuobjdump.is_file():
        listed = subprocess.run([str(cuobjdump), "--list-elf", str(path)], capture_output=True,
                                text=True).stdout
        assert "sm_90a" in listed
    if not torch.cuda.is_available():
        pytest.skip("built for sm_90a; loading needs a CUDA build of torch and a GPU")
    m = jit.load_inline("vt_ext_cuda", CUDA_CPP, CUDA, functions="square")
    x = torch.randn(1000, device="cuda")
    torch.testing.assert_close(m.square(x), x * x)


def test_a_compilers_version_is_remembered_per_name_and_a_scripts_never(tmp_path, monkeypatch):
    """tools.json keeps a compiler's --version per binary and the name it is called by (links to
    one program, as ccache's, answer for different compilers); a wrapper script is asked again
    in each process, as what it runs may change under it."""
    from vitrail.jit.cache import KernelCache
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(tmp_path / "cache"))
    cache = KernelCache()
    version = tmp_path / "version.txt"
    version.write_text("wrapper 1")
    script = tmp_path / "cxx-wrapper"
    script.write_text(f"#!/bin/sh\ncat {version}\n")
    script.chmod(0o755)
    monkeypatch.setattr(toolchain, "_REMEMBERED", {})
    assert extension._tool_id(str(script), cache) == "wrapper 1"
    version.write_text("wrapper 2")
    monkeypatch.setattr(toolchain, "_REMEMBERED", {})  # a new process
    assert extension._tool_id(str(script), cache) == "wrapper 2"
    known = cache.root / "tools.json"
    assert not known.exists() or str(script) not in known.read_text()
    binary = shutil.which("true")
    link = tmp_path / "renamed-true"
    link.symlink_to(binary)
    monkeypatch.setattr(toolchain, "_REMEMBERED", {})
    extension._tool_id(binary, cache)
    extension._tool_id(str(link), cache)
    entries = json.loads(known.read_text())
    called = [json.loads(k)[0][0] for k in entries]  # each key: [command, binary, ...]
    assert called.count(str(link)) == 1 and called.count(binary) == 1
