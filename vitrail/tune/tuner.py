"""Choosing a config: PickAny (store, else heuristic) or PickBest (compile, time, keep the best).

PickBest on a store miss: the candidates (the heuristic's first, then the space's valid configs,
at most ``max_configs``) are compiled in parallel, one process each, into the kernel cache;
each is then loaded and timed on scratch copies of the call's arguments (the caller's tensors,
outputs included, are never written); a config that fails to compile or launch scores inf and
is reported; the record goes to the tuning store, so no process tunes that problem again.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import sys
import time
from concurrent.futures import as_completed
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from vitrail import __version__
from vitrail.jit.errors import VitrailError
from vitrail.tune.settings import PickAny, Settings, current
from vitrail.tune.space import Config, Limits, Space, limits
from vitrail.tune.store import Record, RecordKey, TuningStore

log = logging.getLogger("vitrail.tune")
_GIB = 1 << 30


class TuningError(VitrailError):
    """Tuning could not choose a config: every candidate failed, or tuning is not allowed here."""


@dataclass(frozen=True)
class Tunable:
    """What the tuner needs of a kernel family.

    ``render(config)`` returns the keyword arguments of ``vitrail.jit.compile`` for one config
    (they travel to compile processes, so they must be picklable); ``source_hash`` identifies
    the kernel's code (``source_hash(kernel_source)``), so a new kernel version does not reuse
    old timings.
    """
    name: str
    space: Space
    render: Callable[[Config], dict]
    source_hash: str


# C and C++ comments, and the string and character literals they may not start inside
_COMMENT_OR_LITERAL = re.compile(r'//[^\n]*|/\*.*?\*/|("(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\')',
                                 re.S)


def source_hash(kernel_source: str) -> str:
    """The tuning store's name of a kernel's code: a hash of its source without its comments,
    its spacing collapsed, so that editing a comment or a line's layout keeps the timings of
    the code that did not change (a change of code is tuned afresh)."""
    code = _COMMENT_OR_LITERAL.sub(lambda m: m.group(1) or " ", kernel_source)
    return hashlib.sha256(" ".join(code.split()).encode()).hexdigest()[:16]


def pick(tunable: Tunable, problem_key: str, problem: Any, *,
         run: Callable[[Config, tuple], None] | None = None, args: tuple = (),
         lim: Limits | None = None, timer: Callable[[Callable[[], None]], float] | None = None,
         store: TuningStore | None = None, settings: Settings | None = None) -> Config:
    """The config to use for one problem under the current settings.

    ``run(config, args)`` compiles (through the cache) and launches config on args; PickBest
    calls it on scratch copies, through ``timer`` (default: vitrail.profile.measure's median).
    """
    s = settings or current()
    lim = lim or limits()
    if s.deterministic and _distributed():
        return _pick_on_rank0(tunable, problem_key, problem, run, args, lim, timer, store, s)
    return _pick_here(tunable, problem_key, problem, run, args, lim, timer, store, s)


def _pick_here(tunable, problem_key, problem, run, args, lim, timer, store, s) -> Config:
    store = store or TuningStore()
    key = record_key(tunable, problem_key, lim)
    record = store.get(key) if key is not None else None
    if record is not None:
        stored = _in_space(tunable.space, record.config)  # None: the space changed since
        if stored is not None and not tunable.space.reasons(stored, lim):
            return stored
    if s.policy is PickAny:
        return tunable.space.default(problem, lim)
    if run is None:
        raise TuningError(f"PickBest for '{tunable.name}' needs a way to run candidates")
    _refuse_capture(tunable.name)
    if key is None:
        raise TuningError(f"PickBest for '{tunable.name}' needs a GPU to time candidates on")
    candidates = candidates_for(tunable.space, problem, lim, s.max_configs)
    failures = compile_all([(c, tunable.render(c)) for c in candidates],
                           max_workers=s.max_workers, verbose=s.verbose, label=tunable.name)
    devices = timing_devices(s.devices, args, tunable.name)
    timings = time_candidates(tunable.name, candidates, failures, run, args,
                              timer or _default_timer, devices, s.allow_failure)
    ok = [(t["ms"], i) for i, t in enumerate(timings) if t["ms"] is not None]
    if not ok:
        why = "\n".join(f"  {c.label}: {t['error']}" for c, t in zip(candidates, timings))
        raise TuningError(f"every candidate config of '{tunable.name}' failed for problem "
                          f"{problem_key}:\n{why}")
    best = candidates[min(ok)[1]]
    store.put(Record(key, best, timings))
    if s.verbose:
        _print_timings(tunable.name, problem_key, candidates, timings, best)
    return best


def record_key(tunable: Tunable, problem_key: str, lim: Limits) -> RecordKey | None:
    """The store key on this GPU (None without one: records are per GPU model)."""
    if lim.sm_count is None:
        return None
    gpu = lim.source.removeprefix("GPU ")
    return RecordKey(tunable.name, tunable.source_hash, problem_key, gpu, lim.sm_count,
                     __version__)


def candidates_for(space: Space, problem: Any, lim: Limits, max_configs: int) -> list[Config]:
    """The heuristic's config first (when it has one), then the valid configs in space order."""
    valid = space.valid(lim)
    if not valid:
        raise TuningError(f"no config of the space can run on {lim}")
    first = []
    if space.heuristic is not None:
        first = [space.default(problem, lim)]
    return (first + [c for c in valid if c not in first])[:max_configs]


def scratch_copy(args: Sequence[Any], device: Any = None) -> tuple:
    """The arguments with every tensor replaced by a copy of the same strides and values (on
    ``device`` when one is given, else on the tensor's own)."""
    import torch
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            where = a.device if device is None or a.device.type != "cuda" else device
            copy = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=where)
            out.append(copy.copy_(a))
        else:
            out.append(a)
    return tuple(out)


