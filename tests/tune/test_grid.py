"""The shipped tuning grid (vitrail.tune.grid, ``vitrail tune grid``) on a machine with no GPU:
every problem of the grid routes as its public function would; the file written keeps the
records of other GPUs that still apply and drops stale ones; a record ships with the winner's
and the heuristic's timings; the shipped file, where there is one, is a valid export that
the package carries."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vitrail import __version__
from vitrail.cli import _load_ops, main, resolve_tune
from vitrail.jit.shared import SHIPPED
from vitrail.tune import Config, Record, RecordKey, TuningStore, grid, limits
from vitrail.tune.store import read_export

REGISTRY = _load_ops([])


def key(op="softmax.fwd.float32.v4", problem="n4096;rows4096", gpu="NVIDIA H100 80GB HBM3",
        source=None, version=__version__) -> RecordKey:
    source = REGISTRY[op].tunable.source_hash if source is None else source
    return RecordKey(op, source, problem, gpu, 132, version)


def test_every_grid_problem_routes_to_a_variant_with_configs():
    seen = set()
    for p in grid.GRID:
        shaped, _ = resolve_tune(p.family, p.shape, p.dtype, p.backward, REGISTRY)
        assert shaped.op.tunable.space.valid(limits()), p
        seen.add(p.family)
    assert seen == {"softmax", "log_softmax", "copy", "sympow", "sympow_mma", "mma_sympow_bwd"}
    assert len(set(grid.GRID)) == len(grid.GRID)
    assert grid.problems("copy") == [p for p in grid.GRID if p.family == "copy"]
    with pytest.raises(ValueError, match="no 'gemm' problems; its families: softmax"):
        grid.problems("gemm")


def test_merge_keeps_what_still_applies_and_replaces_what_was_tuned_again():
    applies = grid.applies_here(REGISTRY, __version__)
    h200 = Record(key(gpu="NVIDIA H200"), Config([("B", 1)]))
    stale_source = Record(key(problem="n1024;rows1024", source="0" * 16), Config([("B", 2)]))
    stale_version = Record(key(problem="n512;rows512", version="0.0.1"), Config([("B", 3)]))
    gone = Record(key(op="softmax.fwd.float32.v4").__class__(
        "no.such.op", "abc", "p", "NVIDIA H100 80GB HBM3", 132, __version__), Config([("B", 4)]))
    old_h100 = Record(key(), Config([("B", 5)]))
    new_h100 = Record(key(), Config([("B", 6)]))
    out = grid.merge([new_h100], [h200, stale_source, stale_version, gone, old_h100], applies)
    assert [r.config for r in out] == [Config([("B", 6)]), Config([("B", 1)])]  # key order
    assert out == sorted(out, key=lambda r: r.key.as_tuple())


def test_a_record_ships_with_the_winners_and_the_heuristics_timings():
    timings = [{"config": {"B": b}, "ms": ms, "error": None}
               for b, ms in ((4, 2.0), (1, 3.0), (2, 1.0), (8, None))]
    record = Record(key(), Config([("B", 2)]), timings)
    shipped = grid.shipped_form(record, Config([("B", 4)]))
    assert shipped.timings == [timings[0], timings[2]] and shipped.config == record.config
    assert grid.heuristic_slowdown(record, Config([("B", 4)])) == 2.0
    assert grid.heuristic_slowdown(record, Config([("B", 8)])) is None  # it failed
    assert grid.heuristic_slowdown(record, None) is None  # no heuristic
    assert grid.shipped_form(record, None).timings == [timings[2]]


def test_the_grid_without_a_gpu_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune", "grid", str(tmp_path / "t.json")]) == 1
    err = capsys.readouterr().err
    assert "no GPU is visible" in err and err.count("\n") == 1
    assert not (tmp_path / "t.json").exists()


def test_the_shipped_records_are_a_valid_export_for_known_ops():
    path = Path(SHIPPED) / "tuning.json"
    if not path.exists():
        pytest.skip("no shipped tuning records yet")
    records = read_export(path, REGISTRY)
    assert records and json.loads(path.read_text())["format"] == "vitrail-tuning"
    for r in records:
        assert r.key.op.split(".")[0] in {"softmax", "log_softmax", "copy", "sympow"}, r.key
        assert r.timings and r.key.vitrail == __version__, r.key
    # a lookup that misses the user's store finds them (the layer vitrail ships, read last)
    assert TuningStore().get(records[0].key).config == records[0].config


def test_the_shipped_records_are_of_the_kernels_as_they_are():
    """Each shipped record's source hash is its op's now: a record is found only under the hash
    of the kernel source it was tuned on, so a change to that source (a comment included) leaves
    the record unused without a word. Such a change re-tunes the records (`vitrail tune grid
    --overwrite`) in the same commit."""
    path = Path(SHIPPED) / "tuning.json"
    if not path.exists():
        pytest.skip("no shipped tuning records yet")
    stale = sorted({r.key.op for r in read_export(path, REGISTRY)
                    if r.key.source_hash != REGISTRY[r.key.op].tunable.source_hash})
    assert not stale, f"shipped records of kernels changed since they were tuned: {stale}"


def test_the_docs_list_the_grid():
    import math
    text = (Path(__file__).parents[2] / "docs" / "tuning.md").read_text()
    for p in grid.GRID:
        dims = p.shape.split("x")
        shown = p.shape if len(dims) > 1 else f"2^{int(math.log2(int(dims[0])))}"
        assert shown in text, p
