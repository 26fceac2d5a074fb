"""Find the tools a JIT compile needs, and say plainly what is missing.

- nvcc: ``VITRAIL_NVCC``, then ``$CUDA_HOME/bin/nvcc`` (or ``$CUDA_PATH``), then PATH, then
  /usr/local/cuda; its version, the host C++ compiler it drives, and the toolkit's headers.
- NVRTC: ``VITRAIL_NVRTC``, else the toolkit's beside nvcc (so that NVRTC matches the headers
  it compiles against), else the ``nvidia-cuda-nvrtc`` wheel's; loaded once per process, with
  its full version (13.0.88) read for the cache key.
- The driver: its CUDA version (``cuDriverGetVersion``); cubins from an NVRTC of a newer major
  version than the driver's do not load, and vitrail says so before it launches anything.
- The target arch: ``VITRAIL_ARCH``, else the current GPU (``sm_90a`` on Hopper, so wgmma and
  TMA are usable; read through NVML before CUDA starts, where every GPU is alike, and
  remembered per GPU model across processes), else the highest entry of
  ``TORCH_CUDA_ARCH_LIST``.
- CUTLASS/CuTe headers: ``CUTLASS_PATH``, else the installed ``nvidia-cutlass`` package.

Every lookup is memoized per environment (changing a variable re-runs it) and raises
:class:`ToolchainError` naming the tool, the version found and the version needed, before any
file is written.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from vitrail import knobs
from vitrail.jit.errors import CacheError, ToolchainError

NVCC_MIN = (13, 0)
NVRTC_MIN = (13, 0)
CUTLASS_MIN = (3, 6)
# The versions vitrail's kernels were built, checked for spills and timed with (pyproject.toml's
# bounds; constraints.txt pins one such set). Others may work; doctor warns about them.
TESTED = {"nvcc": ((13, 0), (13, 0)), "NVRTC": ((13, 0), (13, 5)), "CUTLASS": ((4, 2), (4, 2)),
          "torch": ((2, 11), (2, 13)), "cuda-bindings": ((13, 0), (13, 5))}


def major_minor(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string: '13.0.88' -> (13, 0), '2.13.0+cpu' -> (2, 13)."""
    return tuple(int(v) for v in re.findall(r"\d+", text)[:2])


def untested(tool: str, version: tuple[int, ...]) -> str:
    """'' where version (major, minor, ...) is in TESTED's range for tool, else a sentence."""
    low, high = TESTED[tool]
    if low <= tuple(version[:2]) <= high:
        return ""
    span = _fmt(low) if low == high else f"{_fmt(low)} to {_fmt(high)}"
    return f"{tool} {_fmt(version)} is outside the tested {span}"
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
        if device is None and not torch.cuda.is_initialized():
            shared = _machine_capability()
            if shared is not None:  # every GPU is alike: no need to start CUDA to ask
                return shared
        if not torch.cuda.is_initialized() and not torch.cuda.is_available():
            return None
        if device is None:
            from vitrail.jit.arguments import current_device
            device = current_device()
        return _capability_of(device)
    except Exception:  # a broken driver counts as no GPU; doctor reports the details
        return None


GPUS = Path("/proc/driver/nvidia/gpus")  # a folder a GPU, its model in <bus>/information


