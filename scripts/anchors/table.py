"""Markdown tables of loom against every CPU anchor, from one `scripts/anchors/run.sh P OUT`:

    python3 scripts/anchors/table.py OUT

One table per op: µs per call (medians) at the anchors' sizes (nccl-tests bytes), the engine
(loom-bench, out of place, rank 0's single calls after a barrier as the anchors' are timed;
tables made before run.sh passed --after-barrier have the slowest rank's mean back to back), loom through torch (c10d; `torch.ops.loom`; `loom.ops`), Gloo, DeepSpeed's shm
all_reduce, oneCCL (Intel MPI shm; libfabric shm), Open MPI (mpi4py); then how loom stands
against the CPU-speed issue's rules: through torch at most every anchor called through torch
(Gloo, DeepSpeed) at every size and every anchor from 4 KiB, and the engine at most every
anchor. Ratios are the best anchor's time over loom's (above 1: loom is faster)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

SIZES = [8, 64, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
# (engine op, torch op, anchors' op) per collective
OPS = [("all_reduce", "all_reduce", "allreduce"), ("all_gather", "all_gather_into_tensor", "allgather"),
       ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter"), ("broadcast", "broadcast", "broadcast"),
       ("all_to_all", "all_to_all_single", "alltoall")]
LOOM = ["engine", "c10d", "direct", "eager"]
ANCHORS = ["Gloo", "DeepSpeed", "oneCCL mpi", "oneCCL ofi_shm", "Open MPI"]
COLUMNS = LOOM + ANCHORS
THROUGH_TORCH = ("Gloo", "DeepSpeed")
LINE = re.compile(r"^(\w+) \w+ P=(\d+) (\w+) bytes=(\d+) t_us=([0-9.]+)")


def human(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def read(out: Path):
    """{(anchors' op, bytes): {column: µs}} and P."""
    times: dict = {}
    ranks = 0

    def put(op, nbytes, column, us):
        times.setdefault((op, nbytes), {})[column] = us

    engine_ops = {e: a for e, _, a in OPS}
    torch_ops = {t: a for _, t, a in OPS}
    if (out / "engine.jsonl").exists():
        for line in (out / "engine.jsonl").read_text().splitlines():
            row = json.loads(line)
            if not row["inplace"] and row["op"] in engine_ops:
                put(engine_ops[row["op"]], row["bytes"], "engine", row["time_us"])
                ranks = row["ranks"]
    # loom's run through torch, and Gloo's in processes of its own (older runs: both in one).
    for results in (out / "torch" / "results.json", out / "torch_gloo" / "results.json"):
        if not results.exists():
            continue
        data = json.loads(results.read_text())
        ranks = data.get("ranks", ranks)
        for row in data["results"]:
            for backend, column in (("loom", "c10d"), ("direct", "direct"), ("eager", "eager"), ("gloo", "Gloo")):
                if backend in row:
                    put(torch_ops[row["op"]], row["bytes"], column, row[backend] * 1e6)
    for name in ("deepspeed.txt", "oneccl.txt", "openmpi.txt"):
        path = out / name
        if not path.exists():
            continue
        mode = ""
        for line in path.read_text().splitlines():
            if line.startswith("# ===== mode="):
                mode = line.split("mode=")[1].split()[0]
            m = LINE.match(line)
            if not m:
                continue
            who, p, op, nbytes, us = m.group(1), int(m.group(2)), m.group(3), int(m.group(4)), float(m.group(5))
            ranks = ranks or p
            column = {"deepspeed": "DeepSpeed", "openmpi": "Open MPI"}.get(who, f"oneCCL {mode}")
            put(op, nbytes, column, us)
    return times, ranks


def key(op: str, nbytes: int, ranks: int) -> int:
    """Sizes below one float per rank round up to one per rank (as every bench does)."""
    return nbytes if op in ("allreduce", "broadcast") else max(nbytes, 4 * ranks)


def main() -> int:
    out = Path(sys.argv[1])
    times, ranks = read(out)
    print(f"# loom against the CPU anchors, P = {ranks} (from {out})\n")
    for _, _, op in OPS:
        rows = {}
        for (o, nbytes), cols in times.items():
            if o == op:
                rows.setdefault(key(op, nbytes, ranks), {}).update(cols)
        shown = sorted(k for k in rows if k in {key(op, s, ranks) for s in SIZES})
        if not shown:
            continue
        print(f"## {op}\n")
        print("| size | " + " | ".join(COLUMNS) + " | torch: best anchor / loom | engine: best anchor / engine |")
        print("|---" * (len(COLUMNS) + 3) + "|")
        for k in shown:
            c = rows[k]
            cells = [f"{c[col]:.1f}" if col in c else "" for col in COLUMNS]
            loom_torch = min((c[x] for x in ("c10d", "direct", "eager") if x in c), default=None)
            anchors = [col for col in ANCHORS if col in c and (k >= 4096 or col in THROUGH_TORCH)]
            verdicts = []
            for mine, pool in ((loom_torch, anchors), (c.get("engine"), [col for col in ANCHORS if col in c])):
                if mine is None or not pool:
                    verdicts.append("")
                    continue
                best = min(pool, key=lambda col: c[col])
                ratio = c[best] / mine
                verdicts.append(f"{ratio:.2f}x ({best})" + ("" if ratio >= 1 else " **slower**"))
            print(f"| {human(k)} | " + " | ".join(cells) + " | " + " | ".join(verdicts) + " |")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
