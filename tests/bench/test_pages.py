"""Performance pages from a `vitrail bench` JSON (vitrail.bench.pages), checked against a real H100
run (data/gemm-h100.json): the page's numbers are the JSON's rows, and it says which run made
them."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from vitrail.bench import pages

DATA = Path(__file__).parent / "data"
RUN = DATA / "gemm-h100.json"


def _tables(text: str) -> list[list[dict[str, str]]]:
    """The page's markdown tables, each a list of rows keyed by the header's cells."""
    tables, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append([re.sub(r"\\(.)", r"\1", c.strip())  # a cell's escapes undone
                          for c in line.strip().strip("|").split(" | ")])
        elif block:
            head, *body = block
            tables.append([dict(zip(head, cells)) for cells in body[1:]])  # body[0]: ---
            block = []
    return tables


def test_the_page_holds_the_runs_rows_and_their_speedups(tmp_path):
    page = pages.write(RUN, tmp_path, commit="abc1234")
    doc = json.loads(RUN.read_text())
    rows_table = next(t for t in _tables(page.read_text()) if t and "implementation" in t[0])
    assert len(rows_table) == len(doc["results"]["gemm"])
    for line, row in zip(rows_table, doc["results"]["gemm"]):
        assert (line["case"], line["implementation"], line["unit"]) == (
            row["case"], row["impl"], row["unit"])
        assert float(line["value"]) == round(row["value"], 2)
        for base, x in row["speedup_over"].items():
            cell = line[f"vs {base}"]
            if row["baseline"] and base == row["impl"]:
                assert cell == "baseline"
            else:
                assert float(cell.rstrip("x")) == round(x, 2), (row["case"], base)


def test_a_row_not_run_says_why_not_a_value_of_0():
    """A benchmark's row for a case it did not run (value 0, no time, its ``refused`` or
    ``error`` saying why) shows why, cut to 120 characters; a row that ran shows its value."""
    from vitrail.bench import Row
    refused = Row("conv1", "vitrail fprop", 0.0, "TFLOP/s",
                  extra={"refused": "C=3 is not a multiple of 8: pad it; more | detail"})
    failed = Row("conv2", "vitrail fprop", 0.0, "TFLOP/s", extra={"error": "x" * 300})
    ran = Row("conv3", "vitrail fprop", 12.345, "TFLOP/s", ms=1.0)
    lines = pages.rows_table([(refused, {}, None), (failed, {}, None), (ran, {}, None)])
    assert "| not run: C=3 is not a multiple of 8: pad it; more \\| detail |" in lines[2]
    assert f"| not run: {'x' * 117}... |" in lines[3]
    assert "| 12.35 |" in lines[4]


def test_the_summary_is_the_reports(tmp_path):
    from vitrail.bench.report import summarize
    from vitrail.bench.rows import Row
    doc = json.loads(RUN.read_text())
    rows = [Row(**{k: v for k, v in r.items() if k in pages.ROW_FIELDS})
            for r in doc["results"]["gemm"]]
    want = summarize({"gemm": rows})["gemm"]
    summary = next(t for t in _tables(pages.write(RUN, tmp_path).read_text())
                   if t and "geomean" in t[0])
    assert [(s["vitrail"], s["baseline"], int(s["cases"]), s["geomean"]) for s in summary] == [
        (e["impl"], e["baseline"], e["cases"], f"{e['geomean']:.2f}x") for e in want]


def test_the_page_says_which_run_made_it(tmp_path):
    text = pages.write(RUN, tmp_path, commit="abc1234").read_text()
    assert "NVIDIA H100 80GB HBM3, 132 SMs" in text and "2026-11-26T17:31:59" in text
    assert "| commit | abc1234 |" in text and "torch 2.11.0+cu130" in text
    assert "copy 3003.31 GB/s, bf16 matmul 802.35 TFLOP/s" in text
    # a JSON that does not name its commit, and no --commit: the page says so, guessing nothing
    assert "| commit | not recorded |" in pages.write(RUN, tmp_path / "bare").read_text()


def test_the_runs_plots_are_copied_next_to_the_page_and_shown(tmp_path):
    run = tmp_path / "results" / "bench-20261127-101500.json"
    run.parent.mkdir()
    shutil.copyfile(RUN, run)
    for name in ("gemm", "summary"):
        run.with_name(f"{run.stem}-{name}.png").write_bytes(b"\x89PNG " + name.encode())
    out = tmp_path / "docs" / "performance"
    assert pages.main([str(run), "--out", str(out), "--commit", "abc1234"]) == 0
    text = (out / "index.md").read_text()
    assert "![summary](summary.png)" in text and "![gemm](gemm.png)" in text
    assert (out / "gemm.png").read_bytes() == b"\x89PNG gemm"


def test_two_runs_make_one_page_each_benchmark_from_its_own_run(tmp_path):
    """`vitrail bench` and `vitrail bench attention` (real H100 runs): one page, each run's
    provenance, each benchmark's rows from the run that measured it, the two summaries' PNGs
    side by side; a benchmark in both runs is refused."""
    runs = []
    for name in ("bench-h100.json", "attention-h100.json"):
        run = tmp_path / "results" / name
        run.parent.mkdir(exist_ok=True)
        shutil.copyfile(DATA / name, run)
        run.with_name(f"{run.stem}-summary.png").write_bytes(b"\x89PNG " + name.encode())
        runs.append(run)
    out = tmp_path / "performance"
    assert pages.main([*map(str, runs), "--out", str(out), "--commit", "e9ffe52"]) == 0
    text = (out / "index.md").read_text()
    assert text.count("| commit | e9ffe52 |") == 2
    docs = [json.loads(r.read_text()) for r in runs]
    assert all(f"| date | {d['time']} |" in text for d in docs)
    assert (out / "summary-1.png").read_bytes() == b"\x89PNG bench-h100.json"
    assert (out / "summary-2.png").read_bytes() == b"\x89PNG attention-h100.json"
    headings = [line[3:] for line in text.splitlines() if line.startswith("## ")]
    assert headings == [*docs[0]["results"], *docs[1]["results"]]
    tables = [t for t in _tables(text) if t and "implementation" in t[0]]
    assert [len(t) for t in tables] == [len(rows) for d in docs for rows in d["results"].values()]
    attention = tables[-1]
    for line, row in zip(attention, docs[1]["results"]["attention"]):
        assert (line["case"], float(line["value"])) == (row["case"], round(row["value"], 2))
    with pytest.raises(ValueError, match="'attention' is in both"):
        pages.write([runs[1], runs[1]], tmp_path / "twice")
    # a commit per run, in the JSON's order; a count that matches neither is refused
    assert pages.main([*map(str, runs), "--out", str(out), "--commit", "e9ffe52",
                       "--commit", "201a38e"]) == 0
    lines = (out / "index.md").read_text().splitlines()
    runs_at = [i for i, line in enumerate(lines) if line.startswith("Run ")]
    assert "| commit | e9ffe52 |" in lines[runs_at[0]:runs_at[1]]
    assert "| commit | 201a38e |" in lines[runs_at[1]:]
    with pytest.raises(ValueError, match="3 commits for 2 runs"):
        pages.write(runs, tmp_path / "three", commit=["a", "b", "c"])



def test_a_run_cut_short_says_what_it_did_not_run_and_what_failed():
    whole = json.loads(RUN.read_text())
    lines = pages.run_lines({**whole, "pending": ["softmax", "sympow"],
                             "failed": {"copy": "RuntimeError: a | b"}}, "abc1234")
    assert "| not run (the run was cut short) | softmax, sympow |" in lines
    assert "| failed | copy: RuntimeError: a \\| b |" in lines  # the bar escaped
    assert not any("not run" in line or "failed" in line
                   for line in pages.run_lines(whole, "abc1234"))
