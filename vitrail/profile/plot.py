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

from vitrail.profile.bench import Timing, percentile

MAX_SWEEP_BARS = 50
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


def plot_bench(rows: Iterable[Any], path: str | os.PathLike, *, title: str) -> Path:
    """Grouped bars of benchmark rows: one group per case, one bar per implementation.

    ``rows``: :class:`vitrail.bench.Row` objects or mappings with ``case``, ``impl``, ``value``,
    ``unit`` and optionally ``lower_is_better`` and ``baseline``. Each case's baseline bar is
    hatched and outlined, and every other bar is annotated with its speed ratio to it (> 1x:
    faster). Rows of different units go to separate panels; a panel whose values span more than
    LOG_SPAN times is drawn on a log scale. Returns the path of the PNG written.
    """
    _check_title(title)
    data = [_bench_row(r, i) for i, r in enumerate(rows)]
    if not data:
        raise ValueError("rows: expected at least one benchmark row, got none")
    units = list(dict.fromkeys(r["unit"] for r in data))
    impls = list(dict.fromkeys(r["impl"] for r in data))
    color = {impl: PALETTE[i % len(PALETTE)] for i, impl in enumerate(impls)}
    baseline_impls = {r["impl"] for r in data if r["baseline"]}
    Figure = _matplotlib()
    n_cases = max(len({r["case"] for r in data if r["unit"] == u}) for u in units)
    width = min(16.0, max(6.0, 1.2 + n_cases * (0.5 + 0.35 * len(impls))))
    fig = Figure(figsize=(width, 1.0 + 3.6 * len(units)), layout="constrained")
    axes = fig.subplots(len(units), 1, squeeze=False)[:, 0]
    for ax, unit in zip(axes, units):
        mine = [r for r in data if r["unit"] == unit]
        cases = list(dict.fromkeys(r["case"] for r in mine))
        by_case = {c: [r for i in impls for r in mine if r["case"] == c and r["impl"] == i]
                   for c in cases}  # each case's rows in the legend's order
        per_case = max(len(v) for v in by_case.values())
        bar_w = 0.8 / per_case
        top = max(r["value"] for r in mine)
        positive = [r["value"] for r in mine if r["value"] > 0]
        log = needs_log_scale(positive)  # else the small bars vanish beside the large
        for ci, case in enumerate(cases):
            base = next((r for r in by_case[case] if r["baseline"]), None)
            for ii, r in enumerate(by_case[case]):
                impl = r["impl"]
                pos = ci + bar_w * (ii + 0.5 - len(by_case[case]) / 2)
                ax.bar(pos, r["value"], bar_w * 0.92, color=color[impl],
                       hatch="//" if r["baseline"] else None,
                       edgecolor="black" if r["baseline"] else color[impl],
                       linewidth=1.2 if r["baseline"] else 0.5)
                if r["baseline"]:
                    note = "base"
                elif base is not None and base["value"] and r["value"]:
                    ratio = (base["value"] / r["value"] if r["lower_is_better"]
                             else r["value"] / base["value"])
                    note = f"{ratio:.2f}x"
                else:
                    note = _num(r["value"])
                where = r["value"] * 1.08 if log else r["value"] + top * 0.01
                ax.text(pos, where, note, ha="center", va="bottom",
                        fontsize=7, rotation=90 if per_case > 4 else 0)
        ax.set_xticks(range(len(cases)), cases, fontsize=8,
                      rotation=20 if len(cases) > 4 else 0)
        if log:
            ax.set_yscale("log")
            ax.set_ylim(min(positive) / 2, top * 4)
        else:
            ax.set_ylim(0, top * 1.18)
        lower = all(r["lower_is_better"] for r in mine)
        higher = not any(r["lower_is_better"] for r in mine)
        better = " (lower is better)" if lower else " (higher is better)" if higher else ""
        ax.set_ylabel(f"{unit}{', log scale' if log else ''}{better}")
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    from matplotlib.patches import Patch
    handles = [Patch(facecolor=color[i], edgecolor="black" if i in baseline_impls else color[i],
                     hatch="//" if i in baseline_impls else None,
                     label=f"{i} (baseline)" if i in baseline_impls else i) for i in impls]
    axes[0].legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                   title="ratio = speed vs baseline", title_fontsize=7)
    fig.suptitle(_wrap(title, width), fontsize=11)  # over the whole figure, legend included
    return _save(fig, path)


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
    fig.savefig(out, format="png", dpi=120)
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
            "baseline": bool(get("baseline", False))}
