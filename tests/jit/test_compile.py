"""Compiling without a GPU: diagnostics, options, the CuTe build for sm_90a, argument checks."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

import vitrail.jit as jit
from tests.conftest import requires_nvcc
from vitrail.doctor import CUTE_SOURCE

BAD = "// a kernel with a typo\n__global__ void k(float* x) {\n  x[0] = undefined_name;\n}\n"


@requires_nvcc
def test_nvcc_compile_error_names_file_line_command_and_saved_source():
    with pytest.raises(jit.CompileError) as info:
        jit.compile(BAD, name="typo", backend="nvcc")
    e = info.value
    saved = Path(e.source_path)
    assert (saved / "typo.cu").read_text() == BAD
    assert "undefined_name" in (saved / "build.log").read_text()
    assert e.errors and "typo.cu(3)" in e.errors[0] and "undefined_name" in e.errors[0]
    assert e.errors[0].startswith(str(saved))  # the path points at the saved copy
    assert "nvcc" in e.command and "-gencode=arch=compute_90a,code=sm_90a" in e.command
    assert str(saved) in e.command  # the command reproduces the build from the saved copy
    text = str(e)
    assert "typo.cu(3)" in text and e.command in text and str(saved) in text


CUTE_MISTAKE = r"""#include <cute/tensor.hpp>
using namespace cute;
extern "C" __global__ void k(float* x) {
  auto t = make_tensor(make_gmem_ptr(x), make_layout(make_shape(Int<4>{}, Int<4>{})));
  x[0] = t(1, 2, 3);  // a rank-2 tensor indexed with 3 coordinates
}
"""


@requires_nvcc
def test_an_error_deep_in_cute_is_shown_at_the_users_line_first():
    """The static assertion fires in cute/stride.hpp; the summary starts at line 5 of the
    user's file, where the instantiation began (nvcc names it only in its context lines)."""
    with pytest.raises(jit.CompileError) as info:
        jit.compile(CUTE_MISTAKE, name="cute_mistake", backend="nvcc")
    first = info.value.errors[0]
    saved = info.value.source_path
    assert first.startswith(f"{saved}/cute_mistake.cu(5): from your code: ")
    assert "cute/" in first and "error" in first


def test_nvrtc_compile_error_names_file_line_and_saved_source():
    with pytest.raises(jit.CompileError) as info:
        jit.compile(BAD, name="typo_rtc", backend="nvrtc")
    e = info.value
    saved = Path(e.source_path)
    assert (saved / "typo_rtc.cu").read_text() == BAD
    assert any("typo_rtc.cu(3)" in line and "undefined_name" in line for line in e.errors)
    assert e.errors[0].startswith(str(saved))
    assert e.command.startswith("nvrtc ") and "-arch=sm_90a" in e.command


def test_a_failed_compile_publishes_nothing_and_is_retried():
    with pytest.raises(jit.CompileError):
        jit.compile(BAD, name="typo_rtc", backend="nvrtc")
    jit.clear_memory_cache()
    with pytest.raises(jit.CompileError):  # not cached as a failure: compiled, and fails, again
        jit.compile(BAD, name="typo_rtc", backend="nvrtc")


@requires_nvcc
@pytest.mark.slow
def test_cute_kernel_builds_for_sm90a_without_a_gpu(monkeypatch):
    monkeypatch.setenv("VITRAIL_ARCH", "90a")
    mod = jit.compile(CUTE_SOURCE, name="doctor_cute", backend="nvcc")
    assert mod.arch == "sm_90a" and mod.path.name == "kernel.so"
    assert "wgmma.fence.sync.aligned" in mod.ptx  # an sm_90a-only instruction assembled
    res = mod.resources()
    scale = next(r for name, r in res.items() if name.startswith("void scale_kernel<128>"))
    assert 0 < scale.registers <= 64 and not scale.spills and scale.stack == 0
    assert str(mod.function("vitrail_doctor_scale").proto) == (
        "cudaError_t vitrail_doctor_scale(float* x, float* y, int n, float a, "
        "cudaStream_t stream)")


