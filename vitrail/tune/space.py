"""Compile-time configuration spaces: what a kernel may be instantiated with, and what runs here.

A kernel declares its static parameters (tile shapes, stages, warps, cluster, swizzle...) as a
:class:`Space`: candidate values per parameter, constraints that say why a combination cannot
run on a target (too much shared memory, too many threads...), and a heuristic that picks a
config for a problem. Sizes, strides and pointers are not in the space: they are runtime
arguments, so one compiled config serves every shape it can implement.

Limits come from the GPU when there is one, else from a table of the target arch, so spaces can
be filtered (and configs precompiled) on a machine with no GPU.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from vitrail.jit.toolchain import Arch, target_arch


class Config(Mapping[str, Any]):
    """An immutable, hashable assignment of a value to every parameter of a space."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | Sequence[tuple[str, Any]] = ()):
        pairs = tuple(items.items()) if isinstance(items, Mapping) else tuple(items)
        for k, v in pairs:
            if not isinstance(v, (int, float, str, bool)):
                raise TypeError(f"config value {k}={v!r}: expected an int, float, str or bool")
        object.__setattr__(self, "_items", pairs)

    def __getitem__(self, key: str) -> Any:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"config has no parameter '{key}'") from None

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("a Config is immutable; make a new one with config.replace(...)")

    def replace(self, **values: Any) -> "Config":
        unknown = set(values) - set(self)
        if unknown:
            raise KeyError(f"config has no parameter(s) {', '.join(sorted(unknown))}")
        return Config([(k, values.get(k, v)) for k, v in self._items])

    @property
    def label(self) -> str:
        """BLOCK=256,VEC=4: for tables, plots and logs."""
        return ",".join(f"{k}={v}" for k, v in self._items)

    def to_json(self) -> str:
        return json.dumps(dict(self._items), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | Mapping) -> "Config":
        data = json.loads(text) if isinstance(text, str) else dict(text)
        return cls(sorted(data.items()))

    def __repr__(self) -> str:
        return f"Config({self.label})"


@dataclass(frozen=True)
class Limits:
    """What one CTA of a target may use."""
    arch: Arch
    max_threads_per_block: int
    max_shared_per_block: int  # bytes, with the opt-in above 48 KiB
    shared_per_sm: int
    registers_per_sm: int
    max_registers_per_thread: int
    max_cluster_size: int  # 1 before sm_90
    sm_count: int | None  # None when read from the arch table
    source: str  # "GPU <name>" or "arch table"

    def __str__(self) -> str:
        return (f"{self.arch} ({self.source}): {self.max_threads_per_block} threads, "
                f"{self.max_shared_per_block} B shared per CTA")


# (major, minor) -> (shared per CTA with opt-in, shared per SM), from the CUDA programming guide
_SHARED = {(7, 0): (96 << 10, 96 << 10), (7, 5): (64 << 10, 64 << 10),
           (8, 0): (163 << 10, 164 << 10), (8, 6): (99 << 10, 100 << 10),
           (8, 7): (163 << 10, 164 << 10), (8, 9): (99 << 10, 100 << 10),
           (9, 0): (227 << 10, 228 << 10), (10, 0): (227 << 10, 228 << 10),
           (10, 3): (227 << 10, 228 << 10), (12, 0): (99 << 10, 100 << 10)}


def limits(device: int | None = None, arch: Arch | str | None = None) -> Limits:
    """The limits of the GPU (when there is one and no other arch is asked for) or of an arch."""
    wanted = Arch.parse(arch) if isinstance(arch, str) else arch
    import torch
    if torch.cuda.is_available():
        index = torch.cuda.current_device() if device is None else device
        p = torch.cuda.get_device_properties(index)
        if wanted is None or (wanted.major, wanted.minor) == (p.major, p.minor):
            return Limits(
                arch=wanted or target_arch(index),
                max_threads_per_block=getattr(p, "max_threads_per_block", 1024),
                max_shared_per_block=p.shared_memory_per_block_optin,
                shared_per_sm=p.shared_memory_per_multiprocessor,
                registers_per_sm=p.regs_per_multiprocessor,
                max_registers_per_thread=255,
                max_cluster_size=8 if p.major >= 9 else 1,
                sm_count=p.multi_processor_count, source=f"GPU {p.name}")
    wanted = wanted or target_arch()
    per_cta, per_sm = _SHARED.get((wanted.major, wanted.minor),
                                  _SHARED.get((wanted.major, 0), (48 << 10, 64 << 10)))
    return Limits(arch=wanted, max_threads_per_block=1024, max_shared_per_block=per_cta,
                  shared_per_sm=per_sm, registers_per_sm=64 << 10, max_registers_per_thread=255,
                  max_cluster_size=8 if wanted.major >= 9 else 1, sm_count=None,
                  source="arch table")


