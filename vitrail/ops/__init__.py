"""vitrail.ops: the op library, each op a ``torch.library`` custom op in the ``vitrail`` namespace.

One folder per op family (DESIGN.md): ``__init__.py`` (public function, custom op, autograd),
``sm90_<op>.cuh`` (the kernel), ``configs.py`` (space and heuristic), ``reference.py`` (plain
torch), ``benchmarks.py`` (its ``vitrail bench`` entries), ``problems.py`` (how ``vitrail tune``
makes its problems from a shape; ``load_all`` loads it, the family does not import it). Names
load on first use, so ``import vitrail.ops`` compiles and imports nothing.
"""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
import types

# public name -> the op family (or the family's module) that defines it
_EXPORTS = {
    "copy": "copy",
    "softmax": "softmax", "log_softmax": "softmax",
    "mm": "gemm", "bmm": "gemm", "gemm": "gemm", "scaled_mm": "gemm", "grouped_mm": "gemm",
    "conv2d": "conv",
    "attention": "attention", "attention_varlen": "attention", "attention_kvcache": "attention.kvcache",
    "attention_fp8": "attention.fp8",
    "sympow": "sympow", "sympow_mma": "sympow", "mma_sympow_bwd": "sympow",
}
__all__ = list(_EXPORTS)


class _Ops(types.ModuleType):
    """vitrail.ops itself. A public name always means the function, also in the module's
    ``__dict__`` (which torch.compile reads directly). Importing a family makes Python bind the
    subpackage under its own name (``vitrail.ops.softmax``, the package), which would shadow the
    function of that name: that binding is replaced by the function as it happens. The packages
    stay reachable by from-import (``from vitrail.ops.softmax import reference``);
    ``import vitrail.ops.softmax.reference as r`` does not work, since Python resolves it
    through the attribute, the function."""

    def __setattr__(self, name: str, value) -> None:
        if (isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}"
                and name in _EXPORTS and hasattr(value, name)):
            value = getattr(value, name)
        super().__setattr__(name, value)


def __getattr__(name: str):
    """A public name's first use: import its family (which binds the name, see _Ops)."""
    family = _EXPORTS.get(name)
    if family is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    fn = getattr(importlib.import_module(f"{__name__}.{family}"), name)
    globals()[name] = fn
    return fn


sys.modules[__name__].__class__ = _Ops


def families() -> list[str]:
    """The op families present in this installation (subpackages of vitrail.ops)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg)


def load_all() -> None:
    """Import every op family, registering its Ops (vitrail.op.REGISTRY) and custom ops, and its
    ``problems.py`` where it has one: how ``vitrail tune`` makes its problems from a shape (the
    family does not import it, since it drives the family's entry points)."""
    for family in families():
        importlib.import_module(f"{__name__}.{family}")
        if importlib.util.find_spec(f"{__name__}.{family}.problems") is not None:
            importlib.import_module(f"{__name__}.{family}.problems")


def load_benchmarks() -> dict:
    """Register the op library's benchmarks with vitrail.bench (after the registry's own): the
    host-time one (vitrail.ops.benchmarks) and each family's ``benchmarks.py``; the registry."""
    from vitrail import bench
    bench.load()
    importlib.import_module(f"{__name__}.benchmarks")
    for family in families():
        if importlib.util.find_spec(f"{__name__}.{family}.benchmarks") is not None:
            importlib.import_module(f"{__name__}.{family}.benchmarks")
    return bench.REGISTRY
