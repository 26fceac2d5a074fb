"""trace on the CPU (torch.profiler works without a GPU), and ncu's command lines, including
running them with a stand-in ncu and the error where none is installed."""
from __future__ import annotations

import gzip
import importlib
import json
import os
import shlex
import stat
import sys
from pathlib import Path

import pytest
import torch

from vitrail.profile import NcuCommand, NcuError, ncu, trace

trace_mod = importlib.import_module("vitrail.profile.trace")


# ------------------------------------------------------------------------------------- trace
def test_trace_writes_a_chrome_trace_of_the_steps(tmp_path):
    a = torch.randn(32, 32)
    calls = []

    def fn():
        calls.append(1)
        return a @ a

    path = trace(fn, tmp_path / "traces" / "mm.json", warmup=2, steps=3)
    assert path == tmp_path / "traces" / "mm.json" and len(calls) == 5
    events = json.loads(path.read_text())["traceEvents"]
    names = [e.get("name") for e in events]
    assert [n for n in names if n.startswith("vitrail.trace step")] == [
        "vitrail.trace step 0", "vitrail.trace step 1", "vitrail.trace step 2"]
    assert names.count("aten::mm") == 3  # the warm-up calls are not in the trace
    assert all("ph" in e for e in events)


def test_trace_can_write_gzip(tmp_path):
    path = trace(lambda: torch.ones(4).sum(), str(tmp_path / "t.json.gz"), warmup=0, steps=1)
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    assert any(e.get("name") == "vitrail.trace step 0" for e in events)


@pytest.mark.parametrize("kwargs, error, name", [
    ({"steps": 0}, ValueError, "steps"), ({"warmup": -1}, ValueError, "warmup"),
    ({"steps": 2.0}, TypeError, "steps")])
def test_trace_checks_its_counts(tmp_path, kwargs, error, name):
    with pytest.raises(error, match=name):
        trace(lambda: None, tmp_path / "t.json", **kwargs)


def test_trace_checks_fn_and_path(tmp_path):
    with pytest.raises(TypeError, match="fn"):
        trace("not callable", tmp_path / "t.json")
    with pytest.raises(TypeError, match="path"):
        trace(lambda: None, 42)


# --------------------------------------------------------------------------------------- ncu
def test_a_script_with_every_option():
    cmd = ncu("bench_gemm.py --m 4096 --dtype bf16", kernel="gemm_.*bf16", launch_skip=3,
              launch_count=2, sections=["SpeedOfLight", "MemoryWorkloadAnalysis"],
              metrics=["sm__throughput.avg.pct_of_peak_sustained_elapsed",
                       "dram__bytes.sum"], output="out/gemm")
    assert isinstance(cmd, NcuCommand)
    assert cmd.argv == (
        "ncu", "--kernel-name", "regex:gemm_.*bf16", "--launch-skip", "3", "--launch-count", "2",
        "--section", "SpeedOfLight", "--section", "MemoryWorkloadAnalysis",
        "--metrics", "sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes.sum",
        "--force-overwrite", "-o", "out/gemm",
        sys.executable, "bench_gemm.py", "--m", "4096", "--dtype", "bf16")
    assert cmd.report == Path("out/gemm.ncu-rep")
    assert cmd.returncode is None and cmd.output is None
    assert shlex.split(str(cmd)) == list(cmd.argv)


def test_the_defaults_profile_the_first_launch_of_any_kernel():
    assert ncu(["./gemm_app", "--n", "8"]).argv == (
        "ncu", "--launch-skip", "0", "--launch-count", "1", "./gemm_app", "--n", "8")
    assert ncu(["./app"]).report is None


def test_an_argv_list_is_kept_as_given():
    cmd = ncu([sys.executable, "-m", "vitrail.cli", "bench", "jit.launch_overhead"],
              kernel="regex:^vitrail_noop$")
    assert cmd.argv[1:3] == ("--kernel-name", "regex:^vitrail_noop$")
    assert cmd.argv[-5:] == (sys.executable, "-m", "vitrail.cli", "bench", "jit.launch_overhead")


def test_a_script_path_with_a_space_is_not_split(tmp_path):
    script = tmp_path / "my bench.py"
    script.write_text("pass\n")
    assert ncu(str(script)).argv[-2:] == (sys.executable, str(script))
    assert ncu(script).argv[-2:] == (sys.executable, str(script))
    assert "'" in str(ncu(script))  # quoted when printed


def test_names_may_be_one_string_or_comma_separated():
    cmd = ncu("x.py", sections="SpeedOfLight", metrics="a__x.sum, b__y.avg",
              output="r.ncu-rep")
    assert ("--section", "SpeedOfLight") == cmd.argv[5:7]
    assert "a__x.sum,b__y.avg" in cmd.argv
    assert cmd.report == Path("r.ncu-rep")


@pytest.mark.parametrize("kwargs, error, name", [
    ({"launch_count": 0}, ValueError, "launch_count"),
    ({"launch_skip": -1}, ValueError, "launch_skip"),
    ({"launch_skip": "2"}, TypeError, "launch_skip"),
    ({"kernel": ""}, TypeError, "kernel"), ({"kernel": 3}, TypeError, "kernel"),
    ({"metrics": ["a", 1]}, TypeError, "metrics"), ({"sections": [""]}, TypeError, "sections"),
    ({"output": ""}, ValueError, "output"), ({"output": 5}, TypeError, "output")])
def test_bad_options_are_refused_by_name(kwargs, error, name):
    with pytest.raises(error, match=name):
        ncu("x.py", **kwargs)


@pytest.mark.parametrize("target", [[], "", 42, ["ok", 1]])
def test_a_bad_command_is_refused(target):
    with pytest.raises((TypeError, ValueError), match="cmd_or_script"):
        ncu(target)


@pytest.fixture
def no_ncu(monkeypatch, tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(trace_mod, "STANDARD_DIRS", ())
    return empty


def _fake_ncu(directory: Path, body: str) -> None:
    exe = directory / "ncu"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


def test_running_without_ncu_says_it_is_not_installed(no_ncu):
    assert trace_mod.find_ncu() is None
    with pytest.raises(NcuError, match="ncu .*is not installed") as info:
        ncu("x.py", run=True)
    assert isinstance(info.value, RuntimeError)
    assert "--launch-count 1" in str(info.value)  # the command, to run elsewhere


def test_running_with_ncu_returns_its_output(no_ncu, tmp_path, monkeypatch):
    toolkit = tmp_path / "cuda"
    (toolkit / "bin").mkdir(parents=True)
    _fake_ncu(toolkit / "bin", 'echo "fake ncu: $@"\n')
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    assert trace_mod.find_ncu() == str(toolkit / "bin" / "ncu")
    done = ncu(["./app", "--n", "8"], kernel="gemm", run=True)
    assert done.returncode == 0
    assert done.output.strip() == ("fake ncu: --kernel-name regex:gemm --launch-skip 0 "
                                   "--launch-count 1 ./app --n 8")


def test_a_failing_ncu_run_raises_with_its_output_and_a_hint(no_ncu):
    _fake_ncu(no_ncu, 'echo "==ERROR== ERR_NVGPUCTRPERM - no permission"\nexit 1\n')
    assert trace_mod.find_ncu() == os.path.join(str(no_ncu), "ncu")
    with pytest.raises(NcuError, match="exited with status 1") as info:
        ncu("x.py").run()
    assert "ERR_NVGPUCTRPERM - no permission" in str(info.value)
    assert "performance counters" in str(info.value)
