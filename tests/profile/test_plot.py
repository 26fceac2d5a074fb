"""PNG plots: each input form draws a valid PNG whose size follows its content, bad input is
refused by name, and a missing matplotlib gives the install command. Look at the PNGs by eye
after changing the drawing: `python -m pytest tests/profile/test_plot.py --basetemp=/tmp/p`."""
from __future__ import annotations

import math
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from vitrail.bench import Row
from vitrail.profile import plot_bench, plot_sweep, timing_from_samples

pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels of a valid PNG file; fails the test otherwise."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"
    assert len(data) > 10_000, f"{path} is suspiciously small ({len(data)} bytes)"
    return struct.unpack(">II", data[16:24])


def sweep(n: int) -> list[dict]:
    return [{"config": {"BM": 64 * (1 + i % 4), "BN": 64 * (1 + i // 4), "stages": 3},
             "ms": 0.5 + 0.037 * ((i * 7) % n)} for i in range(n)]


def test_sweep_of_dicts(tmp_path):
    path = plot_sweep(sweep(12), tmp_path / "sweeps" / "gemm.png", title="gemm 4096^3 bf16")
    assert path == tmp_path / "sweeps" / "gemm.png"
    width, height = png_size(path)
    assert width > 800 and height > 300


def test_more_configurations_make_a_taller_plot_up_to_a_limit(tmp_path):
    heights = [png_size(plot_sweep(sweep(n), tmp_path / f"{n}.png", title="t"))[1]
               for n in (4, 50, 60)]
    assert heights[0] < heights[1] == heights[2]  # at most 50 bars


def test_sweep_of_timings_pairs_objects_and_a_mapping(tmp_path):
    timings = {f"cfg{i}": timing_from_samples([1.0 + i / 10, 1.1 + i / 10, 1.3 + i / 10])
               for i in range(5)}
    png_size(plot_sweep(timings, tmp_path / "timings.png", title="mapping of Timing"))
    png_size(plot_sweep(list(timings.items()), tmp_path / "pairs.png", title="pairs"))

    @dataclass
    class Result:
        label: str
        tflops: float
    results = [Result("a", 510.0), Result("b", 620.5), Result("c", float("nan"))]
    png_size(plot_sweep(results, tmp_path / "objects.png", title="objects", x="label",
                        y="tflops", unit="TFLOP/s", lower_is_better=False))


def test_failed_configurations_are_left_out(tmp_path):
    results = sweep(3) + [{"config": "broken", "ms": math.inf}, {"config": "x", "ms": None}]
    png_size(plot_sweep(results, tmp_path / "f.png", title="with failures"))
    with pytest.raises(ValueError, match="none of the 2 entries"):
        plot_sweep(results[3:], tmp_path / "g.png", title="only failures")


@pytest.mark.parametrize("results, error, match", [
    ([], ValueError, "results"), ([{"config": "a"}], ValueError, r"results\[0\]"),
    ([{"config": "a", "ms": 1.0}, 3], TypeError, r"results\[1\]"),
    ("abc", TypeError, "results"), (None, TypeError, "results")])
def test_bad_sweeps_are_refused(tmp_path, results, error, match):
    with pytest.raises(error, match=match):
        plot_sweep(results, tmp_path / "x.png", title="t")


def test_title_is_required_and_a_string(tmp_path):
    with pytest.raises(TypeError):
        plot_sweep(sweep(2), tmp_path / "x.png")
    with pytest.raises(TypeError, match="title"):
        plot_bench([], tmp_path / "x.png", title=None)


def bench_rows() -> list[Row]:
    rows = []
    for i, case in enumerate(["1024^3", "4096^3", "8192^3"]):
        rows += [Row(case, "torch.matmul (cuBLAS)", 600.0 + 10 * i, "TFLOP/s", False, True),
                 Row(case, "vitrail.ops.gemm", 590.0 + 30 * i, "TFLOP/s", False),
                 Row(case, "naive", 90.0, "TFLOP/s", False)]
    return rows


def test_bench_rows(tmp_path):
    width, height = png_size(plot_bench(bench_rows(), tmp_path / "b.png", title="bf16 GEMM"))
    assert width > 600 and height > 300


def test_bench_mappings_and_units_in_separate_panels(tmp_path):
    one = png_size(plot_bench(bench_rows(), tmp_path / "one.png", title="one unit"))
    rows = [r.__dict__ for r in bench_rows()] + [
        {"case": "4096^3", "impl": "torch.matmul (cuBLAS)", "value": 210.0, "unit": "µs",
         "baseline": True},
        {"case": "4096^3", "impl": "vitrail.ops.gemm", "value": 205.0, "unit": "µs"},
        {"case": "odd", "impl": "only one", "value": 3.0, "unit": "µs"}]  # no baseline
    two = png_size(plot_bench(rows, tmp_path / "two.png", title="two units"))
    assert two[1] > one[1] + 100  # a second panel below the first, as tall as its bars
    from vitrail.profile.plot import bench_figure
    assert [ax.get_xlabel() for ax in bench_figure(rows, title="t").axes] == [
        "TFLOP/s, higher is better", "µs, log scale, lower is better"]  # 3 beside 210


def test_a_wide_range_of_values_is_drawn_on_a_log_scale(tmp_path):
    from vitrail.profile.plot import needs_log_scale
    assert not needs_log_scale([1.0, 19.0]) and not needs_log_scale([0.0, 5.0])
    assert needs_log_scale([0.12, 135.0]) and not needs_log_scale([])
    rows = [Row("sympow bwd", "torch autograd", 135.1, "ms", baseline=True),
            Row("sympow bwd", "vitrail", 2.29, "ms"),
            Row("sympow fwd", "torch eager", 0.92, "ms", baseline=True),
            Row("sympow fwd", "vitrail", 0.12, "ms")]
    width, height = png_size(plot_bench(rows, tmp_path / "log.png", title="wide range"))
    assert width > 600 and height > 300


@pytest.mark.parametrize("rows, match", [
    ([], "rows"), ([{"case": "a", "impl": "b", "value": 1.0}], r"rows\[0\]: missing unit"),
    ([{"case": "a", "impl": "b", "value": -1.0, "unit": "ms"}], r"rows\[0\]: value"),
    ([{"case": "a", "impl": "b", "value": "fast", "unit": "ms"}], r"rows\[0\]: value")])
def test_bad_bench_rows_are_refused(tmp_path, rows, match):
    with pytest.raises(ValueError, match=match):
        plot_bench(rows, tmp_path / "x.png", title="t")


def test_without_matplotlib_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r'pip install "vitrail\[plot\]"'):
        plot_sweep(sweep(2), tmp_path / "x.png", title="t")
    with pytest.raises(ImportError, match=r'pip install "vitrail\[plot\]"'):
        plot_bench(bench_rows(), tmp_path / "x.png", title="t")


def test_importing_vitrail_profile_needs_neither_torch_nor_matplotlib():
    code = ("import sys, vitrail.profile; "
            "print('torch' in sys.modules, 'matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.split() == ["False", "False"]