@requires_nvcc
def test_entry_point_checks_arguments_before_any_gpu_work():
    src = ('#include <cuda_runtime.h>\nextern "C" cudaError_t run(const float* x, int n, '
           'cudaStream_t s) { return cudaSuccess; }\n'
           'extern "C" int entry(int v) { return v + 1; }\n')
    mod = jit.compile(src, name="checks")
    with pytest.raises(jit.ArgumentError, match=r"run: argument 'x' \(float\*\) is a tensor on cpu"):
        mod.run(torch.zeros(4), 4)
    with pytest.raises(jit.ArgumentError, match=r"takes 3 arguments"):
        mod.run(0)
    with pytest.raises(jit.ArgumentError, match=r"'n'.*outside"):
        mod.run(0, 2**31, 0)
    assert mod.function("entry")(41) == 42  # a name that is also a module attribute
    with pytest.raises(AttributeError, match="exports no function 'missing'"):
        mod.function("missing", signature="void(int)")


def test_defines_and_include_dirs(tmp_path):
    (tmp_path / "tile.h").write_text("#define TILE_FROM_HEADER 32\n")
    src = ('#include "tile.h"\n#if BLOCK != 128 || TILE_FROM_HEADER != 32 || !defined(FLAG)\n'
           '#error "wrong configuration"\n#endif\n'
           'extern "C" __global__ void k(float* x) { x[threadIdx.x] = BLOCK; }\n')
    mod = jit.compile(src, name="cfg", backend="nvrtc", defines={"BLOCK": 128, "FLAG": None},
                      include_dirs=[tmp_path])
    assert "k" in mod.resources()
    with pytest.raises(jit.CompileError, match="wrong configuration"):
        jit.compile(src, name="cfg", backend="nvrtc", defines={"BLOCK": 64, "FLAG": None},
                    include_dirs=[tmp_path])


def test_templated_nvrtc_kernel_is_lowered_and_typed():
    src = "template <typename T, int N> __global__ void fill(T* x, T v) { x[N] = v; }\n"
    kernel = jit.RawKernel(src, "fill<double, 3>").compile()
    assert kernel.lowered == kernel.module.meta["lowered"]["fill<double, 3>"]
    assert kernel.lowered.startswith("_Z4fill")
    assert [p.type for p in kernel.proto.params] == ["double*", "double"]
    assert "void fill<double, 3>(double*, double)" in kernel.module.resources()


def test_nvrtc_outputs_leave_the_interpreter_intact():
    """Regression: a one-byte NVRTC log (no ptxas output, as for PTX) was written into
    CPython's shared b" " object, turning spaces into NUL bytes process-wide."""
    mod = jit.compile('extern "C" __global__ void k(float* x) { x[0] = 1.f; }', name="k",
                      backend="nvrtc")
    assert ".entry k" in mod.ptx  # the PTX compile has an empty log
    assert b" " == bytes([32]) and " ".encode() == b"\x20"


@requires_nvcc
def test_user_flags_replace_defaults():
    src = ("#include <cuda_runtime.h>\n#if __cplusplus < 202002L\n#error need C++20\n#endif\n"
           'extern "C" int version() { return (int)(__cplusplus / 100); }\n')
    with pytest.raises(jit.CompileError, match="need C\\+\\+20"):
        jit.compile(src, name="std")
    mod = jit.compile(src, name="std", flags=["-std=c++20"])
    assert "-std=c++20" in mod.meta["command"] and "-std=c++17" not in mod.meta["command"]
    assert mod.version() >= 2020


@pytest.mark.parametrize("kwargs,message", [
    (dict(backend="clang"), "backend='clang'"),
    (dict(source="  "), "source"),
    (dict(include_dirs=["/no/such/dir"]), "include_dirs: /no/such/dir"),
    (dict(defines={"2BAD": 1}), "defines: '2BAD'"),
    (dict(kernels=["k<int>"]), "kernels="),
    (dict(name=""), "name"),
])
def test_bad_arguments_are_named(kwargs, message):
    args = dict(source="__global__ void k() {}", name="k", backend="nvcc") | kwargs
    source = args.pop("source")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        jit.compile(source, **args)


