"""`vitrail bench host` without a GPU: its cases' kernels are built side by side before the
timing, every case's vitrail side called once across the builder processes."""
from __future__ import annotations

import sys

import torch

from vitrail.ops import benchmarks as host


def test_the_builders_call_each_cases_vitrail_side_once(monkeypatch, capsys):
    calls = []

    def case(name, fail=False):
        def vitrail():
            calls.append(name)
            if fail:
                raise RuntimeError(f"{name} refused")
        return name, {"vitrail": vitrail, "torch": lambda: calls.append(f"torch {name}")}

    monkeypatch.setattr(host, "_host_cases", lambda: [case(f"h{i}") for i in range(5)])
    monkeypatch.setattr(host, "_small_cases", lambda: [case("s0", fail=True), case("s1")])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    for part in range(3):
        host.warm(part, 3)
    assert sorted(calls) == ["h0", "h1", "h2", "h3", "h4", "s0", "s1"]  # no torch side
    assert "s0: RuntimeError: s0 refused" in capsys.readouterr().out


def test_the_builders_are_processes_of_their_own_each_a_part(monkeypatch):
    import subprocess
    started = []

    class Child:
        def __init__(self, argv, env):
            started.append(argv)
            assert "PYTHONPATH" in env  # children import this vitrail

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Child)
    host._build_side_by_side()
    parts = len(started)
    assert 1 <= parts <= host.BUILDERS
    assert [argv[:2] for argv in started] == [[sys.executable, "-c"]] * parts
    assert [argv[2].split("; ")[1] for argv in started] == [f"warm({i}, {parts})"
                                                            for i in range(parts)]
