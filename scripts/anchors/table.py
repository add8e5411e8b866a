"""Markdown tables of loom against every CPU anchor, from one `scripts/anchors/run.sh P OUT`:

    python3 scripts/anchors/table.py OUT        (run.sh's folder)
    python3 scripts/anchors/table.py RAW.txt    (its files joined under "######## NAME" lines, as
                                                 docs/perf/anchors_*/ keeps them)

One table per op: µs per call (medians) at the anchors' sizes (nccl-tests bytes), the engine
(loom-bench, out of place, rank 0's single calls after a barrier as the anchors' are timed;
tables made before run.sh passed --after-barrier have the slowest rank's mean back to back), loom through torch (c10d; `torch.ops.loom`; `loom.ops`), Gloo, DeepSpeed's shm
all_reduce, oneCCL (Intel MPI shm; libfabric shm), Open MPI (mpi4py); then how loom stands
against the CPU-speed issue's rules: through torch at most every anchor called through torch
(Gloo, DeepSpeed) at every size and every anchor from 4 KiB, and the engine at most every
anchor. Ratios are the best anchor's time over loom's (above 1: loom is faster). From 4 MiB the
last column holds the issue's rule there: at least 2x faster than the best anchor of all, unless
loom reaches 80% of the DRAM model (the bytes each rank must read and write once, its input and
its output, summed over ranks, over the copy bandwidth measured in the same run: loom-bench's
own for the engine, loom.bench's for torch)."""

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


def sections(where: Path) -> dict[str, str]:
    """The run's files by name: read from run.sh's folder, or cut out of a joined raw file."""
    if where.is_dir():
        return {str(f.relative_to(where)): f.read_text(errors="replace")
                for f in where.rglob("*") if f.is_file()}
    parts: dict[str, list[str]] = {}
    current = None
    for line in where.read_text(errors="replace").splitlines():
        if line.startswith("######## "):
            current = line.split()[1]
            parts[current] = []
        elif current is not None:
            parts[current].append(line)
    return {name: "\n".join(lines) for name, lines in parts.items()}


def read_engine_text(text: str):
    """(op, bytes, out-of-place µs, DRAM fraction) of each row of loom-bench's printed tables."""
    op = None
    for line in text.splitlines():
        words = line.split()
        if line.startswith("# ") and len(words) == 4 and words[2] in ("float32", "bfloat16", "float64"):
            op = words[1]
        elif op and words and words[0].isdigit() and len(words) >= 14:
            yield op, int(words[0]), float(words[2]), float(words[-1].rstrip("%")) / 100


def read_torch_text(text: str):
    """(op, bytes, backend, µs) of each cell of loom.bench's printed tables, and the copy
    bandwidth in bytes/s it measured (0 where it printed none)."""
    op, backends, rows = None, [], []
    copy = re.search(r"copy bandwidth ([0-9.]+) GB/s", text)
    for line in text.splitlines():
        words = line.split()
        if line.startswith("## "):
            op, backends = words[1], []
        elif op and words[:1] == ["size"]:
            backends = [words[i] for i in range(1, len(words) - 1) if words[i + 1] == "us"]
        elif op and backends and len(words) == 2 + 3 * len(backends) and words[1] in ("B", "KiB", "MiB", "GiB"):
            nbytes = int(words[0]) << {"B": 0, "KiB": 10, "MiB": 20, "GiB": 30}[words[1]]
            for i, backend in enumerate(backends):
                rows.append((op, nbytes, backend, float(words[2 + 3 * i])))
    return rows, float(copy.group(1)) * 1e9 if copy else 0.0


