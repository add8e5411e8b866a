"""loom's CUDA path, checked on a GPU host: every collective x dtype x reduce op on CUDA
tensors against a reference computed on the CPU, with several ranks sharing one GPU (how
loom's GPU path runs on a one-GPU machine), PREMUL_SUM with a factor on the GPU (also
captured, and factors that differ by rank), a call's timeout of centuries, a coalescing block
with a refused operation inside a capture, split_group and a 2-D device mesh on a bound group,
plus send/recv and uneven all_to_all, streams,
staging, DDP/FSDP2/DTensor equivalence, compiled functional collectives, CUDA graph capture
and replay, mismatched calls (also a scatter's root against gathering non-roots), a rank
killed mid-collective (also during a replay), a rank that never issues a call (named in the
others' timeout), a rank that cannot set up its CUDA workspace and one whose LOOM_CUDA_*
settings differ (those failure parts are in check_failures.py), and barriers that settle the
GPU's work (check_barrier.py). Not part of scripts/test.sh (CI has no GPU): run by hand on
the device with scripts/cuda_check.sh, which records its output.

    python tests/cuda/check_cuda.py --ranks 2 3 4
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import os
import queue
import signal
import socket
import sys
import time
import traceback
import warnings
from datetime import timedelta

# Every rank computes its references on the CPU with torch's OpenMP threads, which spin
# between ops unless told otherwise: four ranks of 64 such threads on a 64-core host took
# the reductions part at P = 4 134 s, against 10 s with passive threads (calls 2 and 4 of
# docs/perf/cuda_vs_nccl_h200x4_0bd8b3c.txt). Set before torch starts its pool; the
# spawned ranks inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
from test_collectives import DTYPES, data, op_name, ops_for, reference  # noqa: E402

import loom  # noqa: E402,F401  (registers the backend)
from check_barrier import (barrier_in_capture, barrier_of_a_cpu_group,  # noqa: E402
                           barrier_settles, held_copy_back)
from check_common import LARGE, SIZES, same  # noqa: E402
from check_failures import (PART_ENV, destroyed_meanwhile, graph_killed,  # noqa: E402
                            graph_left, graph_left_p2p, factor_mismatch, left_p2p, left_rank,
                            killed_rank, late_rank, long_timeout, mismatch, refused_in_block,
                            rooted_mismatch, self_rooted, settings_differ, setup_refused,
                            stale_chunk, tag_mismatch, wrong_device)
from check_premul import premul_factors  # noqa: E402
from check_timing import timing  # noqa: E402

def mps_client() -> bool:
    """Whether this process's CUDA contexts go through NVIDIA's MPS, as the driver says
    (CU_DEVICE_ATTRIBUTE_MPS_ENABLED); False where it cannot say."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    device, value = ctypes.c_int(), ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(device), 0) != 0:
        return False
    return cuda.cuDeviceGetAttribute(ctypes.byref(value), 133, device) == 0 and value.value == 1


def fused_transfers() -> bool:
    """Whether loom moves this job's sends and receives with its fused kernels: a GPU per rank,
    LOOM_CUDA_FUSED=1, or (unset) every rank an MPS client, as every rank here is alike (for
    the ranks this script runs: from 13 ranks on one H200 under MPS, transfers take the steps,
    CudaPaths::fusedTransfers)."""
    fused = os.environ.get("LOOM_CUDA_FUSED")
    if fused is not None:
        return fused == "1"
    return bool(os.environ.get("LOOM_CHECK_GPU_PER_RANK")) or mps_client()


def reductions(rank: int, world: int, dev: torch.device, dtypes) -> int:
    checks = 0
    salt = 0
    for dtype in dtypes:
        for op in ops_for(dtype):
            sizes = SIZES + [LARGE] if dtype == torch.float32 and op_name(op) == "SUM" else SIZES
            for n in sizes:
                salt += 1
                what = f"{dtype} {op_name(op)} n={n}"
                inputs = [data(r, n, dtype, salt) for r in range(world)]
                want = reference(inputs, op, dtype)
                t = inputs[rank].to(dev)
                dist.all_reduce(t, op=op)
                same(t, want, "all_reduce " + what)
                t = inputs[rank].to(dev)
                dist.reduce(t, dst=world - 1, op=op)
                if rank == world - 1:
                    same(t, want, "reduce " + what)
                if dtype.is_complex:
                    checks += 2
                    continue
                # reduce_scatter: block r of world blocks of n elements
                blocks = [data(r, n * world, dtype, salt + 7) for r in range(world)]
                full = reference(blocks, op, dtype)
                out = torch.empty(n, dtype=dtype, device=dev)
                dist.reduce_scatter_tensor(out, blocks[rank].to(dev), op=op)
                same(out, full[rank * n:(rank + 1) * n], "reduce_scatter_tensor " + what)
                # In place, as FSDP2 may call it: the output is this rank's block of the input.
                inp = blocks[rank].to(dev)
                dist.reduce_scatter_tensor(inp[rank * n:(rank + 1) * n], inp, op=op)
                same(inp[rank * n:(rank + 1) * n], full[rank * n:(rank + 1) * n],
                     "in-place reduce_scatter_tensor " + what)
                outs = torch.empty(n, dtype=dtype, device=dev)
                dist.reduce_scatter(outs, list(blocks[rank].to(dev).chunk(world)) if n else
                                    [torch.empty(0, dtype=dtype, device=dev)] * world, op=op)
                same(outs, full[rank * n:(rank + 1) * n], "reduce_scatter " + what)
                checks += 5
    return checks


