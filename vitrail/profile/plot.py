"""PNG plots of tuning sweeps and benchmark results, for people to read at a glance.

A table of 200 configurations or of ten implementations over six shapes hides what a picture
shows at once: which configurations cluster near the best, which implementation loses where.
matplotlib is an optional extra (``pip install "vitrail[plot]"``), imported only when a plot is
drawn; figures are drawn without pyplot, so nothing here touches a user's interactive backend.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from vitrail.profile.timing import Timing, geomean, percentile, speedup_of

MAX_SWEEP_BARS = 50
DPI = 120  # the PNGs' pixels per inch: labels of 8 points stay legible
BEST = "#2b8a3e"
OTHER = "#4c6ef5"
PALETTE = ["#4c6ef5", "#f08c00", "#2b8a3e", "#c2255c", "#7048e8", "#0c8599", "#e8590c",
           "#5c940d", "#862e9c", "#495057"]


def plot_sweep(results: Any, path: str | os.PathLike, *, title: str, x: str = "config",
               y: str = "ms", unit: str | None = None, lower_is_better: bool = True) -> Path:
    """A horizontal bar per configuration of a tuning sweep, best first, the best highlighted.

    ``results``: a mapping {label: value}, or a sequence of mappings or objects holding the label
    under ``x`` and the value under ``y`` (or of (label, value) pairs). A label may be a config
    dict (drawn as ``k=v, ...``); a value a number or a :class:`Timing` (its median, with a
    p10-p90 whisker). Missing or non-finite values (configs that failed) are counted in the
    subtitle. ``unit`` defaults to ``ms`` for values named ms/median/time or given as Timing.
    At most the best 50 are drawn. Returns the path of the PNG written.
    """
    _check_title(title)
    points = list(_sweep_points(results, x, y))
    if not points:
        raise ValueError("results: expected at least one (label, value) entry, got none")
    ok = [(label, _value(v), v) for label, v in points if _finite(_value(v))]
    failed = len(points) - len(ok)
    if not ok:
        raise ValueError(f"results: none of the {len(points)} entries has a finite value "
                         f"under {y!r}")
    ok.sort(key=lambda p: p[1], reverse=not lower_is_better)
    shown = ok[:MAX_SWEEP_BARS]
    if unit is None:
        timed = any(isinstance(v, Timing) for _, _, v in ok)
        unit = "ms" if timed or y in ("ms", "median", "time") else ("µs" if y == "us" else "")
    Figure = _matplotlib()
    fig = Figure(figsize=(9, 1.6 + 0.28 * len(shown)), layout="constrained")
    ax = fig.subplots()
    rows = range(len(shown))
    values = [v for _, v, _ in shown]
    colors = [BEST if i == 0 else OTHER for i in rows]
    xerr = None
    if any(isinstance(raw, Timing) for _, _, raw in shown):
        lo = [v - percentile(raw.samples, 10) if isinstance(raw, Timing) else 0
              for _, v, raw in shown]
        hi = [percentile(raw.samples, 90) - v if isinstance(raw, Timing) else 0
              for _, v, raw in shown]
        xerr = [[max(0.0, e) for e in lo], [max(0.0, e) for e in hi]]
    ax.barh(list(rows), values, color=colors, xerr=xerr, ecolor="#343a40", capsize=2)
    ax.set_yticks(list(rows), [_label(label) for label, _, _ in shown], fontsize=8)
    ax.invert_yaxis()  # best on top
    best = values[0]
    ends = [v + (xerr[1][i] if xerr else 0) for i, v in enumerate(values)]
    for i, v in enumerate(values):
        note = f"{_num(v)} {unit}".rstrip()
        note += "  (best)" if i == 0 else f"  ({v / best:.2f}x best)" if best else ""
        ax.text(ends[i] + max(ends) * 0.01, i, note, va="center", fontsize=7)
    ax.set_xlim(0, max(ends) * 1.3)
    better = "lower" if lower_is_better else "higher"
    name = "time" if y in ("ms", "us", "median", "time") else y
    ax.set_xlabel(f"{name} ({unit}, {better} is better)" if unit else
                  f"{name} ({better} is better)")
    ax.set_ylabel(x)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    sub = f"{len(points)} configurations"
    if failed:
        sub += f", {failed} failed (not shown)"
    if len(shown) < len(ok):
        sub += f", the best {len(shown)} shown"
    if xerr:
        sub += "; whiskers: p10-p90 of the samples"
    ax.set_title(f"{_wrap(title, 9)}\n{sub}", fontsize=10)
    return _save(fig, path)


LOG_SPAN = 20  # a panel whose values span more than this factor is drawn on a log scale
MAX_BAR_CASES = 24  # a panel of more cases draws each case's speedup as a point, not bars
SLOT_IN = 0.2  # inches of figure height per bar: room for one line of 8-point text


def plot_bench(rows: Iterable[Any], path: str | os.PathLike, *, title: str) -> Path:
    """Benchmark rows as horizontal bars, one panel per (unit, group), one bar per
    implementation of each case; returns the path of the PNG written.

    ``rows``: :class:`vitrail.bench.Row` objects or mappings with ``case``, ``impl``, ``value``,
    ``unit`` and optionally ``lower_is_better``, ``baseline`` and ``group`` (what a reader
    compares: a family's shapes, its epilogues, its FP8 cases). Each bar ends in its value and,
    past a case's baseline (hatched), its speed ratio to it (> 1x: faster); every label has a
    line of its own, so none can cover another. A panel whose values span more than LOG_SPAN
    times is drawn on a log scale; one of more than MAX_BAR_CASES cases (a sweep) draws each
    case's speedup over its baseline against the case's work instead.
    """
    return _save(bench_figure(rows, title=title), path)


def bench_figure(rows: Iterable[Any], *, title: str) -> Any:
    """The matplotlib Figure :func:`plot_bench` saves (laid out, labels fitted to the axes)."""
    _check_title(title)
    data = [_bench_row(r, i) for i, r in enumerate(rows)]
    if not data:
        raise ValueError("rows: expected at least one benchmark row, got none")
    panels = list(dict.fromkeys((r["unit"], r["group"]) for r in data))
    impls = list(dict.fromkeys(r["impl"] for r in data))
    color = {impl: PALETTE[i % len(PALETTE)] for i, impl in enumerate(impls)}
    mine = {p: [r for r in data if (r["unit"], r["group"]) == p] for p in panels}
    heights = [_panel_height(mine[p]) for p in panels]
    Figure = _matplotlib()
    width = 11.0
    fig = Figure(figsize=(width, 0.7 + sum(heights)), dpi=DPI, layout="constrained")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig)  # a renderer to measure the labels with (no pyplot, no GUI)
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=heights)[:, 0]
    bars = False
    for ax, (unit, group) in zip(axes, panels):
        cases = list(dict.fromkeys(r["case"] for r in mine[unit, group]))
        if len(cases) > MAX_BAR_CASES and any(r["baseline"] for r in mine[unit, group]):
            _speedup_panel(ax, mine[unit, group], group, color)
        else:
            _bars_panel(ax, mine[unit, group], unit, group, color)
            bars = True
    fig.suptitle(_wrap(title, width) + ("\nafter a bar's value: its speed over the case's "
                 "baseline (hatched); > 1x is faster" if bars else ""), fontsize=10)
    _fit_labels(fig, axes)
    return fig


def plot_summary(summary: Mapping[str, Sequence[Mapping]], path: str | os.PathLike, *,
                 title: str) -> Path:
    """One bar per (benchmark, vitrail implementation, baseline) of a run's summary
    (vitrail.bench.report.summarize): the geometric mean of the speedups, a whisker from the
    worst case to the best, and a line at 1x. Returns the path of the PNG written."""
    return _save(summary_figure(summary, title=title), path)


def comparison(entry: Mapping, family: Sequence[Mapping]) -> str:
    """'vitrail vs torch' of a summary entry, with its unit where its family has several."""
    several = len({e.get("unit") for e in family}) > 1
    return f"{entry['impl']} vs {entry['baseline']}" + (f", {entry['unit']}" if several else "")


def summary_figure(summary: Mapping[str, Sequence[Mapping]], *, title: str) -> Any:
    """The matplotlib Figure :func:`plot_summary` saves."""
    _check_title(title)
    entries = [(name, e) for name, es in summary.items() for e in es]
    if not entries:
        raise ValueError("summary: expected at least one benchmark entry, got none")
    Figure = _matplotlib()
    width = 11.0
    fig = Figure(figsize=(width, 1.6 + 0.32 * len(entries)), dpi=DPI, layout="constrained")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    means = [e["geomean"] for _, e in entries]
    lows = [e["min"] for _, e in entries]
    highs = [e["max"] for _, e in entries]
    colors = [BEST if m >= 1.0 else PALETTE[3] for m in means]
    ys = list(range(len(entries)))
    log = max(highs) > 4 * min(lows)
    left = min(lows) / 1.5 if log else min(0.9, min(lows) - 0.05)
    ax.barh(ys, [m - 1.0 for m in means], 0.6, left=1.0, color=colors)  # from 1x, either way
    ax.errorbar(means, ys, xerr=[[max(0.0, m - lo) for m, lo in zip(means, lows)],
                                 [max(0.0, hi - m) for m, hi in zip(means, highs)]],
                fmt="none", ecolor="#343a40", capsize=3, linewidth=1)
    for y, (_, e) in zip(ys, entries):  # right of the whisker and of a bar drawn leftwards
        ax.text(max(e["max"], 1.0), y, f"  {e['geomean']:.2f}x  ({e['min']:.2f}-{e['max']:.2f}x, "
                f"{e['at_or_above_1x']}/{e['cases']} at or above 1x)", va="center",
                fontsize=8, gid="bar-label")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(ys, [_label(f"{name}: {comparison(e, summary[name])}") for name, e in entries],
                  fontsize=9)
    ax.set_ylim(len(entries) - 0.4, -0.6)
    if log:
        ax.set_xscale("log")
        ax.set_xlim(left, max(highs) * 3)
        _ratio_ticks(ax.xaxis, suffix="x")
    else:
        ax.set_xlim(left, max(highs) + 0.25 * (max(highs) - left))
        from matplotlib.ticker import FuncFormatter
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.tick_params(axis="x", labelsize=8)
    ax.set_xlabel("speed over the baseline" + (", log scale" if log else ""), fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    fig.suptitle(_wrap(title, width) + "\nbar: the geometric mean of the cases' speedups; "
                 "whisker: the worst case to the best; > 1x is faster", fontsize=10)
    _fit_labels(fig, [ax])
    return fig


def _panel_height(rows: list[dict]) -> float:
    cases = len({r["case"] for r in rows})
    if cases > MAX_BAR_CASES and any(r["baseline"] for r in rows):
        return 3.2
    return 1.0 + SLOT_IN * (len(rows) + CASE_GAP * cases)


CASE_GAP = 0.7  # empty slots between two cases' bars


def _bars_panel(ax: Any, rows: list[dict], unit: str, group: str, color: dict) -> None:
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    positive = [r["value"] for r in rows if r["value"] > 0]
    log = needs_log_scale(positive)  # else the small bars vanish beside the large
    y, ticks = 0.0, []
    for case in cases:
        own = [r for i in impls for r in rows if r["case"] == case and r["impl"] == i]
        bases = [r for r in own if r["baseline"]]
        ticks.append(y + (len(own) - 1) / 2)
        for r in own:
            ax.barh(y, r["value"], 0.8, color=color[r["impl"]],
                    hatch="//" if r["baseline"] else None,
                    edgecolor="black" if r["baseline"] else color[r["impl"]],
                    linewidth=1.0 if r["baseline"] else 0.5)
            note = f" {_num(r['value'])}"
            ratios = [] if r["baseline"] else [(b["impl"], _ratio(r, b)) for b in bases]
            ratios = [(b, x) for b, x in ratios if x is not None]
            if len(ratios) == 1 and len(bases) == 1:
                note += f"  {ratios[0][1]:.2f}x"
            elif ratios:
                note += "  " + ", ".join(f"{x:.2f}x vs {b}" for b, x in ratios)
            ax.text(r["value"], y, note, va="center", ha="left", fontsize=8,
                    gid="bar-label")
            y += 1
        y += CASE_GAP
    ax.set_yticks(ticks, [_label(c) for c in cases], fontsize=9)
    ax.set_ylim(y - CASE_GAP + 0.2, -0.8)  # first case on top
    top = max(r["value"] for r in rows)
    if log:
        ax.set_xscale("log")
        ax.set_xlim(min(positive) / 2, top * 4)
        _ratio_ticks(ax.xaxis, suffix="")
    else:
        ax.set_xlim(0, top * 1.25 if top > 0 else 1)
    lower = all(r["lower_is_better"] for r in rows)
    higher = not any(r["lower_is_better"] for r in rows)
    better = ", lower is better" if lower else ", higher is better" if higher else ""
    ax.set_xlabel(f"{unit}{', log scale' if log else ''}{better}", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    if group:
        ax.set_title(group, fontsize=10, loc="left")
    _legend(ax, impls, {r["impl"] for r in rows if r["baseline"]}, color)


def _speedup_panel(ax: Any, rows: list[dict], group: str, color: dict) -> None:
    """Each case's speedup over its (first) baseline, one point per case and implementation,
    against the case's work (FLOPs, else bytes) where every row says it, else in case order."""
    cases = list(dict.fromkeys(r["case"] for r in rows))
    by_case = {c: [r for r in rows if r["case"] == c] for c in cases}
    points: dict[str, list[tuple[float, float]]] = {}
    for i, case in enumerate(cases):
        base = next((r for r in by_case[case] if r["baseline"]), None)
        for r in by_case[case]:
            x = _ratio(r, base) if base is not None and not r["baseline"] else None
            if x is not None:
                work = base["work"] if all(q["work"] for q in rows) else i
                points.setdefault(r["impl"], []).append((work, x))
    base_name = next(r["impl"] for r in rows if r["baseline"])
    for impl, pts in points.items():
        ratios = [x for _, x in pts]
        mean = geomean(ratios)
        above = sum(x >= 1.0 for x in ratios)
        ax.scatter([w for w, _ in pts], ratios, s=9, color=color[impl], alpha=0.7,
                   label=f"{impl}: geomean {mean:.2f}x, {above}/{len(ratios)} at or above 1x")
    ax.axhline(1.0, color="black", linewidth=0.8)
    work = all(r["work"] for r in rows)
    if work:
        ax.set_xscale("log")
    what = "FLOPs" if all(r["flops"] for r in rows) else "FLOPs or bytes"
    ax.set_xlabel(f"the case's work ({what}), log scale" if work else "case", fontsize=9)
    ax.set_ylabel(f"speed over {base_name}", fontsize=9)
    ax.tick_params(labelsize=8)
    every = [x for pts in points.values() for _, x in pts]
    if every and needs_log_scale(every):
        ax.set_yscale("log")
        _ratio_ticks(ax.yaxis, suffix="x")
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_title(f"{group + ': ' if group else ''}{len(cases)} cases, each point one case "
                 f"(> 1x: faster than {base_name})", fontsize=9, loc="left")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _ratio(row: dict, base: dict | None) -> float | None:
    """How many times faster row is than base, whichever way the unit points."""
    if base is None:
        return None
    return speedup_of(row["value"], base["value"], row["lower_is_better"])


def _ratio_ticks(axis: Any, suffix: str) -> None:
    """Log-scale ticks at 1, 2, 5 of each decade, written as plain numbers (0.5x, 2x, 20)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}{suffix}"))
    axis.set_minor_formatter(NullFormatter())


def _legend(ax: Any, impls: list[str], baselines: set[str], color: dict) -> None:
    from matplotlib.patches import Patch
    handles = [Patch(facecolor=color[i], edgecolor="black" if i in baselines else color[i],
                     hatch="//" if i in baselines else None,
                     label=f"{i} (baseline)" if i in baselines else i) for i in impls]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _fit_labels(fig: Any, axes: Any) -> None:
    """Widen each bar panel's value axis until every bar's label ends inside the panel."""
    for _ in range(8):
        fig.draw_without_rendering()
        renderer = fig.canvas.get_renderer()
        grown = False
        for ax in axes:
            labels = [t for t in ax.texts if t.get_gid() == "bar-label"]
            right = max((t.get_window_extent(renderer).x1 for t in labels), default=0.0)
            if right > ax.bbox.x1 - 4:
                lo, hi = ax.get_xlim()
                ax.set_xlim(lo, hi * 2.0 if ax.get_xscale() == "log" else lo + (hi - lo) * 1.2)
                grown = True
        if not grown:
            return


# ---------------------------------------------------------------------------------- helpers
def needs_log_scale(values: Iterable[float]) -> bool:
    """Whether bars of these (positive) values span more than LOG_SPAN times."""
    values = [v for v in values if v > 0]
    return bool(values) and max(values) > LOG_SPAN * min(values)


def _matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError('vitrail.profile plots need matplotlib, an optional extra: '
                          'pip install "vitrail[plot]" (or pip install matplotlib)') from None
    return Figure


def _save(fig: Any, path: str | os.PathLike) -> Path:
    out = Path(os.fspath(path))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=DPI)
    return out


def _wrap(title: str, inches: float) -> str:
    """Break a long title into lines that fit a figure this many inches wide."""
    import textwrap
    return "\n".join(textwrap.fill(line, max(30, int(inches * 11))) for line in title.split("\n"))


def _check_title(title: Any) -> None:
    if not isinstance(title, str):
        raise TypeError(f"title: expected a string, got {type(title).__name__}")


def _sweep_points(results: Any, x: str, y: str) -> Iterable[tuple[Any, Any]]:
    if isinstance(results, Mapping):
        yield from results.items()
        return
    if isinstance(results, (str, bytes)) or not isinstance(results, Iterable):
        raise TypeError(f"results: expected a mapping or a sequence of results, got "
                        f"{type(results).__name__}")
    for i, r in enumerate(results):
        if isinstance(r, Mapping):
            if x not in r or y not in r:
                raise ValueError(f"results[{i}]: expected keys {x!r} and {y!r}, got "
                                 f"{sorted(map(str, r))}")
            yield r[x], r[y]
        elif isinstance(r, Sequence) and not isinstance(r, str) and len(r) == 2:
            yield r[0], r[1]
        elif hasattr(r, x) and hasattr(r, y):
            yield getattr(r, x), getattr(r, y)
        else:
            raise TypeError(f"results[{i}]: expected a mapping or an object with {x!r} and "
                            f"{y!r}, or a (label, value) pair; got {r!r:.80}")


def _value(v: Any) -> float:
    if isinstance(v, Timing):
        return v.median
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _finite(v: float) -> bool:
    return math.isfinite(v)


def _label(label: Any) -> str:
    if isinstance(label, Mapping):
        text = ", ".join(f"{k}={v}" for k, v in label.items())
    else:
        text = str(label)
    return text if len(text) <= 70 else text[:67] + "..."


def _num(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def _bench_row(r: Any, i: int) -> dict:
    get = r.get if isinstance(r, Mapping) else (lambda k, d=None: getattr(r, k, d))
    missing = [k for k in ("case", "impl", "value", "unit") if get(k) is None]
    if missing:
        raise ValueError(f"rows[{i}]: missing {', '.join(missing)}; expected a vitrail.bench.Row "
                         f"or a mapping with case, impl, value and unit")
    value = _value(get("value"))
    if not _finite(value) or value < 0:
        raise ValueError(f"rows[{i}]: value must be a finite, non-negative number, got "
                         f"{get('value')!r}")
    return {"case": str(get("case")), "impl": str(get("impl")), "value": value,
            "unit": str(get("unit")), "lower_is_better": bool(get("lower_is_better", True)),
            "baseline": bool(get("baseline", False)), "group": str(get("group", "") or ""),
            "work": float(get("flops", 0.0) or get("bytes", 0.0) or 0.0),
            "flops": float(get("flops", 0.0) or 0.0)}
