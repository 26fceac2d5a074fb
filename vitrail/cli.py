"""The ``vitrail`` command: doctor, cache, bench."""
from __future__ import annotations

import argparse
import sys
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
    from vitrail import bench
    return bench.main(args.names, out_dir=args.out, compile_only=args.compile_only,
                      list_only=args.list)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vitrail", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="check the toolchain, GPUs and cache; build and run two kernels"
                   ).set_defaults(fn=_doctor)
    cache = sub.add_parser("cache", help="inspect or clean the kernel cache")
    cache.add_argument("action", choices=["ls", "info", "clear", "prune"])
    cache.add_argument("--max-size", help="prune: the size to shrink to (e.g. 500M, 2G)")
    cache.set_defaults(fn=_cache)
    bench = sub.add_parser("bench", help="benchmark vitrail against its baselines on this GPU")
    bench.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    bench.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    bench.add_argument("--compile-only", action="store_true",
                       help="build the benchmarks' kernels without running them")
    bench.add_argument("--out", default="results", help="folder for the JSON results")
    bench.set_defaults(fn=_bench)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
