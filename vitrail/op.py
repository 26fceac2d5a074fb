"""Ops and op families: tunable kernels bound to the JIT, from problem to launch in one call.

An op family (``OpFamily``) is the unit of the library: one object per op (softmax, copy, the
GEMM kinds, the sympow kernels). Its variants are keys (the path, dtypes, vector width...: what
the kernel source is instantiated for), each an Op made on its first use; the key is part of the
Op's name, so of its compile and tuning keys. The family's ``configs.route(problem, limits)`` is
the pure choice of a variant and of the problem its heuristic and tuner take.

    op(problem_key, problem, *args)
      -> config   (memoized per problem and policy; else the tuning store, the heuristic, or
                   PickBest's tuning: vitrail.tune)
      -> module   (vitrail.jit.compile of the config's rendered source: cached in memory and on
                   disk; one compiled config serves every shape it can implement)
      -> launch(module, config, *args) on the current stream

Ops register themselves by name, so ``vitrail tune OP`` and ``vitrail precompile`` find them.
An op family also registers how a shape the user gives becomes a problem (``Family``:
``vitrail tune softmax --shape 4096x4096`` runs the variant softmax's public function would
run for that shape); each Op makes its own problem from a shape (``Op.make_problem``).
"""
from __future__ import annotations

import dataclasses
import functools
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from vitrail.jit.errors import LaunchError
from vitrail.tune.settings import PickBest, current, current_policy
from vitrail.tune.space import Config, Limits, Space, limits
from vitrail.tune.tuner import Tunable, compile_all, pick, source_hash

REGISTRY: dict[str, "Op"] = {}  # Ops made outside a family (register=True), by name
OP_FAMILIES: dict[str, "OpFamily"] = {}


@dataclass(frozen=True)
class Shaped:
    """A problem made from a shape on the command line: the variant (Op) that runs it, the
    problem key and problem its heuristic and tuner take, and ``args()``, which makes the
    launch arguments (random inputs on the GPU) when the candidates are timed (so a problem is
    built, and checked, without a GPU)."""
    op: "Op"
    key: str
    problem: Any
    args: Callable[[], tuple]


@dataclass(frozen=True)
class Family:
    """How ``vitrail tune NAME --shape ... --dtype ...`` reads a shape for a family (or a public
    function of one): ``shape`` spells its dims (``ROWSxCOLS``; optional ones in brackets:
    ``MxNxK[xL]``), ``doc`` says what they mean, ``dtypes`` the dtypes it takes (the first is
    the default), ``resolve(shape, dtype, backward=, device=)`` routes it as the public function
    would on ``device`` (None: the build target, vitrail.tune.limits()) and returns the variant's
    problem (``Shaped``); ``backward``: whether it has a backward to tune (``--backward``);
    ``why_not``: a family with nothing to tune says why (resolve None); ``variants``: the
    prefixes of its variants' names in the registry (default ``NAME.``: mm's are ``gemm.``),
    what ``vitrail precompile NAME`` builds."""
    name: str
    shape: str
    doc: str
    dtypes: tuple[str, ...]
    resolve: Callable[..., Shaped] | None
    backward: bool = False
    why_not: str = ""
    variants: tuple[str, ...] = ()

    @property
    def prefixes(self) -> tuple[str, ...]:
        return self.variants or (self.name + ".",)


FAMILIES: dict[str, Family] = {}


def family(name: str, shape: str, doc: str, dtypes: Iterable[str],
           resolve: Callable[..., Shaped] | None, *, backward: bool = False,
           why_not: str = "", variants: Iterable[str] = ()) -> Family:
    """Register how ``vitrail tune`` makes a problem of this family from a shape and dtype (and
    which registered ops ``vitrail precompile`` builds for it: ``variants``)."""
    f = FAMILIES[name] = Family(name, shape, doc, tuple(dtypes), resolve, backward, why_not,
                                tuple(variants))
    return f


