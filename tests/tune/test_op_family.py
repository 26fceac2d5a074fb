"""Op families (vitrail.op.OpFamily): variants made on first use from their keys, once; the CLI's
registry; and the families' routes, whose every answer is a variant the family lists."""
from __future__ import annotations

import importlib
import itertools
import json
import threading
from pathlib import Path

import torch

from vitrail.device import target_limits
from vitrail.op import OP_FAMILIES, REGISTRY, OpFamily, registry
from vitrail.tune import Space

SPACE = Space({"X": [1, 2]}, heuristic=lambda problem, lim: {"X": 1})


def _family(name: str, made: list, **kw) -> OpFamily:
    def make(key):
        made.append(key)
        return dict(name=f"{name}.{key}", space=SPACE, kernel_source=str(key),
                    render=lambda c: None, launch=lambda module, c, *a: None)
    return OpFamily(name, make, **kw)


def test_variants_are_made_once_on_first_use(monkeypatch):
    monkeypatch.setattr("vitrail.op.OP_FAMILIES", dict(OP_FAMILIES))
    made: list = []
    fam = _family("t_once", made, keys=lambda: ["a", "b"])
    assert made == [] and fam.made() == {}
    ops = []
    threads = [threading.Thread(target=lambda: ops.append(fam["a"])) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == ["a"] and all(op is ops[0] for op in ops) and ops[0].name == "t_once.a"
    assert ops[0].name not in REGISTRY  # a family's Ops are reached through the family
    assert set(registry()) >= {"t_once.a", "t_once.b"} and made == ["a", "b"]


def test_listed_and_unregistered_families(monkeypatch):
    monkeypatch.setattr("vitrail.op.OP_FAMILIES", dict(OP_FAMILIES))
    made: list = []
    open_ended = _family("t_open", made, listed=["x"])
    hidden = _family("t_hidden", made, keys=lambda: ["h"], register=False)
    assert open_ended.keys() == ["x"]
    open_ended["y"]  # made by a call: the CLI knows it from then on
    assert open_ended.keys() == ["x", "y"]
    names = set(registry())
    assert {"t_open.x", "t_open.y"} <= names and "t_hidden.h" not in names
    assert hidden["h"].name == "t_hidden.h"


def _module(name: str):
    return importlib.import_module(f"vitrail.ops.{name}")  # vitrail.ops.softmax: the function


def test_softmax_routes_reach_only_listed_variants():
    S = _module("softmax")
    from vitrail.ops.softmax import configs
    keys = configs.variants(S.FLOATS)
    assert len({k.name for k in keys}) == len(keys) == len(set(keys))
    lim = target_limits("90a")
    reached = set()
    for kind, dtype, log, rows, n in itertools.product(
            ("fwd", "bwd"), S.FLOATS, (False, True), (1, 7, 132, 4096, 1 << 16),
            (8, 200, 4096, 1 << 15, 1 << 18, 1 << 21)):
        v = 16 // dtype.itemsize
        for v_, window, packed in ((v, False, True), (v, True, False), (1, False, False)):
            recipe = configs.route(configs.Rows(kind, rows, n, dtype, v_, log, window, packed),
                                   lim)
            assert recipe.variant in keys, recipe
            assert recipe.variant.kind == kind and recipe.variant.log == log
            reached.add(recipe.variant.path)
    assert reached == set(configs.PATH_NAMES)  # every row of the table is taken by something


def test_copy_routes_reach_only_listed_variants():
    C = _module("copy")
    from vitrail.ops.copy import configs
    keys = configs.variants(C.FLOATS)
    assert len({k.name for k in keys}) == len(keys)
    reached = set()
    for src, dst in itertools.product(C.FLOATS, C.FLOATS):
        x = torch.empty(64, 48, dtype=src)
        for a, out in ((x, torch.empty(64, 48, dtype=dst)), (x.t(), torch.empty(48, 64, dtype=dst)),
                       (x[:, 1:], torch.empty(64, 47, dtype=dst)),
                       (x[:, :40], torch.empty(64, 40, dtype=dst))):
            recipe = configs.route(C.layout(a, out))
            assert recipe.variant in keys and C.route(a, out)[0] is C.FAMILY[recipe.variant]
            reached.add(recipe.variant.path)
    assert reached == {"flat", "transpose", "rows", "tiled"}


def test_shipped_records_name_variants_of_a_family():
    """The shipped tuning store's records keep their ops' names (the variant keys' names)."""
    shipped = Path(_module("softmax").__file__).parents[2] / "shipped" / "tuning.json"
    ops = {r["op"] for r in json.loads(shipped.read_text())["records"]}
    names = set(registry())
    assert ops and ops <= names, ops - names
