"""`vitrail bench`'s output read as a user reads it (issue 34): plots whose labels never cover
one another, one summary whose numbers are the rows', and no carriage returns in a log file.

Real H100 runs: data/gemm-h100.json (`vitrail bench gemm`), data/bench-h100.json (the whole
default `vitrail bench`) and data/attention-h100.json (`vitrail bench attention`). The
synthetic rows (made-up values over the families' own case and implementation names, spanning
the ranges their runs report) test only the layout, at sizes no run has had yet. Look at the PNGs by eye after changing the
drawing: `VITRAIL_PLOT_DIR=/tmp/png python -m pytest tests/bench/test_output.py`.
"""
from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path

import pytest

from vitrail.bench import Row, report

DATA = Path(__file__).parent / "data"


def stored_run(name: str = "gemm-h100.json") -> tuple[dict, list[Row]]:
    """The JSON of a real `vitrail bench gemm` run and its rows (grouped as the bench groups
    them now: the run predates rows saying their group)."""
    from vitrail.gemm.ops.benchmarks import group_of
    doc = json.loads((DATA / name).read_text())
    rows = [Row(**{k: v for k, v in r.items() if k not in ("speedup_over", "roofline")})
            for r in doc["results"]["gemm"]]
    for r in rows:
        r.group = r.group or group_of(r.case)
    return doc, rows


# ------------------------------------------------------------------------ synthetic families
def _pair(case, group, unit, ours, base, *, lower=True, impl="vitrail", base_impl="torch",
          **kw):
    return [Row(case, impl, ours, unit, lower_is_better=lower, group=group, **kw),
            Row(case, base_impl, base, unit, lower_is_better=lower, baseline=True, group=group,
                **kw)]


def synthetic_softmax() -> list[Row]:
    from vitrail.ops.softmax.benchmarks import CASES
    rows = []
    for i, ((m, n), dt) in enumerate(CASES):
        for kind, group in (("fwd", "softmax forward"), ("log fwd", "log_softmax forward"),
                            ("bwd", "softmax backward")):
            if kind == "log fwd" and not (n <= 4096 and dt == "bfloat16"):
                continue
            gbps = 400.0 + 250 * (i % 9)
            rows += [Row(f"{kind} {dt} {m}x{n}", impl, gbps * f, "GB/s", False, impl ==
                         "torch eager", group=group)
                     for impl, f in (("vitrail", 1.0), ("torch eager", 0.55),
                                     ("torch.compile", 0.8), ("copy, same bytes", 1.2))]
    return rows


def synthetic_sympow() -> list[Row]:
    from vitrail.ops.sympow.benchmarks import CASES_ELEMENTWISE
    ew, mma = "sympow, sympow_bwd (elementwise)", "sympow_mma, mma_sympow_bwd: fused vs unfused"
    rows = []
    for name, *_ in CASES_ELEMENTWISE:  # vitrail ~0.1 ms beside torch autograd's ~135 ms
        rows += _pair(f"sympow fwd {name}", ew, "ms", 0.12, 0.92, base_impl="torch eager")
        rows += _pair(f"sympow bwd {name}", ew, "ms", 2.29, 135.1, base_impl="torch autograd")
    for case in ("sympow_mma query P64 M4096 d64 N64", "sympow_mma state P64 d64 K4096 N64",
                 "mma_sympow_bwd query P64 M4096 d64 N64",
                 "mma_sympow_bwd state P64 d64 K4096 N64"):
        rows += [Row(case, "unfused (sympow+bmm)", 3.1, "ms", baseline=True, group=mma),
                 Row(case, "vitrail fused", 0.9, "ms", group=mma),
                 Row(case, "vitrail fused sm80 mma.sync", 1.7, "ms", group=mma)]
    rows += [Row("peak memory query fwd+bwd", "unfused", 2112.0, "MiB", baseline=True),
             Row("peak memory query fwd+bwd", "vitrail fused", 96.0, "MiB")]
    return rows


