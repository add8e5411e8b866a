#!/usr/bin/env python3
"""What an 8-byte exchange of send/recv costs through torch.distributed, and which threads
the scheduler ran for it: P ranks (CPU tensors, loom), rank r exchanging with rank r ^ 1 in
one batch_isend_irecv (as pipeline stages pass activations), N exchanges after a warm-up.
Prints rank 0's time per exchange and, per thread name, its voluntary (slept) and
involuntary (preempted or yielded) context switches per exchange, from /proc.

    OMP_WAIT_POLICY=PASSIVE python3 scripts/p2p_turns.py --ranks 2 --exchanges 5000
"""

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import loom  # noqa: F401  (registers the backend)


def switches() -> dict:
    """Voluntary and involuntary context switches of this process's threads, by name."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            fields = dict(line.split(":\t", 1) for line in open(f"/proc/self/task/{tid}/status")
                          if ":\t" in line)
        except OSError:  # the thread ended meanwhile
            continue
        counts = out.setdefault(name, [0, 0])
        counts[0] += int(fields["voluntary_ctxt_switches"])
        counts[1] += int(fields["nonvoluntary_ctxt_switches"])
    return out


def worker(rank: int, world: int, port: int, exchanges: int) -> None:
    dist.init_process_group("loom", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mine, theirs, peer = torch.ones(2), torch.empty(2), rank ^ 1

    def exchange() -> None:
        if peer >= world:
            return
        ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, theirs, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    for _ in range(500):
        exchange()
    dist.barrier()
    before = switches()
    start = time.perf_counter()
    for _ in range(exchanges):
        exchange()
    took = (time.perf_counter() - start) / exchanges * 1e6
    after = switches()
    if rank == 0:
        print(f"P={world}: {took:.1f} us per exchange (rank 0)")
        for name, counts in after.items():
            if name in before:
                vol, invol = ((counts[i] - before[name][i]) / exchanges for i in range(2))
                if vol + invol > 0.01:
                    print(f"  {name:16s} voluntary {vol:.2f}  involuntary {invol:.2f}  per exchange")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--exchanges", type=int, default=5000)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.ranks, port, args.exchanges), nprocs=args.ranks)


if __name__ == "__main__":
    main()
