"""Build behind (vitrail.settings(build_behind=True), VITRAIL_BUILD_BEHIND): Op.ready says
whether a call of a config would wait for a compiler, Op.build_behind compiles it in a
background thread once, and a failed build is raised at the config's next call. The GEMM's
stand-in (torch's ops while its config builds) is tested in tests/ops/test_gemm.py."""
from __future__ import annotations

import threading

import pytest

from vitrail.jit.errors import CompileError
from vitrail.op import Op
from vitrail.tune import Space, settings
from vitrail.tune.settings import current

SPACE = Space({"X": [1, 2]}, heuristic=lambda problem, lim: {"X": 1})


class SlowBuild:
    """Op.module's compile, held until released; counts its builds."""

    def __init__(self, error: Exception | None = None):
        self.release, self.started, self.builds, self.error = (threading.Event(),
                                                               threading.Event(), 0, error)

    def __call__(self, op: Op, config):
        self.builds += 1
        self.started.set()
        assert self.release.wait(10)
        if self.error is not None:
            raise self.error
        module = op._modules[config] = f"module of {dict(config)}"
        return module


def _op(monkeypatch, build: SlowBuild, built: set) -> Op:
    op = Op("t_behind", space=SPACE, kernel_source="k", register=False,
            render=lambda c: None if c["X"] == 2 else {"source": "k", "name": "k"},
            launch=lambda module, c, *a: None)
    monkeypatch.setattr(Op, "module", lambda self, config: build(self, config))
    monkeypatch.setattr("vitrail.jit.compiler.is_built", lambda **kw: kw["name"] in built)
    return op


def test_a_config_builds_behind_once_and_is_ready_when_it_lands(monkeypatch):
    build = SlowBuild()
    op = _op(monkeypatch, build, set())
    one, two = (op.space.config(X=1), op.space.config(X=2))
    assert op.ready(two)  # compiles nothing
    assert not op.ready(one)
    op.build_behind(one)
    assert build.started.wait(10)
    for _ in range(3):  # while it builds: not ready, and no second build
        assert not op.ready(one)
        op.build_behind(one)
    build.release.set()
    for _ in range(1000):
        if op.ready(one):
            break
        threading.Event().wait(0.01)
    assert op.ready(one) and op._modules[one] == "module of {'X': 1}" and build.builds == 1


def test_a_config_in_the_cache_is_loaded_and_ready(monkeypatch):
    build = SlowBuild()
    build.release.set()
    op = _op(monkeypatch, build, {"k"})
    one = op.space.config(X=1)
    assert op.ready(one) and build.builds == 1  # loaded at once: a load, no compiler


def test_a_failed_build_is_raised_at_the_next_call(monkeypatch):
    error = CompileError("k", "nvcc", ["k.cu:1: error: no"], "nvcc k.cu", "/tmp/k", "")
    build = SlowBuild(error)
    op = _op(monkeypatch, build, set())
    one = op.space.config(X=1)
    op.build_behind(one)
    build.release.set()
    for _ in range(1000):
        if op._behind.get(one) is not None:
            break
        threading.Event().wait(0.01)
    assert not op.ready(one)
    with pytest.raises(CompileError):
        op.build_behind(one)
    assert build.builds == 1


def test_the_setting_is_scoped_and_checked():
    assert current().build_behind is False
    with settings(build_behind=True):
        assert current().build_behind is True
    with pytest.raises(TypeError, match="build_behind"):
        with settings(build_behind="yes"):
            pass
