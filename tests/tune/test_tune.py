"""CPU tests of vitrail.tune: spaces, settings, the store, the policies with a fake timer."""
from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import vitrail
from vitrail import cli
from vitrail.jit.toolchain import Arch
from vitrail.tune import (Config, Limits, PickAny, PickBest, Space, TuningError, TuningStore,
                          bucket, limits, max_registers, max_shared, max_threads, pick,
                          problem_key, require, settings, tuner)
from vitrail.tune.store import Record, RecordKey
from vitrail.tune.settings import current_policy

REPO = Path(__file__).resolve().parents[2]
H100 = Limits(arch=Arch(9, 0, "a"), max_threads_per_block=1024, max_shared_per_block=227 << 10,
              shared_per_sm=228 << 10, registers_per_sm=65536, max_registers_per_thread=255,
              max_cluster_size=8, sm_count=132, source="GPU Fake H100")
SMALL = Limits(arch=Arch(8, 6), max_threads_per_block=1024, max_shared_per_block=99 << 10,
               shared_per_sm=100 << 10, registers_per_sm=65536, max_registers_per_thread=255,
               max_cluster_size=1, sm_count=None, source="arch table")


def gemm_space() -> Space:
    smem = lambda c: (c.BM + c.BN) * c.BK * 2 * c.STAGES  # noqa: E731 (bf16 A and B tiles)
    return Space({"BM": [64, 128, 256], "BN": [64, 128, 256], "BK": [64], "STAGES": [2, 4, 8]},
                 constraints=[max_shared(smem), max_threads(lambda c: 2 * c.BM),
                              max_registers(lambda c: c.BN // 4 + 32, lambda c: 2 * c.BM)],
                 heuristic=lambda m, lim: {"BM": 128 if m >= 128 else 64, "BN": 128, "BK": 64,
                                           "STAGES": 4})


# ---------------------------------------------------------------------------------- spaces
def test_space_enumerates_and_filters_by_the_targets_limits():
    space = gemm_space()
    assert space.size == 27 and len(list(space.all())) == 27
    big = space.config(BM=256, BN=256, BK=64, STAGES=8)  # 512 KiB of tiles
    assert space.reasons(big, H100) == [f"{512 << 10} B of shared memory > {227 << 10} B on sm_90a"]
    valid_h100, valid_small = space.valid(H100), space.valid(SMALL)
    assert big not in valid_h100
    # (BM+BN)*64*2*STAGES <= 227 KiB on Hopper, <= 99 KiB on sm_86: count by hand
    def fits(cap):
        return sum((bm + bn) * 64 * 2 * st <= cap for bm in (64, 128, 256)
                   for bn in (64, 128, 256) for st in (2, 4, 8))
    assert len(valid_h100) == fits(227 << 10) and len(valid_small) == fits(99 << 10)
    assert set(valid_small) < set(valid_h100)


def test_constraint_helpers_say_why():
    c = Config([("T", 48)])
    assert "not a positive multiple of 32" in max_threads(lambda c: c.T)(c, H100)
    assert "2048 threads per CTA > 1024" in max_threads(lambda c: 2048)(c, H100)
    assert max_threads(lambda c: 64)(c, H100) is None
    assert "300 registers per thread > 255" in max_registers(lambda c: 300, lambda c: 32)(c, H100)
    assert "128 registers x 1024 threads" in max_registers(lambda c: 128, lambda c: 1024)(c, H100)
    assert require(lambda c, lim: c.T % 32 == 0, "T={T} on {arch}")(c, H100) == "T=48 on sm_90a"


def test_heuristic_default_and_its_validation():
    space = gemm_space()
    assert space.default(4096, H100) == space.config(BM=128, BN=128, BK=64, STAGES=4)
    assert space.default(64, H100).BM == 64
    greedy = Space(space.params, constraints=space.constraints,
                   heuristic=lambda m, lim: {"BM": 256, "BN": 256, "BK": 64, "STAGES": 8})
    with pytest.raises(ValueError, match="heuristic chose BM=256,BN=256,BK=64,STAGES=8.*shared"):
        greedy.default(4096, H100)
    plain = Space({"A": [1, 2]}, constraints=[require(lambda c, lim: c.A == 2, "A=1 is slow")])
    assert plain.default(None, H100) == Config([("A", 2)])  # no heuristic: first valid config


def test_configs_are_immutable_hashable_and_round_trip():
    space = gemm_space()
    c = space.config(BM=64, BN=128, BK=64, STAGES=2)
    assert c.label == "BM=64,BN=128,BK=64,STAGES=2" and c.BN == 128 and c["STAGES"] == 2
    assert hash(c) == hash(space.config(BM=64, BN=128, BK=64, STAGES=2)) and {c: 1}[c] == 1
    with pytest.raises(AttributeError):
        c.BM = 256
    assert c.replace(STAGES=4).STAGES == 4 and c.STAGES == 2
    assert Config.from_json(c.to_json()) == c
    with pytest.raises(ValueError, match="BM=96 is not one of"):
        space.config(BM=96, BN=128, BK=64, STAGES=2)
    with pytest.raises(ValueError, match="missing \\['STAGES'\\]"):
        space.config(BM=64, BN=128, BK=64)
    with pytest.raises(ValueError, match="params\\['X'\\]"):
        Space({"X": []})


def test_limits_without_a_gpu_come_from_the_arch_table(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    h = limits(arch="90a")
    assert (h.max_shared_per_block, h.sm_count, h.source) == (227 << 10, None, "arch table")
    assert limits(arch="86").max_shared_per_block == 99 << 10
    assert limits(arch="80").max_cluster_size == 1 and h.max_cluster_size == 8


# -------------------------------------------------------------------------------- settings
def test_settings_scope_nest_and_stay_per_thread(monkeypatch):
    monkeypatch.delenv("VITRAIL_POLICY", raising=False)
    vitrail.tune.reset_defaults()
    assert vitrail.tune.current().policy is PickAny
    seen = {}
    with settings(policy=PickBest, max_workers=3) as outer:
        assert outer.policy is PickBest and outer.max_workers == 3
        with settings(max_configs=5) as inner:
            assert (inner.policy, inner.max_workers, inner.max_configs) == (PickBest, 3, 5)
        t = threading.Thread(target=lambda: seen.update(policy=vitrail.tune.current().policy))
        t.start()
        t.join()
        assert vitrail.tune.current().max_configs == 64
    assert seen["policy"] is PickAny  # another thread does not see this thread's scope
    assert vitrail.tune.current().policy is PickAny
    with pytest.raises(TypeError, match="unknown option\\(s\\) polcy"):
        with settings(polcy=PickBest):
            pass
    with pytest.raises(ValueError, match="max_workers=0"):
        with settings(max_workers=0):
            pass


def test_policy_from_env_and_process_defaults(monkeypatch):
    monkeypatch.setenv("VITRAIL_POLICY", "pickbest")
    vitrail.tune.reset_defaults()  # the environment is read once, and again after a reset
    assert vitrail.tune.current().policy is PickBest
    monkeypatch.setenv("VITRAIL_POLICY", "any")
    assert vitrail.tune.current().policy is PickBest  # not read at every call
    assert current_policy() is PickBest
    monkeypatch.setenv("VITRAIL_POLICY", "fastest")
    vitrail.tune.reset_defaults()
    with pytest.raises(ValueError, match="VITRAIL_POLICY='fastest'"):
        vitrail.tune.current()
    monkeypatch.setenv("VITRAIL_POLICY", "any")
    vitrail.tune.reset_defaults()
    try:
        vitrail.tune.set_defaults(policy=PickBest)
        assert vitrail.tune.current().policy is PickBest  # process defaults beat the env
    finally:
        vitrail.tune.reset_defaults()
    assert vitrail.tune.current().policy is PickAny


# ----------------------------------------------------------------------------------- store
def key(problem="p", **kw) -> RecordKey:
    return RecordKey(**{"op": "op", "source_hash": "abc", "problem": problem,
                        "gpu": "Fake H100", "sms": 132, "vitrail": "0.1.0", **kw})


def test_store_keys_keep_records_apart(tmp_path):
    store = TuningStore(tmp_path / "t.sqlite")
    c1, c2 = Config([("B", 1)]), Config([("B", 2)])
    store.put(Record(key(), c1, [{"config": {"B": 1}, "ms": 0.5, "error": None}]))
    for other in (key("q"), key(gpu="A100"), key(sms=114), key(source_hash="def"),
                  key(vitrail="0.2.0"), key(op="op2")):
        assert store.get(other) is None
        store.put(Record(other, c2))
    assert store.get(key()).config == c1 and store.get(key()).timings[0]["ms"] == 0.5
    assert len(store.records()) == 7 and len(store.records("op2")) == 1
    assert TuningStore(tmp_path / "t.sqlite").get(key("q")).config == c2  # survives a restart


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign"])
def test_a_damaged_store_is_kept_aside_and_replaced(tmp_path, caplog, damage):
    """A tuning store that is not a database (garbage, truncated, another program's file) makes
    no lookup fail: it is moved aside, named in a warning, and a new store works at once."""
    import sqlite3
    path = tmp_path / "tuning.sqlite"
    store = TuningStore(path)
    store.put(Record(key(), Config([("B", 1)])))
    if damage == "garbage":
        path.write_bytes(os.urandom(64) + b"not a database" * 200)
    elif damage == "truncated":
        for extra in path.parent.glob("tuning.sqlite-*"):  # the WAL holds the record
            extra.unlink()
        path.write_bytes(b"SQLite format 3\x00" + b"\xff" * 200)
    else:
        path.unlink()
        with sqlite3.connect(path) as other:  # a database, but no records table of ours
            other.execute("CREATE TABLE records (x)")
    with caplog.at_level("WARNING", logger="vitrail"):
        got = TuningStore(path).get(key())
    assert got is None
    aside = list(tmp_path.glob("tuning.sqlite.corrupt-*"))
    assert len(aside) == 1 and "kept it as" in caplog.text and str(aside[0]) in caplog.text
    fresh = TuningStore(path)
    fresh.put(Record(key("q"), Config([("B", 2)])))
    assert fresh.get(key("q")).config == Config([("B", 2)])


def test_a_store_of_another_vitrail_version_is_left_as_it_is(tmp_path, caplog):
    """A store whose table has every column of ours and more (a later version's) holds records
    nothing can rebuild: it is not moved aside; lookups say so and fall back."""
    import sqlite3
    path = tmp_path / "tuning.sqlite"
    TuningStore(path).put(Record(key(), Config([("B", 1)])))
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE records ADD COLUMN later TEXT")
    before = path.read_bytes()
    with caplog.at_level("WARNING", logger="vitrail"):
        assert TuningStore(path).get(key()) is None
    assert "another version of vitrail" in caplog.text
    assert not list(tmp_path.glob("tuning.sqlite.corrupt-*")) and path.read_bytes() == before


def test_export_import_round_trip_and_conflicts(tmp_path):
    src = TuningStore(tmp_path / "a.sqlite")
    for i in range(3):
        src.put(Record(key(f"p{i}"), Config([("B", i)]), [{"config": {"B": i}, "ms": i + 1.0,
                                                          "error": None}]))
    assert src.export(tmp_path / "out.json") == 3
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["format"] == "vitrail-tuning" and len(doc["records"]) == 3
    dst = TuningStore(tmp_path / "b.sqlite")
    dst.put(Record(key("p0"), Config([("B", 9)])))  # measured here: kept
    assert dst.import_(tmp_path / "out.json") == (2, 1)
    assert dst.get(key("p0")).config == Config([("B", 9)])
    assert dst.get(key("p2")).config == Config([("B", 2)]) and dst.get(key("p2")).timings
    assert dst.import_(tmp_path / "out.json", overwrite=True) == (3, 0)
    assert dst.get(key("p0")).config == Config([("B", 0)])
    (tmp_path / "bad.json").write_text('{"records": []}')
    with pytest.raises(ValueError, match="not a vitrail tuning export"):
        dst.import_(tmp_path / "bad.json")


def _registered():
    """(a registered op's name, two configs of its space)."""
    registry = cli._load_ops([])
    name = sorted(registry)[0]
    configs = list(itertools.islice(registry[name].space.all(), 2))
    return name, configs[0], configs[-1]


def test_cli_export_import(tmp_path, capsys):
    name, first, second = _registered()
    TuningStore().put(Record(key(op=name), first))
    assert cli.main(["tune", "export", str(tmp_path / "x.json")]) == 0
    assert "exported 1 tuning records" in capsys.readouterr().out
    TuningStore().put(Record(key(op=name), second))
    assert cli.main(["tune", "import", str(tmp_path / "x.json")]) == 0
    assert "kept 1 already here" in capsys.readouterr().out
    assert cli.main(["tune", "import", str(tmp_path / "x.json"), "--overwrite"]) == 0
    assert TuningStore().get(key(op=name)).config == first


def _export(records, **top) -> str:
    return json.dumps({"format": "vitrail-tuning", "version": 1, "records": records, **top})


GOOD = {"op": "op", "source_hash": "abc", "problem": "p", "gpu": "Fake H100", "sms": 132,
        "vitrail": "0.1.0", "config": {"B": 1}, "timings": [], "created": 1.0}
HOSTILE = {
    "not json": "{", "a list": "[]", "another format": '{"format": "x"}',
    "version text": _export([], version="2"), "version newer": _export([], version=99),
    "records not a list": _export({}), "record not an object": _export([5]),
    "missing field": _export([{k: v for k, v in GOOD.items() if k != "gpu"}]),
    "unknown field": _export([{**GOOD, "extra": 1}]),
    "sms text": _export([{**GOOD, "sms": "lots"}]), "sms bool": _export([{**GOOD, "sms": True}]),
    "sms huge": _export([{**GOOD, "sms": 10 ** 30}]), "op a number": _export([{**GOOD, "op": 5}]),
    "config a list": _export([{**GOOD, "config": []}]),
    "config nested": _export([{**GOOD, "config": {"B": {"x": [1]}}}]),
    "timings text": _export([{**GOOD, "timings": "fast"}]),
    "ms negative": _export([{**GOOD, "timings": [{"config": {"B": 1}, "ms": -1, "error": None}]}]),
    "ms nan": _export([{**GOOD, "timings": [{"ms": float("nan")}]}]),
    "ms text": _export([{**GOOD, "timings": [{"ms": "1"}]}]),
    "created infinite": _export([{**GOOD, "created": float("inf")}]),
    "nested deeply": '{"format": "vitrail-tuning", "records": ' + "[" * 100000 + "]" * 100000 + "}",
    "good then bad": _export([GOOD, {**GOOD, "problem": "q", "sms": -3}]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_import_is_refused_whole_in_one_line(tmp_path, case):
    path = tmp_path / "in.json"
    path.write_text(HOSTILE[case])
    store = TuningStore(tmp_path / "t.sqlite")
    with pytest.raises(ValueError) as error:
        store.import_(path)
    assert "\n" not in str(error.value) and str(path) in str(error.value)
    assert store.records() == []  # all or nothing


def test_imports_name_known_ops_and_configs_of_their_space(tmp_path, capsys, monkeypatch):
    name, first, _ = _registered()
    path = tmp_path / "in.json"
    for record, why in [({**GOOD, "op": "no.such.op"}, "is of no family known here"),
                        ({**GOOD, "op": name, "config": {"nope": 1}}, "is not in")]:
        path.write_text(_export([record]))
        assert cli.main(["tune", "import", str(path)]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1
    path.write_text(_export([{**GOOD, "op": name, "config": dict(first)}]))
    assert cli.main(["tune", "import", str(path)]) == 0
    assert cli.main(["tune", "ls"]) == 0 and "1 records" in capsys.readouterr().out
    assert cli.main(["tune", "export"]) == 2
    # an op of a known family that this process has not built (GEMM kinds are made on first
    # use) imports, and a record tuned on several GPUs (timings with device, raw_ms) too
    unbuilt = "gemm.tf32.rcr.lincomb"
    from vitrail.gemm.ops.launch import FAMILY  # as in a process that has not built it (another
    made = {k: op for k, op in FAMILY.made().items() if op.name != unbuilt}  # test may)
    monkeypatch.setattr(FAMILY, "_variants", made)
    assert unbuilt not in cli._load_ops([])
    timings = [{"config": {"B": 1}, "ms": 1.5, "error": None, "device": 1, "raw_ms": 1.4}]
    path.write_text(_export([{**GOOD, "op": unbuilt, "timings": timings}]))
    assert cli.main(["tune", "import", str(path)]) == 0
    assert cli.main(["tune", "ls"]) == 0
    out = capsys.readouterr().out
    assert "2 records" in out
    lines = out.splitlines()  # a header, then columns as wide as their longest entry
    header, *rows = lines[next(i for i, x in enumerate(lines) if x.startswith("op ")):-1]
    starts = [header.index(c) for c in ("gpu", "problem", "config", "best")]
    assert [r[:len(unbuilt) + 2] for r in rows].count(f"{unbuilt}  ") == 1
    assert all(r[s - 2:s] == "  " and r[s] != " " for r in rows for s in starts[:3])
    for bad in ({"device": "x"}, {"raw_ms": float("inf")}):
        path.write_text(_export([{**GOOD, "op": unbuilt, "problem": "q",
                                  "timings": [{**timings[0], **bad}]}]))
        assert cli.main(["tune", "import", str(path)]) == 2
        assert "a timing's" in capsys.readouterr().err


def test_problem_keys_bucket_shapes_and_see_layout_and_alignment():
    assert [bucket(n) for n in (1, 16, 17, 1000, 1024, 1025)] == [1, 16, 32, 1024, 1024, 2048]
    assert [bucket(n, 4) for n in (16, 17, 100, 128, 129, 150, 200, 50000)] == [
        16, 20, 112, 128, 160, 160, 224, 57344]
    assert [bucket(n, 2) for n in (17, 100, 129)] == [24, 128, 192]
    with pytest.raises(ValueError, match="per_octave"):
        bucket(100, 3)
    a = torch.empty(1000, 512, dtype=torch.bfloat16)
    assert problem_key(a) == problem_key(torch.empty(1024, 512, dtype=torch.bfloat16))
    assert problem_key(a) != problem_key(a.float())
    assert problem_key(a).startswith("bfloat16[1024,512]o10a16")
    assert problem_key(a.t()).startswith("bfloat16[512,1024]o01")  # column-major
    assert problem_key(a[:, 1:]).endswith("a2")  # a 2-byte offset: 2-byte alignment
    assert problem_key(a, alpha=2.0) == problem_key(a) + ";alpha=2.0"


# ---------------------------------------------------------------------------------- policies
class Recorder:
    """A fake run/timer pair: each config's time comes from a table; calls are recorded."""

    def __init__(self, times: dict, raising: set = frozenset()):
        self.times, self.raising, self.runs = times, raising, []

    def run(self, config, args):
        self.runs.append((config.label, args))
        if config.label in self.raising:
            raise RuntimeError("too many resources requested for launch")

    def timer(self, fn):
        fn()
        return self.times[self.runs[-1][0]]


@pytest.fixture
def fake_compile(monkeypatch):
    """compile_all with failures chosen by the test, and no compiler involved."""
    failing = {}
    calls = []

    def compile_all(jobs, **kw):
        calls.append([c.label for c, _ in jobs])
        return {c: failing[c.label] for c, _ in jobs if c.label in failing}
    monkeypatch.setattr(tuner, "compile_all", compile_all)
    return failing, calls


def small_tunable() -> tuner.Tunable:
    space = Space({"B": [1, 2, 3, 4]}, heuristic=lambda p, lim: {"B": 2})
    return tuner.Tunable("fake", space, lambda c: {"source": "", "name": "fake"}, "h1")


def test_pick_any_uses_the_store_else_the_heuristic(tmp_path, fake_compile):
    t, store = small_tunable(), TuningStore(tmp_path / "s.sqlite")
    rec = Recorder({})
    with settings(policy=PickAny):
        assert pick(t, "p", None, run=rec.run, lim=H100, store=store, timer=rec.timer).B == 2
        store.put(Record(tuner.record_key(t, "p", H100), Config([("B", 4)])))
        assert pick(t, "p", None, run=rec.run, lim=H100, store=store, timer=rec.timer).B == 4
    assert rec.runs == [] and fake_compile[1] == []  # PickAny times and compiles nothing


def test_pick_best_times_every_candidate_on_scratch_copies_and_stores(tmp_path, fake_compile):
    t, store = small_tunable(), TuningStore(tmp_path / "s.sqlite")
    rec = Recorder({"B=1": 3.0, "B=2": 2.0, "B=3": 0.5, "B=4": 1.0})
    x = torch.randn(8)
    before = x.clone()
    with settings(policy=PickBest):
        best = pick(t, "p", None, run=rec.run, args=(x, 7), lim=H100, store=store,
                    timer=rec.timer)
    assert best.B == 3
    assert [label for label, _ in rec.runs] == ["B=2", "B=1", "B=3", "B=4"]  # heuristic first
    for _, (scratch, seven) in rec.runs:
        assert scratch is not x and torch.equal(scratch, before) and seven == 7
    assert torch.equal(x, before)
    record = store.get(tuner.record_key(t, "p", H100))
    assert record.config.B == 3 and sorted(r["ms"] for r in record.timings) == [0.5, 1, 2, 3]
    rec.runs.clear()
    with settings(policy=PickBest):  # stored: a second pick times nothing
        assert pick(t, "p", None, run=rec.run, lim=H100, store=store, timer=rec.timer).B == 3
    assert rec.runs == [] and len(fake_compile[1]) == 1


def test_failures_score_inf_and_all_failing_lists_why(tmp_path, fake_compile):
    failing, _ = fake_compile
    t, store = small_tunable(), TuningStore(tmp_path / "s.sqlite")
    failing["B=3"] = "compile error: too many registers"
    rec = Recorder({"B=1": 3.0, "B=2": 2.0, "B=3": 0.1, "B=4": 1.0}, raising={"B=4"})
    with settings(policy=PickBest):
        assert pick(t, "p", None, run=rec.run, lim=H100, store=store, timer=rec.timer).B == 2
    timings = {json.dumps(r["config"]): r for r in
               store.get(tuner.record_key(t, "p", H100)).timings}
    assert timings['{"B": 3}']["ms"] is None and "too many registers" in timings['{"B": 3}']["error"]
    assert timings['{"B": 4}']["ms"] is None and "RuntimeError" in timings['{"B": 4}']["error"]
    with settings(policy=PickBest, allow_failure=False):
        with pytest.raises(TuningError, match="B=3 failed: compile error"):
            pick(t, "q", None, run=rec.run, lim=H100, store=store, timer=rec.timer)
    failing.update({"B=1": "e1", "B=2": "e2"})
    rec.raising = {"B=4"}
    with settings(policy=PickBest):
        with pytest.raises(TuningError) as info:
            pick(t, "r", None, run=rec.run, lim=H100, store=store, timer=rec.timer)
    message = str(info.value)
    assert "every candidate config of 'fake' failed" in message
    assert all(s in message for s in ("B=1: e1", "B=2: e2", "B=3: compile error", "B=4: Runtime"))


def test_max_configs_and_no_gpu(tmp_path, fake_compile):
    t = small_tunable()
    rec = Recorder({"B=1": 1.0, "B=2": 2.0, "B=3": 3.0, "B=4": 4.0})
    with settings(policy=PickBest, max_configs=2):
        assert pick(t, "p", None, run=rec.run, lim=H100, store=TuningStore(tmp_path / "s"),
                    timer=rec.timer).B == 1
    assert fake_compile[1][-1] == ["B=2", "B=1"]
    with settings(policy=PickBest):
        with pytest.raises(TuningError, match="needs a GPU"):
            pick(t, "p", None, run=rec.run, lim=SMALL, store=TuningStore(tmp_path / "s"))


def test_a_stale_record_outside_the_space_is_tuned_again(tmp_path, fake_compile):
    t, store = small_tunable(), TuningStore(tmp_path / "s.sqlite")
    store.put(Record(tuner.record_key(t, "p", H100), Config([("B", 9)])))
    with settings(policy=PickAny):
        assert pick(t, "p", None, lim=H100, store=store).B == 2


# ---------------------------------------------------------------------- compiling, precompile
def test_compile_all_builds_in_parallel_processes_and_reports_failures():
    src = 'extern "C" __global__ void k(float* x) { x[0] = VALUE; }\n'
    jobs = [(Config([("VALUE", v)]), dict(source=src, name="k", backend="nvrtc", arch="90a",
                                          defines={"VALUE": v}))
            for v in ("1.f", "2.f", "syntax error")]
    failures = tuner.compile_all(jobs, max_workers=2)
    assert list(failures) == [Config([("VALUE", "syntax error")])]
    assert failures[Config([("VALUE", "syntax error")])].startswith("compile error:")
    from vitrail import jit
    assert jit.compile(src, name="k", backend="nvrtc", arch="90a",
                       defines={"VALUE": "2.f"}).how == "disk"  # built by a worker


def test_compile_all_works_from_a_script_without_a_main_guard(tmp_path):
    """Compile processes never re-run the caller's script (multiprocessing's spawn would, and
    a script with no ``if __name__ == "__main__"`` guard then broke every job)."""
    script = tmp_path / "tune_me.py"
    script.write_text(
        "from vitrail.tune import Config, tuner\n"
        "print('script body ran')\n"
        "src = 'extern \"C\" __global__ void k(float* x) { x[0] = VALUE; }'\n"
        "jobs = [(Config([('VALUE', v)]), dict(source=src, name='k', backend='nvrtc', "
        "arch='90a', defines={'VALUE': v})) for v in ('1.f', '2.f', '3.f')]\n"
        "print('failures:', tuner.compile_all(jobs, max_workers=3))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["script body ran", "failures: {}"]


def test_worker_count_is_bounded():
    assert tuner.worker_count(None, 1) == 1
    assert 1 <= tuner.worker_count(None, 100) <= 100
    assert tuner.worker_count(1, 100) == 1


def test_precompile_for_hopper_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["precompile", "tests.scale", "--arch", "90a", "--workers", "2",
                     "--module", "tests.tune.scale_op"]) == 0
    assert "tests.scale: 2/2 default configs built" in capsys.readouterr().out
    from tests.tune.scale_op import OP
    from vitrail import jit
    for config in OP.default_configs(limits(arch="90a")):
        assert jit.compile(**OP.render(config), arch="90a").how == "disk"
    with pytest.raises(SystemExit, match="unknown op or family .nope."):
        cli.main(["precompile", "nope", "--module", "tests.tune.scale_op"])


def test_no_inf_leaks_into_exports(tmp_path):
    store = TuningStore(tmp_path / "s.sqlite")
    store.put(Record(key(), Config([("B", 1)]), [{"config": {"B": 1}, "ms": None, "error": "x"}]))
    store.export(tmp_path / "e.json")
    text = (tmp_path / "e.json").read_text()
    assert "Infinity" not in text and not math.isnan(len(text))


def test_vitrail_tune_plots_the_stored_sweep(tmp_path, monkeypatch, capsys):
    import argparse
    from tests.tune.scale_op import OP
    monkeypatch.setattr(vitrail.tune, "limits", lambda *a, **k: H100)
    config = OP.space.config(BLOCK=256, ITEMS=4, COALESCED=1)
    timings = [{"config": dict(c), "ms": 0.05 + 0.01 * i, "error": None}
               for i, c in enumerate(OP.space.valid(H100))]
    TuningStore().put(Record(tuner.record_key(OP.tunable, "k", H100), config, timings))
    cli._plot_sweep(OP, "k", "tests.scale 16x16", argparse.Namespace(
        out=str(tmp_path), shape="16x16", dtype="float32"))
    png = tmp_path / "tune-tests.scale-16x16-float32.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"sweep plotted to {png}" in capsys.readouterr().out


# --------------------------------------------------------------------------- several GPUs
def test_devices_setting_is_validated_and_read_from_the_environment(monkeypatch):
    assert tuner.Settings().devices == "current"
    assert tuner.Settings(devices="ALL").devices == "all"
    assert tuner.Settings(devices="1,0").devices == (1, 0)
    assert tuner.Settings(devices=[2]).devices == (2,)
    for bad in ("some", (), (0, 0), (-1,), (True,), (0.5,), "0,x"):
        with pytest.raises(ValueError, match="devices="):
            tuner.Settings(devices=bad)
    monkeypatch.setenv("VITRAIL_TUNE_DEVICES", "all")
    vitrail.tune.reset_defaults()
    assert vitrail.tune.current().devices == "all"
    monkeypatch.setenv("VITRAIL_TUNE_DEVICES", "gpu0")
    vitrail.tune.reset_defaults()
    with pytest.raises(ValueError, match="VITRAIL_TUNE_DEVICES='gpu0'"):
        vitrail.tune.current()
    # the current device only, and no GPU here: one timing stream, no switching
    assert tuner.timing_devices("current", (), "t") == [None]
    if not torch.cuda.is_available():
        assert tuner.timing_devices("all", (), "t") == [None]


def test_timing_spreads_candidates_over_gpus_and_corrects_for_a_slow_one(monkeypatch):
    """Two fake GPUs, the second 25% slow: each candidate is timed once (the reference on
    both), on the GPU's own thread, and the second GPU's timings are scaled back."""
    here = threading.local()
    monkeypatch.setattr(tuner, "_device_scope", lambda d: _FakeDevice(here, d))
    true_ms = {"B=2": 2.0, "B=1": 3.0, "B=3": 0.5, "B=4": 1.0}
    runs = []

    def run(config, args):
        runs.append((config.label, here.device, threading.current_thread().name, args))

    def timer(fn):
        fn()
        return true_ms[runs[-1][0]] * (1.25 if here.device == 1 else 1.0)

    space = Space({"B": [1, 2, 3, 4]}, heuristic=lambda p, lim: {"B": 2})
    candidates = tuner.candidates_for(space, None, H100, 64)
    x = torch.randn(4)
    timings = tuner.time_candidates("fake", candidates, {}, run, (x, 7), timer, [0, 1], True)
    assert [t["config"]["B"] for t in timings] == [2, 1, 3, 4]
    for t in timings:
        assert t["ms"] == pytest.approx(true_ms[f"B={t['config']['B']}"])
    assert {t["device"] for t in timings} == {0, 1}
    timed_on = sorted((label, device) for label, device, _, _ in runs)
    assert timed_on == [("B=1", 1), ("B=2", 0), ("B=2", 1), ("B=3", 0), ("B=4", 1)]
    assert all(name.startswith("vitrail-tune") for _, _, name, _ in runs)
    assert all(a[0] is not x and torch.equal(a[0], x) and a[1] == 7 for *_, a in runs)
    slow = next(t for t in timings if t["device"] == 1 and t["config"]["B"] == 1)
    assert slow["raw_ms"] == pytest.approx(3.75)


def test_timing_on_several_gpus_keeps_failures_and_their_policy(monkeypatch):
    here = threading.local()
    monkeypatch.setattr(tuner, "_device_scope", lambda d: _FakeDevice(here, d))

    def run(config, args):
        if config.B == 3:
            raise RuntimeError("too many resources requested for launch")

    space = Space({"B": [1, 2, 3, 4]}, heuristic=lambda p, lim: {"B": 2})
    candidates = tuner.candidates_for(space, None, H100, 64)
    failures = {candidates[1]: "compile error: boom"}  # B=1
    timings = tuner.time_candidates("fake", candidates, failures, run, (), lambda fn: fn() or 1.0,
                                    [0, 1], True)
    by_b = {t["config"]["B"]: t for t in timings}
    assert by_b[1]["ms"] is None and "boom" in by_b[1]["error"]
    assert by_b[3]["ms"] is None and "RuntimeError" in by_b[3]["error"]
    assert by_b[2]["ms"] == by_b[4]["ms"] == 1.0
    with pytest.raises(TuningError, match="B=3 failed"):
        tuner.time_candidates("fake", candidates, {}, run, (), lambda fn: fn() or 1.0, [0, 1],
                              False)


class _FakeDevice:
    def __init__(self, here, device):
        self.here, self.device = here, device

    def __enter__(self):
        self.here.device = self.device

    def __exit__(self, *exc):
        self.here.device = None


def test_a_kernels_source_hash_is_of_its_code_not_its_comments():
    """Records stay with a kernel whose comments or spacing change (the docs move figures out of
    kernels' comments); a change of code, a string literal's included, is a new kernel."""
    from vitrail.tune.tuner import source_hash
    base = 'int x = 1;  // one\n/* two\n lines */ asm("mov.u32 %0, 1; // kept");'
    same = 'int x = 1;\n\n  asm("mov.u32 %0, 1; // kept");   /* moved */'
    assert source_hash(base) == source_hash(same)
    for other in ('int x = 2; asm("mov.u32 %0, 1; // kept");',
                  'int x = 1; asm("mov.u32 %0, 2; // kept");',
                  "int x = 1; asm(\"mov.u32 %0, 1;\");"):
        assert source_hash(other) != source_hash(base), other
    assert len(source_hash(base)) == 16
