"""Torch C++/CUDA extensions through vitrail's kernel cache: ``load_inline`` and ``load``.

Most CUDA code written for PyTorch is a torch extension (``#include <torch/extension.h>``,
functions on ``torch::Tensor``, bound with ``PYBIND11_MODULE`` or ``TORCH_LIBRARY``). These two
take the arguments of ``torch.utils.cpp_extension``'s and return the same kind of module, but
build into the per-user, content-keyed cache of vitrail.jit.cache instead of a directory keyed
by name:

- The key holds every source's text (and the user's headers it includes), the flags, torch's
  version and ABI, the compilers' ``--version`` and Python's ABI; never an absolute path. Two
  sources under one name are two entries, a copied cache still hits, and a build killed
  half-way (SIGKILL) leaves a lock the kernel has released: the next load builds at once.
- Each translation unit is compiled by its own process (the host compiler for .cpp, nvcc for
  .cu) at the same time, then one link: host and device code compile side by side.
- A .cpp unit that starts with ``#include <torch/extension.h>`` (every load_inline main.cpp)
  compiles against a precompiled header of it that gcc builds once per torch, compiler and
  flags, in the background, and every extension then uses (vitrail.jit.pch: which units, its
  key, why .cu units get none; VITRAIL_TORCH_PCH=0 turns it off): a cold build of one
  function took 8.6 s instead of 20.5 s (torch's: 23.7 s) on two cores.
- A warm load runs no compiler: the compilers' identities are remembered per binary (path,
  size, mtime) in the cache's tools.json, torch's headers are keyed by torch's version.

Torch's own defaults are kept (``-std=c++20``, no ``-O``: pass ``-O3`` in ``extra_cflags``), so a
source that builds with torch builds here. ``.cu`` files target vitrail's arch
(:func:`vitrail.jit.target_arch`) unless ``extra_cuda_cflags`` names one (``-gencode``, ``-arch``).
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import re
import shlex
import shutil
import sys
import sysconfig
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from vitrail import __version__, knobs
from vitrail.jit import pch, toolchain
from vitrail.jit.cache import LAYOUT, KernelCache, header_closure, make_key, safe_name
from vitrail.jit.compiler import BuildFailed, cached_build, run_compiler, run_nvcc
from vitrail.jit.launcher import load_extension

log = logging.getLogger("vitrail.jit")

CPP_SUFFIXES = (".cpp", ".cc", ".cxx", ".c++", ".C")
CUDA_SUFFIXES = (".cu",)
# torch.utils.cpp_extension's defaults, so that a source that builds there builds here
_CXX_FLAGS = ("-fPIC",)
_NVCC_FLAGS = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
               "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__",
               "--expt-relaxed-constexpr", "-Xcompiler=-fPIC")
_STD = "-std=c++20"
_ARCH_FLAGS = ("-gencode", "--generate-code", "-arch", "--gpu-architecture", "-code",
               "--gpu-code")
_FUNCTION = re.compile(r"(?:[A-Za-z_]\w*::)*[A-Za-z_]\w*")

_memo: dict[tuple, types.ModuleType] = {}
_memo_lock = threading.Lock()


@dataclass(frozen=True)
class _Unit:
    file: str          # its name in the build directory
    text: str
    shown: str = ""    # the user's path of the file (load), for error messages
    dir: str = ""      # the user's directory of the file: its "..." includes resolve there

    @property
    def is_cuda(self) -> bool:
        return self.file.endswith(CUDA_SUFFIXES)


@dataclass(frozen=True)
class _Options:
    cflags: tuple[str, ...]
    cuda_cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    include_dirs: tuple[str, ...]
    with_cuda: bool
    verbose: bool


# ---------------------------------------------------------------------------------- public
def load_inline(name: str, cpp_sources=(), cuda_sources=(), functions=None, *,
                extra_cflags: Sequence[str] = (), extra_cuda_cflags: Sequence[str] = (),
                extra_ldflags: Sequence[str] = (), extra_include_paths: Sequence[str] = (),
                with_cuda: bool | None = None, verbose: bool = False) -> types.ModuleType:
    """Build (or fetch from the cache) and load a torch extension from source strings, as
    ``torch.utils.cpp_extension.load_inline`` does.

    Args:
        name: the module's name (``TORCH_EXTENSION_NAME``): a Python identifier.
        cpp_sources: C++ source text (a str or a list of them, joined into one main.cpp after
            ``#include <torch/extension.h>``; line numbers in errors are those of your text).
        cuda_sources: CUDA source text, joined into one cuda.cu after ``#include
            <torch/types.h>``, ``<cuda.h>`` and ``<cuda_runtime.h>``.
        functions: functions of cpp_sources to bind with pybind11: a name, a list of names, or
            a dict name -> docstring. None: the sources bind themselves (``PYBIND11_MODULE``),
            or only register ops (``TORCH_LIBRARY``), and the module has no functions.
        extra_cflags, extra_cuda_cflags, extra_ldflags: flags for the host compiler, nvcc, the
            link (lists of str).
        extra_include_paths: include directories (headers there are part of the key).
        with_cuda: add CUDA's headers and libraries; None: where there are cuda_sources.
        verbose: print the commands and the compilers' output.

    Returns the loaded module; the ops that ``TORCH_LIBRARY`` blocks define are registered
    (``torch.ops.<namespace>.<op>``)."""
    units, options = _inline(name, cpp_sources, cuda_sources, functions, extra_cflags,
                             extra_cuda_cflags, extra_ldflags, extra_include_paths, with_cuda,
                             verbose)
    return _load(name, units, options)


def load(name: str, sources, *, extra_cflags: Sequence[str] = (),
         extra_cuda_cflags: Sequence[str] = (), extra_ldflags: Sequence[str] = (),
         extra_include_paths: Sequence[str] = (), with_cuda: bool | None = None,
         verbose: bool = False) -> types.ModuleType:
    """Build (or fetch from the cache) and load a torch extension from source files (.cpp,
    .cc, .cxx for the host compiler, .cu for nvcc), as ``torch.utils.cpp_extension.load``
    does; the files' own directories are on their include path. Other arguments and the
    result: as :func:`load_inline` (with_cuda None: where a source is a .cu file)."""
    units, options = _files(name, sources, extra_cflags, extra_cuda_cflags, extra_ldflags,
                            extra_include_paths, with_cuda, verbose)
    return _load(name, units, options)


def build_inline(name: str, cpp_sources=(), cuda_sources=(), functions=None, *,
                 extra_cflags: Sequence[str] = (), extra_cuda_cflags: Sequence[str] = (),
                 extra_ldflags: Sequence[str] = (), extra_include_paths: Sequence[str] = (),
                 with_cuda: bool | None = None, verbose: bool = False) -> Path:
    """What :func:`load_inline` does short of loading: the path of the built library, which
    is in the cache afterwards (e.g. to precompile CUDA extensions where torch has no CUDA)."""
    units, options = _inline(name, cpp_sources, cuda_sources, functions, extra_cflags,
                             extra_cuda_cflags, extra_ldflags, extra_include_paths, with_cuda,
                             verbose)
    return _build(name, units, options)[0].artifact


def build(name: str, sources, *, extra_cflags: Sequence[str] = (),
          extra_cuda_cflags: Sequence[str] = (), extra_ldflags: Sequence[str] = (),
          extra_include_paths: Sequence[str] = (), with_cuda: bool | None = None,
          verbose: bool = False) -> Path:
    """What :func:`load` does short of loading: the path of the built library."""
    units, options = _files(name, sources, extra_cflags, extra_cuda_cflags, extra_ldflags,
                            extra_include_paths, with_cuda, verbose)
    return _build(name, units, options)[0].artifact


def build_torch_pch(*, extra_cflags: Sequence[str] = (), with_cuda: bool = False) -> Path:
    """Build now (or find) the precompiled header of torch/extension.h that extensions built
    with these extra_cflags (and, with_cuda, CUDA's headers: those with .cu sources) use, and
    return the path of its .gch: what the first such extension build otherwise starts in the
    background (vitrail.jit.pch), for a CI image or a benchmark. Raises ToolchainError where
    none can be used (VITRAIL_TORCH_PCH=0, a compiler that is not gcc, extra_cflags with
    -include) and CompileError where gcc fails."""
    options = _options(extra_cflags, (), (), (), bool(with_cuda), bool(with_cuda), False)
    cache = KernelCache()
    plan = _plan(options, False, cache)
    spec, why = _pch_spec(options, plan, _system_dirs(plan, options.with_cuda)[0], [])
    if spec is None:
        raise toolchain.ToolchainError(f"no precompiled header for torch extensions: {why}")
    return pch.build(spec).dir / pch.GCH


def torch_pch_status() -> str:
    """Where the precompiled header that extensions with no extra_cflags use stands: its path
    and size, not built yet, or why there is none (``vitrail doctor``)."""
    options = _options((), (), (), (), False, False, False)
    cache = KernelCache()
    plan = _plan(options, False, cache)
    spec, why = _pch_spec(options, plan, _system_dirs(plan, False)[0], [])
    if spec is None:
        return f"no precompiled header of torch/extension.h ({why})"
    entry = cache.lookup(spec.key, read_artifact=False)
    if entry is None:
        return ("precompiled header of torch/extension.h: not built yet (the next extension "
                "build starts it)")
    return (f"precompiled header of torch/extension.h: {entry.dir / pch.GCH} "
            f"({entry.meta.get('gch_size', 0) / 2**30:.1f} GiB)")


def bindings(functions) -> str:
    """The ``PYBIND11_MODULE`` block binding ``functions`` (a name, a list of names, or a dict
    name -> docstring), each through ``torch::wrap_pybind_function`` as torch binds them
    (C++ exceptions become Python ones)."""
    if isinstance(functions, str):
        functions = [functions]
    if isinstance(functions, (list, tuple)):
        functions = {f: f for f in functions}
    if not isinstance(functions, Mapping):
        raise TypeError(f"functions: expected a name, a list of names or a dict name -> "
                        f"docstring, got {type(functions).__name__}")
    lines = ["PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {"]
    for function, doc in functions.items():
        if not isinstance(function, str) or not _FUNCTION.fullmatch(function):
            raise ValueError(f"functions: {function!r} is not the name of a C++ function")
        if not isinstance(doc, str):
            raise TypeError(f"functions: the docstring of {function} is a "
                            f"{type(doc).__name__}, expected a str")
        lines.append(f"  m.def({json.dumps(function)}, torch::wrap_pybind_function({function}), "
                     f"{json.dumps(doc)});")
    return "\n".join(lines + ["}"]) + "\n"


# ------------------------------------------------------------------------------- arguments
def _inline(name, cpp_sources, cuda_sources, functions, cflags, cuda_cflags, ldflags,
            include_paths, with_cuda, verbose) -> tuple[list[_Unit], _Options]:
    _check_name(name)
    cpp = _texts("cpp_sources", cpp_sources)
    cuda = _texts("cuda_sources", cuda_sources)
    if not cpp and not cuda:
        raise ValueError("cpp_sources, cuda_sources: expected some source text, got none")
    units = []
    if cpp or functions is not None:
        # #line 1: the compiler numbers the user's lines as the user does
        text = "#include <torch/extension.h>\n#line 1\n" + "\n".join(cpp) + "\n"
        if functions is not None:
            text += bindings(functions)
        units.append(_Unit("main.cpp", text))
    if cuda:
        head = "#include <torch/types.h>\n#include <cuda.h>\n#include <cuda_runtime.h>\n#line 1\n"
        units.append(_Unit("cuda.cu", head + "\n".join(cuda) + "\n"))
    return units, _options(cflags, cuda_cflags, ldflags, include_paths,
                           bool(cuda) if with_cuda is None else with_cuda, with_cuda, verbose)


def _files(name, sources, cflags, cuda_cflags, ldflags, include_paths, with_cuda,
           verbose) -> tuple[list[_Unit], _Options]:
    _check_name(name)
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    if not isinstance(sources, (list, tuple)) or not sources:
        raise ValueError(f"sources: expected a list of source files, got {sources!r}")
    units, used = [], set()
    for source in sources:
        if not isinstance(source, (str, os.PathLike)):
            raise TypeError(f"sources: expected paths, got {source!r}")
        path = Path(source).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"sources: {source} is not a file")
        if not path.name.endswith(CPP_SUFFIXES + CUDA_SUFFIXES):
            raise ValueError(f"sources: {source} is neither C++ ({', '.join(CPP_SUFFIXES)}) "
                             f"nor CUDA (.cu)")
        file = safe_name(path.name)
        while file in used:  # a.cpp from two folders: both are compiled
            file = f"_{file}"
        used.add(file)
        units.append(_Unit(file, path.read_text(), str(path), str(path.parent)))
    has_cuda = any(u.is_cuda for u in units)
    return units, _options(cflags, cuda_cflags, ldflags, include_paths,
                           has_cuda if with_cuda is None else with_cuda, with_cuda, verbose)


def _options(cflags, cuda_cflags, ldflags, include_paths, cuda: bool, with_cuda,
             verbose) -> _Options:
    if with_cuda is not None and not isinstance(with_cuda, bool):
        raise TypeError(f"with_cuda: expected True, False or None, got {with_cuda!r}")
    dirs = []
    for d in _strings("extra_include_paths", include_paths):
        if not Path(d).is_dir():
            raise ValueError(f"extra_include_paths: {d} is not a directory")
        dirs.append(str(Path(d).resolve()))
    return _Options(_strings("extra_cflags", cflags), _strings("extra_cuda_cflags", cuda_cflags),
                    _strings("extra_ldflags", ldflags), tuple(dirs), cuda, bool(verbose))


def _check_name(name) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name={name!r}: expected a Python identifier (the module's name, "
                         f"TORCH_EXTENSION_NAME)")


def _texts(what: str, value) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{what}: expected a str or a list of str, got {value!r:.80}")
    return [v for v in value if v.strip()]


def _strings(what: str, value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{what}: expected a list of str, got {value!r:.80}")
    for v in value:
        if not isinstance(v, str):
            raise TypeError(f"{what}: expected a list of str, got the item {v!r:.80}")
    return tuple(v.strip() for v in value if v.strip())


# ------------------------------------------------------------------------------ key, build
def _load(name: str, units: list[_Unit], options: _Options) -> types.ModuleType:
    request = (name, tuple(units), dataclasses.replace(options, verbose=False))
    hit = _memo.get(request)
    if hit is not None:
        return hit
    with _memo_lock:
        hit = _memo.get(request)
        if hit is None:
            entry, how = _build(name, units, options)
            hit = _memo[request] = _import(name, entry.artifact, entry.key)
            if options.verbose:
                print(f"vitrail: extension '{name}' ({how}) from {entry.artifact}")
    return hit


def _import(name: str, path: Path, key: str) -> types.ModuleType:
    """The module of the library at path. Loading it runs its static initializers (ops that
    TORCH_LIBRARY defines are registered); a library with no ``PyInit_<name>`` (ops only)
    gives a module with no functions. The library resolves libtorch's symbols from this
    process, which imported torch to compute the key.

    pybind11 keeps one module object per full module name in a process (a second library
    of that name would add its functions to the first's module), so the module's full name
    holds the key: ``_vitrail_ext_<key>.<name>``; its ``__name__`` is name, as torch's."""
    try:
        library = ctypes.CDLL(str(path))
    except OSError as e:
        raise ImportError(f"extension '{name}': loading {path} failed: {e}") from None
    if not hasattr(library, f"PyInit_{name}"):
        module = types.ModuleType(name, f"torch extension {name} (ops only: torch.ops)")
        module.__file__ = str(path)
        return module
    module = load_extension(f"_vitrail_ext_{key[:16]}.{name}", path)
    module.__name__ = name
    return module


def _build(name: str, units: list[_Unit], options: _Options):
    cache = KernelCache()
    key, plan = _key(name, units, options, cache)
    shown = {u.file: u.shown for u in units if u.shown}
    return cached_build(key, name, "torch", lambda build: _compile(build, name, units, options,
                                                                   plan), sources=shown)


def _key(name: str, units: list[_Unit], options: _Options, cache: KernelCache):
    """(key, what the build needs to know): everything the library depends on, found without
    running a compiler where its identity is remembered."""
    plan = _plan(options, any(u.is_cuda for u in units), cache)
    arch = plan["arch"]
    nvcc = ""
    if options.with_cuda or any(u.is_cuda for u in units):  # CUDA's headers, libraries
        nvcc = toolchain.nvcc_path()
    dirs = list(options.include_dirs)
    headers = [header_closure(u.text, ([u.dir] if u.dir else []) + dirs) for u in units]
    key = make_key(
        layout=LAYOUT, vitrail=__version__, backend="torch", name=name,
        units=[(u.file, u.text) for u in units], headers=headers, cflags=options.cflags,
        cuda_cflags=options.cuda_cflags, ldflags=options.ldflags, with_cuda=options.with_cuda,
        arch=arch.name if arch else None, defaults=(_CXX_FLAGS, _NVCC_FLAGS, _STD),
        torch=_torch_id(), python=_python_id(), cxx=plan["cxx_id"],
        nvcc=_tool_id(nvcc, cache) if nvcc else "",
        nvcc_host=_tool_id(toolchain.host_cxx(), cache) if nvcc else "")
    return key, plan


def _plan(options: _Options, has_cuda: bool, cache: KernelCache) -> dict:
    """The host compiler (path, --version), the arch of .cu units, torch's folder, the cache."""
    import torch
    cxx = _which(os.environ.get("CXX") or toolchain.host_cxx(), "CXX")
    arch = None
    if has_cuda and not any(f.split("=")[0] in _ARCH_FLAGS for f in options.cuda_cflags):
        arch = toolchain.target_arch()
    return {"cxx": cxx, "cxx_id": _tool_id(cxx, cache), "arch": arch,
            "torch": os.path.dirname(torch.__file__), "cache": cache}


def _torch_id() -> tuple:
    import torch
    return (torch.__version__, torch.version.git_version, torch.version.cuda,
            int(torch._C._GLIBCXX_USE_CXX11_ABI))


def _python_id() -> tuple:
    return sys.implementation.cache_tag, sysconfig.get_config_var("SOABI")


def _which(tool: str, what: str) -> str:
    found = shutil.which(tool)
    if found is None:
        raise toolchain.ToolchainError(f"{what}={tool}: no such compiler on PATH")
    return found


def _tool_id(tool: str, cache: KernelCache) -> str:
    """``tool --version``, remembered per binary (toolchain.remembered): a warm load runs no
    compiler."""
    return toolchain.remembered([tool, "--version"], tool,
                                lambda: toolchain.version_output(tool).strip(), cache)


def _system_dirs(plan: dict, cuda: bool):
    """(torch's, Python's and, with cuda, CUDA's include directories; the nvcc or None)."""
    torch_dir = plan["torch"]
    system = [f"{torch_dir}/include", f"{torch_dir}/include/torch/csrc/api/include",
              sysconfig.get_paths()["include"]]
    nvcc = None
    if cuda:
        nvcc = toolchain.nvcc()
        system += [d for d in nvcc.include_dirs if d != "/usr/include"]
    return system, nvcc


def _defines() -> list[str]:
    """The defines of every unit but TORCH_EXTENSION_NAME."""
    import torch
    return ["-DTORCH_API_INCLUDE_EXTENSION_H",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


def _host_flags(options: _Options) -> list[str]:
    std = [] if any(f.startswith("-std") for f in options.cflags) else [_STD]
    return [*_CXX_FLAGS, *std, *options.cflags]


def _pch_spec(options: _Options, plan: dict, system: list[str], user_dirs: list[str]):
    """(the PCH the host units may use, None) or (None, why they may not): vitrail.jit.pch."""
    if not knobs.TORCH_PCH.get():
        return None, "VITRAIL_TORCH_PCH=0"
    why = pch.refusal(plan["cxx_id"], options.cflags, [*user_dirs, *options.include_dirs],
                      system)
    if why:
        return None, why
    torch_dir, python = plan["torch"], sysconfig.get_paths()["include"]
    flags = [*_defines(), *(a for d in system for a in ("-isystem", d)), *_host_flags(options)]
    stamps = [f"{torch_dir}/include/{h}" for h in (
        "torch/extension.h", "torch/csrc/api/include/torch/all.h", "ATen/ATen.h",
        "ATen/Functions.h", "c10/macros/cmake_macros.h", "pybind11/pybind11.h")]
    stamps += [f"{python}/Python.h", f"{python}/patchlevel.h"]
    return pch.spec(plan["cxx"], flags, stamps, cxx_id=plan["cxx_id"], torch=_torch_id(),
                    python=_python_id()), None


def _compile(build: Path, name: str, units: list[_Unit], options: _Options, plan: dict) -> dict:
    """Every unit compiled by its own process at once (the .cpp ones that start with torch's
    header against its PCH where there is one), then one link; the build's meta."""
    start = time.time()
    torch_dir = plan["torch"]
    system, nvcc = _system_dirs(plan, options.with_cuda or any(u.is_cuda for u in units))
    cuda_home = nvcc.cuda_home if nvcc else ""
    common = [f"-DTORCH_EXTENSION_NAME={name}", *_defines()]
    commands = []
    for u in units:
        (build / u.file).write_text(u.text)
        own = ([f"-I{u.dir}"] if u.is_cuda else ["-iquote", u.dir]) if u.dir else []
        includes = [*own, *(f"-I{d}" for d in options.include_dirs),
                    *(a for d in system for a in ("-isystem", d))]
        obj = f"{u.file}.o"
        if u.is_cuda:
            arch = []
            if plan["arch"]:
                nvcc.check_arch(plan["arch"])
                arch = [f"-gencode=arch={plan['arch'].compute},code={plan['arch'].sm}"]
            std = [] if any(f.startswith(("-std", "--std")) for f in options.cuda_cflags) \
                else [_STD]
            cmd = [nvcc.path, "-c", str(build / u.file), "-o", obj, *common, *includes,
                   *_NVCC_FLAGS, *arch, *std, *options.cuda_cflags]
        else:
            cmd = [plan["cxx"], "-c", str(build / u.file), "-o", obj, *common, *includes,
                   *_host_flags(options)]
        commands.append((u, cmd))
    jobs = sum(2 if u.is_cuda else 1 for u in units)  # nvcc: two chains at once
    header, later, checked = _header(units, options, plan, system, jobs)
    if options.verbose:
        for u, cmd in commands:
            print("$", shlex.join(pch.command(cmd, header) if _uses(u, header) else cmd))

    def run(item):
        u, cmd = item
        run_one = run_nvcc if u.is_cuda else run_compiler
        try:
            if _uses(u, header):
                with_pch = pch.command(cmd, header)
                try:
                    out = run_one(with_pch, build, shlex.join(with_pch))
                except BuildFailed as failed:
                    # a PCH that fails its checksum is to blame whatever gcc says: bytes of a
                    # corrupt one can read as nonsense errors in the unit (a macro "requires
                    # 17856 arguments") that name no PCH
                    if pch.failed_on_it(failed.log) or not checked.result():
                        log.debug("vitrail: %s: the compile with the precompiled header %s "
                                  "failed on it; compiling without it", u.file, header.dir)
                    else:
                        raise
                else:
                    if checked.result():
                        if pch.refused(out):
                            log.debug("vitrail: %s: gcc did not use the precompiled header %s: "
                                      "%s", u.file, header.dir, pch.refused(out))
                        return (out, with_pch, True), None
                    log.debug("vitrail: %s: the precompiled header %s failed its checksum; "
                              "compiling without it", u.file, header.dir)
            return (run_one(cmd, build, shlex.join(cmd)), cmd, False), None
        except BuildFailed as failed:
            failed.tool = "nvcc" if u.is_cuda else os.path.basename(cmd[0])
            return None, failed

    workers = max(1, min(len(commands), os.cpu_count() or 1))
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="vitrail-ext") as pool:
            results = list(pool.map(run, commands))
    finally:
        if later is not None:  # no core was free for it during the build: now
            pch.build_in_background(later, plan["cache"])
    if header is not None and not checked.result():
        pch.discard(header, plan["cache"])  # the next build starts a new one
    failures = [f for _, f in results if f is not None]
    if failures:
        raise failures[0]
    lib = f"{torch_dir}/lib"
    has = lambda n: os.path.exists(f"{lib}/lib{n}.so")  # noqa: E731  (CPU torch: no torch_cuda)
    libs = ["c10", "c10_cuda", "torch_cpu", "torch_cuda", "torch", "torch_python"]
    link = [plan["cxx"], "-shared", *(f"{u.file}.o" for u in units), "-o", "kernel.so", f"-L{lib}",
            *(f"-l{n}" for n in libs if has(n))]
    if cuda_home:
        cudart = next((d for d in (f"{cuda_home}/lib64", f"{cuda_home}/lib",
                                   *map(str, Path(cuda_home).glob("targets/*/lib")))
                       if os.path.exists(f"{d}/libcudart.so")), f"{cuda_home}/lib64")
        link += [f"-L{cudart}", "-lcudart", f"-Wl,-rpath,{cudart}"]
    link += list(options.ldflags)
    if options.verbose:
        print("$", shlex.join(link))
    try:
        out = run_compiler(link, build, shlex.join(link))
    except BuildFailed as failed:
        failed.tool = "the linker"
        raise
    logs = [f"$ {shlex.join(cmd)}\n{text}" for (text, cmd, _), _ in results]
    logs.append(f"$ {shlex.join(link)}\n{out}")
    (build / "build.log").write_text("".join(logs))
    if options.verbose:
        print("".join(logs))
    for u in units:
        (build / f"{u.file}.o").unlink(missing_ok=True)
    return {"name": name, "backend": "torch", "arch": plan["arch"].sm if plan["arch"] else "host",
            "artifact": "kernel.so", "compile_seconds": round(time.time() - start, 3),
            "created": time.time(), "command": shlex.join(link),
            "compiler": nvcc.version_text if nvcc else "",
            "vitrail": __version__, "source": [u.file for u in units],
            "torch": _torch_id()[0], "resources": {},
            "pch": header.key if header is not None else None,
            "pch_units": [u.file for u, ((_, _, used), _) in zip(units, results) if used]}


def _uses(u: _Unit, header) -> bool:
    return header is not None and not u.is_cuda and pch.applies(u.text)


def _header(units: list[_Unit], options: _Options, plan: dict, system: list[str], jobs: int):
    """(the PCH entry that units starting with torch's header use, or None; a PCH to build in
    the background after this build, or None; the future of the entry's checksum). A missing
    PCH is built in the background at once where cores are plenty beside this build's jobs
    (three to spare), else once they are done: on two cores, two gcc at once take 1.5 times as
    long each (a cold build beside the PCH's took 40 s instead of 26 s)."""
    hosts = [u for u in units if not u.is_cuda and pch.applies(u.text)]
    if not hosts:
        return None, None, None
    spec, why = _pch_spec(options, plan, system, [u.dir for u in hosts if u.dir])
    if spec is None:
        log.debug("vitrail: no precompiled header of torch/extension.h: %s", why)
        return None, None, None
    entry = pch.find(spec, plan["cache"])
    if entry is None:
        if (os.cpu_count() or 1) >= jobs + 3:
            pch.build_in_background(spec, plan["cache"])
            return None, None, None
        return None, spec, None
    checker = ThreadPoolExecutor(1, thread_name_prefix="vitrail-pch")
    checked = checker.submit(pch.verify, entry)
    checker.shutdown(wait=False)
    return entry, None, checked
