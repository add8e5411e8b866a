"""Where a tensor-store get's time goes (run on a GPU host): a writer puts and lends a
transformer-shaped bf16 state dict (as loom.tensor_store.bench does), a reader gets it into
its own tensors many times with the store's steps timed: Store round trips, decoding,
planning, the copies (synchronized, so their device time lands there), the sequence-lock
checks, and the whole get; before that, the writer's lend (reclaim, then lend) the same way.

    python tests/cuda/store_get_phases.py [--device cuda|cpu] [--bytes 600M] [--gets 30] [--reader-lendable]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp


def worker(rank: int, args, path: str, queue) -> None:
    import torch.distributed as dist

    import loom.tensor_store._parts as parts
    import loom.tensor_store._read_plan as read_plan
    import loom.tensor_store._store as store_module
    from loom.tensor_store import TensorStore
    from loom.tensor_store.bench import state_dict

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    torch.set_num_threads(args.threads)
    store = dist.FileStore(path, 2) if args.filestore else dist.TCPStore("127.0.0.1", args.port, 2, rank == 0)
    ts = TensorStore(store, rank=rank)
    sd = state_dict(args.bytes, 200, device, float(rank))
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    spent: dict[str, list[float]] = collections.defaultdict(list)
    calls: dict[str, int] = collections.Counter()

    def timed(owner, name: str, label: str, after=None):
        inner = getattr(owner, name)

        def wrapper(*a, **k):
            calls[label] += 1
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                if after:
                    after()
                spent[label].append(time.perf_counter() - t0)
        setattr(owner, name, wrapper)

    if rank == 0:
        ts.put_state_dict(sd, "put")
        lent = state_dict(args.bytes, 200, device, 1.0)
        ts.make_lendable(lent)
        ts.lend_state_dict(lent, "lent")
        # The lend's own steps, timed over reclaim + lend cycles before the reader starts.
        timed(store_module, "leaf_signature", "leaf signature")
        timed(store_module.TensorStore, "_next_version", "next version")
        timed(store_module, "take_back", "take back")
        if device.type == "cuda":
            timed(torch.cuda, "synchronize", "synchronize the writer's device")
        whole = []
        for _ in range(args.gets):
            ts.reclaim("lent")
            sync()
            t0 = time.perf_counter()
            ts.lend_state_dict(lent, "lent")
            whole.append(time.perf_counter() - t0)
        rows = {label: (1e3 * sum(v) / args.gets, calls[label] / args.gets) for label, v in spent.items()}
        rows["whole lend"] = (1e3 * statistics.median(whole), 1.0)
        store.set("ready", "1")
        store.wait(["done"])
        queue.put((rank, {"lend": rows}))
        return
    timed(store_module.TensorStore, "_get_now", "store round trip (compare_set)")
    timed(store_module.TensorStore, "_parts", "find the version (_parts)")
    timed(store_module.TensorStore, "_state_dict_plan", "plan (cached)")
    timed(read_plan, "run_copies", "copies (synchronized)", after=sync)
    timed(parts.MappedBuffer, "check", "sequence-lock check")
    if args.reader_lendable:  # the reader's tensors back to back in one buffer: joined copies
        ts.make_lendable(sd)
    store.wait(["ready"])
    out = {}
    for key in ("put", "lent"):
        for _ in range(3):
            ts.get_state_dict(key, sd)
        spent.clear()
        calls.clear()
        whole = []
        for _ in range(args.gets):
            sync()
            t0 = time.perf_counter()
            ts.get_state_dict(key, sd)
            sync()
            whole.append(time.perf_counter() - t0)
        rows = {label: (1e3 * sum(v) / args.gets, calls[label] / args.gets) for label, v in spent.items()}
        rows["whole get"] = (1e3 * statistics.median(whole), 1.0)
        out[key] = rows
    store.set("done", "1")
    queue.put((rank, out))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--bytes", type=lambda t: int(float(t.rstrip("M")) * (1 << 20)) if t.endswith("M") else int(t),
                        default=600 << 20)
    parser.add_argument("--gets", type=int, default=30)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--port", type=int, default=29731)
    parser.add_argument("--filestore", action="store_true")
    parser.add_argument("--reader-lendable", action="store_true",
                        help="the reader moves its tensors into one buffer first (make_lendable)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, args, os.path.join(tmp, "s"), queue)) for r in range(2)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    for rows in results[0].values():
        print(f"lend_state_dict after a reclaim, {args.device}, {args.bytes / 1e6:.0f} MB, 200 tensors "
              f"(mean per lend; the whole lend: median)")
        for label, (ms, n) in rows.items():
            print(f"  {label:34} {ms:8.3f} ms  {n:5.1f} calls")
    for key, rows in results[1].items():
        print(f"get_state_dict of a {key} key, {args.device}, {args.bytes / 1e6:.0f} MB, 200 tensors"
              f"{' into one buffer of the reader' if args.reader_lendable else ''} (mean per get; the whole get: median)")
        for label, (ms, n) in rows.items():
            print(f"  {label:34} {ms:8.3f} ms  {n:5.1f} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
