"""Time a GPU function once, right, for everyone: CUDA events, warm-up, a flushed L2.

Every benchmark, tuner and test in vitrail times GPU work through :func:`measure`, so they all
measure the same thing the same way: ``warmup`` untimed calls, then ``rep`` calls each between a
pair of CUDA events recorded on the current stream, with the L2 cache flushed before each timed
call (outside the events) so a kernel never reads its inputs from a cache that a real model
would have evicted. The host synchronizes once, after the last call: a sync inside the loop
would let the GPU run dry between calls and time the host instead.

:func:`timing_from_samples` turns the per-call milliseconds into a :class:`Timing`; it is pure
Python, so the statistics are tested without a GPU.
"""
from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

# Where the device does not report its L2 size, flush with a buffer this large (more than twice
# any L2 shipped so far: H100 50 MiB, B200 126 MiB).
FALLBACK_FLUSH_BYTES = 256 << 20


@dataclass(frozen=True)
class Timing:
    """Statistics of ``rep`` timed calls, in milliseconds.

    ``spread`` is (p90 - p10) / median: the width of the middle 80% of the samples relative to
    the median (0.02 = the calls agree within about 2%). Compare medians; a large spread says the
    machine was noisy (clocks, other processes) and the comparison is weak.
    """
    median: float
    min: float
    max: float
    mean: float
    spread: float
    samples: tuple[float, ...]
    rep: int

    def __str__(self) -> str:
        return (f"{_fmt_ms(self.median)} median (min {_fmt_ms(self.min)}, "
                f"max {_fmt_ms(self.max)}, spread {self.spread:.1%}, {self.rep} reps)")


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default "linear" method)."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"q={q!r}: expected a percentile between 0 and 100")
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def speedup_of(value: float, base: float, lower_is_better: bool) -> float | None:
    """How many times better value is than base (> 1: better), whichever way the unit points;
    None where either is 0 (or missing)."""
    if not value or not base:
        return None
    return base / value if lower_is_better else value / base


def geomean(values: Sequence[float]) -> float:
    """The geometric mean of positive values (of speedups: the mean that 2x and 0.5x cancel in)."""
    return math.exp(sum(math.log(x) for x in values) / len(values))


def timing_from_samples(samples_ms: Sequence[float]) -> Timing:
    """A :class:`Timing` from per-call times in milliseconds (at least one; each finite and
    non-negative)."""
    try:
        samples = tuple(float(s) for s in samples_ms)
    except (TypeError, ValueError):
        raise TypeError(f"samples_ms: expected a sequence of numbers (milliseconds), got "
                        f"{samples_ms!r:.80}") from None
    if not samples:
        raise ValueError("samples_ms: expected at least one sample, got none")
    bad = [s for s in samples if not math.isfinite(s) or s < 0]
    if bad:
        raise ValueError(f"samples_ms: every sample must be a finite, non-negative number of "
                         f"milliseconds; got {bad[0]!r}")
    median = percentile(samples, 50)
    width = percentile(samples, 90) - percentile(samples, 10)
    spread = width / median if median > 0 else (0.0 if width == 0 else math.inf)
    return Timing(median=median, min=min(samples), max=max(samples),
                  mean=math.fsum(samples) / len(samples), spread=spread, samples=samples,
                  rep=len(samples))


