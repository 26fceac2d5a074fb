"""roofline against hand-computed values: a compute-bound GEMM, a copy, a FLOP-only count, a
memory-bound elementwise op, the ridge point, and every argument check."""
from __future__ import annotations

import math

import pytest

from vitrail.profile import Peaks, roofline

H100ISH = {"bf16_tflops": 800.0, "copy_gbps": 3000.0}


def test_achieved_rates_without_peaks():
    # 2 * 4096^3 FLOP and three 4096^2 bf16 matrices in 0.25 ms
    r = roofline(flops=2 * 4096 ** 3, bytes=3 * 4096 * 4096 * 2, ms=0.25)
    assert r.tflops == pytest.approx(549.755813888)   # 137438953472 / 0.25e-3 / 1e12
    assert r.gbps == pytest.approx(402.653184)        # 100663296 / 0.25e-3 / 1e9
    assert r.intensity == pytest.approx(4096 / 3)     # FLOP per byte
    assert r.pct_compute is None and r.pct_memory is None and r.pct_roofline is None
    assert r.bound is None and r.attainable_tflops is None


def test_a_compute_bound_gemm():
    r = roofline(flops=2 * 4096 ** 3, bytes=3 * 4096 * 4096 * 2, ms=0.25, peaks=H100ISH)
    assert r.pct_compute == pytest.approx(68.719476736)   # 549.755813888 / 800
    assert r.pct_memory == pytest.approx(13.4217728)      # 402.653184 / 3000
    # bound: max(0.17179869184 ms of compute, 0.033554432 ms of traffic) = compute
    assert r.bound == "compute"
    assert r.pct_roofline == pytest.approx(68.719476736)
    assert r.attainable_tflops == pytest.approx(800.0)    # min(800, 1365.3 * 3000 / 1e3)
    assert "68.7% of the roofline (compute bound" in str(r)


def test_a_copy_is_memory_bound():
    r = roofline(bytes=2 << 30, ms=1.0, peaks={"copy_gbps": 2500, "bf16_tflops": 800})
    assert r.gbps == pytest.approx(2147.483648) and r.tflops == 0.0 and r.intensity == 0.0
    assert r.pct_memory == pytest.approx(85.89934592) and r.pct_compute == 0.0
    assert r.pct_roofline == pytest.approx(85.89934592) and r.bound == "memory"
    assert r.attainable_tflops is None


def test_flops_alone_are_compute_bound():
    r = roofline(flops=1e12, ms=2.0, peaks=Peaks(copy_gbps=3000.0, bf16_tflops=1000.0))
    assert r.tflops == pytest.approx(500.0) and r.gbps == 0.0 and r.intensity is None
    assert (r.pct_compute, r.pct_memory, r.pct_roofline) == pytest.approx((50.0, 0.0, 50.0))
    assert r.bound == "compute" and r.attainable_tflops == 1000.0


def test_a_memory_bound_elementwise_op_is_judged_by_its_bandwidth():
    # 1 GFLOP over 8 GB in 4 ms: 0.25 TFLOP/s, 2000 GB/s, 0.125 FLOP/byte
    r = roofline(flops=1e9, bytes=8e9, ms=4.0, peaks={"tflops": 1000, "gbps": 2500})
    assert r.tflops == pytest.approx(0.25) and r.gbps == pytest.approx(2000.0)
    assert r.intensity == pytest.approx(0.125)
    assert r.attainable_tflops == pytest.approx(0.3125)   # 0.125 * 2500 / 1e3
    assert r.pct_roofline == pytest.approx(80.0)          # 0.25 / 0.3125 = 2000 / 2500
    assert r.pct_memory == pytest.approx(80.0) and r.pct_compute == pytest.approx(0.025)
    assert r.bound == "memory"


def test_pct_roofline_is_the_larger_of_the_two_percentages():
    for flops, nbytes in [(1e12, 1e9), (1e10, 1e10), (5e11, 2e9), (4e12, 1e10)]:
        r = roofline(flops=flops, bytes=nbytes, ms=3.0, peaks={"tflops": 1000, "gbps": 2500})
        assert r.pct_roofline == pytest.approx(max(r.pct_compute, r.pct_memory))
        # attainable performance reached, in FLOP terms, is the same number
        assert r.pct_roofline == pytest.approx(100 * r.tflops / r.attainable_tflops)


def test_at_the_ridge_point_both_bounds_agree():
    # ridge of 1000 TFLOP/s over 2500 GB/s: 400 FLOP/byte; 4 ms of each at 10 ms
    r = roofline(flops=4e12, bytes=1e10, ms=10.0, peaks={"tflops": 1000, "gbps": 2500})
    assert r.pct_compute == pytest.approx(40.0) and r.pct_memory == pytest.approx(40.0)
    assert r.pct_roofline == pytest.approx(40.0)


def test_numpy_numbers_are_accepted():
    np = pytest.importorskip("numpy")
    r = roofline(flops=np.int64(10 ** 12), bytes=np.float32(1e9), ms=np.float64(1.0))
    assert r.tflops == pytest.approx(1000.0) and r.gbps == pytest.approx(1000.0)


@pytest.mark.parametrize("kwargs, error, name", [
    ({"flops": 1, "ms": 0}, ValueError, "ms"), ({"flops": 1, "ms": -1.0}, ValueError, "ms"),
    ({"flops": 1, "ms": math.nan}, ValueError, "ms"),
    ({"flops": 1, "ms": math.inf}, ValueError, "ms"),
    ({"flops": -1, "ms": 1}, ValueError, "flops"), ({"bytes": -8, "ms": 1}, ValueError, "bytes"),
    ({"bytes": math.inf, "ms": 1}, ValueError, "bytes"),
    ({"flops": "1e12", "ms": 1}, TypeError, "flops"),
    ({"flops": True, "ms": 1}, TypeError, "flops"),
    ({"bytes": None, "ms": 1}, TypeError, "bytes"), ({"flops": 1, "ms": "1"}, TypeError, "ms"),
    ({"ms": 1.0}, ValueError, "flops and bytes are both 0"),
])
def test_bad_arguments_are_refused_by_name(kwargs, error, name):
    with pytest.raises(error, match=name):
        roofline(**kwargs)


def test_ms_is_required():
    with pytest.raises(TypeError):
        roofline(flops=1)


@pytest.mark.parametrize("peaks, error, match", [
    ({"bf16_tflops": 800}, ValueError, "copy_gbps"),
    ({"gbps": 3000}, ValueError, "bf16_tflops"),
    ({"tflops": 0, "gbps": 3000}, ValueError, "positive"),
    ({"tflops": 800, "gbps": -1}, ValueError, "gbps"),
    ({"tflops": "800", "gbps": 3000}, TypeError, "tflops"),
    ((800, 3000), TypeError, "peaks"),
])
def test_bad_peaks_are_refused(peaks, error, match):
    with pytest.raises(error, match=match):
        roofline(flops=1e12, bytes=1e9, ms=1.0, peaks=peaks)


def test_the_short_names_take_precedence_over_the_measured_ones():
    r = roofline(flops=1e12, ms=1.0, peaks={"tflops": 2000, "bf16_tflops": 1000, "gbps": 1})
    assert r.peak_tflops == 2000 and r.pct_compute == pytest.approx(50.0)
