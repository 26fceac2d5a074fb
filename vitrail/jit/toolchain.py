"""Find the tools a JIT compile needs, and say plainly what is missing.

- nvcc: ``VITRAIL_NVCC``, then ``$CUDA_HOME/bin/nvcc`` (or ``$CUDA_PATH``), then PATH, then
  /usr/local/cuda; its version, the host C++ compiler it drives, and the toolkit's headers.
- NVRTC: the library cuda-bindings loads (the toolkit's, or the ``nvidia-cuda-nvrtc`` wheel's).
- The target arch: ``VITRAIL_ARCH``, else the current GPU (``sm_90a`` on Hopper, so wgmma and TMA are
  usable), else the highest entry of ``TORCH_CUDA_ARCH_LIST``.
- CUTLASS/CuTe headers: ``CUTLASS_PATH``, else the installed ``nvidia-cutlass`` package.

Every lookup is memoized per environment (changing a variable re-runs it) and raises
:class:`ToolchainError` naming the tool, the version found and the version needed, before any
file is written.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from vitrail import knobs
from vitrail.jit.errors import ToolchainError

NVCC_MIN = (12, 4)
NVRTC_MIN = (12, 4)
CUTLASS_MIN = (3, 6)
VITRAIL_INCLUDE = Path(__file__).resolve().parent.parent / "include"


def _fmt(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


# ----------------------------------------------------------------------------------------- arch
@dataclass(frozen=True)
class Arch:
    """A compile target: ``Arch(9, 0, "a")`` is sm_90a."""
    major: int
    minor: int
    suffix: str = ""  # "a" (arch-specific features: wgmma, setmaxnreg) or "f" or ""
    source: str = ""  # where it came from, for diagnostics

    @property
    def name(self) -> str:
        return f"{self.major}{self.minor}{self.suffix}"

    @property
    def sm(self) -> str:
        return f"sm_{self.name}"

    @property
    def compute(self) -> str:
        return f"compute_{self.name}"

    def __str__(self) -> str:
        return self.sm

    @classmethod
    def parse(cls, text: str, source: str = "argument") -> "Arch":
        """Accept 90a, sm_90a, compute_90a, 9.0, 9.0a (and a trailing +PTX, which is ignored)."""
        return _parse_arch(cls, text, source)

    @classmethod
    def _parse(cls, text: str, source: str) -> "Arch":
        raw = text.strip().lower().removesuffix("+ptx")
        m = (re.fullmatch(r"(?:sm_|compute_)?(\d+)(\d)([af]?)", raw)
             or re.fullmatch(r"(\d+)\.(\d)([af]?)", raw))
        if not m:
            raise ToolchainError(
                f"{source}={text!r} is not a GPU architecture; expected e.g. 90a, sm_90a or 9.0")
        return cls(int(m.group(1)), int(m.group(2)), m.group(3), source)

    @classmethod
    def of_capability(cls, major: int, minor: int, source: str) -> "Arch":
        # From sm_90 on, the arch-specific target ('a') is what runs on exactly this device and
        # unlocks its own instructions (wgmma, setmaxnreg, tcgen05): use it.
        return cls(major, minor, "a" if major >= 9 else "", source)


@functools.lru_cache(maxsize=64)
def _parse_arch(cls: type, text: str, source: str) -> Arch:
    return cls._parse(text, source)


def target_arch(device: int | None = None) -> Arch:
    """The arch to compile for: VITRAIL_ARCH, else the GPU's, else TORCH_CUDA_ARCH_LIST."""
    override = knobs.ARCH.get()
    if override:
        return Arch.parse(override, "VITRAIL_ARCH")
    cap = _device_capability(device)
    if cap is not None:
        return Arch.of_capability(cap[0], cap[1], source=f"GPU {cap[2]}")
    listed = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if listed:
        archs = [Arch.parse(a, "TORCH_CUDA_ARCH_LIST") for a in re.split(r"[;\s,]+", listed) if a]
        best = max(archs, key=lambda a: (a.major, a.minor))
        if best.major >= 9 and not best.suffix:
            best = Arch.of_capability(best.major, best.minor, "TORCH_CUDA_ARCH_LIST")
        return best
    raise ToolchainError(
        "no GPU is visible and no target arch is set: set VITRAIL_ARCH (e.g. VITRAIL_ARCH=90a "
        "for Hopper) or TORCH_CUDA_ARCH_LIST to compile without a GPU")


def _device_capability(device: int | None) -> tuple[int, int, str] | None:
    try:
        import torch
        if not torch.cuda.is_initialized() and not torch.cuda.is_available():
            return None
        if device is None:
            from vitrail.jit.arguments import current_device
            device = current_device()
        return _capability_of(device)
    except Exception:  # a broken driver counts as no GPU; doctor reports the details
        return None


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> tuple[int, int, str]:
    import torch
    major, minor = torch.cuda.get_device_capability(index)
    return major, minor, torch.cuda.get_device_name(index)


