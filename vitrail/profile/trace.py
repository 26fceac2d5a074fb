"""Look inside a run: a Chrome trace from torch.profiler, and Nsight Compute command lines.

:func:`trace` records what a function launches (CPU ops always, CUDA kernels and memcpys where a
GPU exists) into a Chrome trace JSON that chrome://tracing or https://ui.perfetto.dev opens: the
first question about a slow op is usually "which kernels ran, and what did the host do between
them". :func:`ncu` builds (and optionally runs) the Nsight Compute command that answers the next
question, "why is this kernel slow", for the launches of one kernel in a script, so nobody has to
remember ncu's flags.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from vitrail.profile.timing import check_count

# Where ncu is looked for after PATH: the toolkits named by the environment, then the default one.
STANDARD_DIRS = ("/usr/local/cuda/bin",)


def trace(fn: Callable[[], Any], path: str | os.PathLike, *, warmup: int = 3,
          steps: int = 5) -> Path:
    """Call ``fn()`` ``warmup`` times untraced, then ``steps`` times under torch.profiler, and
    write the Chrome trace to ``path`` (a ``.json`` file; ``.json.gz`` is compressed). Each step
    is a ``vitrail.trace step N`` range in the trace. Returns the path written.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable taking no arguments, got {type(fn).__name__}")
    warmup = check_count("warmup", warmup, minimum=0)
    steps = check_count("steps", steps, minimum=1)
    try:
        out = Path(os.fspath(path))
    except TypeError:
        raise TypeError(f"path: expected a file path, got {type(path).__name__}") from None
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    for _ in range(warmup):
        fn()
    if gpu:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for step in range(steps):
            with record_function(f"vitrail.trace step {step}"):
                fn()
        if gpu:
            torch.cuda.synchronize()  # so the kernels' GPU records are complete
    out.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out))
    return out


class NcuError(RuntimeError):
    """ncu is not installed, or the profiled command failed."""


@dataclass(frozen=True)
class NcuCommand:
    """An Nsight Compute command line; after :meth:`run`, also its exit status and output.

    ``argv`` starts with ``ncu``; :meth:`run` resolves it to the installed binary. ``report`` is
    the ``.ncu-rep`` file ncu writes when an output was given (open it with ``ncu-ui`` or
    ``ncu --import``).
    """
    argv: tuple[str, ...]
    report: Path | None = None
    returncode: int | None = None
    output: str | None = None  # stdout and stderr together, after run()

    def __str__(self) -> str:
        return shlex.join(self.argv)

    def run(self, *, timeout: float | None = None) -> NcuCommand:
        """Run the command; returns a copy holding its exit status and output. Raises NcuError
        where ncu is not installed or the command exits with a non-zero status."""
        exe = find_ncu()
        if exe is None:
            raise NcuError("ncu (NVIDIA Nsight Compute) is not installed: it is not on PATH, in "
                           "$CUDA_HOME/bin or in /usr/local/cuda/bin. Install Nsight Compute "
                           "(it comes with the CUDA toolkit), or run the command elsewhere: "
                           f"{self}")
        proc = subprocess.run([exe, *self.argv[1:]], check=False, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=timeout)
        done = replace(self, returncode=proc.returncode, output=proc.stdout)
        if proc.returncode != 0:
            tail = "\n".join(proc.stdout.splitlines()[-20:])
            hint = ""
            if "ERR_NVGPUCTRPERM" in proc.stdout:
                hint = ("\nThe driver does not let this user read GPU performance counters: run "
                        "as root, or see https://developer.nvidia.com/ERR_NVGPUCTRPERM")
            raise NcuError(f"ncu exited with status {proc.returncode}: {self}\n{tail}{hint}")
        return done


