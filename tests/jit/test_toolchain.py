"""Toolchain discovery on a machine with no GPU: arch parsing and selection, nvcc, CUTLASS, NVRTC.

The nvcc tests that need a particular version or target list use small bash scripts standing in
for nvcc (VITRAIL_NVCC points at them); the rest use the real toolkit. Every failure must be a
ToolchainError that names the tool, the version found and the version needed, raised before
anything is written.
"""
from __future__ import annotations

import functools
import json
import os
import textwrap
from pathlib import Path

import pytest

import vitrail.jit as jit
from vitrail.jit import toolchain
from vitrail.jit.cache import KernelCache
from vitrail.jit.toolchain import Arch, Nvrtc
from vitrail.jit.errors import ToolchainError


@pytest.fixture(autouse=True)
def _fresh_memos():
    """The discovery memos are keyed on the environment; clear them anyway, so no test sees
    another's fake toolchain."""
    toolchain._find_nvcc.cache_clear()
    toolchain._find_cutlass.cache_clear()
    yield
    toolchain._find_nvcc.cache_clear()
    toolchain._find_cutlass.cache_clear()


def _real_nvcc() -> toolchain.Nvcc | None:
    try:
        return toolchain.nvcc()
    except ToolchainError:
        return None


def _real_nvrtc() -> Nvrtc | None:
    try:
        return toolchain.nvrtc()
    except ToolchainError:
        return None


needs_nvcc = pytest.mark.skipif(_real_nvcc() is None, reason="needs nvcc")
needs_nvrtc = pytest.mark.skipif(_real_nvrtc() is None, reason="needs NVRTC")


# ----------------------------------------------------------------------------------- Arch.parse
@pytest.mark.parametrize("text, major, minor, suffix, sm", [
    ("90a", 9, 0, "a", "sm_90a"),
    ("sm_90a", 9, 0, "a", "sm_90a"),
    ("compute_90a", 9, 0, "a", "sm_90a"),
    ("9.0", 9, 0, "", "sm_90"),
    ("9.0a", 9, 0, "a", "sm_90a"),
    ("100a", 10, 0, "a", "sm_100a"),
    ("8.6+PTX", 8, 6, "", "sm_86"),
    ("sm_80", 8, 0, "", "sm_80"),
    (" SM_120F ", 12, 0, "f", "sm_120f"),
])
def test_arch_parse_accepts(text, major, minor, suffix, sm):
    arch = Arch.parse(text, "test")
    assert (arch.major, arch.minor, arch.suffix) == (major, minor, suffix)
    assert arch.sm == sm == str(arch)
    assert arch.compute == sm.replace("sm_", "compute_")
    assert arch.name == sm.removeprefix("sm_")
    assert arch.source == "test"


@pytest.mark.parametrize("text", ["hopper", "9", "", "sm_", "90b", "9.0.1"])
def test_arch_parse_rejects_with_the_value_named(text):
    with pytest.raises(ToolchainError) as e:
        Arch.parse(text, "VITRAIL_ARCH")
    assert f"VITRAIL_ARCH={text!r}" in str(e.value)
    assert "not a GPU architecture" in str(e.value)


def test_of_capability_uses_the_arch_specific_target_from_hopper_on():
    assert Arch.of_capability(9, 0, "x").sm == "sm_90a"
    assert Arch.of_capability(10, 0, "x").sm == "sm_100a"
    assert Arch.of_capability(8, 9, "x").sm == "sm_89"
    assert Arch.of_capability(8, 0, "x").sm == "sm_80"


# ---------------------------------------------------------------------------------- target_arch
@pytest.fixture
def no_arch(monkeypatch):
    """No VITRAIL_ARCH, no TORCH_CUDA_ARCH_LIST and (on a GPU host too) no visible GPU."""
    monkeypatch.delenv("VITRAIL_ARCH", raising=False)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(toolchain, "_device_capability", lambda device=None: None)
    return monkeypatch