def synthetic_copy() -> list[Row]:
    rows = []
    for dt in ("bfloat16", "float32"):
        for kind in ("contiguous", "transpose", "permute(0,2,1)", "slice [:, :16000]"):
            rows += [Row(f"{kind} {dt} 16384^2", "vitrail", 2900.0, "GB/s", False),
                     Row(f"{kind} {dt} 16384^2", "torch eager", 2400.0, "GB/s", False, True),
                     Row(f"{kind} {dt} 16384^2", "torch.compile", 2700.0, "GB/s", False)]
    return rows + _pair("bf16->fp32 16384^2", "", "GB/s", 2950.0, 2800.0, lower=False,
                        base_impl="torch eager")


def synthetic_host() -> list[Row]:
    host, small = "host µs per call (200 back-to-back calls)", "small problems"
    rows = []
    for i, op in enumerate(("mm bf16 256^3", "bmm bf16 4x256^3", "gemm bias+relu bf16 256^3",
                            "grouped_mm bf16 4 groups 512x256x256", "scaled_mm fp8 256^3",
                            "copy transpose bf16 1024^2", "softmax bf16 32x4096",
                            "mma_sympow_bwd p2 t8 4x256x64")):
        rows += _pair(f"host {op}", host, "µs/call", 4.0 + i, 6.0 + 2 * i)
    for case in ("softmax fwd+bwd bf16 32x131072", "mm bf16 2048x2048x8192",
                 "gemm bias+relu fwd+bwd bf16 1024^3"):
        rows += [Row(case, f"{impl} {how}", us, "µs/call", baseline=impl + how == "torcheager",
                     group=small)
                 for (impl, how), us in ((("vitrail", "eager"), 9.0), (("vitrail", "graph"), 4.0),
                                         (("torch", "eager"), 95.0), (("torch", "graph"), 5.0))]
    return rows


def synthetic_launch_overhead() -> list[Row]:
    return [Row("trivial kernel", name, us, "µs/call", baseline=name == "CuPy RawKernel")
            for name, us in (("vitrail RawKernel, k[g, b](...)", 4.1),
                             ("vitrail RawKernel, bound launcher", 3.2),
                             ("vitrail nvcc entry point", 2.9),
                             ("vitrail jit.compile (memo hit)", 0.4),
                             ("torch Tensor.add_", 5.6), ("CuPy RawKernel", 3.9))]


def synthetic_gemm_sweep() -> list[Row]:
    rows = []
    for dn in ("bfloat16", "float16"):
        for i in range(315):  # 1-16384 tokens: the work spans five decades
            m = 1 + (i * 53) % 16384
            flops = 2.0 * m * 4096 * 4096
            ours = 2 + m / 400
            case = f"{dn} llm {m}x4096x4096" + (" held out" if i % 5 == 0 else "")
            rows += _pair(case, f"{dn}, CUDA graph", "us", ours, ours * (0.8 + (i % 7) / 15),
                          flops=flops, ms=ours / 1e3)
    return rows


FAMILIES = {"softmax": synthetic_softmax, "sympow": synthetic_sympow, "copy": synthetic_copy,
            "host": synthetic_host, "jit.launch_overhead": synthetic_launch_overhead,
            "gemm-sweep": synthetic_gemm_sweep}


# ------------------------------------------------------------------------------ text boxes
def drawn_texts(fig) -> list:
    """Every text the figure draws: titles, labels, legends, bar labels, and the tick labels
    that lie in their axis's view (matplotlib keeps others that it does not draw)."""
    from matplotlib.text import Text
    fig.draw_without_rendering()
    ticks, shown = set(), []
    for ax in fig.axes:
        for axis, lim in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = sorted(lim)
            tol = (hi - lo) * 1e-9
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                for label in (tick.label1, tick.label2):
                    ticks.add(id(label))
                    if (tick.get_visible() and label.get_visible() and label.get_text()
                            and lo - tol <= tick.get_loc() <= hi + tol):
                        shown.append(label)
    rest = [t for t in fig.findobj(Text) if id(t) not in ticks and t.get_visible()
            and t.get_text().strip()]
    return rest + shown


