"""Where a kernel stands against the roofline: achieved TFLOP/s and GB/s, and how close to the
bound that applies to it.

A kernel's time is bounded below by ``max(flops / peak_flops, bytes / peak_bandwidth)``: the
roofline. ``pct_roofline`` is that bound over the measured time, i.e. the percentage of the
attainable performance ``min(peak_flops, intensity * peak_bandwidth)`` reached; it equals
``max(pct_compute, pct_memory)``. ``bound`` names the term that sets the bound. Pure Python: the
FLOP and byte counts come from the caller (the minimal traffic of the problem, not what a
particular kernel happens to move), the milliseconds from :func:`vitrail.profile.measure`.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class Roofline:
    """Achieved rates of one measurement and, where peaks were given, percentages of them.

    ``tflops`` is 1e12 FLOP/s, ``gbps`` 1e9 bytes/s; ``intensity`` is FLOP per byte (None when
    ``bytes`` is 0). The percentages, ``bound`` and ``attainable_tflops`` are None without peaks.
    """
    ms: float
    flops: float
    bytes: float
    tflops: float
    gbps: float
    intensity: float | None
    peak_tflops: float | None = None
    peak_gbps: float | None = None
    pct_compute: float | None = None
    pct_memory: float | None = None
    pct_roofline: float | None = None
    bound: str | None = None  # "memory" or "compute"

    @property
    def attainable_tflops(self) -> float | None:
        """min(peak TFLOP/s, intensity x peak bandwidth); None without peaks or with no FLOPs."""
        if self.peak_tflops is None or self.peak_gbps is None or not self.flops:
            return None
        if self.intensity is None:
            return self.peak_tflops
        return min(self.peak_tflops, self.intensity * self.peak_gbps / 1e3)

    def __str__(self) -> str:
        text = f"{self.ms * 1e3:.1f} µs: {self.tflops:.1f} TFLOP/s, {self.gbps:.0f} GB/s"
        if self.pct_roofline is not None:
            text += (f"; {self.pct_roofline:.1f}% of the roofline ({self.bound} bound; "
                     f"{self.pct_compute:.1f}% of compute, {self.pct_memory:.1f}% of bandwidth)")
        return text


def roofline(*, flops: float = 0, bytes: float = 0, ms: float,
             peaks: Any = None) -> Roofline:
    """Achieved rates of ``flops`` floating-point operations and ``bytes`` of memory traffic done
    in ``ms`` milliseconds, compared with ``peaks`` where given: a :class:`~vitrail.profile.Peaks`
    or a mapping with ``bf16_tflops`` and ``copy_gbps`` (or ``tflops`` and ``gbps``; use these to
    compare against another dtype's peak). At least one of flops and bytes must be positive.
    """
    flops = _number("flops", flops)
    nbytes = _number("bytes", bytes)
    ms = _number("ms", ms)
    if ms <= 0:
        raise ValueError(f"ms: expected a positive time in milliseconds, got {ms!r}")
    if flops == 0 and nbytes == 0:
        raise ValueError("flops and bytes are both 0: give the FLOPs, the bytes moved, or both")
    seconds = ms * 1e-3
    tflops = flops / seconds / 1e12
    gbps = nbytes / seconds / 1e9
    intensity = flops / nbytes if nbytes else None
    if peaks is None:
        return Roofline(ms, flops, nbytes, tflops, gbps, intensity)
    peak_tflops, peak_gbps = _peaks(peaks)
    compute_ms = flops / (peak_tflops * 1e12) * 1e3
    memory_ms = nbytes / (peak_gbps * 1e9) * 1e3
    return Roofline(ms, flops, nbytes, tflops, gbps, intensity,
                    peak_tflops=peak_tflops, peak_gbps=peak_gbps,
                    pct_compute=100 * tflops / peak_tflops, pct_memory=100 * gbps / peak_gbps,
                    pct_roofline=100 * max(compute_ms, memory_ms) / ms,
                    bound="memory" if memory_ms > compute_ms else "compute")


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__} {value!r:.60}")
    out = float(value)
    if not math.isfinite(out) or out < 0:
        raise ValueError(f"{name}: expected a finite, non-negative number, got {value!r}")
    return out


def _peaks(peaks: Any) -> tuple[float, float]:
    from vitrail.profile.peaks import Peaks
    if isinstance(peaks, Peaks):
        pair = {"tflops": peaks.bf16_tflops, "gbps": peaks.copy_gbps}
    elif isinstance(peaks, Mapping):
        pair = {}
        for short, long in (("tflops", "bf16_tflops"), ("gbps", "copy_gbps")):
            if short in peaks:
                pair[short] = peaks[short]
            elif long in peaks:
                pair[short] = peaks[long]
            else:
                raise ValueError(f"peaks: the mapping has no '{long}' (or '{short}') entry; "
                                 f"it has {sorted(map(str, peaks))}")
    else:
        raise TypeError(f"peaks: expected a vitrail.profile.Peaks or a mapping with "
                        f"'bf16_tflops' and 'copy_gbps', got {type(peaks).__name__}")
    out = []
    for short in ("tflops", "gbps"):
        value = _number(f"peaks[{short!r}]", pair[short])
        if value <= 0:
            raise ValueError(f"peaks[{short!r}]: expected a positive peak, got {pair[short]!r}")
        out.append(value)
    return out[0], out[1]