def movement(rank: int, world: int, dev: torch.device, dtypes) -> int:
    checks = 0
    for dtype in dtypes:
        for n in SIZES + ([LARGE] if dtype == torch.float32 else []):
            what = f"{dtype} n={n}"
            mine = data(rank, n, dtype, 99).to(dev)
            everyone = [data(r, n, dtype, 99) for r in range(world)]
            root = 1 % world
            t = mine.clone()
            dist.broadcast(t, src=root)
            same(t, everyone[root], "broadcast " + what)
            out = torch.empty(n * world, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(out, mine)
            same(out, torch.cat(everyone), "all_gather_into_tensor " + what)
            outs = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)]
            dist.all_gather(outs, mine)
            for q in range(world):
                same(outs[q], everyone[q], f"all_gather[{q}] " + what)
            # all_to_all: block q of rank r is data(r, ..., salt q)
            blocks = [torch.cat([data(r, n, dtype, 200 + q) for q in range(world)]) for r in range(world)]
            got = torch.empty(n * world, dtype=dtype, device=dev)
            dist.all_to_all_single(got, blocks[rank].to(dev))
            same(got, torch.cat([blocks[q][rank * n:(rank + 1) * n] for q in range(world)]),
                 "all_to_all_single " + what)
            both = blocks[rank].to(dev)  # in place: output and input are one tensor
            dist.all_to_all_single(both, both)
            same(both, torch.cat([blocks[q][rank * n:(rank + 1) * n] for q in range(world)]),
                 "in-place all_to_all_single " + what)
            ins = list(blocks[rank].to(dev).chunk(world)) if n else [torch.empty(0, dtype=dtype, device=dev)] * world
            outl = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)]
            dist.all_to_all(outl, ins)
            for q in range(world):
                same(outl[q], blocks[q][rank * n:(rank + 1) * n], f"all_to_all[{q}] " + what)
            gathered = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)] if rank == root else None
            dist.gather(mine, gathered, dst=root)
            if rank == root:
                for q in range(world):
                    same(gathered[q], everyone[q], f"gather[{q}] " + what)
            piece = torch.empty(n, dtype=dtype, device=dev)
            dist.scatter(piece, [e.to(dev) for e in everyone] if rank == root else None, src=root)
            same(piece, everyone[rank], "scatter " + what)
            checks += 9
    return checks