def parse_shape(text: str, spec: str) -> tuple[int, ...]:
    """The dims of ``text`` (``4096x4096``) as ``spec`` (``ROWSxCOLS``, ``MxNxK[xL]``) asks;
    ValueError saying what is expected."""
    names = [n for n in re.split(r"\[?x", spec.replace("]", "")) if n]
    least = len(re.split(r"\[?x", spec.split("[")[0]))
    example = "x".join("4096" for _ in range(least))
    counts = f"{least}" if least == len(names) else f"{least} to {len(names)}"
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        dims = ()
    if not least <= len(dims) <= len(names) or min(dims) < 1:
        raise ValueError(f"--shape {text!r}: expected {spec} ({counts} positive integers joined "
                         f"by x, e.g. {example})")
    return dims


class Op:
    """A kernel family: a space of configs, how to render and launch one, and examples.

    Args:
        name: unique name (the tuning store's key and the CLI's).
        space: the static parameters, their constraints and heuristic.
        kernel_source: the kernel's own code (template text, headers' text): its hash keys the
            tuning store, so a changed kernel is tuned afresh.
        render: config -> keyword arguments of ``vitrail.jit.compile`` (source, name, ...), or
            None for a config that compiles nothing (it runs a library's function; launch
            gets module None).
        launch: (module, config, *args) -> None; runs the compiled config on the arguments.
        examples: problem descriptions for ``precompile`` (the heuristic's configs for them are
            built ahead of time) and ``vitrail tune``.
        make_problem: (shape, dtype) -> ``Shaped`` for ``vitrail tune`` (ValueError where the
            shape does not fit this variant); dtype None: the variant's own.
        shape: what make_problem's shape spells (``ROWSxCOLS``; see ``parse_shape``).
    """

    def __init__(self, name: str, *, space: Space, kernel_source: str,
                 render: Callable[[Config], dict], launch: Callable[..., None],
                 examples: Iterable[Any] = (),
                 make_problem: Callable[[tuple[int, ...], str | None], Shaped] | None = None,
                 shape: str = "", register: bool = True):
        self.name, self.space, self.render, self.launch = name, space, render, launch
        self.examples = list(examples)
        self.make_problem, self.shape = make_problem, shape
        self.tunable = Tunable(name, space, render, source_hash(kernel_source))
        self._configs: dict[tuple, Config] = {}
        self._modules: dict[Config, Any] = {}
        self._lock = threading.Lock()
        if register:
            REGISTRY[name] = self

    def config(self, problem_key: str, problem: Any, args: tuple = ()) -> Config:
        """The config for this problem under the current settings (tuning it if they say so)."""
        hit = self._configs.get((problem_key, current_policy()))
        if hit is None:
            with self._lock:
                s = current()
                memo = (problem_key, s.policy)
                hit = self._configs.get(memo)
                if hit is None:
                    hit = pick(self.tunable, problem_key, problem, run=self._run, args=args,
                               settings=s)
                    self._configs[memo] = hit
        return hit

    def tune(self, problem_key: str, problem: Any, args: tuple, store) -> Config:
        """PickBest for one problem into ``store`` (a TuningStore of its own), whatever this
        process or the user's store chose before: what ``vitrail tune grid`` measures."""
        s = dataclasses.replace(current(), policy=PickBest)
        return pick(self.tunable, problem_key, problem, run=self._run, args=args, store=store,
                    settings=s)

    def forget_configs(self) -> None:
        """Choose each problem's config afresh at its next call (settings that change the
        heuristic's answer)."""
        self._configs.clear()

    def module(self, config: Config):
        """The config's compiled module (None for a config that compiles nothing)."""
        mod = self._modules.get(config)
        if mod is None and config not in self._modules:
            kwargs = self.render(config)
            from vitrail import jit
            mod = self._modules[config] = None if kwargs is None else jit.compile(**kwargs)
        return mod

    def __call__(self, problem_key: str, problem: Any, *args: Any) -> None:
        config = self.config(problem_key, problem, args)
        try:
            self.launch(self.module(config), config, *args)
        except LaunchError as e:  # say which op and config; the kernel's own words follow
            raise LaunchError(f"op '{self.name}', config {dict(config)}: {e}") from e

    def _run(self, config: Config, args: tuple) -> None:
        self.launch(self.module(config), config, *args)

    def default_configs(self, lim: Limits) -> list[Config]:
        """The heuristic's configs for the examples (what precompile builds), without repeats."""
        seen: list[Config] = []
        for problem in self.examples or [None]:
            config = self.space.default(problem, lim)
            if config not in seen:
                seen.append(config)
        return seen

    def precompile_jobs(self, arch: str | None = None) -> list[tuple[Config, dict]]:
        """(config, jit.compile kwargs) of each default config that compiles something."""
        lim = limits(arch=arch)
        jobs = []
        for config in self.default_configs(lim):
            rendered = self.render(config)
            if rendered is None:
                continue
            kwargs = dict(rendered)
            kwargs.setdefault("arch", lim.arch.name)
            jobs.append((config, kwargs))
        return jobs

    def precompile(self, *, arch: str | None = None, max_workers: int | None = None,
                   verbose: bool = False) -> dict[Config, str]:
        """Build the default configs into the cache; returns {config: error} of failures."""
        return compile_all(self.precompile_jobs(arch), max_workers=max_workers, verbose=verbose,
                           label=self.name)

    def __repr__(self) -> str:
        return f"<Op '{self.name}': {len(self.space.params)} parameters, {self.space.size} configs>"


