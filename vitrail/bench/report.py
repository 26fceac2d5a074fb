"""The end of a `vitrail bench` run: one PNG per benchmark, the JSON, and one summary.

After a dozen tables a reader wants one screen: per benchmark, vitrail's speedup over each
baseline (how many cases, the geometric mean, the worst and the best case, how many at or above
1.0x), the GPU, the versions, and where the JSON and the plots went. The summary is computed from
the rows' own ratios (vitrail.bench.rows.ratios, the tables' "vs" columns), so its numbers are the
rows'; the JSON carries it as its first key.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from vitrail.bench.rows import Row, ratios, roofline_of
from vitrail.profile.timing import geomean

OURS = "vitrail"  # a row is vitrail's when its implementation's name starts with this


RUNS = ("eager", "graph")  # how a row ran, as the last word of its implementation's name


def _how(impl: str) -> str:
    """How an implementation ran ("eager" of "vitrail eager"), or "" where its name says not."""
    last = impl.rsplit(" ", 1)[-1]
    return last if last in RUNS else ""


def _alike(impl: str, base: str) -> bool:
    """Whether a summary compares impl with base: like with like where both say how they ran
    (vitrail graph with torch graph, not with torch eager)."""
    a, b = _how(impl), _how(base)
    return not a or not b or a == b


def summarize(results: dict[str, list[Row]]) -> dict[str, list[dict]]:
    """Per benchmark, one entry per (vitrail implementation, baseline, unit) that share cases
    and ran alike (``_alike``): cases, geomean, min and max (with their cases) and
    at_or_above_1x of vitrail's ratios (> 1: better, whichever way the unit points; a unit
    apart, as sympow's peak MiB is not its ms)."""
    out: dict[str, list[dict]] = {}
    for name, rows in results.items():
        pairs: dict[tuple[str, str, str], list[tuple[str, float]]] = {}
        for r, vs in ratios(rows):
            if r.baseline or not r.impl.startswith(OURS):
                continue
            for base, x in vs.items():
                if x and _alike(r.impl, base):
                    pairs.setdefault((r.impl, base, r.unit), []).append((r.case, x))
        out[name] = []
        for (impl, base, unit), got in pairs.items():
            worst = min(got, key=lambda cx: cx[1])
            best = max(got, key=lambda cx: cx[1])
            out[name].append({
                "impl": impl, "baseline": base, "unit": unit, "cases": len(got),
                "geomean": geomean([x for _, x in got]),
                "min": worst[1], "min_case": worst[0], "max": best[1], "max_case": best[0],
                "at_or_above_1x": sum(x >= 1.0 for _, x in got)})
    return out


def summary_lines(summary: dict, meta: dict) -> list[str]:
    """The summary as the terminal shows it: a heading with the GPU and versions, one line per
    (benchmark, vitrail vs baseline), then where the JSON and plots went."""
    versions = ", ".join(f"{k} {meta[k]}" for k in ("torch", "cuda", "python", "vitrail")
                         if meta.get(k))
    gpu = meta.get("device", "?") + (f" ({meta['sms']} SMs)" if meta.get("sms") else "")
    lines = [f"summary: {gpu}; {versions}; {meta.get('time', '')}".rstrip("; ")]
    from vitrail.profile.plot import comparison
    families = summary["benchmarks"]
    entries = [(name, e, comparison(e, families[name])) for name, es in families.items()
               for e in es]
    nw = max([len("benchmark")] + [len(n) for n, _, _ in entries]) + 2
    vw = max([len("vitrail vs baseline")] + [len(c) for _, _, c in entries]) + 2
    lines.append(f"  {'benchmark':<{nw}}{'vitrail vs baseline':<{vw}}{'cases':>5}"
                 f"{'geomean':>9}{'worst':>8}{'best':>8}{'>=1.0x':>8}  worst case")
    for name, e, what in entries:
        lines.append(f"  {name:<{nw}}{what:<{vw}}{e['cases']:>5}"
                     f"{e['geomean']:>8.2f}x{e['min']:>7.2f}x{e['max']:>7.2f}x"
                     f"{str(e['at_or_above_1x']) + '/' + str(e['cases']):>8}  {e['min_case']}")
    lonely = [n for n, es in summary["benchmarks"].items() if not es]
    if lonely:
        lines.append(f"  no vitrail-vs-baseline cases in: {', '.join(lonely)}")
    if summary.get("json"):
        lines.append(f"  results: {summary['json']}")
    for i, png in enumerate(summary.get("plots", [])):
        lines.append(f"  {'plots:  ' if i == 0 else '        '} {png}")
    return lines


def write(results: dict[str, list[Row]], titles: dict[str, str], peaks, meta: dict,
          stem: Path) -> dict:
    """Plot each benchmark (and the summary) beside ``stem``, write ``stem``.json with the
    summary first, print the summary; returns the JSON's content."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    plots = []
    for name, rows in results.items():
        png = stem.parent / f"{stem.name}-{name}.png"
        if _plot(lambda: _plot_bench(rows, png, f"{name} on {meta.get('device', '?')}: "
                                     f"{titles.get(name, '')}".rstrip(": "))):
            plots.append(str(png))
    png = stem.parent / f"{stem.name}-summary.png"
    summary = summarize(results)
    if any(summary.values()) and _plot(lambda: _plot_summary(
            {"benchmarks": summary}, png,
            f"vitrail against its baselines on {meta.get('device', '?')}")):
        plots.append(str(png))
    report = write_json(results, peaks, meta, stem, plots)
    print("\n" + "\n".join(summary_lines(report["summary"], meta)), flush=True)
    return report


def write_json(results: dict[str, list[Row]], peaks, meta: dict, stem: Path,
               plots: Sequence[str] = ()) -> dict:
    """Write ``stem``.json (the summary first, then meta, peaks and every row with its ratios
    and roofline) and return its content. ``vitrail bench`` writes it after each benchmark, so
    a run cut short keeps what it measured (meta's ``pending`` names what it had not run)."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    json_path = stem.with_suffix(".json")
    summary = {**{k: meta[k] for k in ("device", "torch", "cuda", "python", "vitrail", "time")
                  if meta.get(k)},
               "benchmarks": summarize(results), "json": str(json_path), "plots": list(plots)}
    report = {"summary": summary, **meta,
              "peaks": ({"copy_gbps": peaks["copy_gbps"], "bf16_tflops": peaks["bf16_tflops"]}
                        if isinstance(peaks, dict) else
                        {"copy_gbps": peaks.copy_gbps, "bf16_tflops": peaks.bf16_tflops}),
              "results": {name: [{**asdict(r), "speedup_over": vs,
                                  "roofline": roofline_of(r, peaks)} for r, vs in ratios(rows)]
                          for name, rows in results.items()}}
    tmp = json_path.with_name(json_path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(json_path)  # a reader (or a run killed mid-write) never sees half a file
    return report


def _plot(draw) -> bool:
    try:
        draw()
        return True
    except ImportError as e:  # matplotlib is an optional extra
        print(f"no plot: {e}")
        return False


def _plot_bench(rows: list[Row], png: Path, title: str) -> None:
    from vitrail.profile import plot_bench
    plot_bench(rows, png, title=title)


def _plot_summary(summary: dict, png: Path, title: str) -> None:
    from vitrail.profile.plot import plot_summary
    plot_summary(summary["benchmarks"], png, title=title)
