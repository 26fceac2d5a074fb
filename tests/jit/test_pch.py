"""The precompiled header of torch/extension.h (vitrail.jit.pch) on a machine with no GPU.

The module fixture ``built`` does the real builds, each in its own process: an extension (C)
built first in an empty cache, without a PCH, which starts the PCH's build in the background,
then, once that is published, at once: C again (forced) and a second extension of two files
(D), both against the PCH; C in a cache whose PCH is stale (a .gch gcc refuses) and in one
whose PCH is corrupt (bytes flipped). Everything else here builds nothing.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

import vitrail
from vitrail.jit import extension, pch, toolchain
from vitrail.jit.cache import KernelCache
from vitrail.jit.compiler import BuildFailed
from vitrail.jit.errors import CompileError
from tests.conftest import has_nvcc, requires_gpu

REPO = Path(vitrail.__file__).resolve().parents[1]
C = r"""
at::Tensor scale_add(const at::Tensor& x, const at::Tensor& y, double a) { return x * a + y; }
at::Tensor mix(const at::Tensor& x) { return at::softmax(x, -1) * x.sin(); }
"""
D_H = """#pragma once
#include <torch/types.h>
at::Tensor axpy(const at::Tensor& x, const at::Tensor& y, double a);
at::Tensor row_norm(const at::Tensor& x);
"""
D_OPS = """// the functions; torch/torch.h is torch/extension.h in an extension
#include <torch/torch.h>
#include "d_ops.h"
at::Tensor axpy(const at::Tensor& x, const at::Tensor& y, double a) { return a * x + y; }
at::Tensor row_norm(const at::Tensor& x) { return x.norm(2, -1); }
"""
D_BIND = """/* the bindings,
   in a file of their own */
#include <torch/extension.h>  // first
#include "d_ops.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("axpy", &axpy);
  m.def("row_norm", &row_norm);
}
"""
CHILD = r"""
import json, sys, torch
from pathlib import Path
from vitrail.jit import extension
C, what, files = json.loads(sys.argv[1])
torch.manual_seed(0)
x, y = torch.randn(7, 5), torch.randn(7, 5)
if what == "D":
    m = extension.load("vt_pch_d", files)
    values = {"axpy": m.axpy(x, y, 0.5).tolist(), "row_norm": m.row_norm(x).tolist(),
              "torch": [(0.5 * x + y).tolist(), x.norm(2, -1).tolist()]}
else:
    m = extension.load_inline("vt_pch_c", C, functions=["scale_add", "mix"])
    values = {"scale_add": m.scale_add(x, y, -1.5).tolist(), "mix": m.mix(x).tolist()}