# --------------------------------------------------------------------------------- timing
def timing_devices(requested: str | tuple[int, ...], args: Sequence[Any],
                   name: str) -> list[int | None]:
    """The GPUs to time candidates on: ``[None]`` (the current device, no switching) for
    ``"current"``; for ``"all"`` or a tuple of indices, the arguments' GPU first, then the other
    visible GPUs of the same model (name and SM count): timings from another model would rank
    configs for the wrong chip, so a tuple naming one is refused."""
    if requested == "current":
        return [None]
    import torch
    if not torch.cuda.is_available():
        return [None]
    home = next((a.device.index for a in args
                 if isinstance(a, torch.Tensor) and a.device.type == "cuda"), None)
    home = torch.cuda.current_device() if home is None else home
    count = torch.cuda.device_count()
    if requested == "all":
        chosen = [home] + [i for i in range(count) if i != home and _model(i) == _model(home)]
    else:
        missing = [i for i in requested if not 0 <= i < count]
        if missing:
            raise TuningError(f"settings(devices={requested}) for '{name}': no GPU {missing[0]}; "
                              f"{count} visible")
        other = [i for i in requested if _model(i) != _model(home)]
        if other:
            raise TuningError(
                f"settings(devices={requested}) for '{name}': GPU {other[0]} is a "
                f"{_model(other[0])[0]}, not a {_model(home)[0]} like the arguments' GPU {home}; "
                f"timings must come from the chip the config will run on")
        chosen = sorted(set(requested), key=lambda i: (i != home, i))
    return chosen if len(chosen) > 1 else [None]


def _model(index: int) -> tuple[str, int]:
    import torch
    p = torch.cuda.get_device_properties(index)
    return p.name, p.multi_processor_count