def read(out: Path):
    """{(anchors' op, bytes): {column: µs}}, P, {(anchors' op, bytes): the engine's DRAM
    fraction}, and loom.bench's copy bandwidth (bytes/s)."""
    times: dict = {}
    dram: dict = {}
    copy_bw = 0.0
    ranks = 0
    files = sections(out)

    def put(op, nbytes, column, us):
        times.setdefault((op, nbytes), {})[column] = us

    engine_ops = {e: a for e, _, a in OPS}
    torch_ops = {t: a for _, t, a in OPS}
    columns = {"loom": "c10d", "direct": "direct", "eager": "eager", "gloo": "Gloo"}
    if "engine.jsonl" in files:
        for line in files["engine.jsonl"].splitlines():
            row = json.loads(line)
            if not row["inplace"] and row["op"] in engine_ops:
                put(engine_ops[row["op"]], row["bytes"], "engine", row["time_us"])
                dram[(engine_ops[row["op"]], row["bytes"])] = row.get("dram", 0.0)
                ranks = row["ranks"]
    elif "engine.txt" in files:
        for op, nbytes, us, fraction in read_engine_text(files["engine.txt"]):
            if op in engine_ops:
                put(engine_ops[op], nbytes, "engine", us)
                dram[(engine_ops[op], nbytes)] = fraction
        found = re.search(r"loom-bench: (\d+) ranks", files["engine.txt"])
        ranks = int(found.group(1)) if found else ranks
    # loom's run through torch, and Gloo's in processes of its own (older runs: both in one).
    for folder in ("torch", "torch_gloo"):
        if f"{folder}/results.json" in files:
            data = json.loads(files[f"{folder}/results.json"])
            ranks = data.get("ranks", ranks)
            if folder == "torch":
                copy_bw = data.get("copy_bw", 0.0)
            for row in data["results"]:
                for backend, column in columns.items():
                    if backend in row:
                        put(torch_ops[row["op"]], row["bytes"], column, row[backend] * 1e6)
        elif f"{folder}.txt" in files:
            rows, bandwidth = read_torch_text(files[f"{folder}.txt"])
            if folder == "torch":
                copy_bw = bandwidth
            for op, nbytes, backend, us in rows:
                if op in torch_ops and backend in columns:
                    put(torch_ops[op], nbytes, columns[backend], us)
    for name in ("deepspeed.txt", "oneccl.txt", "openmpi.txt"):
        if name not in files:
            continue
        mode = ""
        for line in files[name].splitlines():
            if line.startswith("# ===== mode="):
                mode = line.split("mode=")[1].split()[0]
            m = LINE.match(line)
            if not m:
                continue
            who, p, op, nbytes, us = m.group(1), int(m.group(2)), m.group(3), int(m.group(4)), float(m.group(5))
            ranks = ranks or p
            column = {"deepspeed": "DeepSpeed", "openmpi": "Open MPI"}.get(who, f"oneCCL {mode}")
            put(op, nbytes, column, us)
    return times, ranks, dram, copy_bw


# Bytes each rank must read and write once, summed over ranks, per nccl-tests byte of the op
# (as loom-bench's dramFactor): all_reduce and all_to_all read N and write N on every rank;
# all_gather N / P in and N out, reduce_scatter N in and N / P out. Broadcast: loom-bench's
# root also writes its output (P + 1); torch's broadcast is in place, its root only read (P).
def dram_factor(op: str, ranks: int, engine: bool) -> float:
    if op in ("allreduce", "alltoall"):
        return 2 * ranks
    if op == "broadcast":
        return ranks + 1 if engine else ranks
    return ranks + 1


def large_rule(ratio: float, fraction: float) -> str:
    """The 4 MiB rule's verdict: 2x the best anchor, or 80% of the DRAM model."""
    if ratio >= 2:
        return f"2x ({ratio:.2f}x)"
    if fraction >= 0.8:
        return f"DRAM {fraction:.0%}"
    return f"**short** ({ratio:.2f}x, DRAM {fraction:.0%})"


def key(op: str, nbytes: int, ranks: int) -> int:
    """Sizes below one float per rank round up to one per rank (as every bench does)."""
    return nbytes if op in ("allreduce", "broadcast") else max(nbytes, 4 * ranks)


def main() -> int:
    out = Path(sys.argv[1])
    times, ranks, dram, copy_bw = read(out)
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
        print("| size | " + " | ".join(COLUMNS) + " | torch: best anchor / loom | engine: best anchor / engine "
              "| from 4 MiB, 2x or 80% DRAM: torch / engine |")
        print("|---" * (len(COLUMNS) + 4) + "|")
        for k in shown:
            c = rows[k]
            cells = [f"{c[col]:.1f}" if col in c else "" for col in COLUMNS]
            loom_torch = min((c[x] for x in ("c10d", "direct", "eager") if x in c), default=None)
            anchors = [col for col in ANCHORS if col in c and (k >= 4096 or col in THROUGH_TORCH)]
            every = [col for col in ANCHORS if col in c]
            verdicts, large = [], []
            for mine, pool, engine in ((loom_torch, anchors, False), (c.get("engine"), every, True)):
                if mine is None or not pool:
                    verdicts.append("")
                    large.append("")
                    continue
                best = min(pool, key=lambda col: c[col])
                ratio = c[best] / mine
                verdicts.append(f"{ratio:.2f}x ({best})" + ("" if ratio >= 1 else " **slower**"))
                if k < 4 << 20:
                    large.append("")
                    continue
                if engine:
                    fraction = dram.get((op, k), 0.0)
                else:
                    fraction = dram_factor(op, ranks, False) * k / copy_bw / (mine * 1e-6) if copy_bw else 0.0
                large.append(large_rule(min(c[col] for col in every) / mine, fraction))
            print(f"| {human(k)} | " + " | ".join(cells) + " | " + " | ".join(verdicts) + " | "
                  + " / ".join(large) + " |")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
