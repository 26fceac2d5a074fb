"""The exceptions of vitrail.jit: each says what went wrong, where, and what to do about it."""
from __future__ import annotations


class VitrailError(Exception):
    """Base class of every error vitrail raises on purpose."""


class ToolchainError(VitrailError):
    """A tool (nvcc, NVRTC, CUTLASS headers, a GPU) is missing, too old, or cannot target the arch.

    Raised before any side effect: nothing is written to the cache when it is.
    """


class CompileError(VitrailError):
    """The compiler rejected a kernel.

    Attributes: ``name`` (kernel name), ``backend``, ``errors`` (the compiler's first error lines,
    file:line first), ``command`` (what was run), ``source_path`` (a saved copy of the source and
    the full log, kept for reproduction), ``log`` (the full compiler output).
    """

    def __init__(self, name: str, backend: str, errors: list[str], command: str,
                 source_path: str, log: str):
        self.name, self.backend, self.errors = name, backend, errors
        self.command, self.source_path, self.log = command, source_path, log
        shown = "\n".join(f"  {line}" for line in errors) or "  (no error line found; see the log)"
        super().__init__(
            f"{backend} failed to compile kernel '{name}':\n{shown}\n"
            f"command: {command}\n"
            f"source and full log saved for reproduction: {source_path}")


class CacheError(VitrailError):
    """The kernel cache's directory cannot be used safely (it, or a directory above it, can be
    written by another user; it is not a directory; it cannot be created). Says what to set."""


class CacheLockTimeout(VitrailError):
    """Another process held a kernel's build lock for longer than VITRAIL_LOCK_TIMEOUT."""


class LaunchError(VitrailError):
    """A kernel or entry point could not be launched, or reported a CUDA error."""


class ArgumentError(VitrailError, TypeError):
    """An argument handed to a kernel or entry point has the wrong kind, device or layout."""