@pytest.mark.skipif(shutil.which("cuobjdump") is not None, reason="cuobjdump is present")
def test_sass_without_cuobjdump_says_what_to_install():
    mod = jit.compile('extern "C" __global__ void k() {}', name="k", backend="nvrtc")
    try:
        text = mod.sass  # the toolkit next to nvcc may still have it
    except jit.ToolchainError as e:
        assert "cuobjdump" in str(e)
    else:
        assert "k" in text


def test_resources_survive_nvrtc_serving_a_cubin_from_the_driver_cache(monkeypatch):
    """On a machine with a driver, NVRTC may serve a cubin from ~/.nv/ComputeCache and print no
    ptxas report; vitrail then compiles once more with a probe kernel the cache has not seen."""
    from vitrail.jit import compiler
    real, calls = compiler.nvrtc_compile, []

    def first_call_hits_the_driver_cache(source, *args):
        calls.append(source)
        data, out, lowered = real(source, *args)
        return (data, "", lowered) if len(calls) == 1 else (data, out, lowered)
    monkeypatch.setattr(compiler, "nvrtc_compile", first_call_hits_the_driver_cache)
    src = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.f; }\n'
    mod = jit.compile(src, name="cached_by_driver", backend="nvrtc")
    assert len(calls) == 2 and calls[0] == src and calls[1].startswith(src)
    assert "__global__ void vitrail_resource_probe_" in calls[1]  # changes what ptxas sees
    assert list(mod.resources()) == ["k"] and mod.resources()["k"].registers > 0


@requires_nvcc
def test_the_c_launcher_builds_and_needs_only_the_driver():
    import sysconfig
    from vitrail.jit import launcher
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        pytest.skip("no Python headers: launches go through cuda-bindings")
    try:
        launch = launcher._build()
    except ImportError as e:  # built, loaded, and refused for want of a driver: no GPU here
        assert "libcuda.so.1" in str(e)
    else:
        assert callable(launch)