@functools.lru_cache(maxsize=1)
def _machine_capability(open_nvml: Callable[[], object] | None = None, gpus: Path = GPUS,
                        cache=None) -> tuple[int, int, str] | None:
    """The compute capability (and name) that every GPU of this machine shares, or None (NVML
    missing or failing, GPUs that differ, CUDA_VISIBLE_DEVICES set). CUDA's own query starts
    the driver first, which takes a fresh process about 0.2 s that a warm load of an extension
    need not pay before the program's first CUDA call; NVML's takes some 20 ms. So where the
    driver's /proc files name one model for every GPU, NVML's answer for that model is
    remembered in the cache's tools.json (``cache``: a KernelCache, default this user's), and a
    later process reads the model there and NVML not at all. Only an answer NVML gave for that
    very model and GPU count is remembered: a model's capability never changes."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:  # its picks and order are CUDA's to read
        return None
    models = _gpu_models(gpus)
    if not models or len(set(models)) != 1:
        found = _nvml_capability(open_nvml)
        return found and found[:3]
    asked: list = []

    def ask() -> str | None:
        found = _nvml_capability(open_nvml)
        asked.append(found)
        if found is None or found[2] != models[0] or found[3] != len(models):
            return None
        return json.dumps(found[:3])

    text = _shared_answer(json.dumps(["GPU capability", models[0]]), ask, cache)
    try:
        major, minor, name = json.loads(text) if text else (None, None, None)
        if type(major) is int and type(minor) is int and name == models[0]:
            return major, minor, name
    except (TypeError, ValueError):
        pass
    found = asked[0] if asked else _nvml_capability(open_nvml)
    return found and found[:3]


def _gpu_models(gpus: Path) -> list[str] | None:
    """Each GPU's model as the driver's /proc files name it (no library is loaded, the driver
    is not asked), or None where there are none."""
    try:
        buses = sorted(os.listdir(gpus))
        infos = [(gpus / bus / "information").read_text(errors="replace") for bus in buses]
    except OSError:
        return None
    models = [re.search(r"^Model:[ \t]*(.*?)[ \t]*$", info, re.M) for info in infos]
    if not models or not all(m and m.group(1) for m in models):
        return None
    return [m.group(1) for m in models]


def _nvml_capability(open_nvml: Callable[[], object] | None
                     ) -> tuple[int, int, str, int] | None:
    """The capability, name and count of this machine's GPUs through NVML, where all alike."""
    import ctypes
    try:
        nvml = open_nvml() if open_nvml else ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0 or count.value == 0:
            return None
        found, name = set(), ctypes.create_string_buffer(96)
        for index in range(count.value):
            handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0 or \
                    nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major),
                                                            ctypes.byref(minor)) != 0:
                return None
            if not found and nvml.nvmlDeviceGetName(handle, name, len(name)) != 0:
                return None
            found.add((major.value, minor.value))
        if len(found) != 1:
            return None
        (major, minor), = found
        return major, minor, name.value.decode(errors="replace"), count.value
    finally:
        nvml.nvmlShutdown()


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


def nvcc_path() -> str:
    """Where the nvcc :func:`nvcc` uses is, found without running it (a cached build's key
    names the compiler by this path's version line); raises ToolchainError if there is none."""
    env = (knobs.NVCC.get(), os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""),
           os.environ.get("PATH", ""))
    return _nvcc_path(env)


@functools.lru_cache(maxsize=8)
def _nvcc_path(env: tuple[str, str, str, str]) -> str:
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
    return path


@functools.lru_cache(maxsize=8)
def _find_nvcc(env: tuple[str, str, str, str]) -> Nvcc:
    path = _nvcc_path(env)

    def ask(*args: str, stderr: bool = False) -> str:
        cmd = [path, *args]
        return remembered(cmd, "nvcc", lambda: _run(cmd, "nvcc", stderr=stderr),
                          files=(profile,))
    profile = os.path.join(os.path.dirname(os.path.realpath(path)), "nvcc.profile")
    out = ask("--version")
    m = re.search(r"release (\d+)\.(\d+), V(\d+)\.(\d+)\.(\d+)", out)
    if not m:
        raise ToolchainError(f"could not read the version of nvcc at {path}; it printed:\n{out}")
    version = (int(m.group(3)), int(m.group(4)), int(m.group(5)))
    if version[:2] < NVCC_MIN:
        raise ToolchainError(
            f"nvcc at {path} is version {_fmt(version)}; vitrail needs nvcc >= {_fmt(NVCC_MIN)}. "
            f"Install a newer CUDA toolkit, or point VITRAIL_NVCC at one.")
    codes = frozenset(ask("--list-gpu-code").split())
    # nvcc may be a wrapper script: ask it where its toolkit and headers are
    dry = ask("--dryrun", "-x", "cu", "-E", os.devnull, stderr=True)
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
    cxx = host_cxx()
    return remembered([cxx, "--version"], cxx, lambda: version_line(cxx))


