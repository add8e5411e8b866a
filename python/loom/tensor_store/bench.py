"""Measures a weight refresh through the tensor store against its baselines, in one run:

    python -m loom.tensor_store.bench --bytes 600M --generators 2 [--device cuda]

One trainer puts a bf16 state dict (transformer-shaped: `--tensors` tensors summing to
`--bytes`) and every generator then reads the latest version into its own state dict in
place. Printed per step, as median and p90 over `--steps` steps:
- put: the trainer's put_state_dict; get: the slowest generator's get_state_dict;
  refresh: put + get, what a generator waits for a new version;
- overlapped: a put while the generators already ask for that version (get with version=),
  so they copy each bucket as it is written: from the start of the put to the last copy;
- lend, lent get, lent refresh: the same with the trainer lending its tensors (make_lendable
  once, then per step reclaim, change them, lend_state_dict): a lend copies nothing, so a
  generator's get is the one copy of the refresh;
- lent overlapped: a lend while the generators already ask for that version (an RL loop's
  generators waiting for the next policy): from the start of the lend to the last copy;
- memcpy: the same bytes copied once, one flat tensor into another (torch's copy_), by one
  process with the same threads (CPU) or by the device (CUDA): the floor of any transfer;
  loom memcpy (CPU): the same with loom's own copy, which the store's copies use (streaming
  stores past half the last-level cache), a lower floor where those pay;
- broadcast: the trainer's state dict delivered to every generator at once in broadcast mode
  (broadcast_state_dict over a loom group, the same state dicts); off with --no-broadcast;
- gloo: the same tensors broadcast from the trainer to the generators over Gloo (CPU tensors:
  what torchstore's Gloo transport sends); off with --no-gloo.

With `--hosts 2` the trainer and the generators run on two hosts made of network namespaces
on this machine (root and iproute2; `--link-gbit G` shapes each host's link), so the
generators read over loom's byte fetch and Gloo broadcasts over TCP between the hosts.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

from .._backend_names import gloo_replaced
from .._stats import p90
from ..bench import parse_size


def state_dict(total: int, tensors: int, device, fill: float):
    """`tensors` bf16 tensors summing to about `total` bytes, in layers of 4 matrices."""
    import torch

    per = max(1, total // 2 // tensors)
    cols = 1024
    rows = max(1, per // cols)
    return {f"layers.{i // 4}.w{i % 4}": torch.full((rows, cols), fill, dtype=torch.bfloat16, device=device)
            for i in range(tensors)}


def stats(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"median_ms": 1e3 * statistics.median(ordered),
            "p90_ms": 1e3 * p90(ordered)}


def rank_main(rank: int, world: int, args, init: str, queue) -> None:
    try:
        import torch
        import torch.distributed as dist

        from loom import _C
        from loom.tensor_store import TensorStore

        if args.hosts:  # before any socket opens: the trainer on host 0, generators on host 1
            os.environ.update(LOOM_NET_IFNAME="eth0", GLOO_SOCKET_IFNAME="eth0")
            args.namespaces.enter(0 if rank == 0 else 1)
        torch.set_num_threads(args.threads)
        device = torch.device(args.device)
        if device.type == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(minutes=10))
        sync = torch.zeros(1)

        def barrier():
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.all_reduce(sync)

        def timed(step_fn, active: bool) -> float:
            barrier()
            t0 = time.perf_counter()
            if active:
                step_fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            return elapsed.item()

        ts = TensorStore()
        loom_group = dist.new_group(backend="loom") if args.broadcast else None
        sd = state_dict(args.bytes, args.tensors, device, float(rank))
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
        flat_src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
        flat_dst = torch.empty_like(flat_src)
        out = {"bytes": nbytes, "put": [], "get": [], "refresh": [], "overlapped": [], "memcpy": [], "gloo": [],
               "first_put": [], "lend": [], "lent get": [], "lent refresh": [], "lent overlapped": [], "loom memcpy": [], "broadcast": []}
        if args.lend:
            lent = state_dict(args.bytes, args.tensors, device, float(rank))
            if rank == 0:
                ts.make_lendable(lent)
                ts.lend_state_dict(lent, "lent")
        lent_version = 1  # the lent key's versions: one per lend
        warm = 2  # the writer's first `keep` puts make its buffers (pages faulted in once)
        version = 0

        def holds(tensors, value: int) -> list:
            """The tensors that are not all `value`, with their means (exact: a float mean
            of a million equal values may round)."""
            return [(n, float(t.float().mean())) for n, t in tensors.items() if not bool((t == value).all())]

        def check(what: str) -> None:
            if rank != 0:
                wrong = holds(sd, version % 256)
                assert not wrong, f"a generator read the wrong version ({what}): {wrong[:4]}"

        def refill() -> None:
            if rank == 0:
                for t in sd.values():
                    t.fill_(version % 256)  # exact in bf16

        for step in range(args.steps + warm):
            version += 1
            refill()
            put = timed(lambda: ts.put_state_dict(sd, "policy"), rank == 0)
            get = timed(lambda: ts.get_state_dict("policy", sd), rank != 0)
            check("after the put")
            # The same refresh with the generators asking for the version before it is put:
            # they copy each bucket as the trainer writes it.
            version += 1
            refill()
            overlapped = timed(lambda: ts.put_state_dict(sd, "policy") if rank == 0
                               else ts.get_state_dict("policy", sd, version=version), True)
            check("while it was put")
            memcpy = timed(lambda: flat_dst.copy_(flat_src), rank == 0)
            if device.type == "cpu":  # loom's own copy of the same bytes: the faster floor here
                streamed = timed(lambda: _C.copy_cpu([flat_dst], [flat_src]), rank == 0)
            if args.lend:
                lent_version += 1
                if rank == 0:
                    ts.reclaim("lent")
                    for t in lent.values():
                        t.fill_(lent_version % 256)
                lend = timed(lambda: ts.lend_state_dict(lent, "lent"), rank == 0)
                lent_get = timed(lambda: ts.get_state_dict("lent", lent), rank != 0)
                if rank != 0:
                    assert not holds(lent, lent_version % 256), "a stale lent version"
                # The same with the generators already waiting for the next version, as an RL
                # loop's generators do: from the lend to the last generator's last copy.
                lent_version += 1
                if rank == 0:
                    ts.reclaim("lent")
                    for t in lent.values():
                        t.fill_(lent_version % 256)
                lent_overlapped = timed(lambda: ts.lend_state_dict(lent, "lent") if rank == 0
                                        else ts.get_state_dict("lent", lent, version=lent_version), True)
                if rank != 0:
                    assert not holds(lent, lent_version % 256), "a stale lent version"
                if step >= warm:
                    out["lend"].append(lend)
                    out["lent get"].append(lent_get)
                    out["lent refresh"].append(lend + lent_get)
                    out["lent overlapped"].append(lent_overlapped)
            if step == 0:
                out["first_put"].append(put)
            if args.broadcast:  # every generator at once, over a loom group
                fill = (version + 128) % 256  # not what the generators hold now
                if rank == 0:
                    for t in sd.values():
                        t.fill_(fill)
                bcast = timed(lambda: ts.broadcast_state_dict(sd, "broadcast", src=0, group=loom_group), True)
                if rank != 0:
                    wrong = holds(sd, fill)
                    assert not wrong, f"a wrong broadcast: {len(wrong)} tensors not {fill}: {wrong[:4]}"
                out["broadcast"].append(bcast) if step >= warm else None
            if args.gloo and device.type == "cpu":
                def broadcast():
                    for t in sd.values():
                        dist.broadcast(t, src=0)
                gloo = timed(broadcast, True)
                out["gloo"].append(gloo) if step >= warm else None
            if step >= warm:
                out["put"].append(put)
                out["get"].append(get)
                out["refresh"].append(put + get)
                out["overlapped"].append(overlapped)
                out["memcpy"].append(memcpy)
                if device.type == "cpu":
                    out["loom memcpy"].append(streamed)
            if rank == 0 and args.progress:
                print(f"  step {step - warm + 1}/{args.steps}: put {put * 1e3:.1f} ms, get {get * 1e3:.1f} ms, "
                      f"overlapped {overlapped * 1e3:.1f} ms, memcpy {memcpy * 1e3:.1f} ms", file=sys.stderr, flush=True)
        barrier()
        ts.close()
        dist.destroy_process_group()
        queue.put((rank, out))
    except BaseException as error:  # noqa: BLE001
        import traceback

        queue.put((rank, traceback.format_exc()))
        raise SystemExit(1) from error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=parse_size, default=parse_size("600M"))
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--generators", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / ranks)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--no-gloo", dest="gloo", action="store_false")
    parser.add_argument("--no-lend", dest="lend", action="store_false", help="leave out the lent rows")
    parser.add_argument("--no-broadcast", dest="broadcast", action="store_false",
                        help="leave out the broadcast-mode row")
    parser.add_argument("--json", help="also write the numbers here")
    parser.add_argument("--progress", action="store_true", help="print every step")
    parser.add_argument("--hosts", type=int, default=0, choices=[0, 2],
                        help="2: trainer and generators on two namespace hosts of this machine")
    parser.add_argument("--link-gbit", type=float, default=0, help="with --hosts: shape each host's link")
    args = parser.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--tensors", args.tensors), ("--generators", args.generators)):
        if value < 1:
            parser.error(f"{flag} must be at least 1 (got {value})")
    if args.gloo and gloo_replaced():
        parser.error("Gloo is measured here, but LOOM_REPLACES_GLOO is set, so a group asked for "
                     "as 'gloo' would run on loom: unset it, or pass --no-gloo")
    if args.hosts:
        from loom import _netns

        reason = _netns.unavailable_reason()
        if reason:
            print(f"--hosts: {reason}", file=sys.stderr)
            return 2
        args.namespaces = _netns.NamespaceHosts(2, subnet="10.77.0")
        try:
            for h in range(2):
                if args.link_gbit:
                    args.namespaces.shape(h, args.link_gbit)
            return run(args)
        finally:
            args.namespaces.close()
    return run(args)


def run(args) -> int:
    world = 1 + args.generators
    if args.threads <= 0:
        args.threads = max(1, len(os.sched_getaffinity(0)) // world)
    ctx = mp.get_context("spawn" if args.device == "cuda" else "fork")
    queue = ctx.Queue()
    # A TCPStore, as torchrun's env:// gives (a FileStore rereads a growing file on every call).
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Across hosts the trainer hosts it on host 0's address (a fresh namespace: any port is free).
    init = f"tcp://{args.namespaces.address(0) if args.hosts else '127.0.0.1'}:{port}"
    procs = [ctx.Process(target=rank_main, args=(r, world, args, init, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, out = queue.get()
        if isinstance(out, str):
            print(f"rank {rank} failed:\n{out}", file=sys.stderr)
            for p in procs:
                p.kill()
            return 1
        results[rank] = out
    for p in procs:
        p.join()
    out = results[0]
    rows = {name: stats(out[name]) for name in ("memcpy", "loom memcpy", "put", "get", "refresh", "overlapped", "lend", "lent get",
                                                "lent refresh", "lent overlapped", "broadcast", "gloo") if out[name]}
    first_put_ms = 1e3 * out["first_put"][0]
    memcpy = rows["memcpy"]["median_ms"]
    print(f"tensor store, {out['bytes'] / 1e6:.0f} MB bf16 state dict ({args.tensors} tensors), 1 trainer + "
          f"{args.generators} generators, {args.device}, {args.threads} threads per rank, {args.steps} steps"
          + (", across 2 namespace hosts" + (f" ({args.link_gbit:g} Gb/s links)" if args.link_gbit else "")
             if args.hosts else ""))
    print(f"{'':16} {'median ms':>10} {'p90 ms':>10} {'GB/s':>8} {'x memcpy':>9}")
    for name, row in rows.items():
        gbps = out["bytes"] / row["median_ms"] / 1e6
        print(f"{name:16} {row['median_ms']:10.2f} {row['p90_ms']:10.2f} {gbps:8.2f} {row['median_ms'] / memcpy:9.2f}")
    print(f"(not in the steps: the first put, which makes the writer's buffer: {first_put_ms:.0f} ms; "
          f"two steps warm up)")
    if "loom memcpy" in rows:
        floor = rows["loom memcpy"]["median_ms"]
        print("against loom memcpy: " + "; ".join(
            f"{name} {rows[name]['median_ms'] / floor:.2f}x" for name in ("get", "overlapped", "lent refresh",
                                                                          "lent overlapped") if name in rows))
    if "gloo" in rows:
        ratios = [f"gloo / {name}: {rows['gloo']['median_ms'] / rows[name]['median_ms']:.1f}x"
                  for name in ("refresh", "overlapped", "lent refresh", "lent overlapped", "broadcast") if name in rows]
        print("; ".join(ratios))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("json", "namespaces")}, "bytes": out["bytes"],
                       "rows": rows, "first_put_ms": first_put_ms}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
