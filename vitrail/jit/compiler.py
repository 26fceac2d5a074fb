"""Building: the cache key, the compile and its atomic publish, for two backends. Nothing here
loads what it builds (vitrail.jit.loading does: ``vitrail.jit.compile``), nor imports torch, so
compile processes (vitrail.tune.compile_job) and machines without a GPU build with it.

- ``backend="nvcc"`` builds a shared library. Its ``extern "C"`` entry points may hold host code
  (CUTLASS device adapters, TMA descriptors) and are called from Python as ``module.launch_add(...)``.
- ``backend="nvrtc"`` builds a cubin for device-only kernels, loaded through the driver API and
  launched as ``module.kernel(name)[grid, block](...)`` (or through :class:`RawKernel`).

A build computes the cache key (source + included headers + toolchain + options), then finds
the artifact on disk (or in a shared cache) or compiles it under the key's lock.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Callable, Mapping, Sequence

from vitrail import __version__, knobs
from vitrail.jit import shared, toolchain
from vitrail.jit.cache import (LAYOUT, META, Entry, KernelCache, dir_size, header_closure,
                                make_key, safe_name)
from vitrail.jit.errors import CacheError, CompileError, ToolchainError
from vitrail.jit.index import Index
from vitrail.jit.ptxas import parse_ptxas

log = logging.getLogger("vitrail.jit")
BACKENDS = ("nvcc", "nvrtc")


def build(source: str, *, name: str, backend: str = "nvcc", arch: str | None = None,
          flags: Sequence[str] = (), include_dirs: Sequence[str | os.PathLike] = (),
          defines: Mapping[str, object] | None = None, kernels: Sequence[str] = ()) -> str:
    """What :func:`vitrail.jit.compile` does short of loading: the artifact is in the cache
    afterwards. Returns "disk" (it was), "shared" (copied from VITRAIL_SHARED_CACHE) or
    "compiled". Imports no torch and touches no GPU, for compile processes and machines without
    one."""
    return build_entry(source, name=name, backend=backend, arch=arch, flags=flags,
                       include_dirs=include_dirs, defines=defines, kernels=kernels)[1]


def build_entry(source: str, *, name: str, backend: str = "nvcc",
                arch: str | toolchain.Arch | None = None, flags: Sequence[str] = (),
                include_dirs: Sequence[str | os.PathLike] = (),
                defines: Mapping[str, object] | None = None,
                kernels: Sequence[str] = ()) -> tuple[Entry, str]:
    """(the cache entry, how) of what :func:`build` builds; the loaders (vitrail.jit.loading,
    vitrail.jit.launcher) load ``entry.artifact``."""
    target = (arch if isinstance(arch, toolchain.Arch) else
              toolchain.Arch.parse(arch) if arch is not None else toolchain.target_arch())
    return _build(source, name, backend, target, list(flags), list(include_dirs), defines or {},
                  list(kernels))


def is_built(source: str, *, name: str, backend: str = "nvcc", arch: str | None = None,
             flags: Sequence[str] = (), include_dirs: Sequence[str | os.PathLike] = (),
             defines: Mapping[str, object] | None = None, kernels: Sequence[str] = ()) -> bool:
    """Whether the kernel :func:`compile` would return is in the cache already (checked by key
    and checksum; nothing is built, loaded or locked)."""
    target = toolchain.Arch.parse(arch) if arch is not None else toolchain.target_arch()
    if knobs.FORCE_RECOMPILE.get():
        return False
    key = _key(source, name, backend, target, list(flags), list(include_dirs), defines or {},
               list(kernels))[0]
    return KernelCache().lookup(key, read_artifact=backend == "nvrtc") is not None


def _key(source: str, name: str, backend: str, arch: toolchain.Arch, flags: list[str],
         include_dirs: list, defines: Mapping[str, object], kernels: list[str]):
    """(cache key, the tool, include dirs, -D flags): everything a build depends on."""
    _check_inputs(source, name, backend, flags, include_dirs, defines, kernels)
    if backend == "nvcc":  # every toolchain check happens before anything is written
        tool = toolchain.nvcc()
        tool_id = {"compiler": f"nvcc {tool.version_text}", "host": tool.host_compiler}
    else:
        tool = toolchain.nvrtc()
        tool_id = {"compiler": f"nvrtc {tool.version_text}"}
    tool.check_arch(arch)
    dirs = [str(Path(d).resolve()) for d in include_dirs] + _standard_include_dirs()
    define_flags = [f"-D{k}" if v is None else f"-D{k}={_define(v)}" for k, v in defines.items()]
    key = make_key(layout=LAYOUT, vitrail=__version__, backend=backend, arch=arch.name,
                   flags=flags, defines=sorted(define_flags), name=name, kernels=kernels, source=source,
                   headers=header_closure(source, dirs), **tool_id)
    return key, tool, dirs, define_flags


def _build(source: str, name: str, backend: str, arch: toolchain.Arch, flags: list[str],
           include_dirs: list, defines: Mapping[str, object], kernels: list[str]):
    key, tool, dirs, define_flags = _key(source, name, backend, arch, flags, include_dirs,
                                         defines, kernels)
    builder = _build_nvcc if backend == "nvcc" else _build_nvrtc
    return cached_build(key, name, backend, lambda build: builder(
        build, source, name, arch, flags, dirs, define_flags, kernels, tool),
        read_artifact=backend == "nvrtc")


def cached_build(key: str, name: str, backend: str, builder: Callable[[Path], dict], *,
                 read_artifact: bool = False, sources: Mapping[str, str] | None = None):
    """(entry, how) of key: from this user's cache ("disk"), else from a shared cache
    ("shared"), else built by ``builder(build dir) -> meta`` under key's lock and published
    ("compiled"). A builder reports a failed step by raising :class:`BuildFailed`; the build is
    saved and a CompileError names its first errors (sources: a file of the build -> the path
    to show for it, where it is the user's own file)."""
    cache = KernelCache()
    index = Index(cache)
    force = knobs.FORCE_RECOMPILE.get()
    entry = None if force else cache.lookup(key, read_artifact=read_artifact)
    how = "disk"
    if entry is None:
        with cache.lock(key, name):
            entry = None if force else cache.lookup(key, read_artifact=read_artifact)
            if entry is None and not force:
                entry = _from_shared(cache, key, read_artifact)
                how = "disk" if entry is None else "shared"
            if entry is None:
                build = cache.new_build_dir(key)
                _announce(index, name, backend)
                try:
                    meta = builder(build)
                    entry = cache.publish(key, build, meta, read_artifact=read_artifact)
                except BuildFailed as failed:
                    if not build.is_dir():  # the failure's cause, not the compiler's errors
                        raise CacheError(
                            f"vitrail: the build directory of '{name}' ({build}) was removed "
                            f"while {failed.tool or backend} ran: was the cache at {cache.root} "
                            f"cleared or deleted meanwhile?") from None
                    (build / "build.log").write_text(f"$ {failed.command}\n{failed.log}")
                    saved = cache.save_failure(name, key, build)
                    raise CompileError(name, failed.tool or backend,
                                       _first_errors(failed.log, build, saved, sources),
                                       failed.command.replace(str(build), str(saved)), str(saved),
                                       failed.log) from None
                finally:
                    shutil.rmtree(build, ignore_errors=True)
                how = "compiled"
                log.info("vitrail: compiled '%s' (%s, %s) in %.1f s", name, backend,
                         entry.meta.get("arch"), entry.meta["compile_seconds"])
    if how != "disk":
        index.record(key, entry.meta, dir_size(entry.dir))
    else:
        index.touch(entry.dir)
    return entry, how


def _announce(index: Index, name: str, backend: str) -> None:
    """One line before a build that keeps the call waiting: what, and about how long its kind's
    last builds took here (none where they took under ANNOUNCE_SECONDS, or for an NVRTC kernel
    this cache has no time for: those take about a second)."""
    typical = index.typical_seconds(name, backend)
    if typical is None and backend == "nvrtc" or typical is not None and typical < ANNOUNCE_SECONDS:
        return
    about = f", about {typical:.0f} s as before here" if typical else ""
    log.warning("vitrail: compiling '%s' (%s) for its first use%s; later calls and processes "
                "load it from the cache", name, backend, about)


ANNOUNCE_SECONDS = 5.0


def _from_shared(cache: KernelCache, key: str, is_cubin: bool):
    """key's entry from a shared read-only cache (VITRAIL_SHARED_CACHE), published as a private
    copy in this user's cache (what loads: vitrail.jit.shared says why), or None. Call it
    holding the key's lock."""
    found = shared.find(key)
    if found is None:
        return None
    meta, files = found
    build = cache.new_build_dir(key)
    try:
        for name, data in files.items():
            if name != META:
                (build / name).write_bytes(data)
        meta = {k: v for k, v in meta.items() if k not in ("key", "sha256", "size")}
        entry = cache.publish(key, build, meta, read_artifact=is_cubin)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    log.info("vitrail: '%s' from the shared cache", meta.get("name"))
    return entry


def _check_inputs(source, name, backend, flags, include_dirs, defines, kernels) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
    if not isinstance(source, str) or not source.strip():
        raise ValueError("source: expected the CUDA C++ source text, got an empty or non-str value")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name={name!r}: expected a non-empty name for the kernel")
    for f in flags:
        if not isinstance(f, str):
            raise TypeError(f"flags: expected strings, got {f!r}")
    for d in include_dirs:
        if not Path(d).is_dir():
            raise ValueError(f"include_dirs: {d} is not a directory")
    for k in defines:
        if not isinstance(k, str) or not re.fullmatch(r"[A-Za-z_]\w*", k):
            raise ValueError(f"defines: {k!r} is not a macro name")
    if kernels and backend != "nvrtc":
        raise ValueError("kernels= names templated kernels to instantiate with NVRTC; with nvcc, "
                         "instantiate them in the source")


def _define(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _standard_include_dirs() -> list[str]:
    dirs = [str(toolchain.VITRAIL_INCLUDE)]
    try:
        found = toolchain.cutlass()
        dirs.append(found.include_dir)
        if found.util_include_dir is not None:  # cutlass/util/packed_stride.hpp (conv)
            dirs.append(found.util_include_dir)
    except ToolchainError as e:  # only a source that includes CUTLASS needs it; say so if it fails
        log.debug("vitrail: no CUTLASS headers on the include path: %s", e)
    return dirs + toolchain.cuda_include_dirs()


def _die_with_parent() -> None:
    """In the compiler's process: be killed when vitrail's process dies (Linux), so a killed
    build leaves no orphaned nvcc behind."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class BuildFailed(Exception):
    def __init__(self, log_text: str, command: str, tool: str = ""):
        self.log, self.command, self.tool = log_text, command, tool


# ---------------------------------------------------------------------------------------- nvcc
_NVCC_DEFAULTS = {"-std": "-std=c++17", "-O": "-O3"}


def _build_nvcc(build: Path, source: str, name: str, arch: toolchain.Arch, flags: list[str],
                dirs: list[str], defines: list[str], kernels: list[str],
                tool: toolchain.Nvcc) -> dict:
    src = build / f"{safe_name(name)}.cu"
    src.write_text(source)
    keep = build / "keep"
    keep.mkdir()
    defaults = [v for k, v in _NVCC_DEFAULTS.items() if not any(f.startswith(k) for f in flags)]
    cmd = [tool.path, "-shared", "-Xcompiler=-fPIC", *defaults, "-DNDEBUG",
           "--expt-relaxed-constexpr", f"-gencode=arch={arch.compute},code={arch.sm}",
           "-Xptxas=-v", "-lineinfo", "-keep", f"-keep-dir={keep}",
           *(f"-I{d}" for d in dirs), *defines, *flags, "-o", str(build / "kernel.so"), str(src)]
    command = shlex.join(cmd)
    start = time.time()
    out = run_nvcc(cmd, build, command)
    (build / "build.log").write_text(f"$ {command}\n{out}")
    ptx = keep / f"{src.stem}.ptx"
    if ptx.is_file():
        os.replace(ptx, build / "kernel.ptx")
    shutil.rmtree(keep, ignore_errors=True)
    return _meta(name, "nvcc", arch, "kernel.so", start, command, out, tool.version_text,
                 source=src.name)


def run_nvcc(cmd: list[str], build: Path, command: str) -> str:
    """nvcc's work, with its device chain (preprocess, cicc, ptxas, fatbinary) run beside its
    host front end (preprocess, cudafe++), which nvcc runs one after the other: the two take
    about as long each for a CUTLASS kernel, so a cold build takes about two thirds of the time
    (59 s -> 38 s on two cores). The phases are nvcc's own (``nvcc --dryrun``); cicc computes
    the module id itself (cudafe++ writes it for cicc otherwise) and the two ids must agree.
    Anything unexpected (several targets, ids that differ) runs nvcc as is, and so does an nvcc
    named by VITRAIL_NVCC (it may be a wrapper whose work is more than nvcc's phases)."""
    if knobs.NVCC.get():
        return run_compiler(cmd, build, command)
    phases = _nvcc_phases(run_compiler([*cmd, "--dryrun"], build, command))
    if phases is None:
        return run_compiler(cmd, build, command)
    env, first, host, device, rest, ids = phases
    from concurrent.futures import ThreadPoolExecutor
    out = _run_script(env, first, build, command) if first else ""
    with ThreadPoolExecutor(2, thread_name_prefix="vitrail-nvcc") as pool:
        parts = list(pool.map(lambda chain: _run_script(env, chain, build, command),
                              (host, device)))
    host_id, device_id = (Path(p).read_text() if Path(p).is_file() else None for p in ids)
    if host_id is None or host_id != device_id:
        return run_compiler(cmd, build, command)
    return out + "".join(parts) + _run_script(env, rest, build, command)


def _nvcc_phases(dryrun: str):
    """(environment lines, commands before, host chain, device chain, commands after, (host
    module id file, device module id file)) from ``nvcc --dryrun``; None if its shape is not
    the one-target build this expects."""
    env, commands = [], []
    for line in dryrun.splitlines():
        if not line.startswith("#$ "):
            continue
        line = line[3:].strip()
        name, eq, value = line.partition("=")
        if eq and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            try:
                if len(shlex.split(value)) <= 1:  # INCLUDES="-I.." "-I..": unused, skipped
                    env.append(f"export {line}")
            except ValueError:
                return None
            continue
        commands.append("rm -f " + line[3:] if line.startswith("rm ") else line)  # as nvcc: a
        # file that is not there is no error

    def tool(c: str) -> str:
        return os.path.basename(shlex.split(c)[0].replace('"$CICC_PATH"', "cicc"))
    try:
        tools = [tool(c) for c in commands]
    except ValueError:
        return None
    if tools.count("cudafe++") != 1 or tools.count("cicc") != 1 or tools.count("ptxas") != 1:
        return None
    fe, cc = tools.index("cudafe++"), tools.index("cicc")
    px = tools.index("ptxas")
    fb = next((i for i in range(px, len(tools)) if tools[i] == "fatbinary"), None)
    pre_host, pre_device = fe - 1, cc - 1
    if (fb is None or not pre_host < fe < pre_device < cc < px < fb
            or "-E" not in shlex.split(commands[pre_host])
            or "-E" not in shlex.split(commands[pre_device])):
        return None
    cicc = commands[cc]
    found = re.search(r'--module_id_file_name ("[^"]+"|\S+)', cicc)
    if not found or "--gen_module_id_file" in cicc:
        return None
    host_ids = found.group(1).strip('"')
    device_ids = host_ids + ".device"
    commands[cc] = cicc.replace(found.group(0), f'--gen_module_id_file --module_id_file_name '
                                                f'"{device_ids}"')
    return (env, commands[:pre_host], commands[pre_host:fe + 1], commands[pre_device:fb + 1],
            commands[fb + 1:], (host_ids, device_ids))


def _run_script(env: list[str], commands: list[str], build: Path, command: str) -> str:
    return run_compiler(["bash", "-ec", "\n".join(env + commands)], build, command)


def _text(raw: bytes) -> str:
    return raw.decode(errors="replace").replace("\r\n", "\n")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone, with its group
        os.killpg(pid, signal.SIGKILL)


def run_compiler(cmd: list[str], build: Path, command: str) -> str:
    timeout = knobs.COMPILE_TIMEOUT.get()
    # bytes, decoded here: a compiler's output need not be UTF-8 (gcc reading a damaged
    # precompiled header printed raw bytes)
    proc = subprocess.Popen(cmd, cwd=build, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=_die_with_parent)
    try:
        raw, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        raw, _ = proc.communicate()
        raise BuildFailed(f"{_text(raw)}\nerror: killed after VITRAIL_COMPILE_TIMEOUT="
                          f"{timeout:.0f} s", command) from None
    except BaseException:  # KeyboardInterrupt: take the compiler down with us
        _kill_group(proc.pid)
        raise
    out = _text(raw)
    if proc.returncode != 0:
        raise BuildFailed(out, command)
    return out


# --------------------------------------------------------------------------------------- NVRTC
def _build_nvrtc(build: Path, source: str, name: str, arch: toolchain.Arch, flags: list[str],
                 dirs: list[str], defines: list[str], kernels: list[str],
                 tool: toolchain.Nvrtc) -> dict:
    src_name = f"{safe_name(name)}.cu"
    (build / src_name).write_text(source)
    opts = nvrtc_options(arch.sm, flags, dirs, defines)
    command = "nvrtc " + shlex.join(opts)
    start = time.time()
    cubin, out, lowered = nvrtc_compile(source, src_name, opts, kernels, command, "CUBIN")
    probe = ""
    if "Compiling entry function" not in out:  # (kernels may come from included headers)
        # NVRTC goes through the driver's compute cache (~/.nv/ComputeCache), keyed by what
        # reaches ptxas: on a hit, ptxas does not run and prints no resource report. Compile
        # once more with an empty, uniquely named kernel added, which the cache has not seen,
        # for the report; the cubin stays the first one, and the probe leaves the report.
        probe = f"vitrail_resource_probe_{uuid.uuid4().hex}"
        probed = f'{source}\nextern "C" __global__ void {probe}() {{}}\n'
        out = nvrtc_compile(probed, src_name, opts, kernels, command, "CUBIN")[1]
    (build / "kernel.cubin").write_bytes(cubin)
    (build / "build.log").write_text(f"$ {command}\n{out}")
    meta = _meta(name, "nvrtc", arch, "kernel.cubin", start, command, out, tool.version_text,
                 source=src_name)
    meta["resources"].pop(probe, None)
    return {**meta, "lowered": lowered, "options": opts}


def nvrtc_options(target: str, flags: list[str], dirs: list[str], defines: list[str]) -> list[str]:
    std = [] if any(f.startswith("-std") or f.startswith("--std") for f in flags) else ["-std=c++17"]
    return [f"-arch={target}", *std, "-DNDEBUG", "-Xptxas=-v", "-lineinfo",
            *(f"-I{d}" for d in dirs), *defines, *flags]


def nvrtc_compile(source: str, src_name: str, opts: list[str], kernels: list[str],
                  command: str, output: str) -> tuple[bytes, str, dict[str, str]]:
    """Compile with NVRTC; returns (CUBIN or PTX bytes, log, lowered names of ``kernels``)."""
    from cuda.bindings import nvrtc
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), src_name.encode(), 0, [], [])
    _nvrtc_check(err, "nvrtcCreateProgram")
    try:
        for k in kernels:
            _nvrtc_check(nvrtc.nvrtcAddNameExpression(prog, k.encode())[0], "add name " + k)
        encoded = [o.encode() for o in opts]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        # Output buffers are bytearrays: NVRTC writes into them, and a one-byte bytes object
        # would be CPython's shared b" " (an empty log has size 1).
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        buf = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, buf)
        out = bytes(buf).rstrip(b"\x00 ").decode(errors="replace")
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise BuildFailed(out or str(result), command)
        get_size = getattr(nvrtc, f"nvrtcGet{output}Size")
        err, size = get_size(prog)
        _nvrtc_check(err, f"nvrtcGet{output}Size")
        data = bytearray(size)
        _nvrtc_check(getattr(nvrtc, f"nvrtcGet{output}")(prog, data)[0], f"nvrtcGet{output}")
        lowered = {}
        for k in kernels:
            err, low = nvrtc.nvrtcGetLoweredName(prog, k.encode())
            _nvrtc_check(err, "nvrtcGetLoweredName " + k)
            lowered[k] = low.decode()
        return bytes(data), out, lowered
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _nvrtc_check(err, what: str) -> None:
    from cuda.bindings import nvrtc
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise ToolchainError(f"NVRTC {what} failed: {err}")


