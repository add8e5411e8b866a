"""Runs PyTorch's backend-generic distributed suite (torch.testing._internal.distributed.
distributed_test, class _DistTestBase) with BACKEND=loom (or any backend BACKEND names).

    BACKEND=loom WORLD_SIZE=2 python -m pytest run_torch_suite.py::TestSuiteWithFork [-k name]

TestSuiteWithFork starts each test's ranks by forking the test process (seconds per test, as
the CPU-only suite allows); TestSuiteWithSpawn starts fresh interpreters, as PyTorch's own CI
does (several seconds more per test: each rank imports torch again).

The suite gates tests on hard-coded backend sets. This runner adds "loom" to the feature sets
loom has (plugin, ddp, subgroup, and gpu/cuda, whose GPU tests skip anyway on a CPU-only
host), lists loom in the profiler-event allowlists (loom records "loom:<op>" events), and
re-enables tests that are marked gloo-only although their bodies are backend-generic. Every
spawned rank re-imports this module, so `import loom` registers the backend everywhere.
"""

import os

os.environ.setdefault("BACKEND", "loom")
os.environ.setdefault("WORLD_SIZE", "2")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import loom  # noqa: E402,F401  (registers "loom")

assert dist.is_backend_available("loom")

# The suite reads these sets while defining its test class: patch them first.
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

for feature in ("plugin", "ddp", "subgroup", "gpu", "cuda"):
    DistTestCases.backend_feature.setdefault(feature, set()).add("loom")

import torch.testing._internal.distributed.distributed_test as suite  # noqa: E402
from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

for allowlist in (suite.PROFILING_SUPPORTED_BACKENDS, suite.CUDA_PROFILING_SUPPORTED_BACKENDS,
                  suite.SEND_RECV_PROFILING_SUPPORTED_BACKENDS):
    allowlist.append("loom")

# Marked "gloo only" in the suite, but nothing in their bodies depends on Gloo.
GLOO_MARKED_GENERIC = [
    "test_all_reduce_coalesced_sum", "test_all_reduce_coalesced_product",
    "test_all_reduce_coalesced_min", "test_all_reduce_coalesced_max",
    "test_all_reduce_coalesced_group_sum", "test_all_reduce_coalesced_group_product",
    "test_all_reduce_coalesced_group_min", "test_all_reduce_coalesced_group_max",
    "test_all_reduce_coalesced_full_group_sum", "test_all_reduce_coalesced_full_group_product",
    "test_all_reduce_coalesced_full_group_min", "test_all_reduce_coalesced_full_group_max",
    "test_scatter_object_list", "test_grads_same_across_ranks_with_no_sync",
    "test_batch_isend_irecv_gloo", "test_batch_isend_irecv_gloo_tags", "test_get_future",
    "test_sparse_all_reduce_sum",
    "test_barrier_timeout_full_group",
]
for name in GLOO_MARKED_GENERIC:
    test = getattr(DistributedTest._DistTestBase, name, None)
    if test is not None:
        test.__unittest_skip__ = False

torch.backends.cuda.matmul.allow_tf32 = False


class TestSuiteWithFork(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)


class TestSuiteWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