def host_cxx() -> str:
    """The host C++ compiler nvcc drives, and that host code (torch extensions' .cpp files)
    is compiled with: g++, else c++, on PATH."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise ToolchainError("nvcc needs a host C++ compiler and none (g++ or c++) is on PATH; "
                             "install g++ (Debian: apt-get install g++)")
    return cxx


def version_line(tool: str) -> str:
    """The first line of ``tool --version``."""
    return version_output(tool).splitlines()[0].strip()


def version_output(tool: str) -> str:
    """What ``tool --version`` prints (what a cache key names a compiler by)."""
    return _run([tool, "--version"], tool)


_REMEMBERED: dict[str, str] = {}  # signature -> output, for this process


def remembered(cmd: list[str], tool: str, run: Callable[[], str], cache=None,
               files: tuple[str, ...] = ()) -> str:
    """run() (what running cmd prints), remembered per binary -- the name called (links such
    as ccache's answer for the compiler they are named after), its real path, size, mtime and
    inode, the arguments and the NVCC_* environment -- for this process and, in the cache's
    tools.json (``cache``: a KernelCache, default this user's), across processes: a warm
    process runs no compiler to learn what it is. A script (a wrapper) is asked again in every
    process: what it runs may change under it. files: others whose size and mtime the answer
    depends on too (nvcc.profile)."""
    real = os.path.realpath(shutil.which(cmd[0]) or cmd[0])
    try:
        st = os.stat(real)
        with open(real, "rb") as f:
            script = f.read(2) == b"#!"
    except OSError:
        return run()
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("NVCC_"))
    others = [(f, o.st_size, o.st_mtime_ns) for f in files for o in _stat(f)]
    sig = json.dumps([cmd, real, st.st_size, st.st_mtime_ns, st.st_ino, env, others])
    if sig in _REMEMBERED:
        return _REMEMBERED[sig]
    if script:
        _REMEMBERED[sig] = out = run()
        return out
    _REMEMBERED[sig] = out = _shared_answer(sig, run, cache)
    return out


def _shared_answer(sig: str, run: Callable[[], str | None], cache=None) -> str | None:
    """The answer remembered under sig in the cache's tools.json (``cache``: a KernelCache,
    default this user's), else run()'s, remembered there unless it is None. Without a cache to
    remember it in, run() answers in every process."""
    from vitrail.jit.cache import KernelCache
    try:
        cache = cache or KernelCache()
    except (OSError, CacheError):
        return run()
    path = cache.root / "tools.json"
    known = _read_json(path)
    if isinstance(known.get(sig), str):
        return known[sig]
    out = run()
    if out is None:
        return None
    try:
        with cache.lock("tools.json", "the tools' identities"):  # writers merge, in turn
            known = _read_json(path)
            known[sig] = out
            tmp = path.with_name(f"tools.json.{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
            os.replace(tmp, path)
    except (OSError, CacheError):
        pass  # not remembered: the next process asks again
    return out


def _stat(path: str) -> list[os.stat_result]:
    try:
        return [os.stat(path)]
    except OSError:
        return []


def _read_json(path: Path) -> dict:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


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
    full_version: str = ""     # 13.0.88: part of every NVRTC cache key (patches change codegen)
    source: str = ""           # VITRAIL_NVRTC, toolkit, wheel, system or loaded before vitrail

    @property
    def version_text(self) -> str:
        return self.full_version or _fmt(self.version)

    def check_arch(self, arch: Arch) -> None:
        if self.supported and arch.major * 10 + arch.minor not in self.supported:
            raise ToolchainError(
                f"NVRTC {self.version_text} ({self.library}) cannot build for {arch.sm}; it "
                f"supports sm_{', sm_'.join(map(str, sorted(self.supported)))}. Install a newer "
                f"nvidia-cuda-nvrtc wheel or CUDA toolkit.")


@functools.lru_cache(maxsize=1)
def nvrtc() -> Nvrtc:
    """The NVRTC library this process compiles with (chosen and loaded once: a process cannot
    swap it); raises ToolchainError if absent or too old."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError as e:
        raise ToolchainError(f"cuda-bindings is not installed ({e}); pip install cuda-bindings") \
            from None
    source = _preload_nvrtc()
    try:
        from cuda.bindings import nvrtc as _nvrtc
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
    if not source:
        source = "wheel" if "site-packages" in str(library) else "system"
    elif source == "process":
        source = "loaded before vitrail" + (", a wheel's" if "site-packages" in str(library)
                                            else "")
    return Nvrtc((major, minor), str(library), archs, _full_version(str(library), major, minor),
                 source)


def _preload_nvrtc() -> str:
    """Load the NVRTC to use before cuda-bindings looks for one (it takes a library already in
    the process): VITRAIL_NVRTC, else the toolkit's beside nvcc. Returns where it came from
    ('' where cuda-bindings should search: the wheel's, else the system's)."""
    import ctypes
    explicit = knobs.NVRTC.get()
    if explicit:
        path, source = _nvrtc_in(Path(explicit)), "VITRAIL_NVRTC"
        if path is None:
            raise ToolchainError(f"VITRAIL_NVRTC={explicit}: no libnvrtc.so.<major> there; point "
                                 f"it at the library or the folder that holds it")
    else:
        try:
            home = Path(nvcc().cuda_home)
        except ToolchainError:
            return ""
        path = next(filter(None, (_nvrtc_in(d) for d in [home / "lib64", home / "lib",
                                                          *sorted(home.glob("targets/*/lib"))])),
                    None)
        source = "toolkit"
        if path is None:
            return ""
    loaded = _loaded_nvrtc()
    if loaded and os.path.realpath(loaded) != os.path.realpath(path):
        # Loaded before vitrail (a CUDA build of torch links its wheel's): cuda-bindings takes
        # that one, and a process cannot swap it.
        if source == "VITRAIL_NVRTC":
            raise ToolchainError(
                f"VITRAIL_NVRTC={explicit} cannot take effect: this process loaded NVRTC from "
                f"{loaded} before vitrail looked (a CUDA build of torch loads its own), and "
                f"cuda-bindings compiles with that one. Unset VITRAIL_NVRTC, or install the "
                f"NVRTC you want as the nvidia-cuda-nvrtc wheel")
        return "process"
    try:  # the builtins first: NVRTC opens them by name, which its folder may not resolve
        for builtins in sorted(path.parent.glob("libnvrtc-builtins.so.*")):
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise ToolchainError(f"loading NVRTC from {path} ({source}) failed: {e}") from None
    return source


def _nvrtc_in(where: Path) -> Path | None:
    """libnvrtc.so.<major> at where (a file, or a folder holding one)."""
    if where.is_file():
        return where
    found = sorted(where.glob("libnvrtc.so.[0-9]*"), key=lambda p: len(p.name))
    return found[0] if found else None


def _loaded_nvrtc() -> str:
    """The libnvrtc this process has mapped already ('' if none)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ""
    found = re.search(r"(/\S*/libnvrtc\.so[.\d]*)$", maps, re.M)
    return found.group(1) if found else ""


def _full_version(library: str, major: int, minor: int) -> str:
    """NVRTC's full version: the toolkit file's name (libnvrtc.so.13.0.88), else the version of
    the wheel whose record lists it, else major.minor and a digest of the library's bytes."""
    real = os.path.realpath(library)
    named = re.search(r"\.so\.(\d+\.\d+\.\d+)$", real)
    if named:
        return named.group(1)
    for folder in list(Path(real).parents)[:4]:  # a wheel, installed or unpacked: its record
        for info in folder.glob("nvidia_cuda_nvrtc*-*.dist-info"):
            record = info / "RECORD"
            rel = os.path.relpath(real, folder)
            if record.is_file() and rel in record.read_text(errors="replace"):
                return info.name[:-len(".dist-info")].rsplit("-", 1)[1]
    import hashlib
    digest = hashlib.sha256()
    with open(real, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return f"{major}.{minor}+{digest.hexdigest()[:16]}"


# --------------------------------------------------------------------------------------- driver
@functools.lru_cache(maxsize=1)
def driver_version() -> tuple[int, int] | None:
    """The CUDA version the installed driver supports (13.0 for r580), or None without one."""
    try:
        from cuda.bindings import driver
        err, version = driver.cuDriverGetVersion()
    except Exception:  # no libcuda: no driver on this machine
        return None
    if err != driver.CUresult.CUDA_SUCCESS or not version:
        return None
    return version // 1000, version % 1000 // 10


def check_driver_runs(compiler: str, version_text: str) -> None:
    """Raise ToolchainError where the driver cannot load cubins built by this compiler version:
    within a major version a newer compiler's cubins load on an older driver (CUDA's minor
    version compatibility; vitrail never hands PTX to the driver, which would need a driver as
    new as the compiler), but not across major versions."""
    version = major_minor(version_text)
    have = driver_version()
    if have is not None and version and have[0] < version[0]:
        raise ToolchainError(
            f"the NVIDIA driver supports CUDA {_fmt(have)}, and cubins from {compiler} "
            f"{_fmt(version)} need a CUDA {version[0]}.x driver: update the driver (CUDA "
            f"{version[0]}.0 needs r580 or newer), or compile with a CUDA {have[0]}.x toolkit "
            f"(VITRAIL_NVCC, VITRAIL_NVRTC)")


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

    @property
    def util_include_dir(self) -> str | None:
        """CUTLASS's utility headers (``cutlass/util/...``: tools/util/include beside include/,
        in a checkout as in the nvidia-cutlass package), which CUTLASS 3's conv collectives
        include; None where this CUTLASS has none."""
        util = Path(self.include_dir).parent / "tools" / "util" / "include"
        return str(util) if (util / "cutlass" / "util").is_dir() else None


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
