"""The ``vitrail`` command: doctor, cache, bench, tune, precompile."""
from __future__ import annotations

import argparse
import importlib
import sys
import textwrap
import time

def _doctor(args: argparse.Namespace) -> int:
    from vitrail import doctor
    return doctor.main()


def _cache(args: argparse.Namespace) -> int:
    from vitrail.jit import housekeeping as hk
    if args.action == "info":
        i = hk.info()
        print(f"directory: {i.root}\nkernels:   {i.entries}\nsize:      {hk.format_size(i.size)}"
              f"\nfailed builds kept: {i.failed}")
    elif args.action == "ls":
        rows = hk.entries()
        if not rows:
            print("the cache is empty")
            return 0
        print(f"{'key':<14}{'name':<28}{'backend':<8}{'arch':<9}{'size':>10}{'compile s':>11}  "
              f"{'created':<17}{'last used':<17}")
        for r in rows:
            name, backend, arch = (str(r[c] if r[c] is not None else "?")
                                   for c in ("name", "backend", "arch"))  # a damaged meta.json
            print(f"{r['key'][:12]:<14}{name[:27]:<28}{backend:<8}{arch:<9}"
                  f"{hk.format_size(r['size'] or 0):>10}{r['compile_seconds'] or 0:>11.1f}  "
                  f"{_when(r['created']):<17}{_when(r['last_used']):<17}")
    elif args.action == "clear":
        print(f"removed {hk.format_size(hk.clear())}")
    elif args.action == "prune":
        if args.max_size is None:
            print("vitrail cache prune: --max-size SIZE is required (e.g. 2G)", file=sys.stderr)
            return 2
        try:
            limit = hk.parse_size(args.max_size)
        except ValueError as e:
            print(f"vitrail cache prune: {e}", file=sys.stderr)
            return 2
        removed = hk.prune(limit)
        print(f"removed {len(removed)} kernels; the cache now holds "
              f"{hk.format_size(hk.info().size)}")
    return 0


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "-"


def _bench(args: argparse.Namespace) -> int:
    from vitrail import bench, ops
    ops.load_benchmarks()  # the families' benchmarks, before the registry runs
    return bench.main(args.names, out_dir=args.out, compile_only=args.compile_only,
                      list_only=args.list)


def _load_ops(extra: list[str]) -> dict:
    from vitrail import ops
    from vitrail.op import registry
    ops.load_all()  # vitrail's op families register themselves; --module adds others
    for name in extra or []:
        importlib.import_module(name)
    return registry()


def _families(registry: dict) -> dict[str, list[str]]:
    """Op names by family (the name's first part: softmax, copy, gemm, ...)."""
    out: dict[str, list[str]] = {}
    for name in sorted(registry):
        out.setdefault(name.split(".")[0], []).append(name)
    return out


