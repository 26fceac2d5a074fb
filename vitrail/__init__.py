"""vitrail: write, compile, tune and call custom GPU kernels from Python.

Layers (see DESIGN.md): ``vitrail.jit`` compiles and caches CUDA C++ and calls it on torch
tensors; ``vitrail.cli`` is the ``vitrail`` command (doctor, cache, bench).
"""
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
