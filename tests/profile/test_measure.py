"""measure on a machine with no GPU: the statistics of timing_from_samples against hand-computed
values, argument checks, the no-GPU error, and the order of the GPU calls measure makes (events,
flush, one synchronize) against a recording stand-in for torch.cuda."""
from __future__ import annotations

import contextlib
import importlib
import math
from types import SimpleNamespace

import pytest
import torch

from vitrail.profile import Timing, measure, timing_from_samples

timing_mod = importlib.import_module("vitrail.profile.timing")


# ------------------------------------------------------------------------------- statistics
def test_odd_number_of_samples():
    t = timing_from_samples([1.0, 2.0, 3.0, 4.0, 5.0])
    # p10 = 1 + 0.4 * (2 - 1) = 1.4; p90 = 4 + 0.6 * (5 - 4) = 4.6; spread = 3.2 / 3
    assert (t.median, t.min, t.max, t.mean, t.rep) == (3.0, 1.0, 5.0, 3.0, 5)
    assert t.spread == pytest.approx(3.2 / 3)
    assert t.samples == (1.0, 2.0, 3.0, 4.0, 5.0)


def test_even_number_of_unsorted_samples_keeps_their_order():
    t = timing_from_samples([4.0, 1.0, 2.0, 3.0])
    # median = 2.5; p10 at position 0.3 -> 1.3; p90 at position 2.7 -> 3.7; spread = 2.4 / 2.5
    assert t.median == 2.5 and t.mean == 2.5 and (t.min, t.max) == (1.0, 4.0)
    assert t.spread == pytest.approx(0.96)
    assert t.samples == (4.0, 1.0, 2.0, 3.0) and t.rep == 4


def test_one_sample_and_identical_samples_have_no_spread():
    one = timing_from_samples([0.5])
    assert (one.median, one.min, one.max, one.mean, one.spread, one.rep) == (0.5, 0.5, 0.5, 0.5,
                                                                              0.0, 1)
    assert timing_from_samples([0.0, 0.0]).spread == 0.0
    assert timing_from_samples((2, 2, 2)).median == 2.0  # ints and tuples are fine


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    data = [0.31, 0.29, 0.5, 0.33, 0.3, 0.28, 0.41]
    for q in (0, 10, 25, 50, 90, 100):
        assert timing_mod.percentile(data, q) == pytest.approx(float(np.percentile(data, q)))


def test_timing_is_frozen_and_prints_briefly():
    t = timing_from_samples([1.0, 2.0, 3.0, 4.0, 5.0])
    with pytest.raises(AttributeError):
        t.median = 1.0
    assert str(t) == "3.000 ms median (min 1.000 ms, max 5.000 ms, spread 106.7%, 5 reps)"
    assert str(timing_from_samples([0.0125])).startswith("12.50 µs median")


@pytest.mark.parametrize("samples, error", [([], ValueError), ([1.0, math.nan], ValueError),
                                            ([1.0, -0.1], ValueError), ([math.inf], ValueError),
                                            (None, TypeError), (["fast"], TypeError)])
def test_bad_samples_are_refused_naming_the_argument(samples, error):
    with pytest.raises(error, match="samples_ms"):
        timing_from_samples(samples)


# --------------------------------------------------------------------------- argument checks
@pytest.mark.parametrize("kwargs, error, name", [
    ({"rep": 0}, ValueError, "rep"), ({"rep": -5}, ValueError, "rep"),
    ({"rep": 1.5}, TypeError, "rep"), ({"rep": True}, TypeError, "rep"),
    ({"warmup": -1}, ValueError, "warmup"), ({"warmup": "25"}, TypeError, "warmup")])
def test_bad_counts_are_refused_before_anything_runs(kwargs, error, name):
    calls = []
    with pytest.raises(error, match=name):
        measure(lambda: calls.append(1), **kwargs)
    assert calls == []


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="fn: expected a callable"):
        measure(42)


def test_no_gpu_is_a_runtime_error_saying_what_is_needed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        measure(lambda: calls.append(1))
    assert calls == []


# -------------------------------------------------- the GPU path, against a recording torch.cuda
class FakeCuda:
    """Records what measure asks of torch.cuda: event n records as "evN"; the pair starting at
    event n elapses 0.1 * (n + 1) ms."""

    def __init__(self, monkeypatch, l2_bytes=50 << 20, devices=1):
        self.log: list[str] = []
        self.events = 0
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.n = fake.events
                fake.events += 1

            def record(self, stream=None):
                assert stream == "stream"
                fake.log.append(f"ev{self.n}")

            def elapsed_time(self, end):
                assert "sync" in fake.log, "elapsed_time before synchronize"
                assert fake.log.index(f"ev{self.n}") < fake.log.index(f"ev{end.n}")
                return 0.1 * (self.n + 1)

        class Flush:
            def zero_(self):
                fake.log.append("flush")

        for name, value in {
                "is_available": lambda: True, "device_count": lambda: devices,
                "current_device": lambda: 0, "device": lambda d: contextlib.nullcontext(),
                "current_stream": lambda d=None: "stream", "Event": Event,
                "synchronize": lambda d=None: fake.log.append("sync"),
                "_sleep": lambda cycles: fake.log.append("hold"),
                "get_device_properties": lambda d: SimpleNamespace(L2_cache_size=l2_bytes)}.items():
            monkeypatch.setattr(torch.cuda, name, value)
        self.flush_sizes: list[int] = []

        def flush_buffer(dev):
            self.flush_sizes.append(timing_mod.l2_flush_bytes(dev))
            return Flush()
        monkeypatch.setattr(timing_mod, "_flush_buffer", flush_buffer)


