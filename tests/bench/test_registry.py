"""The bench registry's table: ratios to the baseline and the roofline columns."""
from __future__ import annotations

import pytest

from vitrail import bench
from vitrail.bench import Benchmark, Row, print_table, ratios, roofline_of
from vitrail.profile import Peaks

PEAKS = Peaks(copy_gbps=3000.0, bf16_tflops=800.0)


def test_ratios_are_speedups_over_the_baseline_either_way():
    rows = [Row("c", "base", 10.0, "us", baseline=True), Row("c", "fast", 5.0, "us"),
            Row("d", "base", 100.0, "GB/s", lower_is_better=False, baseline=True),
            Row("d", "fast", 300.0, "GB/s", lower_is_better=False), Row("e", "alone", 1.0, "us")]
    assert [vs for _, vs in ratios(rows)] == [{"base": 1.0}, {"base": 2.0}, {"base": 1.0},
                                              {"base": 3.0}, {}]


def test_every_baseline_gets_a_column(capsys):
    rows = [Row("softmax 32768x4096", "torch eager", 4.0, "ms", baseline=True),
            Row("softmax 32768x4096", "torch.compile", 2.0, "ms", baseline=True),
            Row("softmax 32768x4096", "vitrail", 1.0, "ms")]
    assert ratios(rows)[2][1] == {"torch eager": 4.0, "torch.compile": 2.0}
    print_table(Benchmark("softmax", "d", lambda: [], lambda: None), rows)
    lines = capsys.readouterr().out.strip().splitlines()  # title, header, one line per row
    assert "vs torch eager" in lines[1] and "vs torch.compile" in lines[1]
    assert lines[2].split()[-2:] == ["baseline", "0.50x"]  # eager is half compile's speed
    assert lines[4].split()[-2:] == ["4.00x", "2.00x"]


def test_roofline_columns_from_the_work_a_row_did(capsys):
    # a 1 GiB copy (read + written) in 1 ms: 2147 GB/s, 71.6% of a 3000 GB/s peak
    copy = Row("copy 1 GiB", "vitrail", 1.0, "ms", ms=1.0, bytes=2 * 2**30)
    gemm = Row("gemm 8192^3", "vitrail", 2.0, "ms", ms=2.0, flops=2 * 8192**3,
               bytes=3 * 2 * 8192**2)
    plain = Row("copy 1 GiB", "torch", 1.1, "ms", baseline=True)
    roof = roofline_of(copy, PEAKS)
    assert roof["gbps"] == pytest.approx(2 * 2**30 / 1e-3 / 1e9)
    assert roof["pct_roofline"] == pytest.approx(100 * 2.147483648 / 3.0, rel=1e-6)
    g = roofline_of(gemm, PEAKS)
    assert g["tflops"] == pytest.approx(2 * 8192**3 / 2e-3 / 1e12)
    assert g["pct_roofline"] == pytest.approx(100 * g["tflops"] / 800.0)
    assert roofline_of(plain, PEAKS) is None
    print_table(Benchmark("b", "desc", lambda: [], lambda: None), [copy, plain, gemm], PEAKS)
    out = capsys.readouterr().out
    assert "% roof" in out and "72%" in out and "2147" in out and f"{g['pct_roofline']:.0f}%" in out
    assert "1.10x" in out  # the vitrail copy against the torch baseline of its case
    copy_line = next(line for line in out.splitlines() if "2147" in line)
    assert copy_line.split()[-4] == "-"  # a copy did no FLOPs: no TFLOP/s shown, not 0.0


def test_a_bare_bench_runs_all_but_the_benchmarks_run_by_name():
    from vitrail import ops
    registry = ops.load_benchmarks()
    assert registry["gemm-sweep"].by_name  # 60 kernels and 630 timed shapes: when asked for
    bare = {b.name for b in bench.select(registry, [])}
    assert "gemm-sweep" not in bare and {"gemm", "softmax", "host"} <= bare
    assert [b.name for b in bench.select(registry, ["gemm-sweep"])] == ["gemm-sweep"]


