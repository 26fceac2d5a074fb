"""vitrail: write, compile, tune and call custom GPU kernels from Python.

Layers (see DESIGN.md): ``vitrail.jit`` compiles and caches CUDA C++ and calls it on torch
tensors; ``vitrail.tune`` chooses configs (``vitrail.settings``, ``vitrail.PickAny``,
``vitrail.PickBest``); ``vitrail.op`` binds the two; ``vitrail.profile`` times;
``vitrail.cli`` is the ``vitrail`` command.
"""
import importlib as _importlib
import logging as _logging

__version__ = "0.1.0"


def _configure_logging() -> None:
    from vitrail import knobs
    logger = _logging.getLogger("vitrail")
    level = knobs.LOG.get().upper()
    logger.setLevel(getattr(_logging, level, _logging.WARNING))
    if not logger.handlers:
        handler = _logging.StreamHandler()
        handler.setFormatter(_logging.Formatter("%(message)s"))
        logger.addHandler(handler)


_configure_logging()


_LAZY = {"settings": "vitrail.tune.settings", "PickAny": "vitrail.tune.settings",
         "PickBest": "vitrail.tune.settings"}


_SUBMODULES = ("jit", "tune", "ops", "gemm", "profile", "plan", "bench", "op", "knobs", "device",
               "cli")


def __getattr__(name: str):
    if name in _LAZY:  # loaded on first use, so `import vitrail` stays light
        value = getattr(_importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:  # vitrail.jit.compile(...) after a bare `import vitrail`
        return _importlib.import_module(f"vitrail.{name}")
    raise AttributeError(f"module 'vitrail' has no attribute '{name}'")