# -------------------------------------------------------------------------------------- shared
def _meta(name: str, backend: str, arch: toolchain.Arch, artifact: str, start: float,
          command: str, out: str, compiler: str, source: str) -> dict:
    return {"name": name, "backend": backend, "arch": arch.sm, "artifact": artifact,
            "compile_seconds": round(time.time() - start, 3), "created": time.time(),
            "command": command, "compiler": compiler, "vitrail": __version__, "source": source,
            "resources": parse_ptxas(out)}


_ERROR_LINE = re.compile(r"(error|catastrophic|fatal)\b", re.I)


_AT_LINE = re.compile(r'at line (\d+) of "?([^"\s]+?)"?\s*$')


_SOURCE_SUFFIXES = (".cu", ".cpp", ".cc", ".cxx", ".c++", ".C")


def _first_errors(out: str, build: Path, saved: Path, shown: Mapping[str, str] | None = None,
                  limit: int = 10) -> list[str]:
    """The compiler's first error lines, with paths pointing at the saved copy of the source
    (or, for a file in ``shown``, at the path shown for it: the user's own file). An error
    inside a header (CuTe, CUTLASS) that an instantiation in the user's own file led to is
    shown at that line of the user's file first (the outermost such line nvcc names), and such
    errors come before the others."""
    sources = {p.name for p in saved.iterdir() if p.suffix in _SOURCE_SUFFIXES}
    shown = shown or {}
    blocks: list[list] = []  # [error line, the user's line that led to it or None]
    for line in out.splitlines():
        if line.startswith("$ "):
            continue
        if _ERROR_LINE.search(line) and not line[:1].isspace():
            blocks.append([line.strip(), None])
        elif blocks and line[:1].isspace():
            found = _AT_LINE.search(line)
            if found and Path(found.group(2)).name in sources:
                blocks[-1][1] = (Path(found.group(2)).name, found.group(1))
    lines = []
    for text, mine in sorted(blocks, key=lambda b: b[1] is None):  # stable: yours first
        for file, path in shown.items():
            text = text.replace(f"{build}/{file}", path)
        text = text.replace(str(build), str(saved))
        if re.match(r"[\w.-]+\.cu[(:]", text):  # NVRTC names the file without a directory
            text = f"{saved}/{text}"
        if mine is not None and not text.startswith(f"{saved}/{mine[0]}"):
            where = shown.get(mine[0], f"{saved}/{mine[0]}")
            if not text.startswith(where):
                text = f"{where}({mine[1]}): from your code: {text}"
        lines.append(text)
        if len(lines) >= limit:
            break
    return lines
