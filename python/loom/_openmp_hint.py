"""A hint, logged once per machine, for ranks that share a machine's cores while torch's
OpenMP threads spin: GNU OpenMP keeps its threads spinning after every parallel region of a
torch op, and with several ranks per machine they hold the cores that the other ranks and
loom's own threads need (docs/PERFORMANCE.md, "Where loom falls short": 1 MiB all_reduce 4x
slower and a DDP step 1.6x slower on a 16-core host at P = 4). The wait policy is read when
torch loads its OpenMP library, so loom cannot change it after import; it can only say so."""

from __future__ import annotations

import logging
import os

import torch

_log = logging.getLogger("loom")
_hinted = False


def hint_wait_policy(group_rank: int, group_size: int) -> None:
    """Logs the hint once per process, on the machine's first rank (LOCAL_RANK 0, else group
    rank 0), if torch's OpenMP threads (more than one per rank) spin by default and several
    ranks share the machine. Setting OMP_WAIT_POLICY (to any value), GOMP_SPINCOUNT or
    KMP_BLOCKTIME silences it."""
    global _hinted
    if _hinted:
        return
    _hinted = True
    if any(name in os.environ for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")):
        return
    try:
        # Without a launcher that says (torchrun does), the group's ranks are taken to share
        # the machine.
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", group_size))
        first_here = int(os.environ.get("LOCAL_RANK", group_rank)) == 0
    except ValueError:
        return
    threads = torch.get_num_threads()
    if local_ranks < 2 or threads < 2 or not first_here:
        return
    if "OpenMP" not in torch.__config__.parallel_info():
        return
    _log.warning(
        "loom: %d ranks share this machine and torch runs %d OpenMP threads in each, which "
        "spin after every op (OMP_WAIT_POLICY is unset) and take the cores the other ranks "
        "and loom's threads need; start the ranks with OMP_WAIT_POLICY=PASSIVE in the "
        "environment (on a 16-core host at 4 ranks: 1 MiB all_reduce 4x faster, a DDP step "
        "1.6x faster; docs/PERFORMANCE.md). Setting OMP_WAIT_POLICY to any value silences "
        "this.", local_ranks, threads)
