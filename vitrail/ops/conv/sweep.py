"""The conv sweep: the problems the tile heuristic (configs.heuristic) was chosen and is judged
on, and every config's time on each.

``cases()``: every dense layer of ``vitrail bench conv`` (ResNet-50, the SD U-Net, ConvNeXt-T's
downsamplers) as fprop, dgrad and wgrad, as conv2d runs them (left out: the 1x1 layers the
GEMM runs, the depthwise and the refused ones, and strided dgrads of several phases, whose one
launch a scratch copy cannot time: they take the heuristic's tile), and ``HELD_OUT``'s layers:
small and odd channel counts, other batches. The heuristic's rules were chosen on the ResNet-50
and U-Net problems (``FIT``); the others are held out.

``time_configs()`` times each config of the kind's space (configs.space) on each case's own
operands (the views and batch chunks conv2d hands the kernel), with vitrail.profile.compare;
``report()`` gives, for each part and kind, the heuristic's loss against each problem's fastest
config (geometric mean and worst), from a sweep's JSON, with the heuristic as it is now (so a
change of rule is judged on an old sweep without a GPU)::

    python -m vitrail.ops.conv.sweep time OUT.json    # on a Hopper GPU
    python -m vitrail.ops.conv.sweep report OUT.json  # anywhere
"""
from __future__ import annotations

import json
import math
import sys
from typing import Iterator

from vitrail.ops.conv import benchmarks
from vitrail.ops.conv.configs import Problem

FIT = ("resnet50", "unet")
L = benchmarks.Layer
HELD_OUT = {  # network: (batch, layers)
    "small32": (32, [L("c32", 32, 112, 112, 32, 3, 3, 1, 1),
                     L("c64k32", 64, 112, 112, 32, 3, 3, 1, 1),
                     L("c32k64", 32, 112, 112, 64, 3, 3, 1, 1),
                     L("c48k96", 48, 80, 80, 96, 3, 3, 1, 1),
                     L("c96", 96, 40, 40, 96, 3, 3, 1, 1),
                     L("c64s2", 64, 112, 112, 64, 3, 3, 2, 1),
                     L("c64p1x1", 64, 56, 56, 64, 1, 1, 1, 1),
                     L("c160k64", 160, 28, 28, 64, 3, 3, 1, 1),
                     L("c64k192", 64, 28, 28, 192, 3, 3, 1, 1),
                     L("c64_5x5", 64, 56, 56, 64, 5, 5, 1, 2)]),
    "small8": (8, [L("c64", 64, 56, 56, 64, 3, 3, 1, 1),
                   L("c128", 128, 56, 56, 128, 3, 3, 1, 1),
                   L("c256", 256, 28, 28, 256, 3, 3, 1, 1),
                   L("c64k256", 64, 56, 56, 256, 3, 3, 1, 1)]),
}


def _timed(case: benchmarks.Case) -> bool:
    """Whether the sweep times the case: one implicit-GEMM launch that a scratch copy can time."""
    from vitrail.ops.conv import kernel_problem
    lay = case.layer
    if benchmarks.runs_gemm(lay) or lay.groups > 1 or benchmarks.refusal(case):
        return False
    if case.kind != "dgrad":
        return True
    pad, stride = (lay.padding,) * 2, (lay.stride,) * 2
    _, phased = kernel_problem("dgrad", case.batch, lay.C, (lay.H, lay.W), lay.K,
                               (lay.R, lay.S), pad, pad, stride, (1, 1))
    return not phased


def cases() -> list[benchmarks.Case]:
    """The sweep's cases: the benchmark's dense ones, then HELD_OUT's (fprop, dgrad, wgrad)."""
    found = [c for c in benchmarks.cases() if c.kind in benchmarks.KINDS]
    found += [benchmarks.Case(network, lay, batch, kind) for network, (batch, layers) in
              HELD_OUT.items() for lay in layers for kind in benchmarks.KINDS]
    return [c for c in found if _timed(c)]


def part(network: str) -> str:
    """The part of the sweep a network's cases are in: fit or held out."""
    return "fit" if network in FIT else "held out"


# ------------------------------------------------------------------------------------ timing
def _variant(case: benchmarks.Case, sms: int):
    """The implicit-GEMM variant (configs.Variant) of the case's launch."""
    import torch

    from vitrail.ops.conv.configs import Variant
    chunked = case.chunks(sms) > 1
    return Variant(case.kind, torch.bfloat16, partials=chunked)


def _operands(case: benchmarks.Case, sms: int):
    """(variant, the _run operands a, b, d, bias, padding, stride, dilation, pad_hi, splits,
    phases) of the case's one launch, on new tensors, as conv2d hands them over (NHWC views;
    dgrad: its one stride phase's; wgrad: its batch chunks' fp32 partials)."""
    import torch

    from vitrail.ops.conv import dgrad_phases, empty_nchw, nhwc, phase_views
    x, w, dy, _ = benchmarks.case_tensors(case)
    lay, (p, q) = case.layer, case.layer.out_hw()
    pad, stride, one = (lay.padding,) * 2, (lay.stride,) * 2, (1, 1)
    variant = _variant(case, sms)
    if case.kind == "fprop":
        d = nhwc(empty_nchw((case.batch, lay.K, p, q), x))
        return variant, (nhwc(x), nhwc(w), d, None, pad, stride, one, pad, 1, None)
    if case.kind == "dgrad":
        (ph,) = [ph for ph in dgrad_phases((lay.H, lay.W), (p, q), (lay.R, lay.S), pad, pad,
                                           stride, one) if all(ph.rows)]
        a, b, d = phase_views(ph, dy, w, nhwc(empty_nchw(x.shape, x)), stride)
        return variant, (a, b, d, None, ph.pad, one, ph.dilation, ph.pad_hi, 1, None)
    if variant.partials:
        splits = case.chunks(sms)
        d = torch.empty(splits * lay.K, lay.R, lay.S, lay.C, device=x.device)
    else:
        splits, d = 1, nhwc(empty_nchw(w.shape, w))
    return variant, (nhwc(dy).contiguous(), nhwc(x), d, None, pad, stride, one, pad, splits,
                     None)


