"""C functions between Python and the GPU: the driver launch, and callers of entry points.

- ``get()``: cuda-bindings' ``cuLaunchKernel`` wraps every argument in Python objects; on a
  Hopper host that costs about as much as CuPy's whole launch. As Triton does, vitrail builds a
  tiny CPython extension once per machine (through its own kernel cache, so it is built once and
  shared by every process) whose ``launch`` takes ten integers and calls the driver.
- ``caller(proto)``: ctypes converts each argument of a foreign call through Python objects
  (docs/perf-notes.md#entry-point-calls-through-ctypes). A caller is
  a METH_FASTCALL function generated for one C prototype, ``call(address, *values)``, which
  converts the values with the C API and calls the function at ``address``; one is built per
  distinct prototype (every GEMM kernel shares one), cached like the launcher.

Where an extension cannot be built (no Python headers, no nvcc), launches go through
cuda-bindings and calls through ctypes: slower, equally correct.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger("vitrail.jit")

SOURCE = r"""
#include <Python.h>
#include <cuda.h>
#include <dlfcn.h>

typedef CUresult (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, unsigned, CUstream, void**, void**);
static launch_fn cu_launch = NULL;

// launch(function, gx, gy, gz, bx, by, bz, shared_mem, stream, params) -> CUresult
static PyObject* launch(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 10) {
    PyErr_SetString(PyExc_TypeError, "launch takes 10 integer arguments");
    return NULL;
  }
  unsigned long long v[10];
  for (int i = 0; i < 10; ++i) {
    v[i] = PyLong_AsUnsignedLongLong(args[i]);
    if (v[i] == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
  }
  CUresult result;
  Py_BEGIN_ALLOW_THREADS  // a full launch queue blocks: let other threads run meanwhile
  result = cu_launch((CUfunction)v[0], (unsigned)v[1], (unsigned)v[2], (unsigned)v[3],
                     (unsigned)v[4], (unsigned)v[5], (unsigned)v[6], (unsigned)v[7],
                     (CUstream)v[8], (void**)v[9], NULL);
  Py_END_ALLOW_THREADS
  return PyLong_FromLong((long)result);
}

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "cuLaunchKernel"},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "vitrail_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_vitrail_launch(void) {
  void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!cuda) cuda = dlopen("libcuda.so.1", RTLD_NOW);
  if (cuda) cu_launch = (launch_fn)dlsym(cuda, "cuLaunchKernel");
  if (!cu_launch) {
    PyErr_SetString(PyExc_ImportError, "libcuda.so.1 with cuLaunchKernel not found");
    return NULL;
  }
  return PyModule_Create(&module);
}
"""

_lock = threading.Lock()
_launch: Callable | None = None
_tried = False


def get() -> Callable | None:
    """The C launch function, or None where it cannot be built or loaded here."""
    global _launch, _tried
    if _tried:
        return _launch
    with _lock:
        if not _tried:
            try:
                _launch = _build()
            except Exception as e:  # any failure: fall back to cuda-bindings, say why once
                log.info("vitrail: launching through cuda-bindings (C launcher unavailable: %s)",
                         str(e).splitlines()[0] if str(e) else type(e).__name__)
            _tried = True
    return _launch


def _build() -> Callable:
    return c_extension(SOURCE, "vitrail_launch").launch


def c_extension(source: str, name: str, *, flags: list[str] = (), include_dirs: list = (),
                tag: str = ""):
    """The CPython extension module ``name`` built from source through the kernel cache (extra
    nvcc flags and include dirs; tag: what else the build is specific to, in its key)."""
    from vitrail.jit import toolchain
    from vitrail.jit.compiler import build_entry
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise FileNotFoundError(f"no Python.h under {include} (install python3-dev)")
    # The extension is specific to this Python: its version and ABI are in the source's key.
    tag = f"// {tag}{sys.implementation.cache_tag} {sysconfig.get_config_var('SOABI')}\n"
    entry, _ = build_entry(tag + source, name=name, backend="nvcc", flags=list(flags),
                           include_dirs=[include, *include_dirs], arch=_host_arch())
    toolchain.check_driver_runs("nvcc", entry.meta["compiler"])  # as a loaded library would
    return load_extension(name, entry.artifact)


def load_extension(name: str, path) -> object:
    """The CPython extension module of the library at path whose init function is
    ``PyInit_<name>``, loaded under that name whatever the file is called. A dotted name
    (``package.name``) is the module's full name and ``PyInit_`` is followed by its last part:
    pybind11 keeps one module per full name for the process, so two libraries of one short
    name are two modules only under two full names."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    ext = importlib.util.module_from_spec(spec)
    loader.exec_module(ext)
    return ext


