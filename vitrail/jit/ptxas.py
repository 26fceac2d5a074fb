"""ptxas's ``-v`` report, read into registers, shared memory, stack and spills per kernel.

Apart from module.py (which imports torch) so that building a kernel needs no torch.
"""
from __future__ import annotations

import re
import shutil
import subprocess

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")


def parse_ptxas(log: str) -> dict[str, dict]:
    """Per entry function (demangled where c++filt exists): ptxas's -v report as a dict."""
    found: dict[str, dict] = {}
    entry = props = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry = m.group(1)
            found.setdefault(entry, {"mangled": entry})
        elif m := _PROPS.search(line):
            props = m.group(1)
        elif (m := _FRAME.search(line)) and props in found:
            found[props].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                                spill_loads=int(m.group(3)))
        elif (m := _USED.search(line)) and entry in found:
            smem = re.search(r"(\d+) bytes smem", line)
            bars = re.search(r"used (\d+) barriers", line)
            found[entry].update(registers=int(m.group(1)), shared=int(smem.group(1)) if smem else 0,
                                barriers=int(bars.group(1)) if bars else 0)
    names = _demangle(list(found))
    return {names[i]: found[k] for i, k in enumerate(found)}


def _demangle(names: list[str]) -> list[str]:
    """Itanium-demangle the C++ names (extern "C" names stay as they are), with binutils'
    c++filt where it exists."""
    mangled = [n for n in names if n.startswith("_Z")]
    tool = shutil.which("c++filt")
    if not tool or not mangled:
        return names
    try:
        out = subprocess.run([tool], input="\n".join(mangled), capture_output=True, text=True,
                             timeout=30).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return names
    if len(out) != len(mangled):
        return names
    plain = dict(zip(mangled, out))
    return [plain.get(n, n) for n in names]