# A constraint returns None when the config can run within the limits, else the reason why not.
Constraint = Callable[[Config, Limits], "str | None"]


def max_threads(threads: Callable[[Config], int]) -> Constraint:
    """The CTA's thread count must be a positive multiple of 32 within the limit."""
    def check(c: Config, lim: Limits) -> str | None:
        n = threads(c)
        if n <= 0 or n % 32:
            return f"{n} threads per CTA is not a positive multiple of 32"
        if n > lim.max_threads_per_block:
            return f"{n} threads per CTA > {lim.max_threads_per_block} on {lim.arch}"
        return None
    return check


def max_shared(shared_bytes: Callable[[Config], int]) -> Constraint:
    """The CTA's shared memory (static + dynamic) must fit the target's opt-in maximum."""
    def check(c: Config, lim: Limits) -> str | None:
        n = shared_bytes(c)
        if n > lim.max_shared_per_block:
            return f"{n} B of shared memory > {lim.max_shared_per_block} B on {lim.arch}"
        return None
    return check


def max_registers(registers_per_thread: Callable[[Config], int],
                  threads: Callable[[Config], int]) -> Constraint:
    """An estimate of registers per thread must fit, per thread and for one CTA per SM."""
    def check(c: Config, lim: Limits) -> str | None:
        r, n = registers_per_thread(c), threads(c)
        if r > lim.max_registers_per_thread:
            return f"{r} registers per thread > {lim.max_registers_per_thread}"
        if r * n > lim.registers_per_sm:
            return f"{r} registers x {n} threads > {lim.registers_per_sm} per SM"
        return None
    return check


def require(predicate: Callable[[Config, Limits], bool], reason: str) -> Constraint:
    """A constraint from a predicate; ``reason`` may use the config's parameters by name."""
    def check(c: Config, lim: Limits) -> str | None:
        return None if predicate(c, lim) else reason.format(**dict(c), arch=lim.arch)
    return check


class Space:
    """Candidate values per static parameter, constraints, and a heuristic default."""

    def __init__(self, params: Mapping[str, Sequence[Any]], *,
                 constraints: Sequence[Constraint] = (),
                 heuristic: Callable[[Any, Limits], Mapping[str, Any]] | None = None):
        if not params:
            raise ValueError("params: a space needs at least one parameter")
        for name, values in params.items():
            if not isinstance(values, (list, tuple)) or not values:
                raise ValueError(f"params['{name}']: expected a non-empty list of values")
            if len(set(values)) != len(values):
                raise ValueError(f"params['{name}']: values repeat: {list(values)}")
        self.params = {k: tuple(v) for k, v in params.items()}
        self.constraints = tuple(constraints)
        self.heuristic = heuristic

    @property
    def size(self) -> int:
        n = 1
        for values in self.params.values():
            n *= len(values)
        return n

    def config(self, **values: Any) -> Config:
        """A config of this space; every parameter must be given a value the space lists."""
        missing = set(self.params) - set(values)
        unknown = set(values) - set(self.params)
        if missing or unknown:
            raise ValueError(f"config: missing {sorted(missing)}, unknown {sorted(unknown)}; "
                             f"the parameters are {list(self.params)}")
        for k, v in values.items():
            if v not in self.params[k]:
                raise ValueError(f"config: {k}={v!r} is not one of {list(self.params[k])}")
        return Config([(k, values[k]) for k in self.params])

    def all(self) -> Iterator[Config]:
        names = list(self.params)
        for combo in itertools.product(*self.params.values()):
            yield Config(zip(names, combo))

    def reasons(self, config: Config, lim: Limits) -> list[str]:
        """Why config cannot run within lim (empty: it can)."""
        return [r for r in (check(config, lim) for check in self.constraints) if r]

    def valid(self, lim: Limits) -> list[Config]:
        return [c for c in self.all() if not self.reasons(c, lim)]

    def default(self, problem: Any, lim: Limits) -> Config:
        """The heuristic's config for problem (else the first valid one), checked against lim."""
        if self.heuristic is None:
            configs = self.valid(lim)
            if not configs:
                raise ValueError(f"no config of this space can run on {lim}")
            return configs[0]
        chosen = self.config(**dict(self.heuristic(problem, lim)))
        why = self.reasons(chosen, lim)
        if why:
            raise ValueError(f"the heuristic chose {chosen.label}, which cannot run on "
                             f"{lim.arch}: {'; '.join(why)}")
        return chosen