def test_vitrail_arch_wins_over_everything(no_arch):
    no_arch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    no_arch.setattr(toolchain, "_device_capability", lambda device=None: (8, 0, "A100"))
    no_arch.setenv("VITRAIL_ARCH", "sm_100a")
    arch = toolchain.target_arch()
    assert arch.sm == "sm_100a" and arch.source == "VITRAIL_ARCH"
    no_arch.setenv("VITRAIL_ARCH", "8.9")
    assert toolchain.target_arch().sm == "sm_89"


def test_a_bad_vitrail_arch_is_reported(no_arch):
    no_arch.setenv("VITRAIL_ARCH", "hopper")
    with pytest.raises(ToolchainError, match=r"VITRAIL_ARCH='hopper'"):
        toolchain.target_arch()


@pytest.mark.parametrize("listed, sm", [
    ("8.0;9.0", "sm_90a"),        # Hopper is promoted to the arch-specific target
    ("8.0 8.6", "sm_86"),
    ("9.0;8.0", "sm_90a"),        # the highest, whatever the order
    ("7.5,8.0+PTX", "sm_80"),
    ("8.0;9.0a", "sm_90a"),
    ("9.0;10.0", "sm_100a"),
])
def test_torch_cuda_arch_list_without_a_gpu(no_arch, listed, sm):
    no_arch.setenv("TORCH_CUDA_ARCH_LIST", listed)
    arch = toolchain.target_arch()
    assert arch.sm == sm
    assert arch.source == "TORCH_CUDA_ARCH_LIST"


def test_no_gpu_and_no_setting_asks_for_vitrail_arch(no_arch):
    with pytest.raises(ToolchainError) as e:
        toolchain.target_arch()
    assert "VITRAIL_ARCH" in str(e.value)
    assert "no GPU" in str(e.value)


@pytest.mark.parametrize("cap, sm", [((9, 0, "H100"), "sm_90a"), ((8, 0, "A100"), "sm_80"),
                                     ((10, 0, "B200"), "sm_100a")])
def test_the_gpu_decides_when_vitrail_arch_is_unset(no_arch, cap, sm):
    no_arch.setenv("TORCH_CUDA_ARCH_LIST", "7.5")  # the GPU wins over the list
    no_arch.setattr(toolchain, "_device_capability", lambda device=None: cap)
    arch = toolchain.target_arch()
    assert arch.sm == sm
    assert cap[2] in arch.source and "GPU" in arch.source


def test_device_capability_is_none_without_a_gpu():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert toolchain._device_capability(None) is None


