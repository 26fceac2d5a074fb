"""Plans: the slow work of an op call done once per signature; later calls are one lookup and
one C call.

Each op family keeps a :class:`Plans` cache. Its public function, on the plain eager path, builds
a key from everything that decides the route (``signature(t)`` of each tensor: shape, strides,
dtype, device and address modulo 16; and the scalars the family names) and calls
``plans.run(key, inputs, outputs, general)``:

- **hit**: the plan allocates the outputs and repeats the launches it recorded, with this call's
  pointers and the current stream. No checks, routing or config lookups run, and no Python object
  is built but the outputs; an entry point is called through its generated C caller
  (``EntryPoint.fast``), a kernel through the driver launcher.
- **miss**: ``general(*inputs, *outputs)`` runs as it always does (it checks, routes, picks the
  config, compiles) while its launches are recorded. The record becomes the key's plan when every
  pointer passed is an input's, an output's, a scratch buffer's (``scratch``) or one the family
  keeps alive (``keep``), and no torch op but allocations and views ran (a TorchDispatchMode
  watches: a copy, a fill or a sync that a plan would skip makes it ``GENERAL``, and every call of
  that key takes the general path).

A plan exists only for a signature whose arguments once passed every check, so the checks hold
for it; any other call misses, and the miss path raises what it always raised. The current
device, its current stream and the tuning policy are part of every key (a plan holds on its
own stream only: it may pass state kept per stream, see ``keep``). Plans are per process,
bounded (the oldest half goes when a cache is full) and dropped with ``clear()``
(``vitrail.plan.clear_all()``: every family's).

Below Python (``native``): an op's public function wrapped by ``native.front(plans)`` hands its
arguments to the family's C++ table first; a hit runs the plan's description there (outputs
allocated through ATen, calls and launches made from C++), a miss runs the function and teaches
the table the plan it ran.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vitrail.jit.errors import LaunchError
from vitrail.jit.module import HOOKS
from vitrail.plan import native

from vitrail.tune.settings import current_policy, on_change

__all__ = ["Plans", "GENERAL", "signature", "scratch", "keep", "setup", "clear_all",
           "recording", "provisional"]

GENERAL = "general"  # a key whose calls take the general path (what they do cannot be replayed)
_ALL: list["Plans"] = []
_state = threading.local()  # .record: the Record of this thread's miss being recorded, or None
_recording = 0  # misses being recorded, in any thread (while one is, hits check their thread)
_count_lock = threading.Lock()
_GPU = torch.cuda.is_available()
if _GPU:
    _stream, _device = torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice
else:  # no plan is ever made: keys say so
    _stream, _device = None, (lambda: -1)


def _where() -> tuple[int, int]:
    """The current device and its current stream: part of every key (a plan may pass state
    kept per stream, e.g. a workspace whose counters two grids must not share)."""
    device = _device()
    return device, 0 if _stream is None else _stream(device)


def signature(t: torch.Tensor) -> tuple:
    """What of a tensor decides a route: shape, strides, dtype, device, address modulo 16."""
    return t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15


def recording() -> "Record | None":
    """The record of this thread's plan miss, or None (the launch paths' hook)."""
    return getattr(_state, "record", None)


def provisional() -> None:
    """The call being recorded (if one is) makes no plan for its key: it ran a stand-in (a
    library's function while its kernel builds in the background) that the key's later calls
    will not run. The key records again at its next call."""
    record = recording()
    if record is not None:
        record.provisional = True


def keep(*tensors: torch.Tensor) -> None:
    """Say that the launch being made passes these long-lived tensors (tables cached per device,
    persistent buffers, a workspace kept per stream): a plan may pass their addresses as
    constants, and holds them. A plan runs on the stream it was recorded on only."""
    record = recording()
    if record is not None:
        record.kept.extend(tensors)


def scratch(n: int, dtype: torch.dtype, device: torch.device | int) -> torch.Tensor:
    """A buffer of n elements for one launch (a workspace, partial results), allocated again at
    every call of a plan that records it. Nothing needs to keep it: torch's caching allocator
    hands its memory out again only to work queued after the launch on the current stream."""
    buf = torch.empty(n, dtype=dtype, device=device)
    record = recording()
    if record is not None:
        record.scratch.append((buf, n, dtype, buf.device))
    return buf


class Record:
    """The launches one general call made: [(kind, target, values, extra)]."""

    def __init__(self):
        self.launches: list[tuple[str, Any, tuple, Any]] = []
        self.scratch: list[tuple[torch.Tensor, int, torch.dtype, torch.device]] = []
        self.kept: list[torch.Tensor] = []
        self.tensor_maps: dict[bytes, Any] = {}  # encoded map -> jit.tma.TensorMap
        self.paused = 0  # inside plan.setup()
        self.replayable = True
        self.why = ""
        self.provisional = False  # it ran a stand-in: no plan, neither replayed nor GENERAL

    def add(self, kind: str, target, values, extra) -> None:
        """An entry point called with C values (pointers as ints, the stream as a handle), or a
        kernel launched as target(*values, shared_mem=, stream=) (extra: those two)."""
        if kind == "kernel" and extra[1] is not None:
            self.refuse("a kernel launched on an explicit stream")
        if kind == "entry" and all(p.kind == "scalar" for p in target.proto.params):
            return  # a query of sizes (a workspace's, an occupancy): its answer is in the launch
        self.launches.append((kind, target, tuple(values), extra and extra[0]))

    def refuse(self, why: str) -> None:
        self.replayable, self.why = False, self.why or why


def _on_launch(kind: str, target, values, extra) -> None:
    record = recording()
    if record is not None:  # launches of other threads are not this record's
        record.add(kind, target, values, extra)


def _on_tensor_map(encoded: bytes, how) -> None:
    record = recording()
    if record is not None:  # maps of other threads are not this record's
        record.tensor_maps[encoded] = how


class setup:
    """``with plan.setup():`` work whose result outlives the call (tables cached per device, a
    buffer kept per stream): what it runs is no reason to refuse the record. Its tensors reach a
    plan only through ``keep``."""

    def __enter__(self):
        self.record = recording()
        if self.record is not None:
            self.record.paused += 1

    def __exit__(self, *exc):
        if self.record is not None:
            self.record.paused -= 1


class _Watch(TorchDispatchMode):
    """Refuses the record when the general path runs a torch op a plan would not repeat."""

    _ALLOC = {"aten::empty", "aten::empty_like", "aten::new_empty", "aten::empty_strided",
              "aten::new_empty_strided"}

    def __init__(self, record: Record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (self.record.paused or func.is_view or func._schema.name in self._ALLOC):
            self.record.refuse(f"it runs {func}")
        return func(*args, **(kwargs or {}))


class Plans:
    """One op family's plans: key -> plan (a function of the inputs returning the outputs) or
    GENERAL. record_from: the call of a key that records its plan (2: the second; the first runs
    the general path unrecorded, so that signatures seen once, such as a decoding loop's growing
    keys, never pay a recording)."""

    def __init__(self, family: str, capacity: int = 4096, record_from: int = 1):
        self.family, self.capacity, self.record_from = family, capacity, record_from
        self._plans: dict[tuple, Any] = {}
        self._seen: dict[tuple, int] = {}  # keys called fewer than record_from times
        self._lock = threading.Lock()
        self.fronts: list[native.Front] = []  # the C++ tables of its front functions
        _ALL.append(self)

    def get(self, key: tuple):
        """The plan of key (with the current device, stream and policy added), GENERAL, or None
        (also inside a call being recorded, which must see the launches of the ops it calls)."""
        if _recording and recording() is not None:
            return None
        return self._plans.get((key, *_where(), current_policy()))

    def run(self, key: tuple, inputs: tuple, make_outputs: Callable[..., tuple],
            general: Callable[..., None], params: tuple = ()) -> tuple:
        """The outputs of one call: through key's plan, or the general path (recording it).

        make_outputs(*inputs, *params) -> tuple of new output tensors; general(*inputs,
        *outputs, *params) fills them (it may launch, allocate ``scratch`` and take views,
        nothing else for a plan). The key holds everything that decides the route, params
        included."""
        full = (key, *_where(), current_policy())
        plan = self._plans.get(full)
        nested = _recording and recording() is not None  # an op inside a recorded call
        if plan is not None and plan is not GENERAL and not nested:
            return plan(*inputs)
        if plan is GENERAL or nested:  # a nested call is recorded as part of the outer one
            outputs = make_outputs(*inputs, *params)
            general(*inputs, *outputs, *params)
            if not nested and native.LEARNING[0]:
                native.saw(GENERAL, inputs, outputs)
            return outputs
        if self.record_from > 1 and self._too_soon(full):
            outputs = make_outputs(*inputs, *params)
            general(*inputs, *outputs, *params)
            if native.LEARNING[0]:
                native.saw(None, inputs, outputs)  # nothing stored: a C++ key learns next time
            return outputs
        plan, outputs = _recorded(inputs, make_outputs, general, params, self.family)
        if plan is not None:
            self._store(full, plan)
            if plan is not GENERAL and _GPU:
                native.load()  # the first plan of a GPU call: the C++ hit path starts building
        if native.LEARNING[0]:
            native.saw(plan, inputs, outputs)
        return outputs

    def _too_soon(self, key: tuple) -> bool:
        """Whether this call of key comes before record_from (counted here; bounded)."""
        with self._lock:
            n = self._seen.get(key, 0) + 1
            if n >= self.record_from:
                self._seen.pop(key, None)
                return False
            if len(self._seen) >= self.capacity:
                self._seen.clear()
            self._seen[key] = n
            return True

    def put(self, key: tuple, plan) -> None:
        """Store a plan written by hand for key (e.g. a library call that the general path
        found to be the route), replacing what a recording stored (and what this call's
        learning saw)."""
        self._store((key, *_where(), current_policy()), plan)
        native.amend(plan)

    def _store(self, key: tuple, plan) -> None:
        with self._lock:
            if len(self._plans) >= self.capacity:  # drop the oldest half (dicts keep order)
                for old in list(self._plans)[: self.capacity // 2]:
                    del self._plans[old]
            self._plans[key] = plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()
            self._seen.clear()
            for front in self.fronts:
                front.clear()

    def __len__(self) -> int:
        return len(self._plans)

    def __repr__(self) -> str:
        general = sum(p is GENERAL for p in self._plans.values())
        return f"<Plans '{self.family}': {len(self)} keys, {general} general>"


def _extent(t: torch.Tensor) -> int:
    """The bytes from t's first element to one past its last (any strides, non-negative)."""
    if not t.numel():
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


def clear_all() -> None:
    """Drop every family's plans (a changed tuning store or settings take effect at once)."""
    for plans in _ALL:
        plans.clear()


def _tell_recording() -> None:
    """The C++ tables miss while a call is recorded in any thread (its ops must be seen)."""
    ext = native.loaded()
    if ext is not None:
        ext.set_recording(_recording)


def _clear_native(*_) -> None:
    """The default settings changed: C++ keys do not hold the policy, so their plans go."""
    for plans in _ALL:
        for front in plans.fronts:
            front.clear()


on_change(_clear_native)
native.on_load(lambda ext: ext.set_recording(_recording))


def _recorded(inputs: tuple, make_outputs, general, params: tuple, family: str):
    """(plan or GENERAL or None, outputs) of a general call, recorded."""
    global _recording
    outputs = make_outputs(*inputs, *params)
    record = _state.record = Record()
    with _count_lock:
        _recording += 1
        HOOKS.record, HOOKS.tensor_map = _on_launch, _on_tensor_map
        _tell_recording()
    try:
        with _Watch(record):
            general(*inputs, *outputs, *params)
    finally:
        _state.record = None
        with _count_lock:
            _recording -= 1
            if not _recording:
                HOOKS.record = HOOKS.tensor_map = None
            _tell_recording()
    return _compile(record, inputs, outputs, make_outputs, general, params, family), outputs


def _compile(record: Record, inputs: tuple, outputs: tuple, make_outputs, general,
             params: tuple, family: str):
    """The plan of a recorded general call: a generated function, GENERAL, or None (nothing to
    store: overlapping views in this call, which the next may not pass). Inputs that are one
    tensor passed twice (mm(a, a), one scale for both operands) give a plan that runs while they
    still are one; another call of the key runs the general path. The plan's ``native`` is its
    description for the C++ hit path (native.describe), or None."""
    if record.provisional:
        return None
    if not record.replayable or not record.launches:
        return GENERAL
    named = [(f"i{k}", t) for k, t in enumerate(inputs)] + \
        [(f"o{k}", t) for k, t in enumerate(outputs)] + \
        [(f"s{k}", s[0]) for k, s in enumerate(record.scratch)]
    spans = [(name, t.data_ptr(), t.data_ptr() + _extent(t)) for name, t in named
             if t is not None and t.numel()]
    kept = {t.data_ptr(): t for t in record.kept if t.numel()}  # alive with the plan: constants
    spans += [("kept", p, p + _extent(t)) for p, t in kept.items()]

    def holders(address: int) -> list[tuple[str, int]]:
        """(name, start) of every named tensor whose bytes hold the address."""
        return [(name, start) for name, start, end in spans if start <= address < end]

    guards: set[tuple[str, ...]] = set()  # inputs that are one tensor in this call

    def where(address: int) -> tuple | None:
        """This call's pointer as ("ptr", tensor name, offset): the one tensor whose bytes hold
        the address, at the same offset from its start (as at every call of the signature); the
        first of several inputs that are one tensor (the plan holds while they still are:
        guards); ("addr", address) in a kept tensor; None where overlapping views hold it (the
        next call may not pass them alike)."""
        found = holders(address)
        if len(found) > 1 and len({start for _, start in found}) == 1 and \
                all(name[0] == "i" for name, _ in found):
            guards.add(tuple(name for name, _ in found))
        elif len(found) != 1:
            return None
        name, start = found[0]
        return ("addr", address) if name == "kept" else ("ptr", name, address - start)

    steps = []  # (kind, target, args, shared_mem): each arg ("stream",), ("ptr", name, offset),
    # ("addr", address), ("const", value, parameter)
    for kind, target, values, shared_mem in record.launches:
        proto = target.proto if kind == "entry" else target.kernel.proto
        args: list[tuple] = []
        for p, v in zip(proto.params, values):
            if p.kind == "stream":
                if kind == "kernel" or v != _stream(_device()):
                    return GENERAL  # an explicit stream, not the current one
                args.append(("stream",))
            elif p.kind == "pointer":
                address = v.data_ptr() if isinstance(v, torch.Tensor) else (v or 0)
                if isinstance(v, torch.Tensor) and not v.is_contiguous():
                    return GENERAL
                expr = where(address) if address else ("addr", 0)
                if expr is None:  # overlapping views: store nothing; unknown: never reproducible
                    return None if holders(address) else GENERAL
                args.append(expr)
            elif p.kind == "scalar":
                if type(v) is int and any(start <= v <= end for _, start, end in spans):
                    return GENERAL  # a pointer passed as an integer: replayed it would be stale
                args.append(("const", v, p))
            elif isinstance(v, bytes) and v in record.tensor_maps:  # encoded again per call
                m = record.tensor_maps[v]
                expr = where(m.tensor.data_ptr() + m.byte_offset) if m.tensor.numel() else None
                if expr is None or expr[0] != "ptr" or expr[2] != m.byte_offset:
                    return GENERAL  # a map of a tensor the plan does not know (a padded copy)
                args.append(("map", expr[1], m))
            else:
                return GENERAL  # another struct by value: through the general path
        steps.append((kind, target, args, shared_mem))

    def failed(j: int, result: int) -> LaunchError:
        kind, target = steps[j][:2]
        if kind == "entry":
            return LaunchError(f"{family} (planned call): {target.error(result)}")
        return LaunchError(f"{family} (planned call): launching {target.kernel.where} failed "
                           f"with CUresult {result}")

    def unplanned(*args):  # the inputs are no longer one tensor
        if native.LEARNING[0]:  # a C++ key holds that: it learns this call's own plan
            plan, outs = _recorded(args, make_outputs, general, params, family)
            native.saw(plan, args, outs)
            return outs
        outs = make_outputs(*args, *params)
        general(*args, *outs, *params)
        return outs
    plan = _python_plan(steps, len(inputs), len(outputs), record, guards, make_outputs, params,
                        family, failed, unplanned)
    # (C++ keys hold which tensor arguments start at one address: the guards are in the key)
    plan.native = _native_template(steps, inputs, outputs, record, failed)
    return plan


def _python_plan(steps, n_inputs: int, n_outputs: int, record: Record, guards, make_outputs,
                 params: tuple, family: str, failed, unplanned):
    """The plan as generated Python: make the outputs, then each call or launch."""
    scope: dict[str, Any] = {"make_outputs": make_outputs, "stream": _stream, "P": params,
                             "current": _device, "empty": torch.empty, "failed": failed,
                             "unplanned": unplanned, "L": native.LEARNING, "saw": native.saw}
    names = ", ".join(f"i{k}" for k in range(n_inputs))
    outs = "".join(f"o{k}, " for k in range(n_outputs))
    lines = [f"def plan({names}):",
             f"    {outs}{'= ' if n_outputs else ''}make_outputs({names}{', ' if names else ''}*P)",
             "    device = current()"]
    for k, (_, n, dtype, device) in enumerate(record.scratch):
        scope[f"sd{k}"], scope[f"sv{k}"] = dtype, device
        lines.append(f"    s{k} = empty({n}, dtype=sd{k}, device=sv{k})")
    for j, (kind, target, args, shared_mem) in enumerate(steps):
        exprs = []
        for n, arg in enumerate(args):
            if arg[0] == "stream":
                exprs.append("stream(device)")
            elif arg[0] == "ptr":
                exprs.append(f"{arg[1]}.data_ptr()" + (f" + {arg[2]}" if arg[2] else ""))
            elif arg[0] == "addr":
                exprs.append(str(arg[1]))
            elif arg[0] == "map":
                scope[f"m{j}_{n}"] = arg[2].encode
                exprs.append(f"m{j}_{n}({arg[1]})")
            else:
                scope[f"c{j}_{n}"] = arg[1]
                exprs.append(f"c{j}_{n}")
        if kind == "entry":
            scope[f"f{j}"] = target.fast
            call = f"f{j}({', '.join(exprs)})"
            if target.checked:
                lines += [f"    r = {call}", "    if r:", f"        raise failed({j}, r)"]
            else:
                lines.append(f"    {call}")
        else:
            scope[f"k{j}"] = target
            lines.append(f"    k{j}({', '.join(exprs)}, shared_mem={int(shared_mem)})")
    inputs = f"({names}{',' if names else ''})"
    lines += [f"    out = ({outs})", "    if L[0]:", f"        saw(plan, {inputs}, out)",
              "    return out"]
    for group in sorted(guards):  # aliased inputs: another call of the key runs the general path
        same = " and ".join(f"{group[0]}.data_ptr() == {n}.data_ptr()" for n in group[1:])
        lines.insert(1, f"    if not ({same}):\n        return unplanned({names})")
    source = "\n".join(lines)
    exec(_code(source, family), scope)
    plan = scope["plan"]
    plan.source = source
    return plan


_CODE: dict[tuple[str, str], Any] = {}


def _code(source: str, family: str):
    """source compiled, kept per text: a family's signatures share a few plan texts (their
    values are in the scope), and compile() took a third of a recording."""
    code = _CODE.get((source, family))
    if code is None:
        if len(_CODE) >= 1024:
            _CODE.clear()
        code = _CODE[source, family] = compile(source, f"<vitrail plan {family}>", "exec")
    return code


def _native_template(steps, inputs: tuple, outputs: tuple, record: Record, failed):
    """The plan in the terms of the C++ hit path (native.describe fills in which argument each
    input is): allocations, and each launch as 8-byte slots; None where it has no such form (an
    output that is a view, a value no packed caller takes, a kernel not loaded here)."""
    from vitrail.jit.kernel import slot_format
    from vitrail.jit.launcher import packed_caller
    used = sorted({int(a[1][1:]) for _, _, args, _ in steps for a in args
                   if a[0] in ("ptr", "map") and a[1][0] == "i"})
    index = {f"i{k}": n for n, k in enumerate(used)}
    index.update({f"o{k}": len(used) + k for k in range(len(outputs))})
    index.update({f"s{k}": len(used) + len(outputs) + k for k in range(len(record.scratch))})
    allocs = []
    for o in outputs:
        if o is None or o.storage_offset() or o.untyped_storage().nbytes() != _extent(o):
            return None  # not a tensor of its own: empty_strided would not make it
        allocs.append((tuple(o.shape), tuple(o.stride()), o.dtype, o.get_device()))
    scratch = tuple(((n,), (1,), dtype, torch.device(device).index
                     if torch.device(device).type == "cuda" else -1)
                    for _, n, dtype, device in record.scratch)
    device = _device()
    launches, maps = [], []
    for kind, target, args, shared_mem in steps:
        slots = []
        for arg in args:
            if arg[0] == "stream":
                slots.append((native.STREAM, 0, 0))
            elif arg[0] == "ptr":
                slots.append((native.POINTER, index[arg[1]], arg[2]))
            elif arg[0] == "addr":
                slots.append((native.CONST, 0, arg[1]))
            elif arg[0] == "map":
                m = arg[2]
                slots.append((native.MAP, index[arg[1]], len(maps)))
                maps.append((m.data_type, m.dims, m.byte_strides, m.box, m.swizzle_enum,
                             m.byte_offset))
            else:
                value, p = arg[1], arg[2]
                fmt = p.fmt if kind == "entry" else slot_format(p)
                if fmt in ("e", "bf16") or not isinstance(value, (int, float)):
                    return None
                slots.append(native.const_slot(value, fmt))
        if kind == "entry":
            packed = packed_caller(target.proto)
            if packed is None:
                return None
            launches.append((True, target.address, packed, target.checked, (0,) * 6, 0,
                             tuple(slots)))
        else:
            function = target.kernel.loaded_function(device)
            if function is None:
                return None
            launches.append((False, function, 0, False, target.dims, int(shared_mem),
                             tuple(slots)))
    return {"kind": "launches", "device": device, "used": tuple(used), "outputs": tuple(allocs),
            "scratch": scratch, "launches": tuple(launches), "maps": tuple(maps),
            "keep": tuple(record.kept),
            "failed": lambda j, code: _raise(failed(j, code))}


def _raise(error: Exception):
    raise error