def test_events_surround_each_call_the_flush_stays_outside_and_one_sync_ends_it(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    t = measure(lambda: cuda.log.append("fn"), warmup=2, rep=3)
    # events 0-2 start the timed calls, 3-5 end them
    # the GPU is held while the host queues the timed calls, then each call is bracketed
    assert cuda.log == ["fn", "fn", "hold", "flush", "ev0", "fn", "ev3", "flush", "ev1", "fn",
                        "ev4", "flush", "ev2", "fn", "ev5", "sync"]
    assert t.samples == pytest.approx((0.1, 0.2, 0.3)) and t.rep == 3
    assert cuda.flush_sizes == [100 << 20]  # one buffer, twice the 50 MiB L2


def test_without_flush_nothing_is_written_between_calls(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    measure(lambda: cuda.log.append("fn"), warmup=0, rep=2, flush_l2=False)
    assert cuda.log == ["hold", "ev0", "fn", "ev2", "ev1", "fn", "ev3", "sync"]
    assert cuda.flush_sizes == []


def test_the_flush_falls_back_to_256_mib_where_the_l2_size_is_unknown(monkeypatch):
    FakeCuda(monkeypatch, l2_bytes=0)
    assert timing_mod.l2_flush_bytes(torch.device("cuda", 0)) == 256 << 20
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace())
    assert timing_mod.l2_flush_bytes(torch.device("cuda", 0)) == 256 << 20


def test_devices_are_accepted_in_every_spelling_and_checked(monkeypatch):
    FakeCuda(monkeypatch, devices=2)
    cuda1 = torch.device("cuda", 1)
    assert timing_mod.cuda_device(None, "measure") == torch.device("cuda", 0)
    assert timing_mod.cuda_device("cuda", "measure") == torch.device("cuda", 0)
    for spelling in (1, "cuda:1", cuda1):
        assert timing_mod.cuda_device(spelling, "measure") == cuda1
    for bad in ("cpu", 2, "cuda:7", "nonsense", 1.5):
        with pytest.raises(ValueError, match="device"):
            measure(lambda: None, device=bad)


def test_timing_type_is_exported():
    assert isinstance(timing_from_samples([1.0]), Timing)


def test_the_gpu_hold_covers_the_hosts_queueing_and_is_capped(monkeypatch):
    FakeCuda(monkeypatch)
    spun = []
    monkeypatch.setattr(torch.cuda, "_sleep", spun.append)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(L2_cache_size=1 << 20, clock_rate=2_000_000))
    timing_mod._hold_gpu(torch.device("cuda", 0), 1e-3)  # 1 ms at 2 GHz
    timing_mod._hold_gpu(torch.device("cuda", 0), 60.0)  # capped
    assert spun == [2_000_000, int(timing_mod.MAX_HOLD_S * 2e9)]


def test_compare_warms_every_function_then_interleaves_rotated_rounds(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    timings = timing_mod.compare({"a": lambda: cuda.log.append("a"),
                                 "b": lambda: cuda.log.append("b")},
                                rounds=3, rep=6, warmup_s=0)
    calls = [x for x in cuda.log if x in ("a", "b")]
    # warm-up: 3 synchronized calls each; then per round 2 warm-up + 2 timed calls, the order
    # rotated each round (a b, b a, a b)
    assert calls[:6] == ["a"] * 3 + ["b"] * 3
    rounds = calls[6:]
    assert rounds == ["a"] * 4 + ["b"] * 4 + ["b"] * 4 + ["a"] * 4 + ["a"] * 4 + ["b"] * 4
    assert set(timings) == {"a", "b"}
    assert timings["a"].rep == timings["b"].rep == 6  # all rounds' samples kept


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(fns={}), TypeError, "fns"), (dict(fns={"x": 3}), TypeError, "fns\\['x'\\]"),
    (dict(fns={"x": print}, rounds=0), ValueError, "rounds"),
    (dict(fns={"x": print}, warmup_s=-1), ValueError, "warmup_s")])
def test_compare_refuses_bad_arguments_naming_them(kwargs, error, name):
    with pytest.raises(error, match=name):
        timing_mod.compare(**kwargs)


def test_the_former_name_reaches_measure_with_a_warning():
    """``bench`` names vitrail.bench, the benchmarks; the timing function's former name still
    reaches it, saying where it went."""
    import vitrail.profile as profile
    with pytest.warns(DeprecationWarning, match="vitrail.profile.measure"):
        from vitrail.profile import bench
    assert bench is measure
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        profile.nope
