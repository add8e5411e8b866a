"""LOOM_BIND=1: each rank of a host keeps to a block of the CPUs they share (the calling thread,
so torch's later threads too); unset, loom leaves every rank's CPUs alone."""

from __future__ import annotations

import os

import pytest

from harness import run_ranks


def cpus_and_sum(rank: int, world: int):
    import torch
    import torch.distributed as dist

    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    return sorted(os.sched_getaffinity(0)), t[0].item()


needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")


@needs_two_cpus
def test_bound_ranks_get_disjoint_blocks_of_the_shared_cpus():
    shared = sorted(os.sched_getaffinity(0))
    share = len(shared) // 2
    results = run_ranks(2, cpus_and_sum, env={"LOOM_BIND": "1", "LOOM_THREADS": "1"})
    assert [cpus for cpus, _ in results] == [shared[:share], shared[share:2 * share]]
    assert [total for _, total in results] == [3.0, 3.0]


@needs_two_cpus
def test_unbound_ranks_keep_their_cpus():
    shared = sorted(os.sched_getaffinity(0))
    results = run_ranks(2, cpus_and_sum, env={"LOOM_BIND": "0"})
    assert [cpus for cpus, _ in results] == [shared, shared]


@needs_two_cpus
def test_openmp_binding_leaves_ranks_alone():
    # OpenMP told to bind its threads: the user placed them, so loom does not split the CPUs
    # (OpenMP may have bound each rank's main thread itself, alike in both ranks).
    results = run_ranks(2, cpus_and_sum, env={"LOOM_BIND": "1", "LOOM_THREADS": "1",
                                              "OMP_PROC_BIND": "close"})
    assert results[0][0] == results[1][0]
