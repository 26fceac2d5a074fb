"""The GEMM sweep: the shapes the selection model is fitted and judged on, and their timings.

``shapes()`` is a broad, fixed sweep (nothing in it is tuned for): the linear layers of public LLM
families at 1 to 16384 tokens (``x @ W.t()``: B column-major), squares and odd sizes, skinny
problems with a long K, and batches. About a quarter of it, chosen by a hash of the shape, is
*held out*: ``vitrail.gemm.ops.model`` is fitted on the rest and reported on both.

Two measurements, both against torch in the same run:

- ``time_configs``: every candidate config of the selection model (``model.CANDIDATES``) on every
  shape, each launch replayed from a CUDA graph (no host time), operands rotated through enough
  copies that they come from DRAM as in a network's layer, not from L2. This is what the model
  is fitted on: ``python -m vitrail.gemm.ops.sweep configs OUT.json``.
- ``time_calls``: what a user gets, ``vitrail.ops.mm``/``bmm`` with the library's own choice
  against ``torch.mm``/``torch.bmm``, in a CUDA graph and eagerly (back-to-back calls, host time
  included); ``vitrail bench gemm-sweep`` reports its geometric mean, minimum and worst shapes.
"""
from __future__ import annotations

import json
import math
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Iterator

from vitrail.gemm.ops import model
from vitrail.gemm.ops.configs import Problem

# (out_features, in_features) of the linear layers of public model families: attention's fused
# QKV and output projections, the MLP's fused gate+up and down projections
LINEAR = {
    "bert-large": [(3072, 1024), (1024, 1024), (4096, 1024), (1024, 4096)],
    "llama-2-13b": [(15360, 5120), (5120, 5120), (27648, 5120), (5120, 13824)],
    "llama-3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
    "llama-3-70b": [(10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)],
    "qwen-2.5-7b": [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)],
    "deepseek-v3-expert": [(4096, 7168), (7168, 2048)],
}
TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
MAX_FLOP = 3e12  # shapes above (~4 ms on an H100) add time and no new regime


@dataclass(frozen=True)
class Shape(Problem):
    """A problem of the sweep: its sizes (M, N, K, L), B's layout and where it comes from."""
    layout_b: str = "row"  # "col": b is a transposed row-major weight (x @ W.t())
    family: str = ""

    @property
    def name(self) -> str:
        return (f"{self.M}x{self.N}x{self.K}" + (f"x{self.L}" if self.L > 1 else "")
                + ("" if self.layout_b == "row" else " (b col)"))

    @property
    def held_out(self) -> bool:
        """Never seen by the fit: a quarter of the sweep, by a hash of the shape."""
        return zlib.crc32(self.name.encode()) % 4 == 0

    @property
    def flop(self) -> float:
        return 2.0 * self.M * self.N * self.K * self.L


def shapes() -> list[Shape]:
    out: list[Shape] = []
    for family, layers in LINEAR.items():
        for n, k in layers:
            out += [Shape(m, n, k, 1, "col", family) for m in TOKENS]
    for s in (256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288):
        out.append(Shape(s, s, s, family="square"))
    odd = [(1000, 1000, 1000), (1536, 2560, 4000), (3000, 5000, 7000), (777, 4096, 4096),
           (4096, 777, 4096), (4096, 4096, 777), (2049, 2049, 2049), (100, 12288, 4096),
           (12288, 4096, 4096), (5120, 3000, 1234), (333, 333, 65536), (9000, 1000, 3000),
           (4000, 4000, 300), (160, 160, 160), (48, 30000, 5000), (6000, 6000, 96)]
    out += [Shape(m, n, k, family="odd") for m, n, k in odd]
    skinny = [(256, 256, 65536), (1024, 1024, 32768), (512, 2048, 16384), (128, 128, 131072),
              (2048, 256, 16384), (256, 4096, 32768)]
    out += [Shape(m, n, k, family="long-k") for m, n, k in skinny]
    batched = [(512, 512, 512, 64), (1024, 1024, 1024, 16), (2048, 2048, 256, 8),
               (128, 128, 4096, 32), (4096, 4096, 4096, 4), (96, 1024, 64, 128),
               (256, 4096, 1024, 12)]
    out += [Shape(m, n, k, b, family="batched") for m, n, k, b in batched]
    return [s for s in out if s.flop <= MAX_FLOP]


