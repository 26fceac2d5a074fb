"""vitrail.ops: every public name is the op's function, however the families were imported."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_public_names_are_functions_even_after_importing_the_family_packages():
    """Also in the module's __dict__, which torch.compile (Dynamo) reads instead of getattr."""
    code = ("import importlib, vitrail.ops as ops\n"
            "for family in ops.families():\n"
            "    importlib.import_module(f'vitrail.ops.{family}')\n"  # binds the packages
            "ops.log_softmax\n"  # and the first use of a name after its family loaded
            "bad = [n for n in ops.__all__ if not callable(getattr(ops, n))\n"
            "       or type(getattr(ops, n)).__name__ == 'module'\n"
            "       or vars(ops).get(n) is not getattr(ops, n)]\n"  # torch.compile reads vars()
            "print('bad:', bad)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "bad: []"


def test_every_public_name_is_defined_by_its_family():
    ops = importlib.import_module("vitrail.ops")
    for name, family in ops._EXPORTS.items():
        module = importlib.import_module(f"vitrail.ops.{family}")
        assert getattr(ops, name) is getattr(module, name), name
    assert {f.split(".")[0] for f in ops._EXPORTS.values()} <= set(ops.families())
