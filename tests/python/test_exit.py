"""Python exiting with loom groups alive: the calls left pending end while loom's threads may
still take the GIL, exit handlers registered after `import loom` may still use their groups,
and every process exits cleanly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Each rank runs this as its own interpreter (multiprocessing's children never run exit
# handlers). The exit handler registered first runs last: it holds the GIL in C for 4 s, and
# the interpreter starts finalising the moment it returns, so a loom thread that waits for
# the GIL meanwhile (to free a tensor whose Python object it keeps alive) is ended by Python
# there, inside a destructor: the process aborted ("terminate called without an active
# exception"), as CI saw once in about 20 DeepSpeed ZeRO-3 runs.
SCRIPT = """
import atexit, ctypes, os, sys, threading, time
from datetime import timedelta
atexit.register(ctypes.PyDLL(None).sleep, 4)
rank, init, case = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def early_handler():
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as e:
        print("early handler:", e, flush=True)
if case == "early handler":
    atexit.register(early_handler)  # before importing loom: runs after loom's handler
import torch
import torch.distributed as dist
import loom
dist.init_process_group("loom", init_method=init, rank=rank, world_size=2,
                        timeout=timedelta(seconds=300))
t = torch.ones(1 << 16)
t.note = "Python state: the tensor keeps its Python object while loom holds it"
if case == "pending":
    if rank == 0:
        dist.all_reduce(t, async_op=True)  # neither waited for nor kept
        del t
    else:
        time.sleep(1.5)  # rank 0 is in its exit handlers by now
        dist.all_reduce(t)
        print(t[0].item(), flush=True)
elif case == "late handler":
    def last_words():
        dist.all_reduce(t)
        print(t[0].item(), flush=True)
        dist.destroy_process_group()
    atexit.register(last_words)
elif case == "daemon":
    if rank == 0:
        def heartbeat():  # a barrier rank 1 never joins
            try:
                dist.barrier()
            except Exception as e:
                print("daemon:", e, flush=True)
        threading.Thread(target=heartbeat, daemon=True).start()
        time.sleep(0.5)
    else:
        try:
            dist.recv(t, src=0)  # never sent
        except Exception as e:
            print("recv:", e, flush=True)
"""


@pytest.mark.parametrize("case", ["pending", "late handler", "daemon", "early handler"])
def test_python_exits_cleanly_with_loom_groups_alive(case, tmp_path):
    """pending: rank 0 leaves an all_reduce unwaited and exits while rank 1 is still to join
    it; rank 0 waits for it at exit and both exit 0 (rank 0 aborted before loom shut its groups
    down in an exit handler of its own). late handler: an exit handler registered after
    `import loom` runs an all_reduce and destroys the group; loom's handler runs after it.
    daemon: a daemon thread of rank 0 is in a barrier rank 1 never joins (rank 1 waits in a
    receive rank 0 never sends), with the group's timeout at 300 s: at exit rank 0 aborts the
    barrier after loom's grace (it waited out the group's timeout), saying why on stderr and to
    the daemon, and rank 1's receive fails naming rank 0. early handler: an exit handler
    registered before `import loom` finds the group shut down, and is told why."""
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    init = f"file://{tmp_path / 'init'}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), init, case], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outcomes = [p.communicate(timeout=120) for p in ranks]
    for r, (p, (out, err)) in enumerate(zip(ranks, outcomes)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{out}\n{err[-3000:]}"
        assert "terminate called" not in err, f"rank {r}:\n{err[-3000:]}"
    out = [o for o, _ in outcomes]
    if case == "pending":
        assert [o.split() for o in out] == [[], ["2.0"]], out
    elif case == "late handler":
        assert [o.split() for o in out] == [["2.0"], ["2.0"]], out
    elif case == "daemon":
        assert "calls of group 'default_pg' (rank 0) were still under way" in outcomes[0][1], outcomes[0][1]
        assert out[0].startswith("daemon: loom barrier (rank 0)") and "Python is exiting" in out[0], out[0]
        assert out[1].startswith("recv: loom recv (rank 1)") and "rank 0" in out[1], out[1]
    else:
        for o in out:
            assert o.startswith("early handler: loom all_reduce") and "Python is exiting" in o, o
