"""vitrail.ops: the op library, each op a ``torch.library`` custom op in the ``vitrail`` namespace.

One folder per op family (DESIGN.md): ``__init__.py`` (public function, custom op, autograd),
``sm90_<op>.cuh`` (the kernel), ``configs.py`` (space and heuristic), ``reference.py`` (plain
torch), ``bench.py`` (its ``vitrail bench`` entries). Names load on first use, so
``import vitrail.ops`` compiles and imports nothing.
"""
from __future__ import annotations

import importlib
import pkgutil

# public name -> the op family that defines it
_EXPORTS = {
    "copy": "copy",
    "softmax": "softmax", "log_softmax": "softmax",
    "mm": "gemm", "bmm": "gemm", "gemm": "gemm", "scaled_mm": "gemm", "grouped_mm": "gemm",
    "sympow": "sympow", "sympow_mma": "sympow", "mma_sympow_bwd": "sympow",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    family = _EXPORTS.get(name)
    if family is not None:
        module = importlib.import_module(f"vitrail.ops.{family}")
        # bind every name of the family now: importing the family binds the subpackage under
        # its own name (vitrail.ops.gemm), which would shadow a function of that name
        for other, fam in _EXPORTS.items():
            if fam == family and hasattr(module, other):
                globals()[other] = getattr(module, other)
        return getattr(module, name)
    raise AttributeError(f"module 'vitrail.ops' has no attribute '{name}'")


def families() -> list[str]:
    """The op families present in this installation (subpackages of vitrail.ops)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg)


def load_all() -> None:
    """Import every op family, registering its Ops (vitrail.op.REGISTRY) and custom ops."""
    for family in families():
        importlib.import_module(f"vitrail.ops.{family}")