def streams_and_staging(rank: int, world: int, dev: torch.device, dtypes) -> int:
    # Produced and consumed on a side stream, asynchronously: the collective must follow
    # the producer and precede the consumer without any host synchronisation.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.full((1 << 20,), float(rank + 1), device=dev)
        torch.cuda._sleep(20_000_000)  # keeps the producer busy, so a missed wait shows
        x.mul_(2)
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        y = x * 1
    side.synchronize()
    want = 2.0 * world * (world + 1) / 2
    assert torch.all(y == want).item(), f"stream order: got {y[:4].tolist()}, want {want}"
    # The CUDA path's monitor (it settles Works and releases waits on failure) is named, so
    # a user reading top -H or a debugger's thread list can tell it from torch's threads.
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    assert "loom-cuda-mon" in names, f"no thread named loom-cuda-mon among {sorted(set(names))}"
    # synchronize() blocks the host until the GPU has run the collective.
    z = torch.ones(1 << 20, device=dev)
    torch.cuda._sleep(20_000_000)
    w = dist.all_reduce(z, async_op=True)
    w.synchronize()
    assert w.is_completed(), "synchronize() returned before the GPU ran the all_reduce"
    same(z[:4], torch.full((4,), float(world)), "all_reduce after synchronize()")
    # Calls run in the order issued whatever their streams: an asynchronous call (on the
    # loom stream) held back by a busy caller stream, then a blocking call on a side stream
    # (blocking calls run on the caller's stream), which must not overtake it.
    a = torch.full((LARGE,), float(rank + 1), device=dev)
    torch.cuda._sleep(20_000_000)
    pending = dist.all_reduce(a, async_op=True)
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        b = torch.full((1000,), float(rank + 2), device=dev)
        dist.all_reduce(b)
        b2 = b * 1
    pending.wait()
    torch.cuda.synchronize()
    same(a[-4:], torch.full((4,), world * (world + 1) / 2), "an async call before a blocking one")
    same(b2[:4], torch.full((4,), world * (world + 3) / 2), "a blocking call on another stream")
    # Non-contiguous tensors are staged, and copied back on the loom stream.
    m = torch.arange(12, dtype=torch.float32, device=dev).reshape(3, 4).t() * (rank + 1)
    dist.all_reduce(m)
    want_m = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * (world * (world + 1) / 2)
    same(m, want_m, "all_reduce of a transposed tensor")
    # The future completes with the outputs, usable after the loom stream.
    f = dist.all_reduce(torch.ones(8, device=dev), async_op=True).get_future()
    got = f.then(lambda fut: fut.value()[0] * 2).wait()
    same(got, torch.full((8,), 2.0 * world), "future chained on a CUDA all_reduce")
    # A future asked for late, after a later call on the loom stream, holds this call's
    # result (its events mark this call's end, made when it is first asked for).
    c = torch.full((LARGE,), float(rank + 1), device=dev)
    torch.cuda._sleep(20_000_000)
    late = dist.all_reduce(c, async_op=True)
    dist.all_reduce(torch.ones(8, device=dev), async_op=True)
    got = late.get_future().then(lambda fut: fut.value()[0][-4:] * 1).wait()
    same(got, torch.full((4,), world * (world + 1) / 2), "a future asked for after a later call")
    # Work.block_current_stream() makes the caller's current stream wait for the collective
    # (queued behind a busy current stream, so a missed wait shows).
    d = torch.full((LARGE,), float(rank + 1), device=dev)
    torch.cuda._sleep(20_000_000)
    w = dist.all_reduce(d, async_op=True)
    w.block_current_stream()
    d2 = d * 2
    torch.cuda.synchronize()
    same(d2[-4:], torch.full((4,), float(world * (world + 1))), "after block_current_stream()")
    # wait(timeout) blocks the host until the GPU is past the call, as NCCL's does (behind a
    # busy stream, so a wait that returned early would leave the result unfinished).
    e = torch.full((LARGE,), float(rank + 1), device=dev)
    torch.cuda._sleep(20_000_000)
    w = dist.all_reduce(e, async_op=True)
    assert w.wait(timeout=timedelta(seconds=60)) and w.is_completed(), "wait(timeout) returned early"
    same(e[-4:], torch.full((4,), world * (world + 1) / 2), "after wait(timeout)")
    # A coalesced block of all_reduces may mix dtypes (one all_reduce per dtype), as NCCL's.
    mixed = [torch.full((3,), float(rank + 1), device=dev),
             torch.full((2, 2), float(rank + 1), dtype=torch.float64, device=dev),
             torch.full((5,), rank + 1, dtype=torch.int32, device=dev)]
    with dist._coalescing_manager(device=dev, async_ops=True) as manager:
        for t in mixed:
            dist.all_reduce(t)
    manager.wait()
    torch.cuda.synchronize()
    for t in mixed:
        same(t.flatten()[:2], torch.full((2,), world * (world + 1) / 2).to(t.dtype), f"coalesced {t.dtype}")
    # all_gather_coalesced's future holds one list per rank, as on CPU.
    outs = [[torch.empty(2, device=dev), torch.empty(3, device=dev)] for _ in range(world)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated, not gone
        fut = dist.all_gather_coalesced(outs, [torch.full((2,), float(rank), device=dev),
                                               torch.full((3,), float(rank), device=dev)], async_op=True)
    value = fut.wait()
    assert len(value) == world and all(len(v) == 2 for v in value), [len(v) for v in value]
    # Mixed CPU and CUDA tensors are refused with a clear error.
    try:
        dist.all_gather([torch.empty(4) for _ in range(world)], torch.ones(4, device=dev))
        raise AssertionError("mixing devices was accepted")
    except (RuntimeError, ValueError) as e:
        assert "one device" in str(e), e
    return 10


def small_model(dev=None) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    return model if dev is None else model.to(dev)


def train_against_reference(rank: int, world: int, dev: torch.device, build, full_tensor) -> None:
    """Three SGD steps of a small model, distributed as `build(model)` makes it (each rank on
    its slice of the batch), against the same steps in this process on the whole batch: the
    parameters (`full_tensor(p)` gathers a sharded one) must agree."""
    torch.manual_seed(0)
    model = small_model(dev)
    reference_model = small_model()
    reference_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    wrapped = build(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference_model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        batch = torch.randn(world * 8, 32, generator=g)
        target = torch.randn(world * 8, 4, generator=g)
        mine = slice(rank * 8, (rank + 1) * 8)
        opt.zero_grad()
        torch.nn.functional.mse_loss(wrapped(batch[mine].to(dev)), target[mine].to(dev)).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference_model(batch), target).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), reference_model.parameters()):
        torch.testing.assert_close(full_tensor(p).detach().cpu(), q.detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"parameter {name}: {m}")


def ddp(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """DDP (bucketed asynchronous all_reduce on CUDA) against a single-process reference."""
    train_against_reference(
        rank, world, dev,
        lambda model: torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index]),
        lambda p: p)
    return 1


