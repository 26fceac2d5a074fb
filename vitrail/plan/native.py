"""The C++ hit path of vitrail.plan (``hit.cpp``): an op call that has a plan runs it from one
C++ call, with no Python between the public function and the launch.

An op's public function is wrapped by ``front(plans)``. The wrapper passes its arguments, as
given, to the function's own ``Table`` (C++), which keys them (each tensor's shape, strides,
dtype, device, dispatch keys, address modulo 16, whether it requires a gradient, and which
earlier tensor argument starts at the same address; each scalar's type and value, and a tuple's
or list's ints; the current device and stream), finds the plan, allocates the outputs through
ATen and makes the recorded calls and launches on the current stream. A key it has no plan for
is *pending*: the function runs its Python path while the plans it uses are watched, and if
exactly one ran and its outputs are the function's result, that plan's description
(``describe``: the allocations, the launches as 8-byte slots, which argument each pointer comes
from) is added under the pending key; any other outcome adds "general", and the key's calls keep
to Python. A call that records gradients has a plan only where the front has a gradient rule
(``front(grad=)``): the outputs then get a C++ autograd node whose backward calls the rule. What
no key can vouch for (gradients without a rule, tensor subclasses, scoped settings, a call being
recorded) is a miss every time, and Python decides as before.

The extension is compiled once per machine and torch version (host C++ against libtorch, about
15 s), in a background thread started by the first plan of a CUDA call; until it is loaded every
call takes the Python plans. ``VITRAIL_NATIVE_PLANS=0`` keeps everything in Python.
"""
from __future__ import annotations

import inspect
import logging
import os
import struct
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from vitrail import knobs

log = logging.getLogger("vitrail.plan")

__all__ = ["MISS", "front", "load", "loaded", "OUTPUT", "INPUT", "GRAD", "VALUE", "ARG"]


class _Miss:
    __slots__ = ()

    def __repr__(self) -> str:
        return "vitrail.plan.native.MISS"


MISS = _Miss()  # a Table's answer where Python must run the call
SOURCE = Path(__file__).with_name("hit.cpp")
_lock = threading.Lock()
_module = None
_started = False
_ready = threading.Event()
_on_load: list[Callable[[Any], None]] = []  # called with the module once it is loaded


def loaded():
    """The extension module, or None (not built yet, disabled, or unavailable here)."""
    return _module


def load(wait: bool = False):
    """Start building (or loading) the extension in the background, once per process; with
    wait, block until it is done. Returns the module, or None where it is not (yet) there."""
    global _started
    if _module is not None or not knobs.NATIVE_PLANS.get():
        return _module
    with _lock:
        start, _started = not _started, True
    if start:
        threading.Thread(target=_load, name="vitrail-native-plans", daemon=True).start()
    if wait:
        _ready.wait()
        if _module is None and not start:  # an earlier attempt failed: asked for, try again
            _ready.clear()
            _load()
    return _module


def _load() -> None:
    global _module
    try:
        ext = _build()
        get_stream = (torch._C._cuda_getCurrentRawStream if torch.cuda.is_available() else
                      (lambda device: 0))
        from vitrail.tune.settings import scoped_settings
        ext.init(_current_device, get_stream, scoped_settings, MISS)
        with _lock:
            _module = ext
            for hook in _on_load:
                hook(ext)
    except Exception as e:  # any failure: plans run from Python, say why once
        log.warning("vitrail: plans run from Python (the C++ hit path did not build: %s)",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
    finally:
        _ready.set()


def _build():
    """The extension, compiled through the kernel cache (nvcc as the host C++ driver)."""
    from torch.utils import cpp_extension

    from vitrail.jit.launcher import c_extension
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-x", "c++", "-std=c++20", "-O2", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             "-Xcompiler=-Wno-deprecated-declarations", f"-L{lib}", "-lc10", "-ltorch_cpu",
             "-ltorch_python", f"-Xlinker=-rpath,{lib}"]
    if torch.version.cuda and any(Path(lib).glob("libc10_cuda.*")):
        # the keys read torch's current device and stream in C++, not through two Python calls
        flags += ["-DVITRAIL_C10_CUDA", "-lc10_cuda"]
    # specific to this torch as well as this Python: both are in the source's key
    return c_extension(SOURCE.read_text(), "vitrail_hit", flags=flags,
                       include_dirs=cpp_extension.include_paths(),
                       tag=f"torch {torch.__version__} ")


def on_load(hook: Callable[[Any], None]) -> None:
    """Call hook(module) once the extension is loaded (now, if it is)."""
    with _lock:
        _on_load.append(hook)
        ext = _module
    if ext is not None:
        hook(ext)


# ------------------------------------------------------------------ plans as descriptions
CONST, POINTER, STREAM, MAP = 0, 1, 2, 3  # hit.cpp's slot kinds


