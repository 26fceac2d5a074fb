"""deterministic=True under torch.distributed: rank 0 chooses, every rank runs its choice.

Two real processes over the gloo backend on the CPU. Each rank has its own tuning store holding
a different record for the same problem, so left alone they would disagree."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

WORKER = textwrap.dedent('''
    import os, sys, json
    import torch.distributed as dist
    from vitrail.jit.toolchain import Arch
    from vitrail.tune import Config, Limits, Space, TuningStore, settings, PickAny, pick, tuner
    from vitrail.tune.store import Record
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    lim = Limits(arch=Arch(9, 0, "a"), max_threads_per_block=1024, max_shared_per_block=1 << 17,
                 shared_per_sm=1 << 17, registers_per_sm=65536, max_registers_per_thread=255,
                 max_cluster_size=8, sm_count=132, source="GPU Fake")
    t = tuner.Tunable("dist", Space({"B": [1, 2, 3]}, heuristic=lambda p, l: {"B": 1}),
                      lambda c: {}, "h")
    store = TuningStore(sys.argv[2])
    store.put(Record(tuner.record_key(t, "p", lim), Config([("B", 2 + rank)])))  # ranks differ
    with settings(policy=PickAny, deterministic=False):
        own = pick(t, "p", None, lim=lim, store=store).B
    with settings(policy=PickAny, deterministic=True):
        agreed = pick(t, "p", None, lim=lim, store=store).B
    print(json.dumps({"rank": rank, "own": own, "agreed": agreed}))
    dist.destroy_process_group()
''')


def test_rank0_chooses_for_every_rank(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(tmp_path / f"s{r}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=os.getcwd()) for r in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        results.append(__import__("json").loads(out.strip().splitlines()[-1]))
    assert [(r["rank"], r["own"]) for r in results] == [(0, 2), (1, 3)]  # left alone: differ
    assert [r["agreed"] for r in results] == [2, 2]  # deterministic: rank 0's choice everywhere