def fsdp2(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """FSDP2 (all_gather_into_tensor, reduce_scatter_tensor on CUDA) against a
    single-process reference on the whole batch; functional collectives too."""
    from torch.distributed.fsdp import fully_shard
    import torch.distributed._functional_collectives as funcol

    def shard(model):
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        return fully_shard(model)

    train_against_reference(rank, world, dev, shard, lambda p: p.full_tensor())
    x = torch.full((1000,), float(rank + 1), device=dev)
    y = funcol.all_reduce(x, "sum", dist.group.WORLD)
    same(y, torch.full((1000,), world * (world + 1) / 2), "functional all_reduce")
    z = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
    same(z, torch.cat([torch.full((1000,), float(r + 1)) for r in range(world)]), "functional all_gather")
    return 3


def device_bound(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """A group bound to its GPU (init_process_group(device_id=...), "cpu:loom,cuda:loom" as
    set up by worker()): CUDA and CPU tensors in one group, and a subgroup split from it."""
    x = torch.full((4,), float(rank), device=dev)
    dist.all_reduce(x)
    c = torch.full((4,), float(rank))
    dist.all_reduce(c)
    same(x, c, "cuda and cpu all_reduce in one group")
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    if rank % 2 == 0:
        y = torch.ones(8, device=dev)
        dist.all_reduce(y, group=evens)
        same(y, torch.full((8,), float((world + 1) // 2)), "all_reduce in a subgroup")
    # split_group deep-copies the parent's backend options (torch's base type of them cannot
    # be copied), and so does a device mesh of two dimensions on a group bound to a GPU.
    halves = [list(range(0, world, 2)), list(range(1, world, 2))]
    split = dist.split_group(split_ranks=halves)
    y = torch.ones(8, device=dev)
    dist.all_reduce(y, group=split)
    same(y, torch.full((8,), float(len(halves[rank % 2]))), "all_reduce in a split_group")
    checks = 3
    if world % 2 == 0:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cuda", (2, world // 2))
        for dim in range(2):
            z = torch.ones(4, device=dev)
            dist.all_reduce(z, group=mesh.get_group(dim))
            same(z, torch.full((4,), float(mesh.size(dim))), f"all_reduce over mesh dimension {dim}")
            checks += 1
    dist.barrier()
    return checks


def point_to_point(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """send/recv with tags (small, and large enough to take many mailbox chunks), a ring of
    batched isend/irecv (which deadlocks unless the sends and receives progress together),
    a non-contiguous receive, all_to_all_single with uneven split sizes, bytes at odd
    offsets, many messages to and from every peer in one group, a fan-out and fan-in in one
    group (the fused kernel's two ends of a pair on different grids), and (fused) the largest
    group refused by name."""
    checks = 0
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for dtype in [torch.float32, torch.bfloat16, torch.int64, torch.uint8]:
        for n in [0, 1, 1000, LARGE]:
            what = f"{dtype} n={n}"
            # Rank 0 sends two messages with different tags to rank 1, which receives them
            # in issue order; everyone else passes one along the ring.
            if rank == 0 and world > 1:
                dist.send(data(0, n, dtype, 1).to(dev), dst=1, tag=5)
                dist.send(data(0, n, dtype, 2).to(dev), dst=1, tag=6)
            elif rank == 1:
                a = torch.empty(n, dtype=dtype, device=dev)
                b = torch.empty(n, dtype=dtype, device=dev)
                dist.recv(a, src=0, tag=5)
                dist.recv(b, src=0, tag=6)
                same(a, data(0, n, dtype, 1), "recv tag 5 " + what)
                same(b, data(0, n, dtype, 2), "recv tag 6 " + what)
                checks += 2
            got = torch.empty(n, dtype=dtype, device=dev)
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, data(rank, n, dtype, 3).to(dev), nxt),
                dist.P2POp(dist.irecv, got, prv)])
            for w in works:
                w.wait()
            same(got, data(prv, n, dtype, 3), "ring isend/irecv " + what)
            checks += 1
    # A non-contiguous receive in a batch is staged and copied back after the transfer.
    m = torch.empty(4, 6, device=dev).t()
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, torch.arange(24, dtype=torch.float32, device=dev).reshape(6, 4) + rank, nxt),
        dist.P2POp(dist.irecv, m, prv)])
    for w in works:
        w.wait()
    same(m, torch.arange(24, dtype=torch.float32).reshape(6, 4) + prv, "transposed irecv")
    checks += 1
    # Uneven all_to_all_single: rank r sends (r + q) * k rows to rank q, some of them
    # empty, and blocks large enough to span several chunks.
    for k in [0, 3, 700_000]:
        send_splits = [((rank + q) % 3) * k for q in range(world)]
        recv_splits = [((q + rank) % 3) * k for q in range(world)]
        payload = torch.cat([torch.full((send_splits[q],), float(rank * 100 + q)) for q in range(world)])
        out = torch.empty(sum(recv_splits), device=dev)
        dist.all_to_all_single(out, payload.to(dev), recv_splits, send_splits)
        want = torch.cat([torch.full((recv_splits[q],), float(q * 100 + rank)) for q in range(world)])
        same(out, want, f"uneven all_to_all_single k={k}")
        checks += 1
    # Bytes at odd offsets (no 16-byte vectors), in a message of several chunks with a short
    # last one: ring isend/irecv of 5,000,003 bytes from offset 3 into offset 5.
    n = 5_000_003
    src = torch.zeros(n + 3, dtype=torch.uint8, device=dev)
    src[3:] = data(rank, n, torch.uint8, 4).to(dev)
    dst = torch.full((n + 5,), 255, dtype=torch.uint8, device=dev)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, src[3:], nxt),
                                    dist.P2POp(dist.irecv, dst[5:], prv)])
    for w in works:
        w.wait()
    same(dst[5:], data(prv, n, torch.uint8, 4), "unaligned ring isend/irecv")
    same(dst[:5], torch.full((5,), 255, dtype=torch.uint8), "bytes before an unaligned irecv")
    checks += 1
    # Many messages of many sizes to and from every peer in one group, matched in issue order.
    count = 40
    sizes = [[(i * 7919 + (r + q) * 104_729) % 300_000 for i in range(count)]
             for r in range(world) for q in range(world)]  # sizes[r * world + q]: r to q
    ops, expected = [], []
    for q in range(world):
        if q == rank:
            continue
        for i in range(count):
            ops.append(dist.P2POp(dist.isend, data(rank * world + q, sizes[rank * world + q][i],
                                                   torch.float32, i).to(dev), q))
            got = torch.empty(sizes[q * world + rank][i], device=dev)
            ops.append(dist.P2POp(dist.irecv, got, q))
            expected.append((got, data(q * world + rank, sizes[q * world + rank][i], torch.float32, i),
                             f"message {i} from {q}"))
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    for got, want, what in expected:
        same(got, want, what)
    checks += 1
    # A fan-out and fan-in in one group: rank 0 trades a message of several chunks with every
    # peer, each peer with rank 0 only. Where the fused transfer runs, rank 0 runs fewer
    # blocks per peer than its peers do (its grid has more streams to share), so the two ends
    # of each pair cut the same chunks among different numbers of blocks.
    n = 5_000_003
    if rank == 0:
        ops, expected = [], []
        for q in range(1, world):
            ops.append(dist.P2POp(dist.isend, data(q, n, torch.float32, 10).to(dev), q))
            got = torch.empty(n, device=dev)
            ops.append(dist.P2POp(dist.irecv, got, q))
            expected.append((got, q))
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        for got, q in expected:
            same(got, data(world + q, n, torch.float32, 10), f"fan-in from {q}")
        checks += world - 1
    else:
        got = torch.empty(n, device=dev)
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, 0),
                                        dist.P2POp(dist.isend, data(world + rank, n, torch.float32, 10).to(dev), 0)])
        for w in works:
            w.wait()
        same(got, data(rank, n, torch.float32, 10), "fan-out from 0")
        checks += 1
    # Where sends and receives run as fused kernels, one group moves at most 4096 messages: a
    # larger one is refused on every rank that issues it, before anything is queued.
    if fused_transfers():
        empty = torch.empty(0, device=dev)
        try:
            dist.batch_isend_irecv([dist.P2POp(dist.isend if i % 2 else dist.irecv, empty, nxt if i % 2 else prv)
                                    for i in range(4098)])
            raise AssertionError("a group of 4098 sends and receives was accepted")
        except RuntimeError as e:
            assert "split it into several groups" in str(e), e
        got = torch.empty(1000, device=dev)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, data(rank, 1000, torch.float32, 9).to(dev), nxt),
                                        dist.P2POp(dist.irecv, got, prv)])
        for w in works:
            w.wait()
        same(got, data(prv, 1000, torch.float32, 9), "ring isend/irecv after a refused group")
        checks += 1
    # recv from any source cannot be queued on the GPU: a clear error.
    try:
        dist.recv(torch.empty(4, device=dev))
        raise AssertionError("recv from any source on CUDA was accepted")
    except RuntimeError as e:
        assert "any source" in str(e), e
    dist.barrier()
    return checks + 1