# ----------------------------------------------------------------------------------------- nvcc
@dataclass(frozen=True)
class Nvcc:
    path: str
    version: tuple[int, int, int]
    cuda_home: str
    host_compiler: str  # first line of the host compiler's --version: part of every nvcc key
    gpu_codes: frozenset[str]  # what --list-gpu-code prints: sm_90, sm_100, ...
    include_dirs: tuple[str, ...]  # the toolkit's own, in the order nvcc searches them

    @property
    def version_text(self) -> str:
        return _fmt(self.version)

    def check_arch(self, arch: Arch) -> None:
        # --list-gpu-code names base targets (sm_90); the 'a'/'f' variants come with them
        if self.gpu_codes and f"sm_{arch.major}{arch.minor}" not in self.gpu_codes:
            raise ToolchainError(
                f"nvcc {self.version_text} at {self.path} cannot build for {arch.sm} "
                f"(arch from {arch.source}); it supports {', '.join(sorted(self.gpu_codes))}. "
                f"Install a newer CUDA toolkit or set VITRAIL_ARCH.")


def nvcc() -> Nvcc:
    """The nvcc to use; raises ToolchainError if none is found or it is older than NVCC_MIN."""
    env = (knobs.NVCC.get(), os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""),
           os.environ.get("PATH", ""))
    return _find_nvcc(env)


@functools.lru_cache(maxsize=8)
def _find_nvcc(env: tuple[str, str, str, str]) -> Nvcc:
    explicit, cuda_home, cuda_path, _ = env
    if explicit:
        candidates = [("VITRAIL_NVCC", explicit)]
    else:
        candidates = [(name, str(Path(root) / "bin" / "nvcc"))
                      for name, root in (("CUDA_HOME", cuda_home), ("CUDA_PATH", cuda_path)) if root]
        on_path = shutil.which("nvcc")
        if on_path:
            candidates.append(("PATH", on_path))
        candidates.append(("default", "/usr/local/cuda/bin/nvcc"))
    path = next((p for _, p in candidates if os.path.isfile(p) and os.access(p, os.X_OK)), None)
    if path is None:
        tried = ", ".join(f"{p} ({why})" for why, p in candidates)
        raise ToolchainError(
            f"nvcc not found (tried {tried}); nvcc >= {_fmt(NVCC_MIN)} is needed. Install the "
            f"CUDA toolkit, or point VITRAIL_NVCC or CUDA_HOME at it.")
    out = _run([path, "--version"], "nvcc")
    m = re.search(r"release (\d+)\.(\d+), V(\d+)\.(\d+)\.(\d+)", out)
    if not m:
        raise ToolchainError(f"could not read the version of nvcc at {path}; it printed:\n{out}")
    version = (int(m.group(3)), int(m.group(4)), int(m.group(5)))
    if version[:2] < NVCC_MIN:
        raise ToolchainError(
            f"nvcc at {path} is version {_fmt(version)}; vitrail needs nvcc >= {_fmt(NVCC_MIN)}. "
            f"Install a newer CUDA toolkit, or point VITRAIL_NVCC at one.")
    codes = frozenset(_run([path, "--list-gpu-code"], "nvcc").split())
    # nvcc may be a wrapper script: ask it where its toolkit and headers are
    dry = _run([path, "--dryrun", "-x", "cu", "-E", os.devnull], "nvcc", stderr=True)
    top = re.search(r"^#\$ TOP=(.*)$", dry, re.M)
    home = os.path.normpath(top.group(1).strip()) if top else str(Path(path).resolve().parents[1])
    includes = []
    for line in re.findall(r"^#\$ (?:SYSTEM_)?INCLUDES=(.*)$", dry, re.M):
        for d in re.findall(r'"?(?:-I|-isystem)"?\s*"?([^"\s]+)"?', line):
            if os.path.isdir(d) and os.path.normpath(d) not in includes:
                includes.append(os.path.normpath(d))
    if not includes:
        includes = [d for d in (f"{home}/include", f"{home}/include/cccl") if os.path.isdir(d)]
    return Nvcc(path, version, home, _host_compiler(), codes, tuple(includes))


def _host_compiler() -> str:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise ToolchainError("nvcc needs a host C++ compiler and none (g++ or c++) is on PATH; "
                             "install g++ (Debian: apt-get install g++)")
    return _run([cxx, "--version"], "host C++ compiler").splitlines()[0].strip()


def _run(cmd: list[str], tool: str, stderr: bool = False) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ToolchainError(f"{tool}: running {' '.join(cmd)} failed: {e}") from None
    if done.returncode != 0:
        raise ToolchainError(f"{tool}: {' '.join(cmd)} exited {done.returncode}:\n"
                             f"{done.stdout}{done.stderr}")
    return done.stdout + (done.stderr if stderr else "")


# ---------------------------------------------------------------------------------------- NVRTC
@dataclass(frozen=True)
class Nvrtc:
    version: tuple[int, int]
    library: str
    supported: frozenset[int]  # numeric archs NVRTC can target: 90, 100, ...

    @property
    def version_text(self) -> str:
        return _fmt(self.version)

    def check_arch(self, arch: Arch) -> None:
        if self.supported and arch.major * 10 + arch.minor not in self.supported:
            raise ToolchainError(
                f"NVRTC {self.version_text} ({self.library}) cannot build for {arch.sm}; it "
                f"supports sm_{', sm_'.join(map(str, sorted(self.supported)))}. Install a newer "
                f"nvidia-cuda-nvrtc wheel or CUDA toolkit.")


