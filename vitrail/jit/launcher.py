"""The launch call itself: one C function between Python and the driver's cuLaunchKernel.

cuda-bindings' ``cuLaunchKernel`` wraps every argument in Python objects; on a Hopper host that
costs about as much as CuPy's whole launch. As Triton does, vitrail builds a tiny CPython
extension once per machine (through its own kernel cache, so it is built once and shared by
every process) whose ``launch`` takes ten integers and calls the driver. Where it cannot be built
(no Python headers, no nvcc), launches go through cuda-bindings: slower, equally correct.
"""
from __future__ import annotations

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
    from vitrail.jit.compiler import compile as jit_compile
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise FileNotFoundError(f"no Python.h under {include} (install python3-dev)")
    # The extension is specific to this Python: its version and ABI are in the source's key.
    tag = f"// {sys.implementation.cache_tag} {sysconfig.get_config_var('SOABI')}\n"
    module = jit_compile(tag + SOURCE, name="vitrail_launch", backend="nvcc",
                         include_dirs=[include], arch=_host_arch())
    loader = importlib.machinery.ExtensionFileLoader("vitrail_launch", str(module.path))
    spec = importlib.util.spec_from_file_location("vitrail_launch", module.path, loader=loader)
    ext = importlib.util.module_from_spec(spec)
    loader.exec_module(ext)
    return ext.launch


def _host_arch() -> str:
    # The launcher holds no device code; any target nvcc knows will do, and fixing one keeps a
    # single build for every GPU of the machine.
    from vitrail.jit import toolchain
    return toolchain.target_arch().name
