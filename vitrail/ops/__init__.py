"""vitrail.ops: the op library, each op a ``torch.library`` custom op in the ``vitrail`` namespace.

One folder per op family (DESIGN.md): ``__init__.py`` (public function, custom op, autograd),
``sm90_<op>.cuh`` (the kernel), ``configs.py`` (space and heuristic), ``reference.py`` (plain
torch), ``bench.py`` (its ``vitrail bench`` entries). Names load on first use, so
``import vitrail.ops`` compiles and imports nothing.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
import types

# public name -> the op family that defines it
_EXPORTS = {
    "copy": "copy",
    "softmax": "softmax", "log_softmax": "softmax",
    "mm": "gemm", "bmm": "gemm", "gemm": "gemm", "scaled_mm": "gemm", "grouped_mm": "gemm",
    "sympow": "sympow", "sympow_mma": "sympow", "mma_sympow_bwd": "sympow",
}
__all__ = list(_EXPORTS)


class _Ops(types.ModuleType):
    """vitrail.ops itself. A public name always means the function: importing a family binds
    the subpackage under its own name (``vitrail.ops.softmax`` the package), which would
    otherwise shadow the function of that name. The packages stay reachable by from-import
    (``from vitrail.ops.softmax import reference``); ``import vitrail.ops.softmax.reference as r``
    does not work, since Python resolves it through the attribute, the function."""

    def __getattribute__(self, name: str):
        family = _EXPORTS.get(name)
        if family is None:
            return super().__getattribute__(name)
        fn = _FUNCTIONS.get(name)
        if fn is None:
            fn = _FUNCTIONS[name] = getattr(importlib.import_module(f"vitrail.ops.{family}"),
                                            name)
        return fn

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_EXPORTS))


_FUNCTIONS: dict = {}
sys.modules[__name__].__class__ = _Ops


def families() -> list[str]:
    """The op families present in this installation (subpackages of vitrail.ops)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg)


def load_all() -> None:
    """Import every op family, registering its Ops (vitrail.op.REGISTRY) and custom ops."""
    for family in families():
        importlib.import_module(f"vitrail.ops.{family}")