def const_slot(value, fmt: str) -> tuple[int, int, int]:
    """A constant's slot: its bytes in struct format fmt at the start of 8."""
    raw = struct.pack("<" + fmt, value)
    return CONST, 0, int.from_bytes(raw.ljust(8, b"\0"), "little")


def describe(template: dict, inputs: tuple, outputs: tuple, result, args: tuple):
    """The description hit.cpp adds for a call of a front function with args whose Python
    path ran one plan (its native template, its inputs and outputs) and returned result; None
    where it cannot be expressed in the call's arguments (an input that is not one of them). An
    input passed twice is read at its first position: the key holds which tensor arguments
    start at one address."""
    positions = []
    for k in template["used"]:
        found = next((j for j, a in enumerate(args) if a is inputs[k]), None)
        if found is None:
            return None
        positions.append(found)
    if template["kind"] == "matmul":
        return None if result is not outputs[0] else ("matmul", tuple(positions))
    if template["kind"] == "addmm":  # used: which of (a, b, c, bias) the call passed
        slots = [-1] * 4
        for k, position in zip(template["used"], positions):
            slots[k] = position
        return None if result is not outputs[0] else ("addmm", tuple(slots), template["params"])
    used = len(positions)
    if len(outputs) == 1 and result is outputs[0]:
        which = used
    elif isinstance(result, tuple) and len(result) == len(outputs) and \
            all(r is o for r, o in zip(result, outputs)):
        which = -2
    elif result is None:
        which = -1
    else:
        which = next((n for n, k in enumerate(template["used"]) if inputs[k] is result), None)
        if which is None:
            return None
    return ("launches", tuple(positions), template["outputs"], template["scratch"],
            template["launches"], template["maps"], which, template["keep"], template["failed"])


# ------------------------------------------------------------------ front functions
_state = threading.local()  # .seen: the plans this thread's learning call ran, or None
LEARNING = [0]  # threads learning: plans report themselves (``saw``) while it is not 0


# the current CUDA device (-1 with no GPU), as the plans' keys say it
_current_device = torch._C._cuda_getDevice if torch.cuda.is_available() else (lambda: -1)


def amend(plan) -> None:
    """The last plan this thread's learning call saw is plan instead (Plans.put)."""
    seen = getattr(_state, "seen", None)
    if seen:
        _, inputs, outputs = seen[-1]
        seen[-1] = (plan, inputs, outputs)


def saw(plan, inputs: tuple, outputs: tuple) -> None:
    """A plan (or GENERAL, or None: nothing to store) ran on inputs, giving outputs."""
    seen = getattr(_state, "seen", None)
    if seen is not None:
        seen.append((plan, inputs, outputs))


_learning_lock = threading.Lock()


def _start() -> list:
    seen = _state.seen = []
    with _learning_lock:
        LEARNING[0] += 1
    return seen


def _stop() -> None:
    _state.seen = None
    with _learning_lock:
        LEARNING[0] -= 1


# The kinds of a gradient rule's arguments (hit.cpp's GradRule): a saved output or input, an
# output's gradient, a value; and of a step's: the rule's argument (as its backward gets it)
OUTPUT, INPUT, GRAD, VALUE, ARG = 0, 1, 2, 3, 4


class Front:
    """The C++ table of one front function (``front``): its key is that function's arguments.
    grad(*args): the gradient rule of a call that records gradients (``front``), or None."""

    def __init__(self, plans, name: str, grad: Callable[..., tuple | None] | None = None):
        self.plans, self.name, self.grad = plans, name, grad
        self.table = None  # once the extension is loaded
        self.call: Callable[..., Any] = _no_table  # table.call: the plan's result, or MISS
        plans.fronts.append(self)
        on_load(self._attach)

    def _attach(self, ext) -> None:
        table = ext.Table(self.plans.capacity)
        if self.grad is not None:
            table.set_grad()
        self.table, self.call = table, table.call

    def pending(self) -> bool:
        """Whether this thread's last ``call`` missed a key the table can learn."""
        return self.table is not None and self.table.pending()

    def clear(self) -> None:
        if self.table is not None:
            self.table.clear()

    def __repr__(self) -> str:
        return f"<Front {self.name}: {len(self.table) if self.table is not None else 0} plans>"


def _no_table(*args):
    return MISS


def _with_tables(rule: tuple | None) -> tuple | None:
    """A gradient rule as hit.cpp reads it: each step with its front function's table (a step
    whose function has none yet: no steps, the backward runs in Python)."""
    if rule is None or len(rule) < 5:
        return rule
    steps = []
    for fn, fn_args, gradient in rule[4]:
        table = getattr(getattr(fn, "front", None), "table", None)
        if table is None:
            return rule[:4]
        steps.append((fn, table, tuple(fn_args), gradient))
    return (*rule[:4], tuple(steps))


