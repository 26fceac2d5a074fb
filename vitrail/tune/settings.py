"""Tuning policies and the settings that choose between them: global, by env, or scoped.

    vitrail.settings(policy=vitrail.PickBest, max_workers=8)   # context manager, per thread/task
    vitrail.tune.settings.set_defaults(policy=vitrail.PickBest)  # for the whole process
    VITRAIL_POLICY=PickBest                                       # every process (read once)

Scoped settings live in a ContextVar, so threads and asyncio tasks each see their own scope.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Iterator

from vitrail import knobs


@dataclass(frozen=True)
class Policy:
    name: str
    doc: str

    def __repr__(self) -> str:
        return self.name


PickAny = Policy("PickAny", "the tuning store's config if there is one, else the heuristic's")
PickBest = Policy("PickBest", "on a store miss: compile candidates in parallel, time each, keep "
                              "the fastest and store it")
POLICIES = {p.name.lower(): p for p in (PickAny, PickBest)}


def policy_named(name: str, source: str = "policy") -> Policy:
    key = name.strip().lower()
    found = POLICIES.get(key) or POLICIES.get(f"pick{key}")
    if found is None:
        raise ValueError(f"{source}={name!r}: expected PickAny or PickBest")
    return found


@dataclass(frozen=True)
class Settings:
    policy: Policy = PickAny
    max_workers: int | None = None  # compile processes; None: bounded by cores and memory
    max_configs: int = 64  # candidates timed by PickBest (the heuristic's first)
    allow_failure: bool = True  # a candidate that fails to compile or launch scores inf
    verbose: bool = False  # progress and a table of timings on stderr
    deterministic: bool = False  # with torch.distributed: rank 0 picks, every rank runs it
    # GPUs PickBest times candidates on: "current", "all" (every local GPU of the arguments'
    # model, candidates shared among them) or a tuple of device indices
    devices: str | tuple[int, ...] = "current"
    # an op with a stand-in (the GEMM: torch's matmul) runs it while a config it has not built
    # compiles in the background, instead of waiting (Op.ready, Op.build_behind)
    build_behind: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise TypeError(f"policy={self.policy!r}: expected vitrail.PickAny or "
                            f"vitrail.PickBest")
        if self.max_workers is not None and self.max_workers < 1:
            raise ValueError(f"max_workers={self.max_workers}: expected a positive number")
        if self.max_configs < 1:
            raise ValueError(f"max_configs={self.max_configs}: expected a positive number")
        if not isinstance(self.build_behind, bool):
            raise TypeError(f"build_behind={self.build_behind!r}: expected True or False")
        object.__setattr__(self, "devices", parse_devices(self.devices))


def parse_devices(value, source: str = "devices") -> str | tuple[int, ...]:
    """"current", "all", or a non-empty tuple of distinct device indices ("0,1" is accepted)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("current", "all"):
            return text
        try:
            value = [int(v) for v in text.split(",")]
        except ValueError:
            raise ValueError(f"{source}={value!r}: expected 'current', 'all' or device indices "
                             f"such as '0,1'") from None
    try:
        indices = tuple(int(v) for v in value if not isinstance(v, bool) and int(v) == v)
        ok = indices and len(indices) == len(tuple(value)) and min(indices) >= 0
    except (TypeError, ValueError):
        ok = False
    if not ok or len(set(indices)) != len(indices):
        raise ValueError(f"{source}={value!r}: expected 'current', 'all' or distinct "
                         f"non-negative device indices")
    return indices


_defaults: Settings | None = None
_env: Settings | None = None  # the environment's settings, once read
# the settings of the innermost ``settings(...)`` block of this context (the C++ hit path reads it)
scoped_settings: contextvars.ContextVar[Settings | None] = contextvars.ContextVar(
    "vitrail_settings", default=None)


def _from_env() -> Settings:
    """The environment's settings, read once per process (at first use, and again after
    ``reset_defaults()``): an op call asks for the policy and pays no environment read."""
    global _env
    if _env is None:
        _env = _parse_env(os.environ.get(knobs.POLICY.name),
                          os.environ.get(knobs.TUNE_WORKERS.name),
                          os.environ.get(knobs.TUNE_DEVICES.name),
                          os.environ.get(knobs.BUILD_BEHIND.name))
    return _env


def _parse_env(policy: str | None, workers: str | None, devices: str | None,
               build_behind: str | None = None) -> Settings:
    return Settings(policy=policy_named(knobs.POLICY.value(policy), "VITRAIL_POLICY"),
                    max_workers=int(knobs.TUNE_WORKERS.value(workers)) or None,
                    devices=parse_devices(knobs.TUNE_DEVICES.value(devices),
                                          "VITRAIL_TUNE_DEVICES"),
                    build_behind=knobs.BUILD_BEHIND.value(build_behind))


def current() -> Settings:
    """The settings in force here: the innermost scope, else the process defaults, else the
    environment's (read once: ``_from_env``)."""
    scoped = scoped_settings.get()
    if scoped is not None:
        return scoped
    return _defaults if _defaults is not None else _env or _from_env()


def current_policy() -> Policy:
    """``current().policy`` (every op call's plan key holds it)."""
    scoped = scoped_settings.get()
    if scoped is not None:
        return scoped.policy
    return (_defaults or _env or _from_env()).policy


def set_defaults(**changes) -> Settings:
    """Change the process-wide defaults (what applies outside every ``settings`` scope)."""
    global _defaults
    _defaults = dataclasses.replace(_defaults or _from_env(), **changes)
    _changed()
    return _defaults


def reset_defaults() -> None:
    """Back to the environment's settings, read again (a variable changed at run time)."""
    global _defaults, _env
    _defaults = _env = None
    _changed()


_ON_CHANGE: list[Callable[[], None]] = []


def on_change(hook: Callable[[], None]) -> None:
    """Call hook() whenever the process-wide defaults change (caches keyed without them)."""
    _ON_CHANGE.append(hook)


def _changed() -> None:
    for hook in _ON_CHANGE:
        hook()


@contextlib.contextmanager
def settings(**changes) -> Iterator[Settings]:
    """Override settings within a ``with`` block (nested scopes stack)."""
    unknown = set(changes) - {f.name for f in dataclasses.fields(Settings)}
    if unknown:
        raise TypeError(f"settings: unknown option(s) {', '.join(sorted(unknown))}; expected "
                        f"{', '.join(f.name for f in dataclasses.fields(Settings))}")
    token = scoped_settings.set(dataclasses.replace(current(), **changes))
    try:
        yield scoped_settings.get()
    finally:
        scoped_settings.reset(token)