def assert_legible(fig, name: str) -> None:
    """No two drawn texts overlap, and every one lies inside the figure."""
    renderer = fig.canvas.get_renderer()
    texts = drawn_texts(fig)
    assert len(texts) > 5, name
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    width, height = fig.bbox.width, fig.bbox.height
    for text, b in boxes:
        assert b.x0 >= -0.5 and b.y0 >= -0.5 and b.x1 <= width + 0.5 and b.y1 <= height + 0.5, \
            f"{name}: {text!r} at {b.bounds} leaves the {width:.0f}x{height:.0f} figure"
    for i, (t1, b1) in enumerate(boxes):
        for t2, b2 in boxes[i + 1:]:
            overlap_x = min(b1.x1, b2.x1) - max(b1.x0, b2.x0)
            overlap_y = min(b1.y1, b2.y1) - max(b1.y0, b2.y0)
            assert overlap_x <= 0.5 or overlap_y <= 0.5, f"{name}: {t1!r} overlaps {t2!r}"
    for ax in fig.axes:  # a bar's label ends inside its panel and covers no bar
        bars = [p.get_window_extent(renderer) for p in ax.patches if p.get_visible()]
        for t in ax.texts:
            b = t.get_window_extent(renderer)
            assert b.x1 <= ax.bbox.x1 + 0.5, (name, t.get_text())
            for bar in bars:
                overlap_x = min(b.x1, bar.x1) - max(b.x0, bar.x0)
                overlap_y = min(b.y1, bar.y1) - max(b.y0, bar.y0)
                assert overlap_x <= 0.5 or overlap_y <= 0.5, \
                    f"{name}: {t.get_text()!r} covers a bar at {bar.bounds}"


def _save_for_eyes(fig, name: str) -> None:
    where = os.environ.get("VITRAIL_PLOT_DIR")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        fig.savefig(Path(where) / f"{name}.png", dpi=fig.dpi)


# ------------------------------------------------------------------------------------- plots
def test_the_gemm_plot_of_a_real_run_has_no_colliding_labels():
    """The H100 run's 21 cases sat in one panel: x labels overlapped, "0.99x" ran into the
    neighbouring bar's "base". Now one panel per group, every label on a line of its own."""
    pytest.importorskip("matplotlib")
    from vitrail.profile.plot import bench_figure
    doc, rows = stored_run()
    fig = bench_figure(rows, title=f"gemm on {doc['device']}: vitrail.ops mm/bmm/gemm/"
                       "scaled_mm/grouped_mm vs torch (cuBLAS)")
    _save_for_eyes(fig, "gemm")
    assert_legible(fig, "gemm")
    groups = list(dict.fromkeys(r.group for r in rows))
    assert len(fig.axes) == len(groups) == 5  # bf16, fp16 shapes, epilogue, fp8, grouped
    assert [ax.get_title(loc="left") for ax in fig.axes] == groups
    labels = {t.get_text().strip() for ax in fig.axes for t in ax.texts}
    for case in {r.case for r in rows}:  # every vitrail bar says its ratio, as the table does
        ours = next(r for r in rows if r.case == case and not r.baseline)
        base = next(r for r in rows if r.case == case and r.baseline)
        ratio = f"{ours.value / base.value:.2f}x"
        assert any(t.startswith(f"{ours.value:,.0f}" if ours.value >= 1000 else
                                f"{ours.value:.3g}") and ratio in t for t in labels), case


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_familys_plot_has_no_colliding_labels(family):
    pytest.importorskip("matplotlib")
    from vitrail.profile.plot import bench_figure
    rows = FAMILIES[family]()  # synthetic values: layout only
    fig = bench_figure(rows, title=f"{family} on NVIDIA H100 80GB HBM3 (synthetic rows)")
    _save_for_eyes(fig, f"synthetic-{family}")
    assert_legible(fig, family)
    panels = list(dict.fromkeys((r.unit, r.group) for r in rows))
    assert len(fig.axes) == len(panels)


