"""A soak of the tensor store's broadcast mode (run by hand; CI runs the test in
test_tensor_store_lending.py): 3 ranks, rank 0 writing a new fill into every tensor before each
broadcast, every element of every tensor checked on the receivers after each one. Prints,
per rank, the broadcasts that left a tensor wrong (an empty list each when all is well).

    LOOM_SOAK_BROADCASTS=60 python3 tests/python/soak_broadcast.py THREADS BUCKET_BYTES ROWS TENSORS {gloo,loom}

With `gloo` the default group is Gloo and the broadcasts run over a loom group made beside
it (as the tensor-store bench does); with `loom` over the loom default group.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import run_ranks  # noqa: E402


def soak(rank, world, threads, bucket, rows, count, beside_gloo):
    from loom.tensor_store import TensorStore

    torch.set_num_threads(threads)
    ts = TensorStore(bucket_bytes=bucket)
    group = dist.new_group(backend="loom") if beside_gloo else None
    sd = {f"w{i}": torch.zeros(rows, 1024, dtype=torch.bfloat16) for i in range(count)}
    bad = []
    for it in range(int(os.environ.get("LOOM_SOAK_BROADCASTS", "40"))):
        fill = float((it * 37 + 5) % 250)
        if rank == 0:
            for t in sd.values():
                t.fill_(fill)
        ts.broadcast_state_dict(sd, "b", src=0, group=group)
        if rank:
            wrong = [k for k, t in sd.items() if not bool((t == fill).all())]
            if wrong:
                bad.append((it, fill, len(wrong), wrong[:3], [float(sd[w].float().mean()) for w in wrong[:3]]))
    return bad


if __name__ == "__main__":
    threads, bucket, rows, count, backend = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                             int(sys.argv[4]), sys.argv[5])
    print(run_ranks(3, soak, threads, bucket, rows, count, backend == "gloo", backend=backend))
