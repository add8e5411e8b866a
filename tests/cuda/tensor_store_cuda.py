"""The tensor store on CUDA tensors (run on a GPU host; CI has none): loom's spread copy
(loom._C.copy_cuda) against torch's copies, then one writer and several
readers sharing GPU 0, state dicts of CUDA tensors read back bit-exact device to device (into
new tensors, in place, and into CPU tensors), mixed CPU and CUDA state dicts, and refresh
loops, put and lent (the writer's own tensors, changed on the GPU between reclaim and lend),
in which no reader may see a torn version.

    python tests/cuda/tensor_store_cuda.py --ranks 2 3 4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp


def expected(step: int, device: str) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "embed": torch.randn(1000, 64, generator=g).to(torch.bfloat16).to(device),
        "layers": {str(i): {"w": torch.randn(64, 64, generator=g).to(device),
                            "b": torch.randn(64, generator=g).to(torch.float16).to(device)} for i in range(3)},
        "counts": torch.randint(0, 1000, (17,), generator=g),  # a CPU tensor beside them
        "meta": {"step": step},
    }


def leaves(sd, prefix=()):
    for k, v in sd.items():
        if isinstance(v, dict) and v and not (k == "meta"):
            yield from leaves(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def same(a: dict, b: dict) -> bool:
    la, lb = dict(leaves(a)), dict(leaves(b))
    if la.keys() != lb.keys():
        return False
    for path, x in la.items():
        y = lb[path]
        if isinstance(x, torch.Tensor):
            if not (x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.cpu(), y.cpu())):
                return False
        elif x != y:
            return False
    return True


def worker(rank: int, world: int, path: str, steps: int, queue) -> None:
    try:
        import torch.distributed as dist

        from loom.tensor_store import TensorStore

        torch.cuda.set_device(0)
        store = dist.FileStore(path, world)
        ts = TensorStore(store, rank=rank)
        if rank == 0:
            ts.put_state_dict(expected(1, "cuda"), "sd")
            store.set("put1", "1")
            while int(store.add("readers_looping", 0)) < world - 1:  # readers read as it puts
                time.sleep(0.001)
            for step in range(2, steps + 2):  # the refresh loop: whole versions only
                time.sleep(0.002)  # as a trainer's step would: readers get in between
                ts.put_state_dict({"w": torch.full((1 << 20,), float(step), device="cuda"),
                                   "b": torch.full((999,), float(step), dtype=torch.bfloat16, device="cuda")}, "loop")
            # Lent: the writer's own tensors, changed by kernels between reclaim and lend.
            lent = {"w": torch.zeros(1 << 20, device="cuda"), "b": torch.zeros(999, dtype=torch.bfloat16, device="cuda"),
                    "cpu": torch.zeros(10)}
            ts.make_lendable(lent)
            ts.lend_state_dict(lent, "lent")
            while int(store.add("readers_lent", 0)) < world - 1:
                time.sleep(0.001)
            for step in range(1, steps + 1):
                time.sleep(0.002)
                with ts.updating("lent"):
                    for t in lent.values():
                        t.fill_(step)
            while int(store.add("readers_done", 0)) < world - 1:
                time.sleep(0.01)
            queue.put((rank, "ok"))
            return
        store.wait(["put1"])
        fresh = ts.get_state_dict("sd")
        assert fresh["embed"].is_cuda and same(fresh, expected(1, "cuda")), "fresh CUDA read differs"
        mine = expected(0, "cuda")
        before = mine["layers"]["1"]["w"]
        filled = ts.get_state_dict("sd", mine)
        assert filled["layers"]["1"]["w"] is before and same(filled, expected(1, "cuda")), "in-place read differs"
        on_cpu = expected(0, "cpu")
        assert same(ts.get_state_dict("sd", on_cpu), expected(1, "cpu")), "read into CPU tensors differs"
        mine = {"w": torch.empty(1 << 20, device="cuda"), "b": torch.empty(999, dtype=torch.bfloat16, device="cuda")}
        seen = []
        store.add("readers_looping", 1)
        while not seen or seen[-1] < steps + 1:
            if not ts.exists("loop"):
                continue
            ts.get_state_dict("loop", mine)
            values = {mine["w"].min().item(), mine["w"].max().item(), mine["b"].min().item(), mine["b"].max().item()}
            assert len(values) == 1, f"torn read: {values}"
            seen.append(values.pop())
        assert seen == sorted(seen), seen
        mine["cpu"] = torch.empty(10)
        lent_seen = []
        store.add("readers_lent", 1)
        while not lent_seen or lent_seen[-1] < steps:
            if not ts.exists("lent"):
                continue
            ts.get_state_dict("lent", mine)
            values = {mine[k].min().item() for k in mine} | {mine[k].max().item() for k in mine}
            assert len(values) == 1, f"torn read of a lent version: {values}"
            lent_seen.append(values.pop())
        assert lent_seen == sorted(lent_seen), lent_seen
        ts.close()  # release the writer's device memory before it exits
        del fresh, filled, mine
        store.add("readers_done", 1)
        queue.put((rank, f"ok ({len(seen)} refreshes seen, {len(lent_seen)} lent)"))
    except BaseException:  # noqa: BLE001
        queue.put((rank, traceback.format_exc()))


def broadcast_worker(rank: int, world: int, path: str, steps: int, queue) -> None:
    """Broadcast mode over a loom group whose ranks share GPU 0: CUDA tensors (packed and
    alone) and a CPU tensor, rank 1 writing, every version checked on every rank."""
    try:
        import torch.distributed as dist

        import loom  # noqa: F401  (registers the backend)
        from loom.tensor_store import TensorStore

        torch.cuda.set_device(0)
        dist.init_process_group("loom", store=dist.FileStore(path, world), rank=rank, world_size=world,
                                device_id=torch.device("cuda", 0))
        ts = TensorStore(bucket_bytes=1 << 20)
        sd = expected(0, "cuda")
        sd["big"] = torch.zeros(1 << 20, device="cuda")  # 4 MiB: alone
        for step in range(1, steps + 1):
            if rank == 1:
                sd = expected(step, "cuda")
                sd["big"] = torch.full((1 << 20,), float(step), device="cuda")
            ts.broadcast_state_dict(sd, "policy", src=1)
            want = expected(step, "cuda")
            want["big"] = torch.full((1 << 20,), float(step), device="cuda")
            assert same(sd, want), f"step {step}: rank {rank} holds another state dict"
        dist.destroy_process_group()
        queue.put((rank, f"ok ({steps} broadcasts)"))
    except BaseException:  # noqa: BLE001
        queue.put((rank, traceback.format_exc()))


def check_spread_copy() -> str:
    """loom._C.copy_cuda against torch's copy_: pieces of odd sizes and alignments, empty ones,
    more than one launch holds, on a side stream; '' if all match, else what differs."""
    from loom import _C

    torch.manual_seed(0)
    sizes = [1, 15, 16, 17, 4095, 65536, 65537, 0, 3 << 20, (8 << 20) + 3, 100] * 30  # 330 pieces
    source = torch.randint(0, 255, (sum(sizes) + 64 * len(sizes),), dtype=torch.uint8, device="cuda")
    target = torch.zeros(sum(sizes) + 64 * len(sizes), dtype=torch.uint8, device="cuda")
    srcs, dsts, at = [], [], 0
    for i, n in enumerate(sizes):
        # Two of three pieces 16-byte aligned on both sides (vector copies), the rest at odd
        # addresses (byte copies); 64 bytes apart, so no two destinations touch.
        first = at if i % 3 else at + 7
        srcs.append(source[first:first + n])
        dsts.append(target[first:first + n])
        at += (n + 64 + 15) // 16 * 16
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _C.copy_cuda(dsts, srcs)
    side.synchronize()
    wrong = [i for i, (d, s) in enumerate(zip(dsts, srcs)) if not torch.equal(d, s)]
    if wrong:
        return f"spread copy: pieces {wrong[:10]} differ"
    floats = [torch.randn(n, device="cuda") for n in (1, 1000, 1 << 20)]
    into = [torch.empty_like(f) for f in floats]
    _C.copy_cuda(into, floats)
    if not all(torch.equal(a, b) for a, b in zip(into, floats)):
        return "spread copy: float32 pieces differ"
    try:
        _C.copy_cuda([torch.empty(4, device="cuda")], [torch.empty(4)])
        return "spread copy: took a CPU source"
    except ValueError as error:
        if "pair 0 must be contiguous CUDA tensors of one device, dtype and size" not in str(error):
            return f"spread copy: unexpected error {error}"
    return ""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    problem = check_spread_copy()
    print(f"loom's spread copy (copy_cuda) against copy_: {problem or 'passed'}")
    failed = bool(problem)
    for target, what in ((worker, "tensor store"), (broadcast_worker, "broadcast mode")):
        failed |= run_all(target, what, args)
    return 1 if failed else 0


def run_all(target, what: str, args) -> bool:
    failed = False
    for world in args.ranks:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            procs = [ctx.Process(target=target, args=(r, world, os.path.join(tmp, "store"), args.steps, queue))
                     for r in range(world)]
            for p in procs:
                p.start()
            results = {}
            while len(results) < len(procs):
                rank, value = queue.get(timeout=300)
                results[rank] = value
                if not value.startswith("ok"):  # the others may wait for it forever
                    for p in procs:
                        p.kill()
                    break
            for p in procs:
                p.join(timeout=60)
        bad = {r: v for r, v in results.items() if not v.startswith("ok")}
        failed |= bool(bad)
        print(f"{what} on CUDA, {world} ranks on one GPU: {'FAILED' if bad else 'passed'} "
              f"({', '.join(f'rank {r}: {v}' for r, v in sorted(results.items()) if r and not bad)})")
        for r, v in bad.items():
            print(f"--- rank {r} ---\n{v}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