def _stored_run(name: str = "gemm-h100.json"):
    """Rows and peaks of a real `vitrail bench gemm` run on an H100 (its JSON, trimmed of the
    derived roofline column, which the code under test computes again)."""
    import json
    from pathlib import Path
    doc = json.loads((Path(__file__).parent / "data" / name).read_text())
    rows = [Row(**{k: v for k, v in r.items() if k not in ("speedup_over", "roofline")})
            for r in doc["results"]["gemm"]]
    return rows, doc["peaks"]


def test_each_row_is_put_under_its_own_maths_roof(capsys):
    """FP8 rows read 158-170% of the bf16 roof before: each row's roof is its own math's (fp8
    twice bf16's, derived) and the table says what each roof is."""
    rows, peaks = _stored_run()
    fp8 = [r for r in rows if r.case.startswith("fp8")]
    bf16 = [r for r in rows if r.case.startswith("bfloat16")]
    assert fp8 and bf16
    for r in rows:
        roof = roofline_of(r, peaks)
        share = 2.0 if r in fp8 else 1.0
        assert roof["pct_roofline"] == pytest.approx(
            100 * r.value / (share * peaks["bf16_tflops"]), rel=1e-6), r.case
        assert roof["pct_roofline"] < 100, r.case  # no row above its own roof
    assert max(roofline_of(r, peaks)["pct_roofline"] for r in fp8) > 75  # FP8 near its roof
    print_table(Benchmark("gemm", "stored H100 run", lambda: rows, lambda: None), rows, peaks)
    out = capsys.readouterr().out
    legend = next(line for line in out.splitlines() if line.startswith("  * "))
    assert "% roof*" in out and f"fp8 {2 * peaks['bf16_tflops']:.0f} TFLOP/s" in legend
    assert "derived" in legend and f"bf16 {peaks['bf16_tflops']:.0f} TFLOP/s (measured)" in legend
    fp8_line = next(line for line in out.splitlines() if "fp8 e4m3 4096^3 fast" in line
                    and "vitrail" in line)
    pct = float(fp8_line.split("%")[0].split()[-1])
    assert pct == pytest.approx(100 * fp8[0].value / (2 * peaks["bf16_tflops"]), abs=0.6)


def test_a_run_writes_its_json_after_each_benchmark_and_survives_a_failing_one(
        monkeypatch, tmp_path, capsys):
    """`vitrail bench` writes the run's JSON after every benchmark (a run cut short keeps what it
    measured, and says what it had not run); a benchmark that raises is reported and costs the
    others nothing; the run's exit status says one failed; each benchmark builds right before
    it runs."""
    import json

    import torch

    import vitrail.profile
    registry = {}
    seen, built = [], []

    def written():
        (path,) = tmp_path.glob("bench-*.json")
        return json.loads(path.read_text())

    def second():
        doc = written()  # the first benchmark's rows are on disk before the second runs
        seen.append((sorted(doc["results"]), doc["pending"]))
        raise RuntimeError("no kernel for you")

    def third():
        seen.append((sorted(written()["results"]), written()["failed"]))
        return [Row("c", "torch", 2.0, "ms", baseline=True), Row("c", "vitrail", 1.0, "ms")]

    for name, run in (("first", lambda: [Row("c", "torch", 3.0, "ms", baseline=True),
                                         Row("c", "vitrail", 1.5, "ms")]),
                      ("second", second), ("third", third)):
        registry[name] = Benchmark(name, name, lambda run=run, name=name: (
            built.append(f"ran {name}"), run())[1], lambda name=name: built.append(name))
    monkeypatch.setattr(bench, "load", lambda: registry)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vitrail.profile, "peaks", lambda: PEAKS)
    monkeypatch.setattr(bench, "_meta", lambda: {"device": "a GPU", "sms": 132})
    assert bench.main([], out_dir=str(tmp_path)) == 1
    assert seen == [(["first"], ["second", "third"]),
                    (["first"], {"second": "RuntimeError: no kernel for you"})]
    doc = written()
    assert sorted(doc["results"]) == ["first", "third"] and "pending" not in doc
    assert doc["failed"] == {"second": "RuntimeError: no kernel for you"}
    assert [e["geomean"] for e in doc["summary"]["benchmarks"]["first"]] == [2.0]
    assert "second failed: RuntimeError" in capsys.readouterr().out
    # each benchmark's kernels are built (side by side) just before it runs
    assert built == [w for n in ("first", "second", "third") for w in (n, f"ran {n}")]