def measure(fn: Callable[[], Any], *, warmup: int = 25, rep: int = 100, flush_l2: bool = True,
          device: Any = None) -> Timing:
    """Time ``fn()`` on the GPU: ``warmup`` untimed calls (a count, not milliseconds), then
    ``rep`` calls, each between two CUDA events on the current stream of ``device``.

    ``fn`` must enqueue its work on the current stream (as vitrail's ops and torch do); work on
    other streams is not timed. With ``flush_l2``, a buffer of twice the L2 size is zeroed before
    each timed call, outside the events. ``device``: None (the current device), an index, a
    string such as ``"cuda:1"`` or a ``torch.device``. Raises RuntimeError where no GPU is visible.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable taking no arguments, got {type(fn).__name__}")
    warmup = check_count("warmup", warmup, minimum=0)
    rep = check_count("rep", rep, minimum=1)
    import torch
    dev = cuda_device(device, "measure")
    with torch.cuda.device(dev):
        flush = _flush_buffer(dev) if flush_l2 else None
        began = time.perf_counter()
        for _ in range(warmup):
            fn()
        host_per_call = (time.perf_counter() - began) / warmup if warmup else DEFAULT_HOST_S
        stream = torch.cuda.current_stream(dev)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
        # Keep the GPU busy while the host queues the timed loop: otherwise a short kernel's
        # events also bracket the host's launch latency (the GPU idles between them).
        _hold_gpu(dev, rep * (host_per_call + EVENT_HOST_S) * 1.25)
        for start, end in zip(starts, ends):
            if flush is not None:
                flush.zero_()
            start.record(stream)
            fn()
            end.record(stream)
        torch.cuda.synchronize(dev)
    return timing_from_samples([s.elapsed_time(e) for s, e in zip(starts, ends)])


def compare(fns: Mapping[str, Callable[[], Any]], *, rounds: int = 5, rep: int = 100,
            warmup_s: float = 0.2, flush_l2: bool = True, device: Any = None) -> dict[str, Timing]:
    """Time several implementations of one computation fairly: {name: Timing}.

    A GPU's clocks follow its temperature and power draw, so back-to-back timings of A then B
    drift against whichever runs later (docs/perf-notes.md#clocks-drift-between-timings).
    Here every function first runs for at least ``warmup_s`` seconds
    (synchronized: modules loaded, clocks up), then the functions are timed in ``rounds``
    interleaved rounds, the order rotated each round, ``rep // rounds`` calls each (as
    :func:`measure`); each Timing holds all of its function's samples.
    """
    if not isinstance(fns, Mapping) or not fns:
        raise TypeError(f"fns: expected a non-empty mapping of name -> callable, got {fns!r:.80}")
    for name, fn in fns.items():
        if not callable(fn):
            raise TypeError(f"fns[{name!r}]: expected a callable taking no arguments, got "
                            f"{type(fn).__name__}")
    rounds = check_count("rounds", rounds, minimum=1)
    rep = check_count("rep", rep, minimum=1)
    if not (isinstance(warmup_s, (int, float)) and math.isfinite(warmup_s) and warmup_s >= 0):
        raise ValueError(f"warmup_s: expected seconds >= 0, got {warmup_s!r}")
    import torch
    dev = cuda_device(device, "compare")
    names = list(fns)
    with torch.cuda.device(dev):
        for name in names:
            began, calls = time.perf_counter(), 0
            while calls < 3 or time.perf_counter() - began < warmup_s:
                fns[name]()
                torch.cuda.synchronize(dev)
                calls += 1
    per_round = max(1, rep // rounds)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = measure(fns[name], warmup=2, rep=per_round, flush_l2=flush_l2, device=dev)
            samples[name].extend(t.samples)
    return {name: timing_from_samples(samples[name]) for name in names}


DEFAULT_HOST_S = 50e-6  # host seconds per call assumed when there is no warm-up to measure
EVENT_HOST_S = 10e-6  # host seconds to record a pair of events (and launch a flush)
MAX_HOLD_S = 0.5


def _hold_gpu(device: Any, seconds: float) -> None:
    """Enqueue a GPU spin of about ``seconds`` (at most MAX_HOLD_S) on the current stream."""
    import torch
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return
    khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 1_500_000
    cycles = int(min(seconds, MAX_HOLD_S) * khz * 1e3)
    if cycles > 0:
        sleep(cycles)


def l2_flush_bytes(device: Any) -> int:
    """Bytes to write to evict the L2 of device: twice its L2 size, else 256 MiB."""
    import torch
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
    return 2 * int(l2) if l2 > 0 else FALLBACK_FLUSH_BYTES


def _flush_buffer(device: Any) -> Any:
    import torch
    return torch.empty(l2_flush_bytes(device) // 4, dtype=torch.int32, device=device)


def cuda_device(device: Any, what: str) -> Any:
    """The torch.device of a CUDA device given as None, an index, a string or a torch.device;
    RuntimeError where no GPU is visible, ValueError for a non-CUDA or absent device."""
    import torch
    if not torch.cuda.is_available():
        raise RuntimeError(f"vitrail.profile.{what} needs a CUDA GPU and a CUDA build of torch; "
                           f"none is visible here (torch {torch.__version__}, "
                           f"torch.cuda.is_available() is False)")
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        raise ValueError(f"device: expected None, a CUDA device index, 'cuda:N' or a "
                         f"torch.device, got {device!r}") from None
    if dev.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {device!r}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if not 0 <= dev.index < torch.cuda.device_count():
        raise ValueError(f"device: {device!r} does not exist; {torch.cuda.device_count()} "
                         f"CUDA device(s) are visible")
    return dev


def check_count(name: str, value: Any, *, minimum: int) -> int:
    """value as an int >= minimum, else an error naming the argument."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an integer, got {value!r}")
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {value!r}") from None
    if count < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {count}")
    return count


def _fmt_ms(ms: float) -> str:
    return f"{ms:.3f} ms" if ms >= 1 else f"{ms * 1e3:.2f} µs"
