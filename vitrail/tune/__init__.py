"""vitrail.tune: configuration spaces, tuning policies and the tuning store.

    space = Space({"BLOCK": [128, 256, 512], "VEC": [1, 2, 4]},
                  constraints=[max_threads(lambda c: c.BLOCK)], heuristic=...)
    with vitrail.settings(policy=vitrail.PickBest):
        op(problem_key, problem, *args)      # tunes once per problem and GPU, then remembers
"""
from vitrail.tune.settings import (PickAny, PickBest, Policy, Settings, current, reset_defaults,
                                   set_defaults, settings)
from vitrail.tune.space import (Config, Constraint, Limits, Space, limits, max_registers,
                                max_shared, max_threads, require)
from vitrail.tune.store import Record, RecordKey, TuningStore, bucket, problem_key
from vitrail.tune.tuner import Tunable, TuningError, compile_all, pick

__all__ = ["PickAny", "PickBest", "Policy", "Settings", "current", "settings", "set_defaults",
           "reset_defaults", "Config", "Constraint", "Limits", "Space", "limits", "max_threads",
           "max_shared", "max_registers", "require", "Record", "RecordKey", "TuningStore",
           "bucket", "problem_key", "Tunable", "TuningError", "compile_all", "pick"]