# ------------------------------------------------------------------ callers of entry points
# C spelling and conversion of each kind of value: (C type, from a Python object, to one)
_INTS = {"b": "int8_t", "B": "uint8_t", "h": "int16_t", "H": "uint16_t", "i": "int32_t",
         "I": "uint32_t", "q": "int64_t", "Q": "uint64_t"}
_callers: dict[str, object] = {}  # caller source -> its extension module, or None
_by_prototype: dict[object, object] = {}  # prototype -> _callers' answer for its source


def _c_value(p) -> tuple[str, str] | None:
    """(C type, conversion of PyObject* o) of one parameter; None where no caller takes it
    (16-bit floats and structs, which ctypes passes)."""
    if p.kind in ("pointer", "stream"):
        return "void*", "PyLong_AsVoidPtr(o)"
    if p.kind != "scalar":
        return None
    if p.fmt in _INTS:
        signed = p.fmt.islower()
        return _INTS[p.fmt], ("PyLong_AsLongLong(o)" if signed else
                              "PyLong_AsUnsignedLongLong(o)")
    if p.fmt in "fd":
        return ("float" if p.fmt == "f" else "double"), "PyFloat_AsDouble(o)"
    if p.fmt == "?":
        return "bool", "PyObject_IsTrue(o)"
    return None


def _c_result(result: str) -> tuple[str, str] | None:
    """(C type, PyObject* of r) of a result; checked results (cudaError_t, CUresult) are
    int-sized enums, called as int so that the caller needs no CUDA header."""
    from vitrail.jit.signature import Param, parse_signature, result_is_checked
    if result == "void":
        return "void", "Py_None"
    if result.endswith("*"):
        return "void*", "PyLong_FromVoidPtr(r)"
    if result_is_checked(result):
        return "int", "PyLong_FromLong(r)"
    try:
        param: Param = parse_signature(f"{result} r", "result").params[0]
    except Exception:
        return None
    value = _c_value(param)
    if value is None or value[0] == "bool":
        return None
    ctype = value[0]
    if ctype in ("float", "double"):
        return ctype, "PyFloat_FromDouble(r)"
    return ctype, ("PyLong_FromLongLong(r)" if param.fmt.islower() else
                   "PyLong_FromUnsignedLongLong(r)")