# --------------------------------------------------------------------------------- timing
def _copies(s: Shape, dtype_bytes: int) -> int:
    """Operand sets to rotate through so that each launch reads DRAM, not L2 (twice the L2)."""
    per = (s.M * s.K + s.K * s.N + s.M * s.N) * s.L * dtype_bytes
    return max(1, min(64, math.ceil(2 * 50e6 / per)))


def _operands(s: Shape, dtype, copies: int) -> list[tuple]:
    """(a, b, d) sets; rows padded to 16 bytes, as vitrail.ops pads an operand TMA cannot read
    (torch gets the same views)."""
    import torch
    lead = (s.L,) if s.L > 1 else ()

    def matrix(rows, cols):
        return torch.randn(*lead, rows, -(-cols // 8) * 8, device="cuda", dtype=dtype)[..., :cols]
    sets = []
    for _ in range(copies):
        a = matrix(s.M, s.K)
        b = matrix(s.N, s.K).transpose(-1, -2) if s.layout_b == "col" else matrix(s.K, s.N)
        sets.append((a, b, matrix(s.M, s.N).zero_()))
    return sets


class Graph:
    """``launch(a, b, d)`` over the operand sets, captured once into a CUDA graph of at least
    ``launches`` launches; ``ms()`` replays it and returns ms per launch."""

    def __init__(self, launch, sets: list[tuple], launches: int = 10):
        import torch
        self.count = max(launches, len(sets))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for a, b, d in sets[:2]:  # loads the module, allocates any workspace before capture
                launch(a, b, d)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for i in range(self.count):
                launch(*sets[i % len(sets)])
        self.graph.replay()
        torch.cuda.synchronize()

    def ms(self) -> float:
        import torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / self.count


def fair_ms(graphs: dict, rounds: int = 3) -> dict:
    """{name: ms per launch}: the graphs replayed in ``rounds`` rounds, the order rotated each
    round, each one's fastest round kept. A GPU's clock falls as it heats under GEMM load, so a
    fixed order would favour whichever runs first; the minimum is the least disturbed round."""
    names = list(graphs)
    best = {n: float("inf") for n in names}
    for r in range(rounds):
        k = (r * len(names)) // rounds
        for n in names[k:] + names[:k]:
            best[n] = min(best[n], graphs[n].ms())
    return best


def _launches(s: Shape) -> int:
    """Launches per graph: about 100 µs of work at least, 10 at most."""
    return max(1, min(10, math.ceil(100e-6 / max(s.flop / 600e12, 1e-6))))


def eager_ms(call, sets: list[tuple], *, calls: int = 30) -> float:
    """ms per call of back-to-back ``call(a, b)`` (host time included, as a user's loop)."""
    import torch
    for a, b, _ in sets[:2]:
        call(a, b)
    torch.cuda.synchronize()
    n = max(calls, len(sets))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(n):
        a, b, _ = sets[i % len(sets)]
        call(a, b)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def fair_eager_ms(calls: dict, sets: list[tuple], rounds: int = 3) -> dict:
    """{name: ms per call} of eager_ms for each call, alternating, each one's fastest of
    ``rounds`` kept (as fair_ms)."""
    best = {name: float("inf") for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            best[name] = min(best[name], eager_ms(call, sets))
    return best


def _torch_launch(a, b, d):
    import torch
    (torch.bmm if a.dim() == 3 else torch.mm)(a, b)  # its own contiguous output, as users call it


def time_configs(dtype_name: str = "bf16", *, only=None, log=sys.stderr) -> Iterator[dict]:
    """Every candidate config and torch on every shape (graph replay); one record per shape."""
    import torch

    from vitrail.gemm import LinearCombination
    from vitrail.gemm.ops.configs import Kind
    from vitrail.gemm.ops.launch import op_for
    from vitrail.tune import limits
    lim = limits()
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype_name]
    for s in shapes() if only is None else only:
        kind = Kind(dtype_name, dtype_name, "row", s.layout_b, LinearCombination(dtype_name))
        op = op_for(kind)
        sets = _operands(s, dtype, _copies(s, 2))
        rec = dict(asdict(s), name=s.name, held_out=s.held_out, torch=None, configs={})
        began = time.time()
        n = _launches(s)
        graphs = {"torch": Graph(_torch_launch, sets, n)}
        for config in model.CANDIDATES:
            if op.space.reasons(config, lim):
                continue

            def launch(a, b, d, c=config, module=op.module(config)):
                op.launch(module, c, a, b, None, d, None, None, None, 1.0, 0.0, 0.01,
                          -math.inf, math.inf, 1)
            try:
                graphs[model.label(config)] = Graph(launch, sets, n)
            except Exception as e:  # a config that cannot run the shape scores nothing
                rec["configs"][model.label(config)] = None
                print(f"  {s.name} {model.label(config)}: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200]}", file=log)
        timed = fair_ms(graphs)
        rec["torch"] = timed.pop("torch")
        rec["configs"].update(timed)
        del graphs
        best = min((v, k) for k, v in rec["configs"].items() if v is not None)
        print(f"{s.name:<28} torch {rec['torch'] * 1e3:9.1f} us  best {best[0] * 1e3:9.1f} us "
              f"{best[1]:<26} {rec['torch'] / best[0]:5.2f}x  ({time.time() - began:.1f} s)",
              file=log, flush=True)
        del sets
        yield rec


def time_calls(dtype, *, only=None, log=sys.stderr) -> Iterator[dict]:
    """vitrail.ops.mm/bmm (the library's choice) against torch.mm/bmm: graph and eager ms."""
    import torch

    from vitrail.gemm.ops.dense import bmm, mm
    for s in shapes() if only is None else only:
        sets = _operands(s, dtype, _copies(s, torch.finfo(dtype).bits // 8))
        ours = bmm if s.L > 1 else mm
        theirs = torch.bmm if s.L > 1 else torch.mm
        rec = dict(asdict(s), name=s.name, held_out=s.held_out)
        n = _launches(s)
        rec["graph"] = fair_ms({"vitrail": Graph(lambda a, b, d: ours(a, b), sets, n),
                                "torch": Graph(lambda a, b, d: theirs(a, b), sets, n)})
        rec["eager"] = fair_eager_ms({"vitrail": ours, "torch": theirs}, sets)
        print(f"{s.name:<28} graph {rec['graph']['torch'] / rec['graph']['vitrail']:5.2f}x  "
              f"eager {rec['eager']['torch'] / rec['eager']['vitrail']:5.2f}x", file=log,
              flush=True)
        del sets
        yield rec


# the fused epilogues ``time_fused`` times: gemm's keyword arguments (c: C is given)
FUSED = {"bias-silu": dict(bias=True, activation="silu"),
         "c-bias-gelu-clamp": dict(c=True, beta=0.5, bias=True, activation="gelu",
                                   clamp_max=1.0)}


def _fused_kind(s: Shape, epilogue: str):
    from vitrail.gemm import LinearCombination
    from vitrail.gemm.ops.configs import Kind
    e = FUSED[epilogue]
    return Kind("bf16", "bf16", "row", s.layout_b, LinearCombination(
        "bf16", element_source="bf16" if e.get("c") else None, bias="col",
        activation=e["activation"], clamp="clamp_max" in e))


def build_fused(shapes_: list[Shape], epilogue: str, log=sys.stderr) -> None:
    """Compile the kernels ``time_fused`` runs, in parallel (one process per config)."""
    from vitrail.gemm.ops.launch import op_for
    from vitrail.tune import limits
    from vitrail.tune.tuner import compile_all
    arch = limits().arch.name
    jobs = {}
    for s in shapes_:
        op = op_for(_fused_kind(s, epilogue))
        config = model.choose(s.M, s.N, s.K, s.L, torch_ok=False)
        jobs[(op.name, config)] = (config, dict(op.render(config), arch=arch))
    failed = compile_all(list(jobs.values()), label="fused gemm")
    print(f"built {len(jobs)} fused configs, {len(failed)} failed", file=log, flush=True)


def time_fused(dtype, epilogue: str = "bias-silu", *, only=None,
               log=sys.stderr) -> Iterator[dict]:
    """A fused epilogue (``FUSED``) on each shape, in CUDA graphs: vitrail's kernel (the
    selection's config without torch) and torch's route for it (launch.torch_fused: addmm
    taking C or the bias, the rest in place), the two options the selection chooses between;
    and what a user gets, vitrail.ops.gemm (the library's choice) against torch's ops as a
    user writes them (silu(addmm(bias, a, b)), ...), in a graph and eagerly."""
    import torch
    import torch.nn.functional as F

    from vitrail.gemm.ops import launch, testing
    from vitrail.gemm.ops.dense import gemm
    from vitrail.plan import native
    native.load(wait=True)  # eager calls through the C++ hit path, as a user's soon are
    e = FUSED[epilogue]
    act = {"silu": F.silu, "gelu": F.gelu}[e["activation"]]
    beta, hi = e.get("beta", 0.0), e.get("clamp_max")
    for s in shapes() if only is None else only:
        sets = _operands(s, dtype, _copies(s, torch.finfo(dtype).bits // 8))
        bias = torch.randn(s.N, device="cuda", dtype=dtype)
        c = torch.randn(*((s.L,) if s.L > 1 else ()), s.M, s.N, device="cuda",
                        dtype=dtype) if e.get("c") else None
        product = torch.baddbmm if s.L > 1 else torch.addmm
        kind = _fused_kind(s, epilogue)
        chosen = _heuristic_config(kind, s)
        rec = dict(asdict(s), name=s.name, held_out=s.held_out, epilogue=epilogue,
                   passes=kind.torch_passes, chosen=model.label(chosen))
        n = _launches(s)

        def ours(a, b, d=None):
            return gemm(a, b, c, beta=beta, bias=bias, activation=e["activation"], clamp_max=hi)

        def theirs(a, b, d=None):
            y = act(product(c, a, b, beta=beta) + bias if c is not None else product(bias, a, b))
            return y if hi is None else torch.clamp(y, max=hi)

        def route(a, b, d):
            launch.torch_fused(d, a, b, c, bias, 1.0, beta, e["activation"], 0.01, None, hi)
        with testing.kernels_only():
            kernel = Graph(ours, sets, n)
        graphs = {"kernel": kernel, "route": Graph(route, sets, n),
                  "vitrail": Graph(ours, sets, n), "torch": Graph(theirs, sets, n)}
        rec["graph"] = fair_ms(graphs)
        rec["eager"] = fair_eager_ms({"vitrail": ours, "torch": theirs}, sets)
        g = rec["graph"]
        print(f"{s.name:<28} {rec['chosen']:<30} kernel/route {g['kernel'] / g['route']:5.2f}  "
              f"graph {g['torch'] / g['vitrail']:5.2f}x  eager "
              f"{rec['eager']['torch'] / rec['eager']['vitrail']:5.2f}x", file=log, flush=True)
        del sets, graphs, kernel
        yield rec


def _heuristic_config(kind, s: Shape):
    """The config the library's heuristic gives kind on shape s."""
    from vitrail.gemm.ops import configs
    from vitrail.tune import limits
    return configs.space(kind).default(s, limits())


def fused_report(records: list[dict]) -> str:
    """The fused choice on ``time_fused``'s records: its time over the faster of the two
    options (kernel, torch's route) against always taking the kernel; what users get against
    torch's ops as written."""
    lines = []
    for part, rs in (("all", records), ("held out", [r for r in records if r["held_out"]])):
        if not rs:
            continue
        g = [r["graph"] for r in rs]
        chosen = [x["route"] if r["chosen"] == model.TORCH else x["kernel"]
                  for r, x in zip(rs, g)]
        best = [min(x["kernel"], x["route"]) for x in g]
        regret = [c / b for c, b in zip(chosen, best)]
        always = [x["kernel"] / b for x, b in zip(g, best)]
        lines.append(f"{part}, {len(rs)} shapes, {sum(r['chosen'] == model.TORCH for r in rs)} "
                     f"on torch's route: chosen / faster option geomean {model.geomean(regret):.3f}"
                     f" max {max(regret):.2f} ({sum(x > 1.05 for x in regret)} above 1.05); "
                     f"always the kernel: geomean {model.geomean(always):.3f} max {max(always):.2f}"
                     f" ({sum(x > 1.05 for x in always)} above 1.05)")
    for how in ("graph", "eager"):
        for epilogue in sorted({r["epilogue"] for r in records}):
            lines.append(f"vitrail.ops.gemm / torch's ops, {epilogue}, {how}: " + summary(
                {r["name"]: r[how]["torch"] / r[how]["vitrail"] for r in records
                 if r["epilogue"] == epilogue}))
    return "\n".join(lines)


def summary(ratios: dict[str, float], worst: int = 10) -> str:
    """Geometric mean, minimum and the worst shapes of {shape: torch time / vitrail time}."""
    if not ratios:
        return "no shapes"
    low = sorted(ratios.items(), key=lambda kv: kv[1])[:worst]
    return (f"{len(ratios)} shapes: geomean {model.geomean(ratios.values()):.3f}x, min "
            f"{low[0][1]:.3f}x; worst: "
            + ", ".join(f"{k} {v:.2f}x" for k, v in low))


USAGE = """usage: python -m vitrail.gemm.ops.sweep COMMAND ...
  configs OUT.json [i/n]  time every candidate config and torch on the sweep (i/n: only the
                          i-th of n interleaved parts)
  calls OUT.json [i/n]    time vitrail.ops.mm/bmm (the library's choice) against torch
  fused OUT.json [i/n [EPILOGUE]]  time a fused epilogue (FUSED; bias-silu by default): the
                          kernel, torch's route, the library's choice and torch's ops as
                          written, on the shapes where the plain product's choice is torch's
                          matmul (elsewhere the kernel runs)
  table SWEEP.json...     print the selection table (vitrail/gemm/ops/selection_h100.json)
  check SWEEP.json...     the selection on the held-out shapes, from a table of the others
  fused-report FUSED.json...  the fused choice against its two options and torch's ops"""


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("configs", "calls", "fused", "table", "check",
                                        "fused-report"):
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] in ("table", "check", "fused-report"):
        records = [r for path in argv[1:] for r in json.load(open(path))["records"]]
        if argv[0] == "check":
            print(model.check(records))
            return 0
        if argv[0] == "fused-report":
            print(fused_report(records))
            return 0
        data = model.make_table(records)
        rows = ",\n  ".join(json.dumps(r, separators=(",", ":")) for r in data.pop("shapes"))
        print(json.dumps(data, indent=1)[:-2] + f',\n "shapes": [\n  {rows}\n ]\n}}')
        return 0
    import torch
    part = shapes()
    if argv[0] == "fused":
        part = [s for s in part if model.choose(s.M, s.N, s.K, s.L, torch_ok=True)
                == model.TORCH_CONFIG]
    if len(argv) >= 3:
        i, n = (int(x) for x in argv[2].split("/"))
        part = part[i::n]
    epilogue = argv[3] if len(argv) == 4 else "bias-silu"
    records = []
    if argv[0] == "fused":
        build_fused(part, epilogue)
    timings = {"configs": lambda: time_configs("bf16", only=part),
               "calls": lambda: time_calls(torch.bfloat16, only=part),
               "fused": lambda: time_fused(torch.bfloat16, epilogue, only=part)}[argv[0]]
    for rec in timings():
        records.append(rec)  # written after each shape: a run cut short keeps what it timed
        with open(argv[1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