def test_a_sweep_draws_speedups_not_630_bars():
    pytest.importorskip("matplotlib")
    from vitrail.profile.plot import bench_figure
    rows = synthetic_gemm_sweep()
    fig = bench_figure(rows, title="gemm-sweep (synthetic rows)")
    for ax in fig.axes:
        assert not ax.patches  # no bars: one point per case
        (points,) = ax.collections
        assert len(points.get_offsets()) == 315
        assert ax.get_xscale() == "log"
        label = ax.get_legend().get_texts()[0].get_text()
        mine = [r for r in rows if r.group == ax.get_title(loc="left").split(":")[0]]
        ratios = [b.value / o.value for o, b in zip(mine[::2], mine[1::2])]
        mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        assert f"geomean {mean:.2f}x" in label
        assert f"{sum(x >= 1 for x in ratios)}/315 at or above 1x" in label


def test_the_overlap_check_finds_overlapping_labels():
    """The check itself can fail: two texts drawn on top of each other are caught."""
    pytest.importorskip("matplotlib")
    from vitrail.profile.plot import bench_figure
    fig = bench_figure(synthetic_copy(), title="copy (synthetic rows)")
    fig.axes[0].text(0.5, 0.5, "overlap me", transform=fig.axes[0].transAxes)
    fig.axes[0].text(0.5, 0.5, "overlap me", transform=fig.axes[0].transAxes)
    with pytest.raises(AssertionError, match="overlaps"):
        assert_legible(fig, "copy")


# ----------------------------------------------------------------------------------- summary
def _expected(rows: list[Row]) -> dict[tuple[str, str], list[float]]:
    """Speedups of vitrail's rows over each baseline of their case, from the values."""
    got: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if r.baseline or not r.impl.startswith("vitrail"):
            continue
        for b in rows:
            if b.baseline and b.case == r.case:
                x = b.value / r.value if r.lower_is_better else r.value / b.value
                got.setdefault((r.impl, b.impl), []).append(x)
    return got


def test_the_summary_is_written_last_and_first_in_the_json_with_the_rows_numbers(
        tmp_path, capsys, monkeypatch):
    doc, rows = stored_run()
    meta = {k: doc[k] for k in ("device", "sms", "torch", "python", "time")}
    sympow = synthetic_sympow()
    monkeypatch.setattr("sys.stdout", io.StringIO())  # a file, not a terminal
    out_doc = report.write({"gemm": rows, "sympow": sympow}, {"gemm": "GEMMs"}, doc["peaks"],
                           meta, tmp_path / "bench-1")
    out = __import__("sys").stdout.getvalue()
    monkeypatch.undo()
    assert "\r" not in out
    written = json.loads((tmp_path / "bench-1.json").read_text())
    assert written == json.loads(json.dumps(out_doc))
    assert list(written)[0] == "summary"
    summary = written["summary"]
    assert summary["device"] == "NVIDIA H100 80GB HBM3" and summary["torch"] == doc["torch"]
    for family, family_rows in (("gemm", rows), ("sympow", sympow)):
        expected = _expected(family_rows)
        entries = summary["benchmarks"][family]
        assert {(e["impl"], e["baseline"]) for e in entries} == set(expected)
        for e in entries:
            xs = expected[e["impl"], e["baseline"]]
            assert e["cases"] == len(xs)
            assert e["geomean"] == pytest.approx(math.prod(xs) ** (1 / len(xs)), rel=1e-12)
            assert e["min"] == pytest.approx(min(xs)) and e["max"] == pytest.approx(max(xs))
            assert e["at_or_above_1x"] == sum(x >= 1.0 for x in xs)
            # and the rows' own "speedup_over" in the same JSON says the same
            stored = [r["speedup_over"][e["baseline"]] for r in written["results"][family]
                      if r["impl"] == e["impl"] and e["baseline"] in r["speedup_over"]]
            assert sorted(stored) == pytest.approx(sorted(xs))
    gemm = {e["baseline"]: e for e in summary["benchmarks"]["gemm"]}
    assert gemm["torch.matmul"]["cases"] == 14 and gemm["torch._scaled_mm"]["cases"] == 4
    assert gemm["torch.matmul"]["min_case"] == "bfloat16 2048x2048x2048"
    assert gemm["torch.matmul"]["min"] == pytest.approx(0.9372294627275369)
    # the terminal's summary is the last thing printed, one line per entry, the same numbers
    lines = out.rstrip("\n").splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("summary: "))
    assert "NVIDIA H100 80GB HBM3" in lines[start] and f"torch {doc['torch']}" in lines[start]
    body = lines[start + 2:]
    e = gemm["torch.matmul"]
    line = next(line for line in body if "vitrail vs torch.matmul " in line)
    assert line.split()[:10] == [
        "gemm", "vitrail", "vs", "torch.matmul", "14", f"{e['geomean']:.2f}x",
        f"{e['min']:.2f}x", f"{e['max']:.2f}x", f"{e['at_or_above_1x']}/14", "bfloat16"]
    assert f"results: {tmp_path / 'bench-1.json'}" in out
    pngs = summary["plots"]
    plotted = pytest.importorskip("matplotlib") and pngs
    assert [Path(p).name for p in plotted] == [
        "bench-1-gemm.png", "bench-1-sympow.png", "bench-1-summary.png"]
    assert all(Path(p).stat().st_size > 10_000 and p in out for p in plotted)