def _adopt(front: Front, seen: list, result, args: tuple, when) -> None:
    """Add the plan of the pending miss: what the Python path ran, described, or general."""
    table = front.table
    if table is None:
        return
    description: tuple | None = ("general",)
    if len(seen) == 1 and (when is None or when(*args)):
        plan, inputs, outputs = seen[0]
        template = getattr(plan, "native", None) if plan is not None else None
        if plan is None:
            description = None  # nothing stored for this call: the next one tries again
        elif template is not None and template.get("device", None) in \
                (None, _current_device()):  # launched on the device current here
            description = describe(template, inputs, outputs, result, args) or ("general",)
    if description is not None:
        try:  # a call that records gradients: its rule too (none: the key keeps to Python)
            grad = _with_tables(front.grad(*args)) if table.pending_grad() else None
            table.add(description, grad)
        except Exception as e:  # a description the C++ side refuses: the key keeps to Python
            log.debug("vitrail: no C++ plan for a %s call: %s", front.name, e)
            table.add(("general",))


def front(plans, *, when: Callable[..., bool] | None = None,
          grad: Callable[..., tuple | None] | None = None):
    """Decorator: the C++ hit path in front of an op's public function (its parameters plain
    positional or keyword ones, no ``*args``/``**kwargs``), with a table of its own among the
    family's plans (``wrapper.front``). when(*args): whether a call may have a C++ plan at all
    (the others keep to Python: state the key cannot see).

    grad(*args) -> (backward, args, inputs, name[, steps]) or None: calls that record gradients
    get C++ plans too, where the function's Python path ran one plan whose outputs are its
    result and grad gives that call's rule: ``backward(*args)`` returns the gradient of each
    argument position in ``inputs`` (a tensor, a tuple, None for none), each of args being
    (OUTPUT, k), (INPUT, position), (GRAD, k): output k's gradient, or (VALUE, value); name
    names the autograd node. The backward must be linear in the output gradients (a zero one
    gives zero gradients without a call) and may be a front function itself. steps: the same
    backward as front-function calls, (fn, fn_args, gradient) each, fn_args being (ARG, j): the
    backward's argument j, or (VALUE, value), its result the gradient of ``inputs[gradient]``
    (those of no step: none); where no graph of the gradients is asked for, the C++ autograd
    node calls each fn's table itself, no Python between (fn where the table misses)."""
    def wrap(fn):
        front = Front(plans, f"{fn.__module__}.{fn.__name__}", grad)
        params = list(inspect.signature(fn).parameters.values())
        decl, names, call = [], [], []
        keyword_only = False
        for p in params:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY) or \
                    p.name.startswith("_v_"):
                raise TypeError(f"front: {fn.__name__} has parameter {p}: only plain "
                                "positional or keyword ones")
            if p.kind is p.KEYWORD_ONLY and not keyword_only:
                decl.append("*")
                keyword_only = True
            decl.append(p.name if p.default is p.empty else f"{p.name}=_v_d_{p.name}")
            names.append(p.name)
            call.append(f"{p.name}={p.name}" if keyword_only else p.name)
        args, body = ", ".join(names), ", ".join(call)
        # every name of the wrapper's own starts with _v_: no parameter can shadow one
        source = "\n".join([
            f"def {fn.__name__}({', '.join(decl)}):",
            # while a call learns (any thread), front functions it calls run their Python path,
            # so that the plans they run are seen by it
            "    if not _v_learning[0] and not _v_compiling():",
            f"        _v_out = _v_front.call({args})",
            "        if _v_out is not _v_MISS:",
            "            return _v_out",
            "        if _v_front.pending():",
            "            _v_seen = _v_start()",
            "            try:",
            f"                _v_out = _v_fn({body})",
            "            finally:",
            "                _v_stop()",
            f"            _v_adopt(_v_front, _v_seen, _v_out, ({args},), _v_when)",
            "            return _v_out",
            f"    return _v_fn({body})"])
        # dynamo folds is_dynamo_compiling() to True while it traces (the Python path is what it
        # sees); eagerly it costs a third of is_compiling(), which asks TorchScript first
        scope: dict[str, Any] = {"_v_compiling": torch.compiler.is_dynamo_compiling,
                                 "_v_front": front, "_v_MISS": MISS, "_v_fn": fn,
                                 "_v_start": _start, "_v_stop": _stop, "_v_adopt": _adopt,
                                 "_v_when": when, "_v_learning": LEARNING}
        scope.update({f"_v_d_{p.name}": p.default for p in params if p.default is not p.empty})
        exec(compile(source, f"<vitrail front {fn.__module__}.{fn.__name__}>", "exec"), scope)
        wrapper = scope[fn.__name__]
        for attr in ("__module__", "__qualname__", "__doc__", "__annotations__"):
            setattr(wrapper, attr, getattr(fn, attr))
        wrapper.__wrapped__, wrapper.front = fn, front
        return wrapper
    return wrap