def caller_source(proto) -> str | None:
    """The C source of proto's caller, ``call(address, *values)`` (and ``packed``, whose address
    ``packed_address()`` gives); None where a value or the result is of a kind it does not
    take."""
    from vitrail.jit.signature import result_is_checked
    values = [_c_value(p) for p in proto.params]
    result = _c_result(proto.result)
    if result is None or any(v is None for v in values):
        return None
    n = len(values)
    types = ", ".join(v[0] for v in values) or "void"
    lines = ["#include <Python.h>", "#include <stdbool.h>", "#include <stdint.h>",
             "#include <string.h>",
             f"typedef {result[0]} (*fn_t)({types});",
             "static PyObject* call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {",
             f"  if (nargs != {n + 1}) {{",
             f'    PyErr_SetString(PyExc_TypeError, "call takes the address and {n} values");',
             "    return NULL;", "  }", "  fn_t fn = (fn_t)PyLong_AsVoidPtr(args[0]);",
             "  PyObject* o;"]
    for i, (ctype, convert) in enumerate(values):
        lines.append(f"  o = args[{i + 1}]; {ctype} v{i} = ({ctype}){convert};")
    lines.append("  if (PyErr_Occurred()) return NULL;")
    call = f"fn({', '.join(f'v{i}' for i in range(n))})"
    if result[0] == "void":
        lines += ["  Py_BEGIN_ALLOW_THREADS", f"  {call};", "  Py_END_ALLOW_THREADS",
                  "  Py_RETURN_NONE;", "}"]
    else:
        lines += [f"  {result[0]} r;", "  Py_BEGIN_ALLOW_THREADS", f"  r = {call};",
                  "  Py_END_ALLOW_THREADS", f"  return {result[1]};", "}"]
    # packed(address, slots): the same call from an array of 8-byte slots, each holding its
    # value's bytes at its start (vitrail.plan's C hit path); a checked result comes back,
    # any other 0.
    lines += ["static long long packed(void* address, const unsigned long long* s) {",
              "  fn_t fn = (fn_t)address;"]
    for i, (ctype, _) in enumerate(values):
        lines.append(f"  {ctype} v{i}; memcpy(&v{i}, &s[{i}], sizeof v{i});")
    checked = result[0] == "int" and result_is_checked(proto.result)
    lines += [f"  {'return ' if checked else ''}{call};", f"  {'' if checked else 'return 0;'}",
              "}"]
    return "\n".join(lines) + "\n"


def caller(proto) -> Callable | None:
    """``call(address, *values)`` for functions of C prototype proto (its name aside), or None
    where proto has a value the callers do not take or no extension can be built here.

    The values are trusted: pointers and streams as ints, integers in their type's range,
    numbers for floats. The hot paths that use it pass values they computed from checked
    arguments; anything from a user goes through the checking marshaller first."""
    ext = _caller_module(proto)
    return None if ext is None else ext.call


def packed_caller(proto) -> int | None:
    """The address of ``long long packed(void* address, const unsigned long long* slots)``,
    which calls a function of prototype proto with the values in 8-byte slots (each value's
    bytes at its slot's start) and returns its checked result (else 0); None as for caller."""
    ext = _caller_module(proto)
    return None if ext is None else ext.packed_address()


def _caller_module(proto):
    found = _by_prototype.get(proto, _callers)  # (a plan's recording asks once per signature)
    if found is not _callers:
        return found
    body = caller_source(proto)
    if body is None:
        return None
    if body not in _callers:
        with _lock:
            if body not in _callers:
                name = "vitrail_call_" + hashlib.sha256(body.encode()).hexdigest()[:16]
                source = body + _MODULE.replace("@NAME@", name)
                try:
                    _callers[body] = c_extension(source, name)
                except Exception as e:  # any failure: ctypes calls, say why once
                    log.info("vitrail: calling %s through ctypes (no C caller: %s)", proto.name,
                             str(e).splitlines()[0] if str(e) else type(e).__name__)
                    _callers[body] = None
    _by_prototype[proto] = _callers[body]
    return _callers[body]


_MODULE = r"""
static PyObject* packed_address(PyObject* self, PyObject* unused) {
  return PyLong_FromVoidPtr((void*)&packed);
}
static PyMethodDef methods[] = {
    {"call", (PyCFunction)(void (*)(void))call, METH_FASTCALL, "call(address, *values)"},
    {"packed_address", packed_address, METH_NOARGS, "the address of packed(address, slots)"},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "@NAME@", NULL, -1, methods};
PyMODINIT_FUNC PyInit_@NAME@(void) { return PyModule_Create(&module); }
"""


def _host_arch() -> str:
    # The launcher holds no device code; any target nvcc knows will do, and fixing one keeps a
    # single build for every GPU of the machine.
    from vitrail.jit import toolchain
    return toolchain.target_arch().name