meta = json.loads((Path(m.__file__).parent / "meta.json").read_text())
print(json.dumps({"values": values, "meta": meta}))
"""


def _env(cache: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VITRAIL_")}
    env.update(PYTHONPATH=str(REPO), VITRAIL_CACHE_DIR=str(cache), VITRAIL_ARCH="90a",
               VITRAIL_LOG="debug", VITRAIL_TORCH_PCH="1", **extra)
    return env


def _child(what: str, cache: Path, files=(), **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, json.dumps([C, what, list(files)])],
                            env=_env(cache, **env), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen, what: str) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, f"{what}: {err}"
    return json.loads(out.splitlines()[-1]), err


def _pch_entries(cache: Path) -> list[Path]:
    found = []
    for meta in (cache / "v1" / "kernels").glob("*/*/meta.json"):
        if json.loads(meta.read_text()).get("backend") == pch.BACKEND:
            found.append(meta.parent)
    return found


def _copy_pch(entry: Path, cache: Path) -> Path:
    """The PCH entry copied into another cache (its key: its folder's name)."""
    KernelCache(cache)
    dest = cache / "v1" / "kernels" / entry.name[:2] / entry.name
    shutil.copytree(entry, dest)
    return dest


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("pch")
    cache = root / "cache"
    src = root / "src"
    src.mkdir()
    for name, text in (("d_ops.h", D_H), ("d_ops.cpp", D_OPS), ("d_bind.cpp", D_BIND)):
        (src / name).write_text(text)
    files = [str(src / "d_ops.cpp"), str(src / "d_bind.cpp")]
    results = {"cache": cache, "root": root}
    # 1. the first extension: no PCH yet; its build starts one in the background
    results["first"] = _result(_child("C", cache), "first")
    deadline = time.monotonic() + 600
    while not _pch_entries(cache):
        assert time.monotonic() < deadline, "the PCH was not built in the background"
        time.sleep(1)
    (entry,) = _pch_entries(cache)
    gch = entry / pch.GCH
    results["pch"], results["gch_stat"] = entry, gch.stat()
    # 2. stale: a PCH gcc refuses where C's is looked for; corrupt: C's with bytes flipped
    stale = _copy_pch(entry, root / "stale")
    (stale / pch.GCH).unlink()
    (stale / pch.GCH).write_bytes(b"not a PCH at all")
    meta = json.loads((stale / "meta.json").read_text())
    meta.update(gch_size=16, gch_sha256=pch._sha256(stale / pch.GCH))
    (stale / "meta.json").write_text(json.dumps(meta))
    corrupt = _copy_pch(entry, root / "corrupt")
    with open(corrupt / pch.GCH, "r+b") as f:
        f.seek(gch.stat().st_size // 2)
        f.write(os.urandom(1 << 20))
    # 3. at once: C again and D against the PCH; C against the stale and the corrupt one
    procs = {"again": _child("C", cache, VITRAIL_FORCE_RECOMPILE="1"),
             "D": _child("D", cache, files),
             "stale": _child("C", root / "stale"),
             "corrupt": _child("C", root / "corrupt")}
    for what, proc in procs.items():
        results[what] = _result(proc, what)
    results["corrupt_left"] = (corrupt / pch.GCH).exists()
    return results


# ---------------------------------------------------------------------------- built for real
def test_the_first_build_starts_the_pch_in_the_background(built):
    result, err = built["first"]
    assert result["meta"]["pch"] is None and result["meta"]["pch_units"] == []
    assert "building torch's precompiled header in the background" in err
    meta = json.loads((built["pch"] / "meta.json").read_text())
    assert meta["name"] == "torch/extension.h" and meta["gch_size"] > 1e6
    assert "-x c++-header" in meta["command"] and "TORCH_EXTENSION_NAME" not in meta["command"]


def test_the_pch_is_built_once_and_used_by_every_extension(built):
    key = built["pch"].name
    again, err = built["again"]
    assert again["meta"]["pch"] == key and again["meta"]["pch_units"] == ["main.cpp"]
    d, _ = built["D"]
    assert d["meta"]["pch"] == key and sorted(d["meta"]["pch_units"]) == ["d_bind.cpp",
                                                                          "d_ops.cpp"]
    for result in (again, d):
        folder = built["cache"] / "v1" / "kernels" / result["meta"]["key"][:2] / \
            result["meta"]["key"]
        text = (folder / "build.log").read_text()
        assert f"-include {built['pch'] / pch.WRAPPER} -Winvalid-pch" in text
        assert "not used" not in text  # gcc took it
    assert _pch_entries(built["cache"]) == [built["pch"]]  # one PCH, built once
    after = (built["pch"] / pch.GCH).stat()
    assert (after.st_ino, after.st_mtime_ns) == (built["gch_stat"].st_ino,
                                                 built["gch_stat"].st_mtime_ns)
    assert "did not use the precompiled header" not in err


def test_results_are_the_same_with_and_without_the_pch(built):
    first, again = built["first"][0], built["again"][0]
    assert first["values"] == again["values"]  # bit for bit
    d = built["D"][0]["values"]
    assert [d["axpy"], d["row_norm"]] == d["torch"]


def test_a_stale_pch_is_refused_by_gcc_and_the_build_goes_on(built):
    result, err = built["stale"]
    assert result["values"] == built["first"][0]["values"]
    assert "did not use the precompiled header" in err and "too short" in err


def test_a_corrupt_pch_is_compiled_without_and_removed(built):
    result, err = built["corrupt"]
    assert result["values"] == built["first"][0]["values"]
    assert result["meta"]["pch_units"] == []
    assert "compiling without it" in err
    assert not built["corrupt_left"]  # removed: the next build starts a new one


# ------------------------------------------------------------------- keys, units, the knob
@pytest.fixture(autouse=True)
def pch_on(monkeypatch):
    """The knob on (the tests' conftest turns it off), and no PCH built in the background by
    this process: the tests below build nothing."""
    monkeypatch.setenv("VITRAIL_TORCH_PCH", "1")

    def refuse(*args, **kwargs):
        raise AssertionError(f"a test started a process: {args}")
    monkeypatch.setattr(pch, "subprocess", types.SimpleNamespace(
        Popen=refuse, DEVNULL=subprocess.DEVNULL))


def _spec(cflags=(), with_cuda=False, include=()):
    options = extension._options(cflags, (), (), include, with_cuda, with_cuda, False)
    plan = extension._plan(options, False, KernelCache())
    system = extension._system_dirs(plan, False)[0]
    return extension._pch_spec(options, plan, system, [])


def test_a_different_flag_set_gets_a_different_pch(tmp_path):
    plain = _spec()[0]
    assert _spec()[0] == plain
    assert "-std=c++20" in plain.flags and "-fPIC" in plain.flags
    assert not any("TORCH_EXTENSION_NAME" in f for f in plain.flags)
    keys = {plain.key}
    for cflags in (["-O3"], ["-O2"], ["-DNDEBUG"], ["-std=c++17"], ["-O3", "-DNDEBUG"]):
        spec = _spec(cflags)[0]
        assert spec.flags[-len(cflags):] == tuple(cflags)
        keys.add(spec.key)
    assert len(keys) == 6
    # the user's include directories are not the PCH's flags: one PCH for every project
    (tmp_path / "inc").mkdir()
    assert _spec(include=[str(tmp_path / "inc")])[0] == plain


def test_units_get_the_pch_only_where_it_changes_nothing(tmp_path):
    for text in ("#include <torch/extension.h>\nint a;", "// c\n/* d\n */\n  #include "
                 "<torch/torch.h> // e\n", '#include "torch/extension.h"'):
        assert pch.applies(text), text
    for text in ("#include <torch/library.h>\n#include <torch/extension.h>\n",
                 "#define X 1\n#include <torch/extension.h>\n", "int a;",
                 "#include <torch/extension.h> int a;"):
        assert not pch.applies(text), text
    gcc = "g++ (Debian 12.2.0-14) 12.2.0\nCopyright (C) 2022 Free Software Foundation, Inc."
    torch_inc = tmp_path / "torch_inc"
    (torch_inc / "c10").mkdir(parents=True)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "kernel.h").write_text("")
    assert pch.refusal(gcc, ["-O3"], [str(mine)], [str(torch_inc)]) is None
    assert "not gcc" in pch.refusal("clang version 17.0.6", [], [], [str(torch_inc)])
    assert "-include" in pch.refusal(gcc, ["-include", "x.h"], [], [str(torch_inc)])
    (mine / "c10").mkdir()  # a header of torch's could be found here first
    assert "holds c10" in pch.refusal(gcc, [], [str(mine)], [str(torch_inc)])
    with pytest.raises(vitrail.jit.ToolchainError, match="extra_cflags hold -include"):
        extension.build_torch_pch(extra_cflags=["-include", "x.h"])


def _publish_fake(spec) -> Path:
    cache = KernelCache()
    build = cache.new_build_dir(spec.key)
    (build / pch.WRAPPER).write_text("#include <torch/extension.h>\n")
    (build / pch.GCH).write_bytes(b"fake")
    cache.publish(spec.key, build, {"name": pch.NAME, "backend": pch.BACKEND, "arch": "host",
                                    "artifact": pch.WRAPPER, "gch_size": 4,
                                    "gch_sha256": pch._sha256(build / pch.GCH)}, False)
    return cache.entry_dir(spec.key)


def _commands(monkeypatch) -> list[list[str]]:
    """The compile commands of C's build (stopped at its first compile: nothing is built)."""
    seen = []

    def stop(cmd, build, command):
        seen.append(cmd)
        raise BuildFailed("stopped by the test", command)
    monkeypatch.setattr(extension, "run_compiler", stop)
    with pytest.raises(CompileError):
        extension.load_inline("vt_pch_knob", C, functions=["scale_add"])
    return seen


def test_a_failure_beside_a_pch_that_fails_its_checksum_compiles_again_without_it(monkeypatch):
    """A corrupt PCH's bytes can read as nonsense errors in the unit that name no PCH (CI saw a
    macro that "requires 17856 arguments"): the checksum decides, the unit compiles again
    without the PCH, and the PCH is removed."""
    monkeypatch.setenv("VITRAIL_TORCH_PCH", "1")
    entry = _publish_fake(_spec()[0])
    (entry / pch.GCH).write_bytes(b"fak!")  # the size checked before use still matches
    seen = []

    def compile_(cmd, build, command):
        seen.append(cmd)
        if "-include" in cmd:
            raise BuildFailed('main.cpp:5:1: error: macro "PYBIND11_CONCAT" requires 17856 '
                              'arguments, but only 2 given', command)
        raise BuildFailed("stopped by the test", command)
    monkeypatch.setattr(extension, "run_compiler", compile_)
    with pytest.raises(CompileError, match="vt_pch_checksum"):
        extension.load_inline("vt_pch_checksum", C, functions=["scale_add"])
    assert ["-include" in cmd for cmd in seen] == [True, False]
    assert not entry.exists()  # removed: the next build starts a new one


def test_the_knob_turns_the_pch_off(monkeypatch):
    monkeypatch.setenv("VITRAIL_TORCH_PCH", "1")
    entry = _publish_fake(_spec()[0])
    (cmd,) = _commands(monkeypatch)
    assert cmd[2:5] == ["-include", str(entry / pch.WRAPPER), "-Winvalid-pch"]
    monkeypatch.setenv("VITRAIL_TORCH_PCH", "0")
    started = []
    monkeypatch.setattr(pch, "build_in_background", lambda *a: started.append(a))
    shutil.rmtree(entry)  # missing, and off: nothing is started either
    (cmd,) = _commands(monkeypatch)
    assert "-include" not in cmd and not any(".gch" in a for a in cmd)
    assert started == []
    with pytest.raises(vitrail.jit.ToolchainError, match="VITRAIL_TORCH_PCH=0"):
        extension.build_torch_pch()


def test_doctor_says_where_the_pch_stands(monkeypatch):
    assert "not built yet" in extension.torch_pch_status()
    entry = _publish_fake(_spec()[0])
    assert str(entry / pch.GCH) in extension.torch_pch_status()
    monkeypatch.setenv("VITRAIL_TORCH_PCH", "0")
    assert "(VITRAIL_TORCH_PCH=0)" in extension.torch_pch_status()


def test_a_missing_pch_is_started_once_and_never_beside_a_builder(monkeypatch):
    monkeypatch.setenv("VITRAIL_TORCH_PCH", "1")
    spec = _spec()[0]
    cache = KernelCache()
    started = []
    monkeypatch.setattr(pch.subprocess, "Popen", lambda *a, **k: started.append(a) or
                        type("P", (), {"pid": 1})())
    monkeypatch.setattr(pch, "_started", set())
    with cache.lock(spec.key, "test"):  # another process is building it
        assert pch.build_in_background(spec, cache) is None
    failed = cache.root / "failed" / f"torch_extension.h-{spec.key[:16]}"
    failed.mkdir()  # its last build failed a moment ago
    assert pch.build_in_background(spec, cache) is None
    shutil.rmtree(failed)
    assert pch.build_in_background(spec, cache) == 1
    assert pch.build_in_background(spec, cache) is None  # once per process
    assert len(started) == 1 and json.loads(started[0][0][-1])["key"] == spec.key


# ------------------------------------------------------------------------------- CUDA units
CU = r"""
__global__ void twice_kernel(const float* x, float* y, long n) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = 2 * x[i];
}
void twice(const float* x, float* y, long n) {
  twice_kernel<<<(n + 255) / 256, 256>>>(x, y, n);
}
"""


@pytest.mark.skipif(not has_nvcc(), reason="needs nvcc")
def test_host_and_device_units_compile_at_once(tmp_path, monkeypatch):
    """A .cpp unit and a .cu unit: each compile starts before the other ends (a second longer
    each, so that they would not overlap by chance if run one after the other)."""
    spans = {}

    def timed(run, what):
        def wrapped(cmd, build, command):
            start = time.monotonic()
            time.sleep(1)
            try:
                return run(cmd, build, command)
            finally:
                if "-c" in cmd:
                    spans[what] = (start, time.monotonic())
        return wrapped
    monkeypatch.setattr(extension, "run_compiler", timed(extension.run_compiler, "cpp"))
    monkeypatch.setattr(extension, "run_nvcc", timed(extension.run_nvcc, "cu"))
    (tmp_path / "host.cpp").write_text("void twice(const float*, float*, long);\n"
                                       "int host() { return 1; }\n")
    (tmp_path / "device.cu").write_text(CU)
    path = extension.build("vt_pch_mixed", [str(tmp_path / "host.cpp"),
                                            str(tmp_path / "device.cu")])
    assert path.is_file()
    (s0, e0), (s1, e1) = spans["cpp"], spans["cu"]
    assert s0 < e1 and s1 < e0, f"the .cpp and .cu compiles did not overlap: {spans}"


CUDA_CPP = """#include <torch/extension.h>
at::Tensor twice(const at::Tensor& x);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
"""
CUDA_CU = r"""
#include <torch/types.h>
__global__ void twice_kernel(const float* x, float* y, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) y[i] = 2 * x[i];
}
at::Tensor twice(const at::Tensor& x) {
  auto y = at::empty_like(x);
  twice_kernel<<<(x.numel() + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(),
                                                 x.numel());
  return y;
}
"""


@requires_gpu
@pytest.mark.skipif(not has_nvcc(), reason="needs nvcc")
def test_a_cuda_extensions_cpp_unit_uses_the_pch_and_its_cu_unit_none(tmp_path, monkeypatch):
    """On a GPU machine (a CUDA build of torch): the PCH with CUDA's headers built at once,
    then an extension of a .cpp and a .cu file: the .cpp against the PCH, the .cu (nvcc) as it
    is, and the module's result right."""
    import torch
    gch = extension.build_torch_pch(with_cuda=True)
    assert gch.is_file()
    (tmp_path / "bind.cpp").write_text(CUDA_CPP)
    (tmp_path / "twice.cu").write_text(CUDA_CU)
    m = extension.load("vt_pch_cuda", [str(tmp_path / "bind.cpp"), str(tmp_path / "twice.cu")])
    meta = json.loads((Path(m.__file__).parent / "meta.json").read_text())
    assert meta["pch"] == gch.parent.name and meta["pch_units"] == ["bind.cpp"]
    log = (Path(m.__file__).parent / "build.log").read_text()
    assert f"-include {gch.parent / pch.WRAPPER}" in log and "not used" not in log
    x = torch.randn(1000, device="cuda")
    torch.testing.assert_close(m.twice(x), 2 * x)


# ------------------------------------------------------------------------ many processes
BUILDER = r"""
import sys
from vitrail.jit.extension import build_torch_pch
print(build_torch_pch())
"""


def test_processes_wanting_the_pch_at_once_build_it_once(tmp_path):
    """Four processes ask for the PCH at once: one builds it (under the cache's per-key lock),
    the others wait and get the same one. The compiler is a wrapper that writes a dummy .gch
    (a second long) for a header, and runs g++ for anything else (--version)."""
    real = toolchain.host_cxx()
    log = tmp_path / "headers.log"
    cxx = tmp_path / "g++"
    cxx.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        case " $* " in *" c++-header "*) ;; *) exec "{real}" "$@";; esac
        echo "$$" >> "{log}"
        sleep 1
        while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done
        echo dummy > "$out"
        """))
    cxx.chmod(0o755)
    env = _env(tmp_path / "cache", CXX=str(cxx))
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    paths = set()
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        paths.add(out.strip())
    assert len(log.read_text().split()) == 1  # built once
    (path,) = paths
    assert Path(path).read_text() == "dummy\n"