def ncu(cmd_or_script: str | os.PathLike | Sequence[str], *, kernel: str | None = None,
        metrics: str | Sequence[str] | None = None, output: str | os.PathLike | None = None,
        sections: str | Sequence[str] | None = None, launch_skip: int = 0,
        launch_count: int = 1, run: bool = False) -> NcuCommand:
    """The Nsight Compute command that profiles ``cmd_or_script``; with ``run=True``, run it.

    ``cmd_or_script``: a Python script's path (run with this interpreter), a command line string,
    or an argv list. ``kernel``: a regular expression matched against kernel names (passed as
    ``regex:...``; a value already starting with ``regex:`` is kept). ``launch_skip`` launches of
    the matching kernels are skipped, then ``launch_count`` are profiled. ``sections`` (e.g.
    ``"SpeedOfLight"``, ``"MemoryWorkloadAnalysis"``) and ``metrics`` (e.g.
    ``"sm__throughput.avg.pct_of_peak_sustained_elapsed"``) select what is collected (ncu's
    default set when neither is given). ``output``: the report file (``.ncu-rep`` is appended
    where missing), overwritten if it exists; without it ncu prints its results.
    """
    argv = ["ncu"]
    if kernel is not None:
        if not isinstance(kernel, str) or not kernel:
            raise TypeError(f"kernel: expected a non-empty regular expression string, got "
                            f"{kernel!r}")
        argv += ["--kernel-name", kernel if kernel.startswith("regex:") else f"regex:{kernel}"]
    argv += ["--launch-skip", str(check_count("launch_skip", launch_skip, minimum=0))]
    argv += ["--launch-count", str(check_count("launch_count", launch_count, minimum=1))]
    for section in _names("sections", sections):
        argv += ["--section", section]
    metric_names = _names("metrics", metrics)
    if metric_names:
        argv += ["--metrics", ",".join(metric_names)]
    report = None
    if output is not None:
        try:
            out = os.fspath(output)
        except TypeError:
            raise TypeError(f"output: expected a file path, got {type(output).__name__}") from None
        if not out:
            raise ValueError("output: expected a file path, got an empty string")
        report = Path(out if out.endswith(".ncu-rep") else out + ".ncu-rep")
        argv += ["--force-overwrite", "-o", out]
    argv += _target(cmd_or_script)
    command = NcuCommand(tuple(argv), report)
    return command.run() if run else command


def find_ncu() -> str | None:
    """The path of the ncu binary: on PATH, else in $CUDA_HOME/bin, $CUDA_PATH/bin or the
    default toolkit; None where it is not installed."""
    found = shutil.which("ncu")
    if found:
        return found
    dirs = [os.path.join(os.environ[v], "bin") for v in ("CUDA_HOME", "CUDA_PATH")
            if os.environ.get(v)]
    for d in [*dirs, *STANDARD_DIRS]:
        path = os.path.join(d, "ncu")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def _names(arg: str, value: str | Sequence[str] | None) -> list[str]:
    if value is None:
        return []
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    if not all(isinstance(v, str) and v.strip() for v in items):
        raise TypeError(f"{arg}: expected a name or a list of names (strings), got {value!r}")
    return [v.strip() for v in items]


def _target(cmd_or_script: Any) -> list[str]:
    if isinstance(cmd_or_script, os.PathLike):
        argv = [os.fspath(cmd_or_script)]
    elif isinstance(cmd_or_script, str):
        if os.path.isfile(cmd_or_script):  # a script whose path may hold spaces
            argv = [cmd_or_script]
        else:
            argv = shlex.split(cmd_or_script)
    elif isinstance(cmd_or_script, Sequence) and all(isinstance(a, str) for a in cmd_or_script):
        argv = list(cmd_or_script)
    else:
        raise TypeError(f"cmd_or_script: expected a script path, a command line or a list of "
                        f"strings, got {cmd_or_script!r:.80}")
    if not argv or not argv[0]:
        raise ValueError("cmd_or_script: the command is empty")
    if argv[0].endswith(".py"):
        argv.insert(0, sys.executable)
    return argv