def time_configs(only: list[benchmarks.Case] | None = None, log=sys.stderr) -> Iterator[dict]:
    """A row per case (``only``: those cases): its problem, the GPU's SM count, and each
    config's median ms (None where the config cannot run it: ``errors`` says why). Every
    config's kernel is built first, in parallel."""
    import torch

    from vitrail.gemm.conv_arguments import launch
    from vitrail.ops.conv import FAMILY, launch_problem, prepared_operation
    from vitrail.profile import compare
    from vitrail.tune import compile_all, limits
    lim = limits()
    todo = cases() if only is None else only
    variants = sorted({_variant(c, lim.sm_count) for c in todo}, key=lambda v: v.name)
    jobs = [(f"{v.name} {c.label}", dict(FAMILY[v].render(c), arch=lim.arch.name))
            for v in variants for c in FAMILY[v].space.valid(lim)]
    for name, error in compile_all(jobs, verbose=True, label="conv sweep").items():
        print(f"  build failed: {name}: {error[:500]}", file=log)
    for case in todo:
        variant, operands = _operands(case, lim.sm_count)
        family_op = FAMILY[variant]
        valid = family_op.space.valid(lim)
        calls, errors = {}, {}
        for config in valid:
            op, args, why = prepared_operation(variant, config, *operands)
            if why:
                errors[config.label] = "; ".join(why)
                continue
            calls[config.label] = (lambda op=op, module=family_op.module(config), args=args:
                                   launch(op, module, args))
        times = {k: t.median for k, t in compare(calls).items()} if calls else {}
        problem = launch_problem(case.kind, *operands[:3], None)
        row = {"case": case.name, "network": case.network, "kind": case.kind,
               "problem": problem._asdict(), "sms": lim.sm_count,
               "ms": {c.label: times.get(c.label) for c in valid}, "errors": errors}
        print(f"  {case.name:<60} " + "  ".join(
            f"{k} {'-' if v is None else f'{v * 1e3:.1f} us'}" for k, v in row["ms"].items()),
            file=log)
        yield row
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ report
def report(rows: list[dict]) -> list[str]:
    """For each part (fit, held out) and kind: the problems, and the loss of configs.heuristic's
    choice against each problem's fastest config (its time over the fastest's), geometric mean
    and worst, with the case it is worst on."""
    import dataclasses

    from vitrail.device import target_limits
    from vitrail.ops.conv import configs
    groups: dict[tuple[str, str], list[tuple[float, str]]] = {}
    for row in rows:
        times = {k: v for k, v in row["ms"].items() if v}
        if not times:
            continue
        problem = Problem(**row["problem"])
        lim = dataclasses.replace(target_limits("90a"), sm_count=row["sms"])
        chosen = configs.space(problem.kind).default(problem, lim).label
        loss = times[chosen] / min(times.values()) if chosen in times else math.inf
        groups.setdefault((part(row["network"]), row["kind"]), []).append((loss, row["case"]))
    lines = [f"  {'part':<10}{'kind':<7}{'problems':>9}{'geomean':>9}{'worst':>7}  worst case"]
    for (where, kind), losses in sorted(groups.items()):
        geo = math.exp(sum(math.log(v) for v, _ in losses) / len(losses))
        worst, name = max(losses)
        lines.append(f"  {where:<10}{kind:<7}{len(losses):>9}{geo:>9.3f}{worst:>7.2f}  {name}")
    lines.append("  loss: the heuristic's config's time over the problem's fastest config's")
    return lines + _schedules(rows)


def _schedules(rows: list[dict]) -> list[str]:
    """Per kind, the fastest cooperative config's speed over the fastest non-persistent one's
    (configs.SCHEDULES), on the problems where both ran: what the heuristic would gain taking
    the persistent kernel, and where."""
    speedups: dict[str, list[tuple[float, str]]] = {}
    for row in rows:
        best: dict[str, float] = {}
        for label, ms in row["ms"].items():
            if ms:
                key = "coop" if "schedule=cooperative" in label else "ws"
                best[key] = min(best.get(key, math.inf), ms)
        if len(best) == 2:
            speedups.setdefault(row["kind"], []).append((best["ws"] / best["coop"], row["case"]))
    if not speedups:
        return []
    lines = [f"  {'kind':<7}{'problems':>9}{'geomean':>9}{'worst':>7}{'best':>7}  "
             f"(cooperative: its fastest config over the non-persistent kernel's; > 1 faster)"]
    for kind, values in sorted(speedups.items()):
        geo = math.exp(sum(math.log(v) for v, _ in values) / len(values))
        lines.append(f"  {kind:<7}{len(values):>9}{geo:>9.3f}{min(values)[0]:>7.2f}"
                     f"{max(values)[0]:>7.2f}  best on {max(values)[1]}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("time", "report"):
        print("usage: python -m vitrail.ops.conv.sweep time|report OUT.json", file=sys.stderr)
        return 2
    what, path = argv
    if what == "time":
        rows = list(time_configs())
        with open(path, "w") as f:
            json.dump({"format": "vitrail-conv-sweep", "rows": rows}, f, indent=1)
    else:
        with open(path) as f:
            rows = json.load(f)["rows"]
    print("\n".join(report(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
