"""all_to_all copying out of the peers' memory (process_vm_readv, from LOOM_PEER_READ_BYTES)
through torch: c10d's all_to_all_single (equal and uneven splits), loom.ops's out form, and
a compiled call give the same bits as with LOOM_PEER_READS=0, with every input rewritten
right after each call; loom._C.peer_read_collectives proves which path ran."""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness import run_ranks

# Every all_to_all below reads peers unless turned off (the default starts at 4 MiB).
EVERY_SIZE = {"LOOM_PEER_READ_BYTES": "0"}


def exchanges(rank: int, world: int) -> dict:
    import loom
    import loom.ops

    before = loom._C.peer_read_collectives()
    results = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        n = 50_000  # per block
        inp = torch.empty(n * world, dtype=dtype)
        out = torch.empty(n * world, dtype=dtype)
        for step in range(3):
            inp.copy_(torch.arange(n * world, dtype=torch.float64).add(1000 * rank + step).to(dtype))
            dist.all_to_all_single(out, inp)
            inp.fill_(-1)  # at once: every peer must be done reading it
            for q in range(world):
                want = torch.arange(rank * n, (rank + 1) * n, dtype=torch.float64).add(1000 * q + step)
                assert torch.equal(out.narrow(0, q * n, n), want.to(dtype)), (dtype, step, q)
        results[str(dtype)] = out.clone()
    # Uneven splits: rank r sends (r + q) % 3 * 7000 + 1 elements to rank q.
    sends = [(rank + q) % 3 * 7000 + 1 for q in range(world)]
    receives = [(q + rank) % 3 * 7000 + 1 for q in range(world)]
    src = torch.cat([torch.full((sends[q],), float(100 * rank + q)) for q in range(world)])
    dst = torch.empty(sum(receives))
    dist.all_to_all_single(dst, src, receives, sends)
    results["uneven"] = dst.clone()
    at = 0
    for q in range(world):
        assert torch.equal(dst[at : at + receives[q]], torch.full((receives[q],), float(100 * q + rank)))
        at += receives[q]
    # The direct entry's out form, eager and compiled.
    group = dist.group.WORLD.group_name
    inp = torch.randn(4096 * world, generator=torch.Generator().manual_seed(rank))
    out = torch.empty_like(inp)
    loom.ops.all_to_all_single_out(inp, [], [], group, out=out)
    results["ops"] = out.clone()
    compiled = torch.compile(lambda t: loom.ops.all_to_all_single(t, [], [], group), fullgraph=True)
    results["compiled"] = compiled(inp)
    results["peer reads"] = loom._C.peer_read_collectives() - before
    return results


def test_all_to_all_reading_peers_gives_the_staged_bits():
    world = 3
    peer = run_ranks(world, exchanges, env=EVERY_SIZE)
    staged = run_ranks(world, exchanges, env={**EVERY_SIZE, "LOOM_PEER_READS": "0"})
    for rank in range(world):
        # 3 dtypes x 3 steps, the uneven call, the out form and the compiled call (the
        # kernel may refuse the reads only where ptrace is restricted; CI's is not).
        assert peer[rank].pop("peer reads") == 12, rank
        assert staged[rank].pop("peer reads") == 0, rank
        for name, tensor in peer[rank].items():
            assert torch.equal(tensor, staged[rank][name]), (rank, name)
