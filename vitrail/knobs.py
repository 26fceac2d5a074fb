"""Every ``VITRAIL_*`` environment variable, typed and documented, read in one place.

Nothing else in vitrail reads ``os.environ`` for a ``VITRAIL_*`` name: add a knob here, with its
documentation, and read it as ``knobs.NAME.get()``. Values are read at the moment of the call (so a
test or a user may change the environment between calls), except the tuning settings, which an op
call needs: read once per process (vitrail.tune.settings); keep reads off per-launch paths.
``vitrail doctor`` prints those set; docs/knobs.md holds their table (tests/test_cli.py checks it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def _float(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None


def _str(name: str, raw: str) -> str:
    return raw


@dataclass(frozen=True)
class Knob(Generic[T]):
    name: str
    default: T
    parse: Callable[[str, str], T]
    doc: str

    def get(self) -> T:
        return self.value(os.environ.get(self.name))

    def value(self, raw: str | None) -> T:
        """The knob's value for the variable's text ``raw`` (None: unset)."""
        if raw is None or (raw == "" and self.parse is not _bool):
            return self.default
        return self.parse(self.name, raw)

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name))

    def set(self, raw: str) -> None:
        """Set it for this process and the processes it starts (the compilers, the tuner's
        workers): what a command line does where the user gave no value."""
        self.parse(self.name, raw)  # a bad value fails here, not at the next read
        os.environ[self.name] = raw


ALL: list[Knob] = []


def _knob(name: str, default: T, parse: Callable[[str, str], T], doc: str) -> Knob[T]:
    knob = Knob(name, default, parse, doc)
    ALL.append(knob)
    return knob


CACHE_DIR = _knob(
    "VITRAIL_CACHE_DIR", "", _str,
    "Kernel cache directory. Default: $XDG_CACHE_HOME/vitrail, else ~/.cache/vitrail. "
    "Created with mode 0700; never the working directory.")
SHARED_CACHE = _knob(
    "VITRAIL_SHARED_CACHE", "", _str,
    "Read-only kernel caches shared by a team or an administrator, DIR[:DIR...] (each built as "
    "VITRAIL_CACHE_DIR=DIR vitrail precompile, then made read-only), consulted after a miss of "
    "your own cache and before compiling; never written. An artifact loads only where root, you "
    "or VITRAIL_SHARED_CACHE_OWNERS own it and every directory down to it, none writable by "
    "group or others (checked on the open files); a shared library loads from a private copy in "
    "your cache. DIR/tuning.sqlite and DIR/tuning.json (an export), if there, are read after your "
    "tuning store. Packages' layers (entry points vitrail.caches) are searched after these.")
SHARED_CACHE_OWNERS = _knob(
    "VITRAIL_SHARED_CACHE_OWNERS", "", _str,
    "Users trusted to own VITRAIL_SHARED_CACHE's files besides root and you: uids or user names, "
    "separated by commas or spaces (e.g. the account that builds a team's cache).")
NVCC = _knob(
    "VITRAIL_NVCC", "", _str,
    "Path of the nvcc to use. Default: $CUDA_HOME/bin/nvcc, then nvcc on PATH, then "
    "/usr/local/cuda/bin/nvcc. The default nvcc's phases run as two chains at once (device "
    "code beside the host front end); an nvcc named here runs as given, as a wrapper expects.")
NVRTC = _knob(
    "VITRAIL_NVRTC", "", _str,
    "Path of the NVRTC library (libnvrtc.so.13) to compile with, or the folder holding it; read "
    "once, at the process's first NVRTC compile, and refused where the process loaded another "
    "NVRTC first (a CUDA build of torch does). Default: the toolkit's beside nvcc, else the "
    "nvidia-cuda-nvrtc wheel's.")
ARCH = _knob(
    "VITRAIL_ARCH", "", _str,
    "Target GPU architecture, e.g. 90a, sm_90a or 9.0. Default: the current GPU "
    "(sm_90a on Hopper), else TORCH_CUDA_ARCH_LIST. Set it to build on a machine with no GPU.")
TORCH_PCH = _knob(
    "VITRAIL_TORCH_PCH", True, _bool,
    "1: the C++ files of torch extensions (load_inline, load) whose first include is "
    "torch/extension.h or torch/torch.h compile against a precompiled header of it, kept in the "
    "cache per torch, gcc and flags (about 0.8 GB each) and built once, in the background, the "
    "first time one is missing. 0: they parse torch's headers each time.")
FORCE_RECOMPILE = _knob(
    "VITRAIL_FORCE_RECOMPILE", False, _bool,
    "1: ignore cached kernels on disk and compile each kernel again (once per process), "
    "replacing the cached artifact.")
LOCK_TIMEOUT = _knob(
    "VITRAIL_LOCK_TIMEOUT", 900.0, _float,
    "Seconds a process waits for another process compiling the same kernel before it gives up "
    "with CacheLockTimeout.")
COMPILE_TIMEOUT = _knob(
    "VITRAIL_COMPILE_TIMEOUT", 1800.0, _float,
    "Seconds one nvcc compile may run before it is killed and reported as a CompileError.")
LOG = _knob(
    "VITRAIL_LOG", "warning", _str,
    "Log level of the 'vitrail' logger: debug, info (one line per compile), warning or error.")
NATIVE_PLANS = _knob(
    "VITRAIL_NATIVE_PLANS", True, _bool,
    "1: an op call whose signature has a plan runs it from C++ (vitrail.plan.native: a small "
    "extension against libtorch, built once per machine and torch version, in the background at "
    "the first plan). 0: plans run from Python. Read once per process.")
POLICY = _knob(
    "VITRAIL_POLICY", "PickAny", _str,
    "Default tuning policy: PickAny (the tuning store's config, else the heuristic's; compiles "
    "one) or PickBest (on a store miss, compile the candidates in parallel, time them, keep the "
    "fastest). Read once per process; vitrail.settings(policy=...) overrides it in a scope, "
    "vitrail.tune.set_defaults for the process.")
BUILD_BEHIND = _knob(
    "VITRAIL_BUILD_BEHIND", False, _bool,
    "1: a GEMM call whose config is not built yet runs torch's own sequence (matmul, then the "
    "epilogue's ops) while the config compiles in a background thread; the calls after the build "
    "run the kernel (the first calls' results are torch's, not the kernel's bits). 0: the call "
    "waits for the build. Read once per process; vitrail.settings(build_behind=...) overrides it "
    "in a scope.")
TUNE_WORKERS = _knob(
    "VITRAIL_TUNE_WORKERS", 0.0, _float,
    "Processes compiling candidate configs in parallel (PickBest, precompile). 0: as many as "
    "cores and memory allow (about 2 GiB per nvcc). Read once per process.")
TUNE_DEVICES = _knob(
    "VITRAIL_TUNE_DEVICES", "current", _str,
    "GPUs PickBest times candidate configs on: current (the arguments' GPU), all (every local "
    "GPU of the same model, sharing the candidates) or indices such as 0,1. "
    "Read once per process; vitrail.settings(devices=...) overrides it in a scope.")