def time_candidates(name: str, candidates: list[Config], failures: dict[Config, str],
                    run: Callable[[Config, tuple], None], args: tuple,
                    timer: Callable[[Callable[[], None]], float], devices: list[int | None],
                    allow_failure: bool) -> list[dict]:
    """One timing record per candidate, in candidate order: ``{"config", "ms", "error"}``, plus
    ``"device"`` when timed on several GPUs.

    Several GPUs share the candidates round-robin, one host thread each (the host waits on
    events with the GIL released, so the GPUs run at once). Each GPU also times the first
    candidate, the reference, and its timings are scaled by reference-on-first-GPU over
    reference-on-this-GPU, so a GPU running a few percent slow does not skew the ranking.
    """
    if len(devices) == 1:
        return [_time_one(name, c, failures, run, args, timer, None, allow_failure)
                for c in candidates]
    from concurrent.futures import ThreadPoolExecutor
    reference = candidates[0]
    shares = {d: [reference] + [c for i, c in enumerate(candidates)
                                if i % len(devices) == k and c != reference]
              for k, d in enumerate(devices)}

    def time_share(device):
        with _device_scope(device):
            return [_time_one(name, c, failures, run, args, timer, device, allow_failure)
                    for c in shares[device]]

    with ThreadPoolExecutor(len(devices), thread_name_prefix="vitrail-tune") as pool:
        results = dict(zip(devices, pool.map(time_share, devices)))
    base = results[devices[0]][0]["ms"]
    timed: dict[Config, dict] = {}
    for device in devices:
        ref = results[device][0]["ms"]
        scale = base / ref if base and ref else 1.0
        for config, t in zip(shares[device], results[device]):
            if config == reference and device != devices[0]:
                continue  # the reference's own record is the first GPU's
            t["device"] = device
            if t["ms"] is not None:
                t["raw_ms"], t["ms"] = t["ms"], t["ms"] * scale
            timed[config] = t
    return [timed[c] for c in candidates]


def _time_one(name, config, failures, run, args, timer, device, allow_failure) -> dict:
    error = failures.get(config)
    ms = math.inf
    if error is None:
        try:
            scratch = scratch_copy(args, device)
            ms = timer(lambda c=config, a=scratch: run(c, a))
        except Exception as e:  # a launch failure is a score, not a crash
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if error is not None and not allow_failure:
        raise TuningError(f"'{name}' config {config.label} failed: {error}")
    return {"config": dict(config), "ms": None if math.isinf(ms) else ms, "error": error}


def _device_scope(device: int | None):
    import contextlib
    if device is None:
        return contextlib.nullcontext()
    import torch
    return torch.cuda.device(device)


def _default_timer(fn: Callable[[], None]) -> float:
    from vitrail.profile import measure
    return measure(fn).median


def _refuse_capture(name: str) -> None:
    import torch
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise TuningError(
            f"'{name}' would be tuned while the current stream is being captured into a CUDA "
            f"graph, where nothing can be timed; run it once before capturing (tuning is "
            f"stored, and a tuned op captures and replays), or use vitrail.PickAny")


# ------------------------------------------------------------------------------ compiling
def compile_all(jobs: list[tuple[Config, dict]], *, max_workers: int | None = None,
                verbose: bool = False, label: str = "") -> dict[Config, str]:
    """Compile every (config, jit.compile kwargs) into the cache; returns {config: error} for
    the ones that failed. One process per job (vitrail.tune.compile_job), at most as many at
    once as cores and memory allow; a process that dies fails its own job only. Kwargs None:
    a config that compiles nothing (Op's render), skipped."""
    jobs = [(config, kwargs) for config, kwargs in jobs if kwargs is not None]
    workers = worker_count(max_workers, len(jobs))
    progress = _Progress(len(jobs), f"compiling {label} configs", verbose)
    failures: dict[Config, str] = {}
    if workers <= 1:
        from vitrail.tune.compile_job import run
        for config, kwargs in jobs:
            error = run(kwargs)
            if error:
                failures[config] = error
            progress.step()
        progress.done()
        return failures
    from concurrent.futures import ThreadPoolExecutor
    env = child_env()
    jobs = [(config, kwargs) for config, kwargs in jobs if not _built(kwargs)]
    for _ in range(progress.total - len(jobs)):
        progress.step()  # already in the cache: no process started for them
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="vitrail-compile") as pool:
        futures = {pool.submit(_compile_in_process, kwargs, env): config
                   for config, kwargs in jobs}
        for future in as_completed(futures):
            error = future.result()
            if error:
                failures[futures[future]] = error
            progress.step()
    progress.done()
    return failures