class OpFamily:
    """An op family: its variants, an Op each, made on first use from a key.

    Args:
        name: the family's name (its variants' names begin with it, or with one of the public
            functions it serves: softmax's are softmax.* and log_softmax.*).
        make: key -> the keyword arguments of the variant's Op (name, space, kernel_source,
            render, launch; examples, make_problem, shape): what the key instantiates.
        keys: () -> every variant's key, what ``vitrail tune`` and ``precompile`` can name; None
            for a family of too many to list (the GEMM kinds): the CLI knows the ones made so
            far, and ``listed`` the ones it always knows.
        listed: keys the CLI knows even where ``keys`` is None (precompile's defaults).
        register: whether the CLI knows the family (``vitrail tune``, ``precompile``).

    How a variant makes its problem from a shape (``Op.make_problem``) comes from the family's
    ``problems`` module, which ``set_problems`` registers when it loads (``vitrail.ops.load_all``
    loads them): it drives the family's entry points, so the family does not import it.
    """

    def __init__(self, name: str, make: Callable[[Any], dict], *,
                 keys: Callable[[], Iterable[Any]] | None = None, listed: Iterable[Any] = (),
                 register: bool = True):
        self.name, self._make, self._keys, self._listed = name, make, keys, tuple(listed)
        self._variants: dict[Any, Op] = {}
        self._variant_problem: Callable[..., Shaped] | None = None
        self._lock = threading.Lock()
        if register:
            OP_FAMILIES[name] = self

    def __getitem__(self, key: Any) -> Op:
        op = self._variants.get(key)
        if op is None:
            with self._lock:
                op = self._variants.get(key)
                if op is None:
                    op = self._variants[key] = Op(**self._make(key), register=False)
                    self._give_problems(key, op)
        return op

    def set_problems(self, variant_problem: Callable[..., Shaped]) -> None:
        """Register variant_problem(key, shape, dtype=None) -> ``Shaped`` (ValueError where the
        shape does not fit the variant) as every variant's ``make_problem``, those made so far
        included."""
        with self._lock:
            self._variant_problem = variant_problem
            for key, op in self._variants.items():
                self._give_problems(key, op)

    def _give_problems(self, key: Any, op: Op) -> None:
        if self._variant_problem is not None and op.make_problem is None:
            op.make_problem = functools.partial(self._variant_problem, key)

    def keys(self) -> list:
        """The variants' keys the CLI can name: every one, or (keys None) the listed ones and
        those made so far."""
        if self._keys is not None:
            return list(self._keys())
        return list(dict.fromkeys([*self._listed, *self._variants]))

    def made(self) -> dict[Any, Op]:
        """The variants made so far, by key."""
        return dict(self._variants)

    def __repr__(self) -> str:
        return f"<OpFamily '{self.name}': {len(self._variants)} variants made>"


def registry() -> dict[str, Op]:
    """Every Op the CLI can name: each family's variants (made here where they were not yet) and
    the Ops made outside a family, by name."""
    ops = {op.name: op for f in OP_FAMILIES.values() for op in (f[k] for k in f.keys())}
    return {**ops, **REGISTRY}