# ----------------------------------------------------------------------------------------- nvcc
def _fake_nvcc(tmp_path: Path, release: str, gpu_codes: str = "sm_80 sm_90",
               dryrun: str = "") -> Path:
    """A bash script answering the three probes nvcc() makes (and failing anything else)."""
    major, minor = release.split(".")[:2]
    script = tmp_path / f"fake-nvcc-{release}-{len(list(tmp_path.iterdir()))}" / "bin" / "nvcc"
    script.parent.mkdir(parents=True)
    (script.parent / "dryrun.txt").write_text(dryrun)
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        case "$1" in
          --version)
            echo "nvcc: NVIDIA (R) Cuda compiler driver"
            echo "Cuda compilation tools, release {major}.{minor}, V{release}"
            echo "Build cuda_{major}.{minor}.r{major}.{minor}/compiler.0_0";;
          --list-gpu-code) printf '%s\\n' {gpu_codes};;
          --dryrun) cat "$(dirname "$0")/dryrun.txt" >&2;;
          *) echo "fake nvcc: unexpected $*" >&2; exit 1;;
        esac
        """))
    script.chmod(0o755)
    return script


def test_a_missing_vitrail_nvcc_names_nvcc_and_the_version_needed(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere" / "nvcc"
    monkeypatch.setenv("VITRAIL_NVCC", str(missing))
    with pytest.raises(ToolchainError) as e:
        toolchain.nvcc()
    msg = str(e.value)
    assert "nvcc not found" in msg
    assert f"{missing} (VITRAIL_NVCC)" in msg
    assert "nvcc >= 13.0" in msg


def test_a_non_executable_vitrail_nvcc_is_not_found(monkeypatch, tmp_path):
    script = _fake_nvcc(tmp_path, "13.0.88")
    script.chmod(0o644)
    monkeypatch.setenv("VITRAIL_NVCC", str(script))
    with pytest.raises(ToolchainError, match="nvcc not found"):
        toolchain.nvcc()


def test_an_old_nvcc_is_refused_with_both_versions(monkeypatch, tmp_path):
    script = _fake_nvcc(tmp_path, "11.8.89")
    monkeypatch.setenv("VITRAIL_NVCC", str(script))
    with pytest.raises(ToolchainError) as e:
        toolchain.nvcc()
    msg = str(e.value)
    assert "11.8.89" in msg and "13.0" in msg
    assert str(script) in msg


def test_nvcc_just_below_the_minimum_is_refused_and_the_minimum_accepted(monkeypatch, tmp_path):
    monkeypatch.setenv("VITRAIL_NVCC", str(_fake_nvcc(tmp_path, "12.9.86")))
    with pytest.raises(ToolchainError, match=r"12\.9\.86.*>= 13\.0"):
        toolchain.nvcc()
    monkeypatch.setenv("VITRAIL_NVCC", str(_fake_nvcc(tmp_path, "13.0.48")))
    assert toolchain.nvcc().version == (13, 0, 48)


def test_an_unreadable_version_is_reported(monkeypatch, tmp_path):
    script = tmp_path / "nvcc"
    script.write_text("#!/bin/bash\necho 'hello, I am not nvcc'\n")
    script.chmod(0o755)
    monkeypatch.setenv("VITRAIL_NVCC", str(script))
    with pytest.raises(ToolchainError, match="(?s)could not read the version .*I am not nvcc"):
        toolchain.nvcc()


def test_an_nvcc_that_cannot_target_the_arch(monkeypatch, tmp_path):
    monkeypatch.setenv("VITRAIL_NVCC", str(_fake_nvcc(tmp_path, "13.0.88", gpu_codes="sm_80")))
    tool = toolchain.nvcc()
    assert tool.version == (13, 0, 88) and tool.version_text == "13.0.88"
    assert tool.gpu_codes == frozenset({"sm_80"})
    tool.check_arch(Arch.parse("80"))  # fine
    with pytest.raises(ToolchainError) as e:
        tool.check_arch(Arch.parse("90a", "VITRAIL_ARCH"))
    msg = str(e.value)
    assert "sm_90a" in msg and "13.0.88" in msg and "sm_80" in msg and "VITRAIL_ARCH" in msg


def test_a_wrapper_nvcc_reports_its_toolkit_through_dryrun(monkeypatch, tmp_path):
    top = tmp_path / "toolkit"
    (top / "targets" / "include" / "cccl").mkdir(parents=True)
    dryrun = (f'#$ TOP={top}/bin/..\n'
              f'#$ INCLUDES="-I{top}/targets/include" "-I{tmp_path}/does-not-exist"\n'
              f'#$ SYSTEM_INCLUDES="-isystem" "{top}/targets/include/cccl"')
    script = _fake_nvcc(tmp_path, "13.0.88", dryrun=dryrun)
    monkeypatch.setenv("VITRAIL_NVCC", str(script))
    tool = toolchain.nvcc()
    assert tool.path == str(script)
    assert tool.cuda_home == str(top)
    assert tool.include_dirs == (str(top / "targets" / "include"),
                                 str(top / "targets" / "include" / "cccl"))


def test_changing_vitrail_nvcc_re_runs_the_lookup(monkeypatch, tmp_path):
    monkeypatch.setenv("VITRAIL_NVCC", str(_fake_nvcc(tmp_path, "13.0.88")))
    assert toolchain.nvcc().version == (13, 0, 88)
    monkeypatch.setenv("VITRAIL_NVCC", str(_fake_nvcc(tmp_path, "13.1.80")))
    assert toolchain.nvcc().version == (13, 1, 80)


@needs_nvcc
def test_the_real_nvcc():
    tool = toolchain.nvcc()
    assert tool.version[:2] >= toolchain.NVCC_MIN
    assert os.access(tool.path, os.X_OK)
    assert any((Path(d) / "cuda_runtime.h").is_file() for d in tool.include_dirs)
    assert all(Path(d).is_dir() for d in tool.include_dirs)
    assert tool.host_compiler.strip() and "\n" not in tool.host_compiler
    assert "sm_90" in tool.gpu_codes
    tool.check_arch(Arch.parse("90a"))
    with pytest.raises(ToolchainError, match="sm_35"):  # dropped by CUDA 12.0
        tool.check_arch(Arch.parse("35"))
    assert toolchain.cuda_include_dirs() == list(tool.include_dirs)


def test_compile_fails_before_any_side_effect(monkeypatch, tmp_path, cache_dir):
    monkeypatch.setenv("VITRAIL_NVCC", str(tmp_path / "no-such-nvcc"))
    src = 'extern "C" int x(int a) { return a; }\n'
    with pytest.raises(ToolchainError, match="nvcc not found"):
        jit.compile(src, name="x")
    assert not cache_dir.exists()
    # an nvcc that is found but too old: the same
    monkeypatch.setenv("VITRAIL_NVCC", str(_fake_nvcc(tmp_path, "11.8.89")))
    with pytest.raises(ToolchainError, match="11.8.89"):
        jit.compile(src, name="x")
    # and one that cannot build for the arch
    monkeypatch.setenv("VITRAIL_NVCC", str(_fake_nvcc(tmp_path, "13.0.88", gpu_codes="sm_80")))
    with pytest.raises(ToolchainError, match="sm_90a"):
        jit.compile(src, name="x", arch="90a")
    assert not cache_dir.exists()


@needs_nvrtc
def test_nvrtc_arch_check_fails_before_any_side_effect(monkeypatch, cache_dir):
    real = toolchain.nvrtc()
    monkeypatch.setattr(toolchain, "nvrtc", lambda: Nvrtc(real.version, real.library,
                                                           frozenset({80})))
    with pytest.raises(ToolchainError, match="sm_90a"):
        jit.compile('extern "C" __global__ void k() {}', name="k", backend="nvrtc", arch="90a")
    assert not cache_dir.exists()


# -------------------------------------------------------------------------------------- CUTLASS
def _fake_cutlass(root: Path, major: int, minor: int, patch: int = 0,
                  version_h: bool = True) -> Path:
    (root / "include" / "cute").mkdir(parents=True)
    (root / "include" / "cute" / "tensor.hpp").write_text("#pragma once\n")
    if version_h:
        (root / "include" / "cutlass").mkdir()
        (root / "include" / "cutlass" / "version.h").write_text(textwrap.dedent(f"""\
            #pragma once
            #define CUTLASS_MAJOR {major}
            #define CUTLASS_MINOR {minor}
            #define CUTLASS_PATCH {patch}
            """))
    return root


def test_the_installed_cutlass(monkeypatch):
    monkeypatch.delenv("CUTLASS_PATH", raising=False)
    try:
        found = toolchain.cutlass()
    except ToolchainError as e:
        pytest.skip(f"nvidia-cutlass is not installed: {e}")
    assert found.source == "nvidia-cutlass"
    assert found.version[:2] >= (3, 6)
    assert found.version_text == ".".join(map(str, found.version))
    assert (Path(found.include_dir) / "cute" / "tensor.hpp").is_file()
    assert (Path(found.include_dir) / "cutlass" / "cutlass.h").is_file()


def test_cutlass_path_without_headers(monkeypatch, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("CUTLASS_PATH", str(empty))
    with pytest.raises(ToolchainError) as e:
        toolchain.cutlass()
    assert f"CUTLASS_PATH={empty}" in str(e.value)
    assert "cute/tensor.hpp" in str(e.value)


def test_an_old_cutlass_names_the_version_found_and_needed(monkeypatch, tmp_path):
    root = _fake_cutlass(tmp_path / "cutlass-2.11", 2, 11)
    monkeypatch.setenv("CUTLASS_PATH", str(root))
    with pytest.raises(ToolchainError) as e:
        toolchain.cutlass()
    msg = str(e.value)
    assert "2.11.0" in msg and ">= 3.6" in msg and "CUTLASS_PATH" in msg


def test_cutlass_path_at_a_checkout_or_at_its_include_dir(monkeypatch, tmp_path):
    root = _fake_cutlass(tmp_path / "cutlass-3.9", 3, 9, 2)
    for path in (root, root / "include"):
        monkeypatch.setenv("CUTLASS_PATH", str(path))
        found = toolchain.cutlass()
        assert found.include_dir == str(root / "include")
        assert found.version == (3, 9, 2) and found.source == "CUTLASS_PATH"


def test_cutlass_path_without_version_h_is_a_toolchain_error(monkeypatch, tmp_path):
    # was a bare FileNotFoundError, which escaped every compile (CUTLASS is optional there)
    root = _fake_cutlass(tmp_path / "partial", 0, 0, version_h=False)
    monkeypatch.setenv("CUTLASS_PATH", str(root))
    with pytest.raises(ToolchainError, match="version.h"):
        toolchain.cutlass()


# ---------------------------------------------------------------------------------------- NVRTC
@needs_nvrtc
def test_the_real_nvrtc():
    found = toolchain.nvrtc()
    assert found.version >= toolchain.NVRTC_MIN
    assert found.version_text.startswith(f"{found.version[0]}.{found.version[1]}")
    assert found.source in ("VITRAIL_NVRTC", "toolkit", "wheel", "system") or \
        found.source.startswith("loaded before vitrail")
    assert Path(found.library).is_file() and "nvrtc" in Path(found.library).name
    assert 90 in found.supported and 80 in found.supported
    found.check_arch(Arch.parse("90a"))


def test_nvrtc_check_arch_rejects_an_unsupported_arch():
    old = Nvrtc((12, 4), "/opt/libnvrtc.so.12", frozenset({75, 80}))
    old.check_arch(Arch.parse("80"))
    with pytest.raises(ToolchainError) as e:
        old.check_arch(Arch.parse("90a"))
    msg = str(e.value)
    assert "sm_90a" in msg and "12.4" in msg and "/opt/libnvrtc.so.12" in msg
    assert "sm_75, sm_80" in msg
    # an empty list (NVRTC that does not say) accepts anything
    Nvrtc((12, 4), "x", frozenset()).check_arch(Arch.parse("100a"))


def test_nvrtc_full_version_from_name_record_or_bytes(tmp_path):
    """The cache key's NVRTC version: a toolkit file's name, else the wheel record that lists
    the library, else major.minor and a digest of the bytes (a patch release changes them)."""
    lib = tmp_path / "cuda/lib64/libnvrtc.so.13.0.88"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"toolkit")
    (lib.parent / "libnvrtc.so.13").symlink_to(lib.name)
    assert toolchain._full_version(str(lib.parent / "libnvrtc.so.13"), 13, 0) == "13.0.88"
    site = tmp_path / "site"
    wheel_lib = site / "nvidia/cu13/lib/libnvrtc.so.13"
    wheel_lib.parent.mkdir(parents=True)
    wheel_lib.write_bytes(b"wheel")
    info = site / "nvidia_cuda_nvrtc-13.5.37.dist-info"
    info.mkdir()
    (info / "RECORD").write_text("nvidia/cu13/lib/libnvrtc.so.13,sha256=x,5\n")
    assert toolchain._full_version(str(wheel_lib), 13, 5) == "13.5.37"
    (info / "RECORD").write_text("nvidia/cu13/include/nvrtc.h,sha256=x,5\n")  # not this file
    one = toolchain._full_version(str(wheel_lib), 13, 5)
    wheel_lib.write_bytes(b"patched")
    assert one.startswith("13.5+") and toolchain._full_version(str(wheel_lib), 13, 5) != one


def test_nvrtc_choice_names_a_bad_override(monkeypatch, tmp_path):
    monkeypatch.setenv("VITRAIL_NVRTC", str(tmp_path))
    with pytest.raises(ToolchainError, match="VITRAIL_NVRTC=.*no libnvrtc.so"):
        toolchain._preload_nvrtc()
    (tmp_path / "libnvrtc.so.13").write_bytes(b"")
    (tmp_path / "libnvrtc.so").write_bytes(b"")
    assert toolchain._nvrtc_in(tmp_path) == tmp_path / "libnvrtc.so.13"
    assert toolchain._nvrtc_in(tmp_path / "libnvrtc.so") == tmp_path / "libnvrtc.so"


def test_nvrtc_override_refused_where_the_process_has_another(monkeypatch, tmp_path):
    """A CUDA build of torch loads its NVRTC first; VITRAIL_NVRTC cannot replace it and says so
    instead of being ignored."""
    (tmp_path / "libnvrtc.so.13").write_bytes(b"")
    monkeypatch.setenv("VITRAIL_NVRTC", str(tmp_path))
    monkeypatch.setattr(toolchain, "_loaded_nvrtc", lambda: "/site-packages/libnvrtc.so.13")
    with pytest.raises(ToolchainError, match="cannot take effect.*/site-packages/libnvrtc"):
        toolchain._preload_nvrtc()
    monkeypatch.delenv("VITRAIL_NVRTC")
    monkeypatch.setattr(toolchain, "nvcc", lambda: toolchain.Nvcc(
        "nvcc", (13, 0, 88), str(tmp_path.parent), "g++", frozenset(), ()))
    (tmp_path.parent / "lib64").mkdir(exist_ok=True)
    (tmp_path.parent / "lib64" / "libnvrtc.so.13").write_bytes(b"")
    assert toolchain._preload_nvrtc() == "process"  # the toolkit's is only a preference


def test_driver_check_refuses_cubins_of_a_newer_major(monkeypatch):
    """Minor version compatibility: a 13.5 cubin loads on a 13.0 driver (measured on an H100
    with driver 580); a 13.x cubin on a 12.x driver does not, and vitrail says so first."""
    monkeypatch.setattr(toolchain, "driver_version", lambda: (13, 0))
    toolchain.check_driver_runs("NVRTC", "13.5.37")
    toolchain.check_driver_runs("NVRTC", "13.0+0123456789abcdef")
    monkeypatch.setattr(toolchain, "driver_version", lambda: (12, 8))
    with pytest.raises(ToolchainError, match=r"CUDA 12\.8.*NVRTC 13\.0.*r580"):
        toolchain.check_driver_runs("NVRTC", "13.0.88")
    monkeypatch.setattr(toolchain, "driver_version", lambda: None)  # no driver: nothing runs
    toolchain.check_driver_runs("nvcc", "13.0.88")


def test_untested_versions_are_named():
    assert toolchain.untested("NVRTC", (13, 0)) == toolchain.untested("NVRTC", (13, 5, 37)) == ""
    assert toolchain.untested("NVRTC", (13, 6)) == "NVRTC 13.6 is outside the tested 13.0 to 13.5"
    assert toolchain.untested("CUTLASS", (4, 3, 0)) == "CUTLASS 4.3.0 is outside the tested 4.2"


def test_pyproject_bounds_match_the_tested_set():
    """pyproject.toml's ranges and constraints.txt's pins say what toolchain.TESTED says."""
    import re
    root = Path(__file__).resolve().parents[2]
    project = (root / "pyproject.toml").read_text()
    pins = dict(re.findall(r"^([\w.-]+)==([\w.]+)$", (root / "constraints.txt").read_text(), re.M))
    for package, tool in [("nvidia-cuda-nvrtc", "NVRTC"), ("cuda-bindings", "cuda-bindings"),
                          ("nvidia-cutlass", "CUTLASS"), ("torch", "torch")]:
        low, high = toolchain.TESTED[tool]
        spec = re.search(rf'"{package}>=([\d.]+),<([\d.]+)"', project)
        assert spec, package
        assert tuple(map(int, spec.group(1).split("."))) == low, package
        assert tuple(map(int, spec.group(2).split("."))) == (high[0], high[1] + 1), package
        pinned = tuple(map(int, pins[package].split(".")[:2]))
        assert low <= pinned <= high, package


def test_a_warm_process_learns_what_its_nvcc_is_without_running_it(tmp_path, monkeypatch):
    """nvcc's version, targets and include directories, and its host compiler's version, are
    remembered per binary in the cache's tools.json: a second process finds the same Nvcc and
    runs no compiler (a wrapper script would be asked again)."""
    real = Path(toolchain.nvcc().cuda_home) / "bin" / "nvcc"  # the binary a wrapper runs
    with open(real, "rb") as f:
        if f.read(2) == b"#!":
            pytest.skip(f"nvcc at {real} is a script (asked anew in every process)")
    cxx = os.path.realpath(toolchain.host_cxx())
    with open(cxx, "rb") as f:
        if f.read(2) == b"#!":
            pytest.skip(f"the host compiler {cxx} is a script")
    monkeypatch.setenv("VITRAIL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VITRAIL_NVCC", str(real))
    monkeypatch.setattr(toolchain, "_REMEMBERED", {})
    toolchain._find_nvcc.cache_clear()
    first = toolchain.nvcc()
    assert len(json.loads((tmp_path / "v1" / "tools.json").read_text())) == 4
    monkeypatch.setattr(toolchain, "_REMEMBERED", {})  # a new process
    toolchain._find_nvcc.cache_clear()

    def no_run(cmd, *args, **kwargs):
        raise AssertionError(f"ran {cmd}")
    monkeypatch.setattr(toolchain, "_run", no_run)
    monkeypatch.setattr(toolchain, "version_line", no_run)
    assert toolchain.nvcc() == first


class _FakeNvml:
    """NVML's calls that _machine_capability makes, on made-up GPUs (named GPU0, GPU1, ...,
    or all ``name``)."""

    def __init__(self, caps, init=0, name=None):
        self.caps, self.init, self.name, self.shut, self.inits = caps, init, name, False, 0

    def nvmlInit_v2(self):
        self.inits += 1
        return self.init

    def nvmlShutdown(self):
        self.shut = True
        return 0

    def nvmlDeviceGetCount_v2(self, count):
        count._obj.value = len(self.caps)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = index + 1
        return 0

    def nvmlDeviceGetCudaComputeCapability(self, handle, major, minor):
        major._obj.value, minor._obj.value = self.caps[handle.value - 1]
        return 0

    def nvmlDeviceGetName(self, handle, name, size):
        name.value = (self.name or f"GPU{handle.value - 1}").encode()
        return 0


def _proc_gpus(root: Path, *models: str) -> Path:
    """A made-up /proc/driver/nvidia/gpus: a folder a GPU, its model in its information."""
    for i, model in enumerate(models):
        bus = root / f"0000:{i:02x}:00.0"
        bus.mkdir(parents=True)
        (bus / "information").write_text(
            f"Model: \t\t {model}\nIRQ:             42\nGPU UUID:        GPU-{i}\n")
    return root


def test_the_machines_one_capability_is_read_without_starting_cuda(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cache = KernelCache(tmp_path / "c")
    read = functools.partial(toolchain._machine_capability.__wrapped__,
                             gpus=tmp_path / "no-proc-files", cache=cache)
    nvml = _FakeNvml([(9, 0), (9, 0)])
    assert read(lambda: nvml) == (9, 0, "GPU0") and nvml.shut
    assert read(lambda: _FakeNvml([(9, 0), (8, 0)])) is None  # GPUs that differ: CUDA decides
    assert read(lambda: _FakeNvml([])) is None
    assert read(lambda: _FakeNvml([(9, 0)], init=9)) is None

    def missing():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")
    assert read(missing) is None
    assert not (cache.root / "tools.json").exists()  # no /proc model: nothing remembered
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # its picks are CUDA's to read
    assert read(lambda: _FakeNvml([(9, 0)])) is None


def test_a_gpu_models_capability_is_remembered_and_nvml_not_asked_again(tmp_path, monkeypatch):
    """NVML's answer for the model every GPU's /proc file names is kept in tools.json; a new
    process (the memo of this one cleared) reads it and opens no NVML. An answer for another
    model, another count, or GPUs that differ is not kept, nor read back for another model."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    read = toolchain._machine_capability.__wrapped__
    cache = KernelCache(tmp_path / "c")
    h200 = _proc_gpus(tmp_path / "h200", "NVIDIA H200", "NVIDIA H200")
    nvml = _FakeNvml([(9, 0), (9, 0)], name="NVIDIA H200")
    assert read(lambda: nvml, gpus=h200, cache=cache) == (9, 0, "NVIDIA H200")
    assert nvml.inits == 1

    def no_nvml():
        raise AssertionError("NVML was opened for a remembered model")
    assert read(no_nvml, gpus=h200, cache=cache) == (9, 0, "NVIDIA H200")

    b200 = _proc_gpus(tmp_path / "b200", "NVIDIA B200")
    assert read(lambda: _FakeNvml([(10, 0)], name="NVIDIA B200"), gpus=b200,
                cache=cache) == (10, 0, "NVIDIA B200")
    assert read(no_nvml, gpus=b200, cache=cache) == (10, 0, "NVIDIA B200")
    known = json.loads((cache.root / "tools.json").read_text())
    assert sorted(json.loads(v) for v in known.values()) == [[9, 0, "NVIDIA H200"],
                                                            [10, 0, "NVIDIA B200"]]

    # not kept: NVML names another model than /proc, counts other GPUs, or the models differ
    cases = [(_proc_gpus(tmp_path / "a", "NVIDIA A100"), _FakeNvml([(8, 0)], name="A100 SXM")),
             (_proc_gpus(tmp_path / "b", "NVIDIA L4"), _FakeNvml([(8, 9)] * 2, name="NVIDIA L4")),
             (_proc_gpus(tmp_path / "m", "NVIDIA H100", "NVIDIA L4"),
              _FakeNvml([(9, 0), (8, 9)], name="NVIDIA H100"))]
    for gpus, fake in cases:
        first = read(lambda: fake, gpus=gpus, cache=cache)
        assert read(lambda: fake, gpus=gpus, cache=cache) == first and fake.inits == 2
    assert len(json.loads((cache.root / "tools.json").read_text())) == 2

    # a damaged entry is not believed: NVML answers, and its answer is what counts
    known = {k: json.dumps([7, "x", "NVIDIA H200"]) for k in known}
    (cache.root / "tools.json").write_text(json.dumps(known))
    nvml = _FakeNvml([(9, 0), (9, 0)], name="NVIDIA H200")
    assert read(lambda: nvml, gpus=h200, cache=cache) == (9, 0, "NVIDIA H200")
    assert nvml.inits == 1


def test_the_proc_files_give_each_gpus_model_or_nothing(tmp_path):
    assert toolchain._gpu_models(tmp_path / "missing") is None
    (tmp_path / "none").mkdir()
    assert toolchain._gpu_models(tmp_path / "none") is None  # the driver lists no GPU
    two = _proc_gpus(tmp_path / "two", "NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3")
    assert toolchain._gpu_models(two) == ["NVIDIA H100 80GB HBM3"] * 2
    blank = _proc_gpus(tmp_path / "blank", "")
    assert toolchain._gpu_models(blank) is None
    (two / "0000:07:00.0").mkdir()  # a GPU folder without its information file
    assert toolchain._gpu_models(two) is None


def test_the_capability_comes_from_nvml_only_before_cuda_starts(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(toolchain, "_machine_capability", lambda: (9, 0, "GPU0"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert toolchain._device_capability(None) == (9, 0, "GPU0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert toolchain._device_capability(0) is None  # a device named: CUDA's own answer