def dtensor(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """DTensor and tensor parallelism on a CUDA DeviceMesh (several ranks on one GPU: the
    mesh is made from the group, not one device per rank), and compiled functional
    collectives, against single-process references."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    import torch.distributed._functional_collectives as funcol

    mesh = DeviceMesh("cuda", list(range(world)))
    full = torch.arange(world * 6 * 5, dtype=torch.float32).reshape(world * 6, 5)
    d = distribute_tensor(full.to(dev), mesh, [Shard(0)])
    same(d.redistribute(mesh, [Replicate()]).to_local(), full, "DTensor Shard(0) -> Replicate")
    same((d.sum(dim=0)).full_tensor(), full.sum(dim=0), "DTensor partial sum -> Replicate")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8 * world), torch.nn.ReLU(),
                                torch.nn.Linear(8 * world, 4)).to(dev)
    reference_model = torch.nn.Sequential(torch.nn.Linear(16, 8 * world), torch.nn.ReLU(),
                                          torch.nn.Linear(8 * world, 4))
    reference_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(model(x.to(dev)).cpu(), reference_model(x), rtol=1e-4, atol=1e-5)

    def step(t):
        return funcol.all_reduce(t * 2, "sum", dist.group.WORLD) + 1

    compiled = torch.compile(step, fullgraph=True)
    t = torch.full((1000,), float(rank + 1), device=dev)
    same(compiled(t), torch.full((1000,), 2.0 * world * (world + 1) / 2 + 1), "compiled all_reduce")
    return 4


def graphs(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """Collectives captured in CUDA graphs and replayed with new inputs each time: calls of
    one and of several steps, two graphs replayed in turn, send/recv and uneven all_to_all,
    eager calls between the replays (they run in a lane of their own), and a captured call
    whose work's future was asked."""
    n_large = LARGE  # float32: two steps of the default chunk
    big = torch.zeros(n_large, device=dev)
    small = torch.zeros(1000, dtype=torch.int32, device=dev)
    piece = torch.zeros(300, device=dev)
    gathered = torch.empty(world * 300, device=dev)
    scatter_in = torch.zeros(world * 500, dtype=torch.bfloat16, device=dev)
    scatter_out = torch.empty(500, dtype=torch.bfloat16, device=dev)
    root_data = torch.zeros(777, dtype=torch.float16, device=dev)
    # Warm up on a side stream, as torch's CUDA graph notes ask.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dist.all_reduce(torch.ones(8, device=dev))
    torch.cuda.current_stream().wait_stream(side)
    first, second = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(first):
        dist.all_reduce(big)
        dist.all_reduce(small, op=dist.ReduceOp.MAX)  # one step: the device epoch is padded
        dist.all_gather_into_tensor(gathered, piece)
    with torch.cuda.graph(second):
        dist.reduce_scatter_tensor(scatter_out, scatter_in)
        dist.broadcast(root_data, src=world - 1)
    checks = 0
    for replay in range(4):
        salt = 100 * replay
        everyone = [data(r, n_large, torch.float32, salt + 1) for r in range(world)]
        ints = [data(r, 1000, torch.int32, salt + 2) for r in range(world)]
        pieces = [data(r, 300, torch.float32, salt + 3) for r in range(world)]
        big.copy_(everyone[rank])
        small.copy_(ints[rank])
        piece.copy_(pieces[rank])
        first.replay()
        eager = torch.full((5,), float(rank + replay), device=dev)
        dist.all_reduce(eager)  # between replays, in the eager lane
        same(big, reference(everyone, dist.ReduceOp.SUM, torch.float32), f"replay {replay} all_reduce")
        same(small, reference(ints, dist.ReduceOp.MAX, torch.int32), f"replay {replay} all_reduce MAX")
        same(gathered, torch.cat(pieces), f"replay {replay} all_gather_into_tensor")
        same(eager, torch.full((5,), float(sum(range(world)) + world * replay)), "eager between replays")
        blocks = [data(r, world * 500, torch.bfloat16, salt + 4) for r in range(world)]
        scatter_in.copy_(blocks[rank])
        root_data.copy_(data(world - 1, 777, torch.float16, salt + 5))
        second.replay()
        want = reference([b[rank * 500:(rank + 1) * 500] for b in blocks], dist.ReduceOp.SUM,
                         torch.bfloat16)
        same(scatter_out, want, f"replay {replay} reduce_scatter_tensor")
        same(root_data, data(world - 1, 777, torch.float16, salt + 5), f"replay {replay} broadcast")
        checks += 6
    # Send/recv and all_to_all with split sizes, captured too: a ring exchange through
    # batch_isend_irecv (several mailbox chunks with a small chunk size) and uneven blocks,
    # with an eager exchange between the replays (their chunks are counted apart).
    right, left = (rank + 1) % world, (rank - 1) % world
    outgoing = torch.zeros(10_000, device=dev)
    incoming = torch.empty(10_000, device=dev)
    splits_in = [r + 1 + rank for r in range(world)]  # what this rank sends to r
    splits_out = [rank + 1 + r for r in range(world)]  # what r sends to this rank
    a2a_in = torch.zeros(sum(splits_in), device=dev)
    a2a_out = torch.empty(sum(splits_out), device=dev)

    def ring(send: torch.Tensor, recv: torch.Tensor) -> None:
        ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    third = torch.cuda.CUDAGraph()
    with torch.cuda.graph(third):
        ring(outgoing, incoming)
        dist.all_to_all_single(a2a_out, a2a_in, splits_out, splits_in)
    for replay in range(3):
        outgoing.copy_(data(rank, 10_000, torch.float32, 500 + replay))
        a2a_in.copy_(torch.cat([torch.full((splits_in[r],), float(100 * rank + r + replay))
                                for r in range(world)]))
        third.replay()
        eager_in = torch.empty(7, device=dev)
        ring(torch.full((7,), float(rank + replay), device=dev), eager_in)
        same(incoming, data(left, 10_000, torch.float32, 500 + replay), f"replay {replay} ring")
        want = torch.cat([torch.full((splits_out[r],), float(100 * r + rank + replay))
                          for r in range(world)])
        same(a2a_out, want, f"replay {replay} all_to_all_single with splits")
        same(eager_in, torch.full((7,), float(left + replay)), "eager exchange between replays")
        checks += 3
    # Inside one capture, an asynchronous call (loom stream) then a blocking one (the
    # capturing stream): the second must follow the first at every replay.
    early = torch.zeros(LARGE, device=dev)
    late = torch.zeros(300, device=dev)
    fourth = torch.cuda.CUDAGraph()
    with torch.cuda.graph(fourth):
        pending = dist.all_reduce(early, async_op=True)
        dist.all_reduce(late)
        pending.wait()
    for replay in range(3):
        early.fill_(float(rank + replay))
        late.fill_(float(2 * rank + replay))
        fourth.replay()
        same(early[-4:], torch.full((4,), float(sum(range(world)) + world * replay)),
             f"replay {replay}: an async call captured before a blocking one")
        same(late[:4], torch.full((4,), float(2 * sum(range(world)) + world * replay)),
             f"replay {replay}: the blocking call after it")
        checks += 2
    # A future asked of a captured call's work (DDP's comm hooks ask one): the capture still
    # ends (a stream it completes on must be joined back), and the replays are right.
    hooked = torch.zeros(LARGE, device=dev)
    fifth = torch.cuda.CUDAGraph()
    with torch.cuda.graph(fifth):
        work = dist.all_reduce(hooked, async_op=True)
        future = work.get_future()
        work.wait()
    for replay in range(2):
        hooked.fill_(float(rank + replay))
        fifth.replay()
        same(hooked[-4:], torch.full((4,), float(sum(range(world)) + world * replay)),
             f"replay {replay}: a captured call whose future was asked")
        checks += 1
    del future
    dist.all_reduce(torch.ones(4, device=dev))  # the group still works
    return checks


def direct_ops(rank: int, world: int, dev: torch.device, dtypes) -> int:
    """torch.ops.loom.* and loom.ops.* (its eager functions) on CUDA tensors (they take the
    group's c10d path on the caller's stream): each equal to the torch.distributed call,
    ordered after a kernel of the caller's, the *_out forms into the caller's tensors, and
    traced by torch.compile."""
    import loom.ops

    name = dist.group.WORLD.group_name
    checks = 0
    for ops in (torch.ops.loom, loom.ops):
        entry = "torch.ops.loom" if ops is torch.ops.loom else "loom.ops"
        for dtype in dtypes:
            x = (torch.arange(1000, device=dev) % 7 + rank).to(dtype)
            want = x.clone()
            dist.all_reduce(want)
            got = torch.empty_like(x)
            got.copy_(x)  # a kernel of the caller's just before the call, on its stream
            ops.all_reduce_(got, "sum", name)
            same(got, want.cpu(), f"{entry}.all_reduce_ {dtype}")
            same(ops.all_reduce(x, "sum", name), want.cpu(), f"{entry}.all_reduce {dtype}")
            checks += 2
        x = torch.full((6, 2), float(rank), device=dev)
        t = x.clone()
        ops.broadcast_(t, world - 1, name)
        same(t, torch.full((6, 2), float(world - 1)), f"{entry}.broadcast_")
        gathered = torch.cat([torch.full((6, 2), float(q)) for q in range(world)])
        g = ops.all_gather_into_tensor(x, world, name)
        same(g, gathered, f"{entry}.all_gather_into_tensor")
        r = ops.reduce_scatter_tensor(g, "sum", world, name)
        same(r, gathered.chunk(world)[rank] * world, f"{entry}.reduce_scatter_tensor")
        a = ops.all_to_all_single(g, [], [], name)
        same(a, torch.full((6 * world, 2), float(rank)), f"{entry}.all_to_all_single")
        out = torch.full((6 * world, 2), -1.0, device=dev)
        ops.all_gather_into_tensor_out(x, world, name, out=out)
        same(out, gathered, f"{entry}.all_gather_into_tensor_out")
        part = torch.full((6, 2), -1.0, device=dev)
        ops.reduce_scatter_tensor_out(out, "sum", world, name, out=part)
        same(part, gathered.chunk(world)[rank] * world, f"{entry}.reduce_scatter_tensor_out")
        ops.all_to_all_single_out(g, [], [], name, out=out)
        same(out, torch.full((6 * world, 2), float(rank)), f"{entry}.all_to_all_single_out")
        checks += 8

        def step(v, ops=ops):
            y = v * 2
            ops.all_reduce_(y, "sum", name)
            return y + 1

        compiled = torch.compile(step, fullgraph=True)
        v = torch.full((100,), float(rank + 1), device=dev)
        same(compiled(v), torch.full((100,), 2.0 * world * (world + 1) / 2 + 1), f"compiled {entry}.all_reduce_")
        checks += 1
    return checks


def worker(rank: int, world: int, port: int, part: str, dtypes, results) -> None:
    faulthandler.enable()  # a crash prints its Python stack (the parent names the rank)
    # Every rank on GPU 0 (how a one-GPU host runs several ranks), or each on its own.
    dev = torch.device("cuda", rank if os.environ.get("LOOM_CHECK_GPU_PER_RANK") else 0)
    torch.cuda.set_device(dev)
    os.environ.update(PART_ENV.get(part, lambda r, w: {})(rank, world))
    # Bound to the GPU (eager set-up of the CUDA workspaces): the first CUDA call of p2p is
    # a send between two ranks, which must not wait for the others.
    bound = part in ("device_bound", "p2p", "tag_mismatch", "stale_chunk", "refused_in_block",
                     "wrong_device", "barrier_settles", "barrier_of_a_cpu_group", "held_copy_back")
    dist.init_process_group("cpu:loom,cuda:loom" if bound else "loom",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=60),
                            device_id=dev if bound else None)
    try:
        n = {"reductions": reductions, "premul": premul_factors, "long_timeout": long_timeout,
             "refused_in_block": refused_in_block, "movement": movement, "streams": streams_and_staging,
             "ddp": ddp, "fsdp2": fsdp2, "device_bound": device_bound, "p2p": point_to_point,
             "mismatch": mismatch, "tag_mismatch": tag_mismatch, "stale_chunk": stale_chunk,
             "dtensor": dtensor,
             "killed": killed_rank, "graphs": graphs, "graph_killed": graph_killed,
             "left": left_rank, "left_p2p": left_p2p, "graph_left": graph_left,
             "graph_left_p2p": graph_left_p2p,
             "destroyed_meanwhile": destroyed_meanwhile,
             "direct": direct_ops, "setup_refused": setup_refused,
             "rooted_mismatch": rooted_mismatch, "settings_differ": settings_differ,
             "factor_mismatch": lambda *a: factor_mismatch(*a[:3], on_device=False),
             "device_factor_mismatch": lambda *a: factor_mismatch(*a[:3], on_device=True),
             "late_rank": lambda *a: late_rank(*a[:3]),
             "late_root": lambda *a: late_rank(*a[:3], "broadcast"),
             "late_scatter_root": lambda *a: late_rank(*a[:3], "scatter"),
             "self_rooted_broadcast": lambda *a: self_rooted(*a[:3], "broadcast"),
             "self_rooted_scatter": lambda *a: self_rooted(*a[:3], "scatter"),
             "timing": timing, "wrong_device": wrong_device, "barrier_settles": barrier_settles,
             "barrier_settles_unbound": barrier_settles, "barrier_in_capture": barrier_in_capture,
             "barrier_of_a_cpu_group": barrier_of_a_cpu_group, "held_copy_back": held_copy_back,
             }[part](rank, world, dev, dtypes)
        torch.cuda.synchronize()
        results.put((rank, part, n, None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, part, 0, traceback.format_exc()))
    if part not in ("killed", "graph_killed", "left", "left_p2p", "graph_left", "graph_left_p2p",
                    "mismatch", "tag_mismatch", "stale_chunk", "setup_refused",
                    "factor_mismatch", "device_factor_mismatch",
                    "rooted_mismatch", "settings_differ", "late_rank", "late_root",
                    "late_scatter_root", "self_rooted_broadcast", "self_rooted_scatter"):
        dist.destroy_process_group()