def _compile_in_process(kwargs: dict, env: dict) -> str | None:
    import json
    import pickle
    import subprocess
    done = subprocess.run([sys.executable, "-m", "vitrail.tune.compile_job"],
                          input=pickle.dumps(kwargs), capture_output=True, env=env)
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    if done.returncode == 0 and lines:
        try:
            return json.loads(lines[-1])["error"]
        except (ValueError, KeyError, TypeError):
            pass
    why = (f"killed by signal {-done.returncode} (out of memory?)" if done.returncode < 0
           else f"exit status {done.returncode}")
    tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:]
    return f"compile process failed: {why}" + (f": {tail[0]}" if tail else "")


def _built(kwargs: dict) -> bool:
    """Whether the kernel is in the cache already (its key is computed here, nothing built)."""
    from vitrail.jit.compiler import is_built
    try:
        return is_built(**kwargs)
    except Exception:  # let the compile process find and report what is wrong
        return False


def child_env() -> dict:
    """This process's environment, with its import path, so children import the same vitrail."""
    env = dict(os.environ)
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def worker_count(requested: int | None, jobs: int) -> int:
    """Processes for jobs compiles: the request, bounded by cores, ~2 GiB of memory each, jobs."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    memory = _available_memory() // (2 * _GIB) or 1
    return max(1, min(requested or cores, cores, memory, jobs))


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * _GIB


class _Progress:
    """A progress bar on stderr, shown when verbose or when stderr is a terminal: one line
    redrawn with carriage returns when stdout and stderr are both terminals, else (`vitrail
    bench > log`, `| tee`, CI) about ten whole lines, stdout flushed first so a log that holds
    both keeps their order."""

    def __init__(self, total: int, what: str, verbose: bool):
        self.total, self.what, self.done_count = total, what, 0
        self.enabled = total > 1 and (verbose or _isatty(sys.stderr))
        self.redraw = _isatty(sys.stderr) and _isatty(sys.stdout)
        self.start = time.monotonic()

    def step(self) -> None:
        self.done_count += 1
        if not self.enabled:
            return
        elapsed = f"{self.done_count}/{self.total} {time.monotonic() - self.start:.0f} s"
        if self.redraw:  # one line, redrawn
            width = 24
            filled = width * self.done_count // self.total
            sys.stderr.write(f"\rvitrail: {self.what} [{'#' * filled}{'.' * (width - filled)}] "
                             f"{elapsed}")
        else:  # a log file: whole lines, about ten of them
            if self.done_count % max(1, self.total // 10) and self.done_count != self.total:
                return
            sys.stdout.flush()
            sys.stderr.write(f"vitrail: {self.what} {elapsed}\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.enabled and self.redraw:
            sys.stderr.write("\n")


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without it, or closed
        return False


def _print_timings(name: str, problem_key: str, candidates: list[Config], timings: list[dict],
                   best: Config) -> None:
    print(f"vitrail: tuned '{name}' for {problem_key}:", file=sys.stderr)
    for config, t in sorted(zip(candidates, timings),
                            key=lambda ct: ct[1]["ms"] if ct[1]["ms"] is not None else math.inf):
        mark = " <- best" if config == best else ""
        shown = f"{t['ms'] * 1e3:10.1f} us" if t["ms"] is not None else f"  failed: {t['error']}"
        print(f"  {config.label:<40}{shown}{mark}", file=sys.stderr)


# ---------------------------------------------------------------------------- distributed
def _distributed() -> bool:
    try:
        import torch.distributed as dist
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    except ImportError:
        return False


def _pick_on_rank0(tunable, problem_key, problem, run, args, lim, timer, store, s) -> Config:
    """Rank 0 chooses (tuning if its policy says so); every rank gets its choice."""
    import torch.distributed as dist
    chosen = [None]
    if dist.get_rank() == 0:
        chosen[0] = _pick_here(tunable, problem_key, problem, run, args, lim, timer, store,
                               s).to_json()
    dist.broadcast_object_list(chosen, src=0)
    config = _in_space(tunable.space, Config.from_json(chosen[0]))
    if config is None:
        raise TuningError(f"rank 0 chose {chosen[0]} for '{tunable.name}', which is not in this "
                          f"rank's space: are all ranks running the same vitrail?")
    return config


def _in_space(space: Space, config: Config) -> Config | None:
    """config rebuilt in the space's parameter order, or None if the space has no such config."""
    try:
        return space.config(**dict(config))
    except ValueError:
        return None
