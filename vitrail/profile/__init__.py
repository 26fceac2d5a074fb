"""Timing and profiling done once, right, for everyone: benchmarks, the tuner and tests use it.

- :func:`measure` times a GPU function with CUDA events after warm-up, the L2 flushed before
  each call, and returns a :class:`Timing` (median, min, max, mean, spread, samples) in
  milliseconds; :func:`compare` times several implementations in interleaved rounds (clock
  drift falls on all).
- :func:`peaks` measures (once per machine, then cached) the GPU's copy bandwidth and bf16
  matmul throughput; :func:`roofline` turns FLOPs, bytes and milliseconds into TFLOP/s, GB/s
  and percentages of those peaks.
- :func:`trace` writes a Chrome trace with torch.profiler; :func:`ncu` builds (and runs) an
  Nsight Compute command line for one kernel.
- :func:`plot_sweep` and :func:`plot_bench` draw PNGs (needs ``pip install "vitrail[plot]"``;
  matplotlib is imported only when a plot is drawn).

Neither torch nor matplotlib is imported by ``import vitrail.profile``. ``measure``'s module is
vitrail.profile.timing; peaks, roofline and trace share their names with their modules, so
``vitrail.profile.peaks`` is the function: reach such a module as
``importlib.import_module("vitrail.profile.peaks")``. "bench" means one thing, the benchmarks
of ``vitrail bench`` (``vitrail.bench``); the timing function's former name, ``bench``, still
reaches ``measure``, with a DeprecationWarning.
"""
import warnings

from vitrail.profile.timing import Timing, compare, measure, timing_from_samples
from vitrail.profile.peaks import Peaks, peaks
from vitrail.profile.plot import plot_bench, plot_sweep
from vitrail.profile.roofline import Roofline, roofline
from vitrail.profile.trace import NcuCommand, NcuError, ncu, trace

__all__ = ["measure", "compare", "Timing", "timing_from_samples", "peaks", "Peaks", "roofline",
           "Roofline", "trace", "ncu", "NcuCommand", "NcuError", "plot_sweep", "plot_bench"]


def __getattr__(name: str):
    if name == "bench":  # the timing function's former name
        warnings.warn("vitrail.profile.bench is vitrail.profile.measure now (\"bench\" names "
                      "vitrail.bench, the benchmarks of `vitrail bench`)", DeprecationWarning,
                      stacklevel=2)
        return measure
    raise AttributeError(f"module 'vitrail.profile' has no attribute {name!r}")
