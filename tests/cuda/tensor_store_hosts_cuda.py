"""The tensor store across hosts on CUDA tensors (run as root on a GPU host with iproute2; CI
has no GPU): a writer on one namespace host puts and lends state dicts of CUDA tensors, and a
reader on another reads them over loom's byte fetch (the writer's device memory staged through
its pinned host memory) into CUDA and CPU tensors, bit-exact, with no torn version while the
writer rewrites them.

    python tests/cuda/tensor_store_hosts_cuda.py
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.multiprocessing as mp

STEPS = 20


def expected(step: int, device: str) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"embed": torch.randn(4096, 256, generator=g).to(torch.bfloat16).to(device),
            "w": torch.randn(512, 512, generator=g).to(device),
            "b": torch.randn(512, generator=g).to(torch.float16).to(device),
            "counts": torch.randint(0, 1000, (17,), generator=g),  # a CPU tensor beside them
            "step": torch.full((1,), step, dtype=torch.int64, device=device)}


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def rank_main(rank: int, hosts, port: int, errors) -> None:
    try:
        os.environ["LOOM_NET_IFNAME"] = "eth0"
        hosts.enter(rank)
        import torch.distributed as dist

        from loom.tensor_store import TensorStore

        torch.cuda.set_device(0)
        store = dist.TCPStore(hosts.address(0), port, 2, rank == 0, timeout=timedelta(seconds=120))
        ts = TensorStore(store, rank=rank, timeout=timedelta(seconds=60))
        if rank == 0:
            sd = expected(1, "cuda")
            ts.put_state_dict(sd, "put")
            lent = expected(1, "cuda")
            ts.make_lendable(lent)
            ts.lend_state_dict(lent, "lent")
            store.set("ready", b"1")
            store.wait(["read v1"])  # a writer keeps 2 versions: version 1 goes at step 3
            for step in range(2, STEPS + 1):
                for name, t in expected(step, "cuda").items():
                    sd[name].copy_(t)
                ts.put_state_dict(sd, "put")
                with ts.updating("lent"):
                    for name, t in expected(step, "cuda").items():
                        lent[name].copy_(t)
            store.set("writer done", b"1")
            store.wait(["reader done"])
            return
        store.wait(["ready"])
        got = ts.get_state_dict("put", version=1)
        assert same(got, expected(1, "cuda")) and got["w"].is_cuda, "version 1 into new tensors"
        into_cpu = {k: torch.empty_like(v, device="cpu") for k, v in got.items()}
        assert same(ts.get_state_dict("put", into_cpu, version=1), expected(1, "cpu")), "into CPU tensors"
        store.set("read v1", b"1")
        into = {k: torch.empty_like(v) for k, v in got.items()}
        seen = set()
        while True:
            done = store.check(["writer done"])
            for key in ("put", "lent"):
                ts.get_state_dict(key, into)
                step = int(into["step"].item())
                assert same(into, expected(step, "cuda")), f"'{key}' read torn at step {step}"
                seen.add((key, step))
            if done:
                break
        ts.get_state_dict("put", into)
        assert same(into, expected(STEPS, "cuda")), "the last version"
        print(f"reader: {len(seen)} (key, version) pairs read whole across hosts, none torn", flush=True)
        store.set("reader done", b"1")
    except BaseException:  # noqa: BLE001
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise SystemExit(1)


def main() -> int:
    from loom import _netns

    reason = _netns.unavailable_reason()
    if reason:
        print(f"cannot make namespace hosts: {reason}")
        return 2
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    with _netns.NamespaceHosts(2, subnet="10.76.0") as hosts:
        procs = [ctx.Process(target=rank_main, args=(r, hosts, 29533, errors)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
            if p.is_alive():
                p.kill()
        failed = [p.exitcode for p in procs if p.exitcode != 0]
    while not errors.empty():
        print(errors.get(), file=sys.stderr)
    print("tensor_store_hosts_cuda:", "FAILED" if failed else "passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
