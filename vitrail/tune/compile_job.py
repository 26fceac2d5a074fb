"""One compile of ``compile_all``, in its own process: ``python -m vitrail.tune.compile_job``.

Reads a pickled ``vitrail.jit.compile`` keyword dict on stdin, builds it into the kernel cache
and prints one JSON line: ``{"error": null}`` or ``{"error": "why"}``. A plain subprocess, not a
multiprocessing worker: those re-run the caller's ``__main__`` (a script without a main guard
then breaks the pool), and one killed worker would fail every job still queued.
"""
from __future__ import annotations

import json
import pickle
import sys


def run(kwargs: dict) -> str | None:
    """Build one kernel into the cache (no loading, no torch); None, or why it failed."""
    from vitrail.jit.compiler import build
    from vitrail.jit.errors import CompileError
    try:
        build(**kwargs)
        return None
    except CompileError as e:
        return "compile error: " + (e.errors[0] if e.errors else str(e).splitlines()[0])
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def main() -> int:
    kwargs = pickle.loads(sys.stdin.buffer.read())
    print(json.dumps({"error": run(kwargs)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