def collect(results, procs, expected: int, killing: bool, start: float):
    """The ranks' reports, until `expected` came, a rank ended without one (its stack, if a
    signal ended it, is in the output: the worker turns faulthandler on), or 600 s passed;
    and the ranks that ended silently, as (rank, exit code). A part that kills its last rank
    (os._exit) expects that one to end without a report."""
    got = []
    while len(got) < expected and time.time() - start < 600:
        try:
            got.append(results.get(timeout=1))
            continue
        except queue.Empty:
            pass
        reported = {g[0] for g in got}
        ended = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None
                 and r not in reported and not (killing and r == len(procs) - 1)]
        if ended:
            # What a rank put just before it ended may still be on its way.
            try:
                while len(got) < expected:
                    got.append(results.get(timeout=2))
            except queue.Empty:
                pass
            reported = {g[0] for g in got}
            return got, [(r, code) for r, code in ended if r not in reported]
    return got, []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--parts", nargs="+", default=["reductions", "premul", "long_timeout",
        "refused_in_block", "movement", "streams", "ddp", "fsdp2", "device_bound", "p2p",
        "mismatch", "factor_mismatch", "device_factor_mismatch", "tag_mismatch", "stale_chunk",
        "dtensor", "killed", "graphs", "graph_killed", "left", "left_p2p", "graph_left", "graph_left_p2p",
        "destroyed_meanwhile", "direct", "setup_refused", "rooted_mismatch", "settings_differ",
        "late_rank", "late_root", "late_scatter_root", "self_rooted_broadcast",
        "self_rooted_scatter", "timing", "wrong_device", "barrier_settles",
        "barrier_settles_unbound", "barrier_in_capture", "barrier_of_a_cpu_group", "held_copy_back"])
    parser.add_argument("--gpu-per-rank", action="store_true",
                        help="rank r on GPU r (a multi-GPU host) instead of every rank on GPU 0")
    parser.add_argument("--dtypes", nargs="+", default=None,
                        help="only these dtypes (e.g. float32 bfloat16), for slow runs such as "
                             "under compute-sanitizer")
    args = parser.parse_args()
    dtypes = DTYPES if args.dtypes is None else [getattr(torch, name) for name in args.dtypes]
    if args.gpu_per_rank:
        os.environ["LOOM_CHECK_GPU_PER_RANK"] = "1"  # the spawned ranks read it
    ctx = mp.get_context("spawn")
    failed = 0
    for world in args.ranks:
        for part in args.parts:
            results = ctx.Queue()
            start = time.time()
            port = free_port()
            procs = [ctx.Process(target=worker, args=(r, world, port, part, dtypes, results))
                     for r in range(world)]
            for p in procs:
                p.start()
            killing = part in ("killed", "graph_killed")  # their last rank leaves (os._exit)
            expected = world - 1 if killing else world
            got, silent = collect(results, procs, expected, killing, start)
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
            errors = [g for g in got if g[3]]
            ok = len(got) == expected and not errors
            failed += not ok
            checks = sum(g[2] for g in got)
            print(f"P={world} {part:<10} {'ok' if ok else 'FAILED'}: {checks} checks, "
                  f"{time.time() - start:.1f} s", flush=True)
            for g in errors:
                print(f"  rank {g[0]}:\n{g[3]}", flush=True)
            if len(got) != expected:
                print(f"  only {len(got)} of {expected} ranks reported", flush=True)
            for r, code in silent:
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                print(f"  rank {r} ended ({how}) without reporting", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
