"""Performance pages from `vitrail bench` runs: their JSON becomes one markdown page.

    python -m vitrail.bench.pages results/bench-20261127-101500.json --out docs/performance
    python -m vitrail.bench.pages results/bench-1.json results/bench-2.json ...  # several runs

The page says which runs it shows (the GPU, its SMs, the date, the commit, the versions, the
peaks measured in the run), then per benchmark vitrail's summary against each baseline and a
table of every row: its value, its place on the roofline where it says what work it did, and
its speedup over each baseline of its case, all measured in that same run. The PNGs the run
wrote beside its JSON are copied next to the page and shown. The numbers are the JSON's rows,
rounded to two decimals; nothing is measured here. A JSON that does not name its commit takes
``--commit`` (one for every run, or one per run in the JSON's order); a page never guesses one.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Sequence

from vitrail.bench.report import summarize
from vitrail.bench.rows import Row, ratios, roofline_of

ROW_FIELDS = {f for f in Row.__dataclass_fields__}


def rows_of(doc: dict) -> dict[str, list[tuple[Row, dict, dict | None]]]:
    """Per benchmark, each row with its speedups over the baselines of its case and its
    roofline: as the JSON has them, else computed from the rows and the run's peaks (runs
    written before the JSON carried them)."""
    out = {}
    for name, items in doc.get("results", {}).items():
        rows = [Row(**{k: v for k, v in r.items() if k in ROW_FIELDS}) for r in items]
        computed = [vs for _, vs in ratios(rows)]
        peaks = doc.get("peaks")
        out[name] = [(row, item.get("speedup_over", vs),
                      item["roofline"] if "roofline" in item else roofline_of(row, peaks))
                     for row, item, vs in zip(rows, items, computed)]
    return out


def _num(x: float | None, fmt: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{fmt}}{suffix}"


def _cell(text: str) -> str:
    """Text as a table cell: a bar or a bracket is a character, not markup (a case named
    ``k[g, b](...)`` was read as a link)."""
    return "".join("\\" + c if c in "|[]" else c for c in str(text))


def run_lines(doc: dict, commit: str | None) -> list[str]:
    """The run this page shows: what a reader needs to trust or reproduce its numbers."""
    gpu = doc.get("device", "unknown GPU") + (f", {doc['sms']} SMs" if doc.get("sms") else "")
    versions = ", ".join(f"{k} {doc[k]}" for k in ("vitrail", "torch", "cuda", "python")
                         if doc.get(k))
    peaks = doc.get("peaks") or {}
    lines = ["| | |", "| --- | --- |", f"| GPU | {_cell(gpu)} |",
             f"| date | {doc.get('time', 'not recorded')} |",
             f"| commit | {commit or doc.get('commit') or 'not recorded'} |",
             f"| versions | {versions or 'not recorded'} |"]
    if peaks:
        lines.append(f"| peaks measured in the run | copy {_num(peaks.get('copy_gbps'))} GB/s, "
                     f"bf16 matmul {_num(peaks.get('bf16_tflops'))} TFLOP/s |")
    if doc.get("pending"):  # the JSON of a run cut short (vitrail.bench.main)
        lines.append(f"| not run (the run was cut short) | {', '.join(doc['pending'])} |")
    for name, why in (doc.get("failed") or {}).items():
        lines.append(f"| failed | {name}: {_cell(why)} |")
    return lines


def summary_table(entries: list[dict]) -> list[str]:
    lines = ["| vitrail | baseline | unit | cases | geomean | worst | best | >= 1.0x "
             "| worst case |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for e in entries:
        lines.append(f"| {_cell(e['impl'])} | {_cell(e['baseline'])} | {_cell(e['unit'])} | "
                     f"{e['cases']} | {e['geomean']:.2f}x | {e['min']:.2f}x | {e['max']:.2f}x | "
                     f"{e['at_or_above_1x']}/{e['cases']} | {_cell(e['min_case'])} |")
    return lines


def rows_table(rows: list[tuple[Row, dict, dict | None]]) -> list[str]:
    """One line per row, as `vitrail bench` printed it: value, roofline, speedup per baseline."""
    baselines = list(dict.fromkeys(r.impl for r, _, _ in rows if r.baseline))
    on_roof = any(roof for _, _, roof in rows)
    head = ["case", "implementation", "value", "unit"]
    if on_roof:
        head += ["TFLOP/s", "GB/s", "% roof"]
    head += [f"vs {b}" for b in baselines]
    lines = ["| " + " | ".join(_cell(h) for h in head) + " |",
             "| " + " | ".join("---" if i < 2 or h == "unit" else "---:"
                               for i, h in enumerate(head)) + " |"]
    for r, vs, roof in rows:
        cells = [_cell(r.case), _cell(r.impl), _value(r), _cell(r.unit)]
        if on_roof:
            roof = roof or {}
            cells += [_num(roof.get("tflops")) if r.flops else "-",
                      _num(roof.get("gbps")) if r.bytes else "-",
                      _num(roof.get("pct_roofline"), ".1f", "%")]
        cells += ["baseline" if r.baseline and b == r.impl else _num(vs.get(b), ".2f", "x")
                  for b in baselines]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _value(r: Row) -> str:
    """A row's value, or for one that was not run (no time; the benchmark's ``refused`` or
    ``error`` saying why) why, cut to 120 characters, not a value of 0."""
    why = r.extra.get("refused") or r.extra.get("error") if r.ms is None else None
    if not why:
        return f"{r.value:.2f}"
    why = str(why)
    return _cell(f"not run: {why[:117] + '...' if len(why) > 120 else why}")


def _plots(json_path: Path, names: list[str], doc: dict) -> dict[str, Path]:
    """The PNGs the run wrote beside its JSON (``<stem>-<benchmark>.png``, ``-summary.png``)."""
    found = {}
    for name in [*names, "summary"]:
        png = json_path.with_name(f"{json_path.stem}-{name}.png")
        if png.is_file():
            found[name] = png
    return found


def write(runs: Path | Sequence[Path], out: Path,
          commit: str | Sequence[str] | None = None) -> Path:
    """Write ``out``/index.md from one run's JSON or several (``vitrail bench`` and a run of
    the benchmarks it runs only by name, say), copy their PNGs next to it; returns the page's
    path. ``commit``: the commit of every run, or a list of one per run. A benchmark in two of
    the runs is refused: which one to show would be a guess."""
    paths = [Path(runs)] if isinstance(runs, (str, Path)) else [Path(r) for r in runs]
    if not paths:
        raise ValueError("pages: expected at least one run's JSON, got none")
    commits = [commit] if commit is None or isinstance(commit, str) else list(commit)
    if len(commits) == 1:
        commits *= len(paths)
    if len(commits) != len(paths):
        raise ValueError(f"pages: {len(commits)} commits for {len(paths)} runs; give one for "
                         f"every run or one per run")
    docs = [json.loads(path.read_text()) for path in paths]
    where: dict[str, Path] = {}
    for path, doc in zip(paths, docs):
        for name in doc.get("results", {}):
            if name in where:
                raise ValueError(f"pages: benchmark {name!r} is in both {where[name].name} and "
                                 f"{path.name}; give one run of each benchmark")
            where[name] = path
    out.mkdir(parents=True, exist_ok=True)
    several = len(paths) > 1
    gpus = list(dict.fromkeys(doc.get("device", "an unknown GPU") for doc in docs))
    names = ", ".join(f"`{path.name}`" for path in paths)
    lines = [f"# Performance on {' and '.join(gpus)}", "",
             f"Generated by `python -m vitrail.bench.pages` from {names}, the JSON of "
             f"{'one `vitrail bench` run' if not several else f'{len(paths)} `vitrail bench` runs'}"
             "; every ratio is against a baseline measured in that same run, on that GPU. "
             "Regenerate it from new runs rather than editing it.", ""]
    sections = []
    for i, (path, doc, commit) in enumerate(zip(paths, docs, commits)):
        rows = rows_of(doc)
        summary = (doc.get("summary") or {}).get("benchmarks") or summarize(
            {name: [r for r, _, _ in rs] for name, rs in rows.items()})
        plots = {}
        for name, png in _plots(path, list(rows), doc).items():
            dest = out / (f"summary-{i + 1}.png" if name == "summary" and several else
                          f"{name}.png")
            shutil.copyfile(png, dest)
            plots[name] = dest.name
        if several:
            lines += [f"Run {i + 1}, `{path.name}`: " + ", ".join(rows) + ".", ""]
        lines += [*run_lines(doc, commit), ""]
        if "summary" in plots:
            lines += [f"![summary]({plots['summary']})", ""]
        sections += _sections(rows, summary, plots, doc, path.name if several else None)
    lines += ["Benchmarks: " + ", ".join(f"[{n}](#{_anchor(n)})" for n in where), "",
              *sections]
    page = out / "index.md"
    page.write_text("\n".join(lines).rstrip() + "\n")
    return page


def _sections(rows: dict, summary: dict, plots: dict, doc: dict, run: str | None) -> list[str]:
    """A heading per benchmark: its summary, its picture and every row."""
    lines = []
    for name, rs in rows.items():
        lines += [f"## {name}", ""]
        if run:
            lines += [f"From `{run}`.", ""]
        if summary.get(name):
            lines += ["vitrail against each baseline over the cases they share (speedup: > 1 "
                      "is vitrail faster):", "", *summary_table(summary[name]), ""]
        if name in plots:
            lines += [f"![{name}]({plots[name]})", ""]
        lines += [*rows_table(rs), ""]
        roofed = [(r, roof) for r, _, roof in rs if roof]
        if roofed and doc.get("peaks"):
            lines += ["% roof: of the row's own math's compute roof (bf16's measured rate, FP8 "
                      "twice it, TF32 half) or of the copy bandwidth measured in the run, "
                      "whichever bounds the row.", ""]
    return lines


def _anchor(heading: str) -> str:
    """A heading's anchor as GitHub and mkdocs make it (for the benchmarks' index line)."""
    import re
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vitrail.bench.pages",
                                     description="Markdown pages from a `vitrail bench` JSON.")
    parser.add_argument("json", type=Path, nargs="+",
                        help="the runs' JSON (results/bench-<time>.json), each benchmark in one")
    parser.add_argument("--out", type=Path, default=Path("docs/performance"),
                        help="folder for index.md and the PNGs (default: docs/performance)")
    parser.add_argument("--commit", action="append",
                        help="the commit the run measured, where its JSON does not say (git "
                        "rev-parse --short HEAD on the GPU machine); once for every run, or "
                        "once per run in the JSON's order")
    args = parser.parse_args(argv)
    page = write(args.json, args.out, args.commit)
    print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