def test_the_summary_picture_has_no_colliding_labels():
    pytest.importorskip("matplotlib")
    from vitrail.profile.plot import summary_figure
    _, rows = stored_run()
    results = {"gemm": rows, **{name: make() for name, make in FAMILIES.items()}}
    summary = report.summarize(results)
    fig = summary_figure(summary, title="vitrail against its baselines (gemm: an H100 run; "
                         "others synthetic)")
    _save_for_eyes(fig, "summary")
    assert_legible(fig, "summary")
    (ax,) = fig.axes
    entries = [e for es in summary.values() for e in es]
    assert len(ax.get_yticklabels()) == len(entries) > 10
    assert ax.get_xscale() == "log"  # sympow's 59x beside gemm's 0.94x


REAL_RUNS = ("bench-h100.json", "attention-h100.json")  # `vitrail bench`, `bench attention`


def real_rows(name: str) -> tuple[dict, dict[str, list[Row]]]:
    """A whole real run (an H100, 2026-11-27): its JSON and each benchmark's rows."""
    doc = json.loads((DATA / name).read_text())
    fields = set(Row.__dataclass_fields__)
    return doc, {bench: [Row(**{k: v for k, v in r.items() if k in fields}) for r in rows]
                 for bench, rows in doc["results"].items()}


@pytest.mark.parametrize("run", REAL_RUNS)
def test_every_plot_of_a_real_run_is_legible(run):
    """Each family's picture and the summary as an H100 run drew them: no text covers another
    or a bar (the summary's label of a 0.60x entry sat on its own bar, drawn leftwards from 1x),
    and the summary drawn from the rows says what the run printed."""
    pytest.importorskip("matplotlib")
    from vitrail.profile.plot import bench_figure, summary_figure
    doc, results = real_rows(run)
    for bench, rows in results.items():
        fig = bench_figure(rows, title=f"{bench} on {doc['device']}")
        _save_for_eyes(fig, f"real-{bench}")
        assert_legible(fig, bench)
    summary = report.summarize(results)
    for bench, entries in summary.items():  # the rows give the run's own summary
        printed = doc["summary"]["benchmarks"][bench]
        assert [(e["impl"], e["baseline"], e["cases"]) for e in entries] == [
            (e["impl"], e["baseline"], e["cases"]) for e in printed]
        assert [e["geomean"] for e in entries] == pytest.approx(
            [e["geomean"] for e in printed], rel=1e-4)
    fig = summary_figure(summary, title=f"vitrail against its baselines on {doc['device']}")
    _save_for_eyes(fig, f"real-summary-{run}")
    assert_legible(fig, "summary")


