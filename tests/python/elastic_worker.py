"""A torchrun worker for test_faults.py: on the first attempt rank 1 is killed with SIGKILL
in the middle of its all_reduces; torchrun restarts every worker, and the second attempt
must run to the end on fresh loom groups."""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

import loom  # noqa: F401  (registers the backend)

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("loom")
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.ones(4)
for step in range(5):
    if attempt == 0 and rank == 1 and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(x)
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"attempt": attempt, "world": world, "x": x.tolist()}, f)
dist.destroy_process_group()
