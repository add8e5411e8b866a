"""Where a group bound to a GPU stops while torch makes its subgroups: P ranks on GPU 0 join
with init_process_group("cpu:loom,cuda:loom", device_id=...), then new_group, split_group and
(even P) init_device_mesh("cuda", (2, P // 2)), each step printed with its time, and every
rank's Python stack dumped after --watchdog seconds (faulthandler) if it has not finished.
At P = 4 on one H100 the mesh stopped inside torch's split_group (docs/perf/
cuda_options_copy_h100.txt, call 2), after split_group of the same halves had passed: the
mesh's second dimension pairs ranks that are in different earlier groups, torch names each
pair's child apart, and loom's ranks met by that name (fixed; tests/python/test_collectives.py,
test_groups_whose_members_name_them_apart_still_meet, shows it without a GPU).

    python3 tests/cuda/bound_groups_probe.py --ranks 4
"""

from __future__ import annotations

import argparse
import faulthandler
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import loom  # noqa: F401  (registers the backend)


def say(start: float, rank: int, what: str) -> None:
    print(f"[{time.time() - start:6.1f} s] rank {rank}: {what}", flush=True)


def worker(rank: int, world: int, port: int, start: float, watchdog: float) -> None:
    faulthandler.dump_traceback_later(watchdog, exit=True)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("cpu:loom,cuda:loom", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=30),
                            device_id=dev)
    say(start, rank, "init")
    x = torch.ones(4, device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    say(start, rank, "all_reduce")
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    say(start, rank, "new_group")
    if rank % 2 == 0:
        y = torch.ones(8, device=dev)
        dist.all_reduce(y, group=evens)
        torch.cuda.synchronize()
        say(start, rank, "all_reduce in new_group")
    split = dist.split_group(split_ranks=[list(range(0, world, 2)), list(range(1, world, 2))])
    say(start, rank, "split_group")
    y = torch.ones(8, device=dev)
    dist.all_reduce(y, group=split)
    torch.cuda.synchronize()
    say(start, rank, f"all_reduce in split_group: {y[0].item()}")
    if world % 2 == 0:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda", (2, world // 2))
        say(start, rank, "init_device_mesh")
        for dim in range(2):
            z = torch.ones(4, device=dev)
            dist.all_reduce(z, group=mesh.get_group(dim))
            torch.cuda.synchronize()
            say(start, rank, f"all_reduce over mesh dimension {dim}: {z[0].item()}")
    dist.barrier()
    say(start, rank, "barrier")
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--watchdog", type=float, default=35.0)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(args.ranks, port, time.time(), args.watchdog),
                       nprocs=args.ranks, start_method="fork")


if __name__ == "__main__":
    main()