@pytest.mark.parametrize("run", REAL_RUNS)
def test_every_table_of_a_real_run_names_its_baselines_whole(run, capsys):
    """The H100 run printed "vs torch gelu(addmm" and "vs unfused (sympow+" (headers cut at 16
    characters) and, for copy and softmax, a roof legend of ": ; memory ...". Now each baseline's
    column is as wide as its name, and a table of memory-bound rows names the memory roof."""
    from vitrail.bench import Benchmark, print_table
    doc, results = real_rows(run)
    for bench, rows in results.items():
        print_table(Benchmark(bench, "a real run", lambda: rows, lambda: None), rows,
                    doc["peaks"])
        out = capsys.readouterr().out
        head = next(line for line in out.splitlines() if line.lstrip().startswith("case"))
        for base in dict.fromkeys(r.impl for r in rows if r.baseline):
            assert f"vs {base}" in head, (bench, base)
        legend = [line for line in out.splitlines() if line.startswith("  * ")]
        assert all(": ;" not in line for line in legend), legend
        if bench in ("copy", "softmax"):
            assert legend == [f"  * % of the memory roof: memory "
                              f"{doc['peaks']['copy_gbps']:.0f} GB/s (copy, measured)"]


# ---------------------------------------------------------------------------------- progress
class Stream(io.StringIO):
    """A captured stream that says whether it is a terminal."""

    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _compile_output(monkeypatch, stdout_tty: bool, stderr_tty: bool) -> tuple[str, str]:
    """What the GEMM bench's build (vitrail.tune.compile_all, verbose) writes for 40 kernels,
    with the compiles themselves replaced by no-ops."""
    from vitrail.tune import compile_job, tuner
    monkeypatch.setattr(compile_job, "run", lambda kwargs: None)
    out, err = Stream(stdout_tty), Stream(stderr_tty)
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    failures = tuner.compile_all([(i, {"name": f"k{i}"}) for i in range(40)], max_workers=1,
                                 verbose=True, label="gemm bench")
    monkeypatch.undo()
    assert failures == {}
    return out.getvalue(), err.getvalue()


@pytest.mark.parametrize("stdout_tty, stderr_tty", [(False, True), (False, False),
                                                    (True, False)])
def test_progress_written_to_a_file_is_whole_lines(monkeypatch, stdout_tty, stderr_tty):
    """`vitrail bench > log` (stderr still a terminal), `> log 2>&1`, `2> log`: no carriage
    return anywhere, about ten whole lines, the last one saying all 40 were done."""
    out, err = _compile_output(monkeypatch, stdout_tty, stderr_tty)
    assert "\r" not in out + err
    lines = err.splitlines()
    assert 4 <= len(lines) <= 12 and all(ln.startswith("vitrail: compiling gemm bench configs ")
                                         for ln in lines)
    assert lines[-1].split()[-3:-1] == ["40/40", "0"]


def test_progress_on_a_terminal_is_one_line_redrawn(monkeypatch):
    out, err = _compile_output(monkeypatch, True, True)
    assert err.count("\r") == 40 and err.endswith("\n") and err.count("\n") == 1


def test_the_summary_compares_eager_with_eager_and_graph_with_graph():
    """Rows that say how they ran (host's small problems: eager, replayed from a graph) are
    summarized like with like, though each case has both baselines."""
    rows = []
    cases = {"a": (10.0, 4.0, 20.0, 8.0), "b": (30.0, 5.0, 15.0, 5.0)}
    for case, (ve, vg, te, tg) in cases.items():
        for impl, us in (("vitrail eager", ve), ("vitrail graph", vg), ("torch eager", te),
                         ("torch graph", tg)):
            rows.append(Row(case, impl, us, "µs/call", baseline=impl.startswith("torch")))
    entries = report.summarize({"host": rows})["host"]
    got = {(e["impl"], e["baseline"]): e for e in entries}
    assert set(got) == {("vitrail eager", "torch eager"), ("vitrail graph", "torch graph")}
    assert got["vitrail eager", "torch eager"]["geomean"] == pytest.approx((2.0 * 0.5) ** 0.5)
    assert got["vitrail graph", "torch graph"]["min"] == pytest.approx(1.0)
    assert got["vitrail graph", "torch graph"]["at_or_above_1x"] == 2