@requires_nvcc
def test_build_fills_the_cache_without_loading_or_importing_torch(cache_dir):
    """compiler.build (what compile processes run) needs no torch; is_built sees its result and
    compile() then loads it from disk."""
    import subprocess
    import sys
    src = ('#include <cuda_runtime.h>\n__global__ void one(float* x) { x[0] = 1.f; }\n'
           'extern "C" cudaError_t launch_one(float* x, cudaStream_t s) {\n'
           '  one<<<1, 1, 0, s>>>(x); return cudaGetLastError(); }\n')
    from vitrail.jit.compiler import is_built
    assert not is_built(src, name="one", arch="90a")
    code = ("import sys\nfrom vitrail.jit.compiler import build\n"
            f"print(build({src!r}, name='one', arch='90a'), 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["compiled", "False"]
    assert is_built(src, name="one", arch="90a")
    assert not is_built(src.replace("1.f", "2.f"), name="one", arch="90a")
    assert jit.compile(src, name="one", arch="90a").how == "disk"


@requires_nvcc
def test_nvcc_phases_run_as_two_chains(tmp_path):
    """nvcc's own phases (--dryrun), its device chain beside its host front end: cicc writes
    the module id itself, under another name; two targets (or anything else unexpected) run nvcc
    as is; a kernel built so has its launcher and its resource report."""
    from vitrail.jit import compiler, toolchain
    src = tmp_path / "k.cu"
    src.write_text('extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2; }\n')
    base = [toolchain.nvcc().path, "-shared", "-Xcompiler=-fPIC", "-Xptxas=-v"]

    def dry(*gencode):
        cmd = [*base, *gencode, "-o", str(tmp_path / "k.so"), str(src)]
        return compiler.run_compiler([*cmd, "--dryrun"], tmp_path, "")
    phases = compiler._nvcc_phases(dry("-gencode=arch=compute_90a,code=sm_90a"))
    assert phases is not None
    env, first, host, device, rest, (host_id, device_id) = phases
    assert "cudafe++" in host[-1] and "-E" in host[0]
    assert "cicc" in device[1] and "--gen_module_id_file" in device[1]
    assert device_id == host_id + ".device" and f'"{device_id}"' in device[1]
    assert "ptxas" in device[2] and "fatbinary" in device[3] and rest
    assert any(line.startswith("export CICC_PATH=") for line in env)
    assert compiler._nvcc_phases(dry("-gencode=arch=compute_90a,code=sm_90a",
                                     "-gencode=arch=compute_80,code=sm_80")) is None
    mod = jit.compile('#include <cuda_runtime.h>\n__global__ void twice(float* x) '
                      '{ x[threadIdx.x] *= 2; }\nextern "C" cudaError_t run(float* x, '
                      'cudaStream_t s) { twice<<<1, 32, 0, s>>>(x); return cudaGetLastError(); }'
                      '\n', name="two_chains", backend="nvcc", arch="90a")
    assert mod.function("run").proto.name == "run" and any("twice" in n for n in mod.resources())


@requires_nvcc
def test_a_build_that_keeps_the_call_waiting_says_so_once(cache_dir, caplog):
    """One line before an nvcc build: what, and how long its kind's builds took here (the
    median of the last ones), none for a warm load, an NVRTC kernel of unknown time or a kind
    that builds in under ANNOUNCE_SECONDS."""
    from vitrail.jit import compiler
    from vitrail.jit.cache import KernelCache
    from vitrail.jit.index import Index
    src = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] += 1.f; }\n'
    with caplog.at_level("WARNING", logger="vitrail.jit"):
        jit.compile(src, name="announced", arch="90a", backend="nvcc")
        jit.compile(src, name="announced", arch="90a", backend="nvcc")
    lines = [r.getMessage() for r in caplog.records if "for its first use" in r.getMessage()]
    assert len(lines) == 1 and "'announced' (nvcc)" in lines[0] and "about" not in lines[0]

    index = Index(KernelCache())
    for i, (name, backend, seconds) in enumerate([
            ("gemm_a", "nvcc", 40.0), ("gemm_b", "nvcc", 61.0), ("gemm_c", "nvcc", 70.0),
            ("gemmish_d", "nvcc", 900.0), ("softmax.fwd", "nvrtc", 0.5)]):
        index.record(f"k{i}", {"name": name, "backend": backend,
                               "compile_seconds": seconds}, 1)
    caplog.clear()
    with caplog.at_level("WARNING", logger="vitrail.jit"):
        compiler._announce(index, "gemm_e", "nvcc")
        compiler._announce(index, "softmax.bwd", "nvrtc")
        compiler._announce(index, "copy.tile", "nvrtc")
    assert [r.getMessage() for r in caplog.records] == [
        "vitrail: compiling 'gemm_e' (nvcc) for its first use, about 61 s as before here; "
        "later calls and processes load it from the cache"]


def test_a_compiler_printing_bytes_that_are_not_utf8_fails_cleanly(tmp_path):
    """gcc reading a damaged precompiled header printed raw bytes: the failure is reported with
    them replaced, not lost in a UnicodeDecodeError (which then killed a finished process)."""
    from vitrail.jit.compiler import BuildFailed, run_compiler
    script = "import sys; sys.stdout.buffer.write(b'bad \\x83\\xff bytes\\n'); sys.exit(1)"
    with pytest.raises(BuildFailed) as failed:
        run_compiler([sys.executable, "-c", script], tmp_path, "fake-cc")
    assert "bad \ufffd\ufffd bytes" in failed.value.log
    ok = "import sys; sys.stdout.buffer.write(b'fine \\x83\\n')"
    assert run_compiler([sys.executable, "-c", ok], tmp_path, "fake-cc") == "fine \ufffd\n"


def test_a_build_whose_directory_is_removed_under_it_says_so():
    """The compiler fails because its build directory went (the cache deleted meanwhile): the
    error says that, not a FileNotFoundError from saving the failed build's log."""
    from vitrail.jit.compiler import BuildFailed, cached_build

    def builder(build):
        shutil.rmtree(build)
        raise BuildFailed("Fatal error: can't create keep/k.o: No such file or directory",
                          "nvcc -o kernel.so k.cu", "nvcc")
    with pytest.raises(jit.CacheError, match="'gone'.*was removed while nvcc ran"):
        cached_build("0" * 64, "gone", "nvcc", builder)
