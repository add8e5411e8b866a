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
import atexit, ctypes, sys, time
atexit.register(ctypes.PyDLL(None).sleep, 4)
import torch
import torch.distributed as dist
import loom
rank, init, case = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("loom", init_method=init, rank=rank, world_size=2)
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
else:
    def last_words():
        dist.all_reduce(t)
        print(t[0].item(), flush=True)
        dist.destroy_process_group()
    atexit.register(last_words)
"""


@pytest.mark.parametrize("case", ["pending", "handler"])
def test_python_exits_cleanly_with_loom_groups_alive(case, tmp_path):
    """pending: rank 0 leaves an all_reduce unwaited and exits while rank 1 is still to join
    it; rank 0 waits for it at exit and both exit 0 (rank 0 aborted before loom shut its groups
    down in an exit handler of its own). handler: an exit handler registered after `import
    loom` runs an all_reduce and destroys the group; loom's handler runs after it."""
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
    printed = [out.split() for out, _ in outcomes]
    assert printed == ([[], ["2.0"]] if case == "pending" else [["2.0"], ["2.0"]]), printed