def _select_ops(names: list[str], registry: dict, command: str):
    """The ops named: each name an op, a whole family or a public function (the families of
    ``vitrail tune``: mm builds the gemm ops); an unknown one exits with the nearest names (and
    `vitrail {command} --list`), not the whole registry."""
    import difflib
    from vitrail.op import FAMILIES
    families = _families(registry)
    chosen: list[str] = []
    for n in names:
        if n in registry:
            chosen.append(n)
        elif n in families:
            chosen.extend(families[n])
        elif n in FAMILIES:
            found = [r for r in sorted(registry) if r.startswith(FAMILIES[n].prefixes)]
            if not found:
                why = FAMILIES[n].why_not or "its kernels are built at its first calls"
                raise SystemExit(f"vitrail {command}: {n} has no registered ops to build ({why})")
            chosen.extend(found)
        else:
            names = dict.fromkeys([*families, *FAMILIES, *registry])  # one of each, in order
            near = difflib.get_close_matches(n, list(names), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise SystemExit(f"vitrail {command}: unknown op or family {n!r}{hint} "
                             f"(`vitrail {command} --list` shows them)")
    return [registry[n] for n in dict.fromkeys(chosen or sorted(registry))]


def _list_ops(registry: dict) -> int:
    for family, names in _families(registry).items():
        print(f"{family:<14}{len(names):>4} variants  e.g. {names[0]}")
    return 0


def _tune(args: argparse.Namespace) -> int:
    from vitrail.tune import TuningStore
    store = TuningStore()
    what = args.what
    if what in ("export", "import"):
        if not args.file:
            print(f"vitrail tune {what}: FILE is required", file=sys.stderr)
            return 2
        if what == "export":
            n = store.export(args.file, op=args.op)
            print(f"exported {n} tuning records to {args.file}")
        else:
            try:
                added, kept = store.import_(args.file, overwrite=args.overwrite,
                                            ops=_load_ops(args.module))
            except ValueError as e:
                print(f"vitrail tune import: {e}", file=sys.stderr)
                return 2
            print(f"imported {added} tuning records from {args.file}"
                  + (f"; kept {kept} already here (--overwrite replaces them)" if kept else ""))
        return 0
    if what == "grid":
        return _tune_grid(args)
    if what == "ls":
        records = store.records(args.op)
        rows = []
        for r in records:
            best = min((t["ms"] for t in r.timings if t.get("ms") is not None), default=None)
            shown = f"{best * 1e3:.1f} us" if best is not None else "-"
            rows.append((r.key.op, r.key.gpu, r.key.problem, r.config.label, shown))
        if rows:  # columns as wide as their longest entry (op names and problems run long)
            rows.insert(0, ("op", "gpu", "problem", "config", "best"))
            widths = [max(len(row[i]) for row in rows) for i in range(5)]
            for row in rows:
                print("  ".join(f"{c:<{w}}" for c, w in zip(row[:4], widths))
                      + f"  {row[4]:>{widths[4]}}")
        print(f"{len(records)} records in {store.path}")
        return 0
    registry = _load_ops(args.module)
    try:
        shaped, label = resolve_tune(what, args.shape, args.dtype, args.backward, registry,
                                     device=_gpu())
    except _Usage as e:
        print(f"vitrail tune {what}: {e}", file=sys.stderr)
        return 2
    print(f"{label}: {'' if shaped.op.name == what else shaped.op.name + ', '}problem "
          f"{shaped.key}")
    if _gpu() is None:
        print("vitrail tune: no GPU is visible: tuning times the candidate kernels on one",
              file=sys.stderr)
        return 1
    import vitrail
    with vitrail.settings(policy=vitrail.PickBest, verbose=True, max_workers=args.workers):
        config = shaped.op.config(shaped.key, shaped.problem, shaped.args())
    print(f"{label}: {shaped.op.name} {config.label}")
    _plot_sweep(shaped.op, shaped.key, label, args)
    return 0


def _tune_grid(args: argparse.Namespace) -> int:
    """``vitrail tune grid [FILE]``: PickBest over vitrail.tune.grid.GRID on this GPU, into a
    store of its own (nothing this machine tuned before is reused), merged into FILE (default:
    the shipped layer's tuning.json) after each problem, with the records of other GPUs that
    still apply; a problem FILE already holds for this GPU is skipped (--overwrite: tuned
    again), so an interrupted run goes on where it stopped."""
    import math
    import os
    import tempfile
    from pathlib import Path

    from vitrail import __version__
    from vitrail.jit.shared import SHIPPED
    from vitrail.tune import TuningError, TuningStore, grid, limits, tuner
    from vitrail.tune.store import read_export, write_export
    path = Path(args.file or os.path.join(SHIPPED, "tuning.json"))
    if _gpu() is None:
        print("vitrail tune grid: no GPU is visible: tuning times the candidate kernels on one",
              file=sys.stderr)
        return 1
    registry = _load_ops(args.module)
    try:
        chosen = grid.problems(args.op)
        shipped = read_export(path) if path.exists() else []
        # every problem routed once: the loop below takes its own; merge checks the records
        # against the grid's ops, some not registered (sympow's other dtypes)
        resolved = {p: resolve_tune(p.family, p.shape, p.dtype, p.backward, registry,
                                    device=_gpu())[0] for p in grid.GRID}
        known = {**registry, **{s.op.name: s.op for s in resolved.values()}}
    except (ValueError, _Usage) as e:
        print(f"vitrail tune grid: {e}", file=sys.stderr)
        return 2
    applies = grid.applies_here(known, __version__)
    records = {r.key: r for r in grid.merge([], shipped, applies)}
    failed, slowdowns, skipped = [], {}, 0
    import vitrail
    with tempfile.TemporaryDirectory() as tmp, vitrail.settings(max_workers=args.workers):
        store = TuningStore(Path(tmp) / "tuning.sqlite")
        for p in chosen:
            shaped = resolved[p]
            key = tuner.record_key(shaped.op.tunable, shaped.key, limits())
            if key in records and key not in slowdowns and not args.overwrite:
                skipped += 1
                continue
            try:
                config = shaped.op.tune(shaped.key, shaped.problem, shaped.args(), store)
            except TuningError as e:
                failed.append(f"{p.label}: {e}")
                print(f"{p.label}: FAILED {e}", file=sys.stderr)
                continue
            space = shaped.op.tunable.space
            heuristic = space.default(shaped.problem, limits()) if space.heuristic else None
            record = store.get(key)
            records[key] = grid.shipped_form(record, heuristic)
            slow = slowdowns[key] = grid.heuristic_slowdown(record, heuristic)
            write_export(path, grid.merge(records.values(), [], applies))
            print(f"{p.label}: {shaped.op.name} {config.label}"
                  + (f" (the heuristic's config: {slow:.3f}x the best's time)" if slow else ""),
                  flush=True)
    slow = [x for x in slowdowns.values() if x is not None]
    if slow:
        geo = math.exp(sum(map(math.log, slow)) / len(slow))
        print(f"the heuristic's config vs the best over {len(slow)} records: geomean "
              f"{geo:.3f}x the time, worst {max(slow):.3f}x")
    print(f"{len(slowdowns)} records tuned here, {skipped} problems skipped (FILE holds them; "
          f"--overwrite tunes them again); {len(records)} records in {path}"
          + (f"; {len(failed)} problems failed" if failed else ""))
    return 1 if failed else 0


class _Usage(Exception):
    """A command line that cannot be tuned: one line saying what to give."""


def _gpu():
    import torch
    return torch.device("cuda") if torch.cuda.is_available() else None


def resolve_tune(what: str, shape: str | None, dtype: str | None, backward: bool,
                 registry: dict, device=None):
    """(Shaped, a label) of ``vitrail tune WHAT --shape ... --dtype ...``: a family (or a
    public function: vitrail.op.FAMILIES) routed as its public function routes the shape on
    ``device`` (None: the build target), or a variant (an op name) given the shape as is.
    _Usage says what is wrong in one line."""
    from vitrail.op import FAMILIES, parse_shape
    fam = FAMILIES.get(what)
    if fam is None and what not in registry:
        import difflib
        near = difflib.get_close_matches(what, list(dict.fromkeys([*FAMILIES, *registry])), n=3)
        if what in _families(registry):
            raise _Usage("this family gives no shapes to tune; name one of its variants "
                         "(`vitrail precompile --list`)")
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise _Usage(f"unknown op or family{hint} (`vitrail tune --help` lists the families)")
    if fam is not None and fam.resolve is None:
        raise _Usage(fam.why_not)
    op = None if fam is not None else registry[what]
    if op is not None and op.make_problem is None:
        raise _Usage("this op makes no problem from a shape on the command line; tune it from "
                     "Python (vitrail.settings(policy=vitrail.PickBest) around a call)")
    spec = fam.shape if fam is not None else op.shape
    if not shape:
        raise _Usage(f"give --shape {spec}" + (f": {fam.doc}" if fam is not None else ""))
    try:
        dims = parse_shape(shape, spec)
    except ValueError as e:
        raise _Usage(str(e)) from None
    if fam is None:
        if backward:
            raise _Usage("--backward is for a family; a variant is a forward or a backward")
        try:
            return op.make_problem(dims, dtype), f"{what} {shape}"
        except ValueError as e:
            raise _Usage(str(e)) from None
    dtype = dtype or fam.dtypes[0]
    if dtype not in fam.dtypes:
        shown = ", ".join(d for d in fam.dtypes if ":" not in d)
        raise _Usage(f"--dtype {dtype!r}: {what} takes {shown}"
                     + (" or IN:OUT" if any(":" in d for d in fam.dtypes) else ""))
    if backward and not fam.backward:
        raise _Usage(f"{what} has no backward to tune (--backward)")
    try:
        shaped = fam.resolve(dims, dtype, backward=backward, device=device)
    except ValueError as e:
        raise _Usage(str(e)) from None
    return shaped, f"{what}{' backward' if backward else ''} {shape} {dtype}"


def _tune_epilog() -> str:
    """The families `vitrail tune` takes, what --shape means for each and their dtypes."""
    from vitrail.op import FAMILIES
    _load_ops([])
    lines = ["families (--shape, its meaning; --dtype, the first the default):"]
    for name, fam in sorted(FAMILIES.items()):
        if fam.resolve is None:
            lines.append(f"  {name}: {fam.why_not}")
            continue
        dtypes = ", ".join(d for d in fam.dtypes if ":" not in d)
        lines.append(f"  {name} --shape {fam.shape}" + (" [--backward]" if fam.backward else ""))
        lines.extend(textwrap.wrap(f"{fam.doc}; dtypes {dtypes}", 94, initial_indent="      ",
                                   subsequent_indent="      "))
    lines.append("a variant (an op name, `vitrail precompile --list`) takes the same shape as "
                 "its family and fixes its dtype; a family runs the variant its public "
                 "function runs for the shape")
    return "\n".join(lines)


def _plot_sweep(op, key: str, label: str, args: argparse.Namespace) -> None:
    """A PNG of every candidate's time, from the tuning store's record of this problem."""
    from pathlib import Path

    from vitrail.tune import TuningStore, limits, tuner
    record = TuningStore().get(tuner.record_key(op.tunable, key, limits()))
    if record is None or not record.timings:
        return
    dtype = f"-{args.dtype.replace(':', '-')}" if args.dtype else ""
    path = Path(args.out) / f"tune-{op.name}-{args.shape}{dtype}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        from vitrail.profile import plot_sweep
        plot_sweep([(t["config"], t["ms"]) for t in record.timings], path,
                   title=f"{label}: {op.name} on {record.key.gpu}")
        print(f"sweep plotted to {path}")
    except ImportError as e:  # matplotlib is an optional extra
        print(f"no plot: {e}")


def _precompile(args: argparse.Namespace) -> int:
    registry = _load_ops(args.module)
    if args.list:
        return _list_ops(registry)
    ops = _select_ops(args.ops, registry, "precompile")
    if not ops:
        print("vitrail precompile: no ops are registered yet")
        return 0
    from vitrail.tune.tuner import compile_all
    start = time.perf_counter()
    jobs = [((op.name, config), kwargs) for op in ops
            for config, kwargs in op.precompile_jobs(args.arch)]
    # one pool for every op's configs: --workers compiles across ops, not one op at a time
    failures = compile_all(jobs, max_workers=args.workers, verbose=True,
                           label=f"{len(ops)} ops'")
    for op in ops:
        configs = len(op.default_configs(_limits(args.arch)))
        mine = {config: error for (name, config), error in failures.items() if name == op.name}
        print(f"{op.name}: {configs - len(mine)}/{configs} default configs built")
        for config, error in mine.items():
            print(f"  {config.label}: {error}")
    print(f"{len(jobs)} kernels of {len(ops)} ops in {time.perf_counter() - start:.1f} s")
    return 1 if failures else 0


def _limits(arch: str | None):
    from vitrail.tune import limits
    return limits(arch=arch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vitrail", description=__doc__.replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check the toolchain, GPUs and cache; build and run two kernels"
                   ).set_defaults(fn=_doctor)
    cache = sub.add_parser("cache", help="inspect or clean the kernel cache")
    cache.add_argument("action", choices=["ls", "info", "clear", "prune"],
                       help="ls: every kernel; info: the directory and its size; clear: remove "
                       "everything; prune: remove the least recently used down to --max-size")
    cache.add_argument("--max-size", help="prune: the size to shrink to (e.g. 500M, 2G)")
    cache.set_defaults(fn=_cache)
    bench = sub.add_parser("bench", help="benchmark vitrail against its baselines on this GPU")
    bench.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    bench.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    bench.add_argument("--compile-only", action="store_true",
                       help="build the benchmarks' kernels without running them")
    bench.add_argument("--out", default="results", help="folder for the JSON results")
    bench.set_defaults(fn=_bench)
    words = sys.argv[1:] if argv is None else argv  # tune's help lists the families (ops load)
    helping = words[:1] == ["tune"] and bool({"-h", "--help"} & set(words))
    tune = sub.add_parser("tune", help="tune a family or op for a shape (PickBest), or list, "
                          "export and import tuning records",
                          epilog=_tune_epilog() if helping else None,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    tune.add_argument("what", help="a family (softmax, gemm, ...: below), an op (a variant), "
                      "or ls | export | import | grid (the shipped grid: vitrail.tune.grid)")
    tune.add_argument("file", nargs="?", help="export/import: the JSON file; grid: the file "
                      "to write (default: the shipped layer's tuning.json)")
    tune.add_argument("--shape", help="the problem's shape: what it means is the family's "
                      "(below), e.g. softmax 4096x4096 (ROWSxCOLS), gemm 4096x4096x4096 (MxNxK)")
    tune.add_argument("--dtype", help="the problem's dtype (torch name; default: the family's "
                      "first, below; a variant fixes its own)")
    tune.add_argument("--backward", action="store_true",
                      help="tune the family's backward (softmax, log_softmax)")
    tune.add_argument("--op", help="ls/export: only this op's records; grid: only this "
                      "family's problems")
    tune.add_argument("--overwrite", action="store_true",
                      help="import: replace records this machine already has; grid: tune "
                      "again the problems FILE holds for this GPU")
    tune.add_argument("--workers", type=int, help="compile processes (default: cores/memory)")
    tune.add_argument("--out", default="results", help="folder for the sweep's PNG")
    tune.add_argument("--module", action="append", default=[],
                      help="import this module first (it registers more ops)")
    tune.set_defaults(fn=_tune)
    pre = sub.add_parser("precompile", help="build ops' default configs into the cache ahead of "
                         "time (for CI images and releases)")
    pre.add_argument("ops", nargs="*", help="families or public functions (softmax, copy, gemm, "
                     "mm, sympow_mma, ...: the names tune takes) or ops to build (default: all "
                     "registered)")
    pre.add_argument("--list", action="store_true", help="list the families and exit")
    pre.add_argument("--arch", help="target, e.g. 90a (default: this GPU, or VITRAIL_ARCH)")
    pre.add_argument("--workers", type=int, help="compile processes (default: cores/memory)")
    pre.add_argument("--module", action="append", default=[],
                     help="import this module first (it registers more ops)")
    pre.set_defaults(fn=_precompile)
    args = parser.parse_args(argv)
    from vitrail.jit.errors import VitrailError
    try:
        return args.fn(args)
    except BrokenPipeError:  # `vitrail cache ls | head`: the reader has all it wanted
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except VitrailError as e:  # a misconfiguration: one line, not a traceback
        print(f"vitrail {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