@functools.lru_cache(maxsize=1)
def nvrtc() -> Nvrtc:
    """The NVRTC library cuda-bindings loads; raises ToolchainError if absent or too old."""
    try:
        from cuda.bindings import nvrtc as _nvrtc
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError as e:
        raise ToolchainError(f"cuda-bindings is not installed ({e}); pip install cuda-bindings") \
            from None
    try:
        library = load_nvidia_dynamic_lib("nvrtc").abs_path or "nvrtc"
        err, major, minor = _nvrtc.nvrtcVersion()
    except Exception as e:
        raise ToolchainError(
            f"the NVRTC library was not found ({str(e).splitlines()[0]}); NVRTC >= "
            f"{_fmt(NVRTC_MIN)} is needed: pip install nvidia-cuda-nvrtc, or install the CUDA "
            f"toolkit") from None
    if (major, minor) < NVRTC_MIN:
        raise ToolchainError(f"NVRTC at {library} is version {major}.{minor}; vitrail needs "
                             f">= {_fmt(NVRTC_MIN)}: pip install -U nvidia-cuda-nvrtc")
    err, n = _nvrtc.nvrtcGetNumSupportedArchs()
    archs: frozenset[int] = frozenset()
    if n:
        err, listed = _nvrtc.nvrtcGetSupportedArchs()
        archs = frozenset(int(a) for a in listed)
    return Nvrtc((major, minor), str(library), archs)


def cuda_include_dirs() -> list[str]:
    """Toolkit headers (cuda_fp16.h, cuda/std/...) for NVRTC: nvcc's toolkit, else the wheels'."""
    try:
        dirs = list(nvcc().include_dirs)
        if dirs:
            return dirs
    except ToolchainError:
        pass
    found = []
    try:
        import nvidia  # namespace package of NVIDIA's CUDA wheels
        for base in nvidia.__path__:
            for header in sorted(Path(base).glob("*/include/cuda_fp16.h")):
                found.append(str(header.parent))
                if (header.parent / "cccl").is_dir():
                    found.append(str(header.parent / "cccl"))
    except ImportError:
        pass
    return found


# -------------------------------------------------------------------------------------- CUTLASS
@dataclass(frozen=True)
class Cutlass:
    include_dir: str
    version: tuple[int, int, int]
    source: str

    @property
    def version_text(self) -> str:
        return _fmt(self.version)


def cutlass() -> Cutlass:
    """CUTLASS/CuTe headers: CUTLASS_PATH, else the nvidia-cutlass package."""
    return _find_cutlass(os.environ.get("CUTLASS_PATH", ""))


@functools.lru_cache(maxsize=4)
def _find_cutlass(cutlass_path: str) -> Cutlass:
    if cutlass_path:
        root = Path(cutlass_path)
        include = root / "include" if (root / "include" / "cute").is_dir() else root
        source = "CUTLASS_PATH"
        if not (include / "cute" / "tensor.hpp").is_file():
            raise ToolchainError(
                f"CUTLASS_PATH={cutlass_path} holds no CuTe headers (looked for "
                f"{include}/cute/tensor.hpp); point it at a CUTLASS checkout, or unset it to use "
                f"the nvidia-cutlass package")
    else:
        import importlib.util
        spec = importlib.util.find_spec("cutlass_library")  # locate it; importing needs more
        if spec is None or not spec.submodule_search_locations:
            raise ToolchainError(
                f"CUTLASS headers not found: pip install nvidia-cutlass (>= "
                f"{_fmt(CUTLASS_MIN)}), or set CUTLASS_PATH to a CUTLASS checkout")
        include = Path(list(spec.submodule_search_locations)[0]).resolve() / "source" / "include"
        source = "nvidia-cutlass"
        if not (include / "cute" / "tensor.hpp").is_file():
            raise ToolchainError(f"the nvidia-cutlass package has no headers at {include}; "
                                 f"reinstall it, or set CUTLASS_PATH")
    version_h = include / "cutlass" / "version.h"
    if not version_h.is_file():
        raise ToolchainError(
            f"CUTLASS at {include} ({source}) has no cutlass/version.h, so its version is "
            f"unknown; vitrail needs CUTLASS >= {_fmt(CUTLASS_MIN)}: point CUTLASS_PATH at a "
            f"complete CUTLASS checkout, or pip install -U nvidia-cutlass")
    text = version_h.read_text(errors="replace")
    parts = [re.search(rf"#define CUTLASS_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    version = tuple(int(p.group(1)) if p else 0 for p in parts)
    if version[:2] < CUTLASS_MIN:
        raise ToolchainError(
            f"CUTLASS at {include} ({source}) is version {_fmt(version)}; vitrail needs >= "
            f"{_fmt(CUTLASS_MIN)}: pip install -U nvidia-cutlass")
    return Cutlass(str(include), version, source)  # type: ignore[arg-type]
