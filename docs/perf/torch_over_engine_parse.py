"""Tables of torch_over_engine_h200.txt: main through c10d and through torch.ops.loom
("direct"), each over the engine's out-of-place median (loom-bench run just before it), two
turns per P; the criterion is at most 1.3x from 64 KiB through either entry.

    python3 docs/perf/torch_over_engine_parse.py docs/perf/torch_over_engine_h200.txt
"""
import collections
import re
import sys

ENGINE_OP = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "broadcast": "broadcast",
             "all_to_all_single": "all_to_all"}
UNIT = {"KiB": 1 << 10, "MiB": 1 << 20}


def read(path):
    """{file: {(op, bytes): values}}: loom.bench files give (c10d, c10d p90, direct, direct
    p90), loom-bench files the out-of-place median."""
    tabs = collections.defaultdict(dict)
    name = op = None
    for line in open(path):
        m = re.match(r"==> (\S+) <==", line)
        if m:
            name, op = m[1], None
            continue
        if name is None:
            continue
        if "engine" in name:
            h = re.match(r"# (\w+)\s+float32", line)
            if h:
                op = h[1]
                continue
            r = re.match(r"\s+(\d+)\s+\d+\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\d+)", line)
            if r:
                assert r[3] == "0", f"{name}: wrong results at {op} {r[1]}"
                tabs[name][(op, int(r[1]))] = float(r[2])
            continue
        if line.startswith("## "):
            op = line[3:].strip()
            continue
        r = re.match(r"\s+(\d+) ([KM]iB)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s+([\d.]+)\s+([\d.]+)", line)
        if r and op:
            tabs[name][(op, int(r[1]) * UNIT[r[2]])] = tuple(float(r[i]) for i in (3, 4, 5, 6))
    return tabs


def size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def main(path):
    tabs = read(path)
    for P in (4, 8):
        turns = [t for t in (1, 2) if f"ratio_torch_P{P}_t{t}.txt" in tabs]
        print(f"\nP = {P}: per turn, engine µs | c10d µs [p90] | direct µs [p90] | "
              f"the faster entry over the engine")
        within = total = 0
        for op, eop in ENGINE_OP.items():
            print(f"  {op}")
            keys = sorted(k for k in tabs[f"ratio_torch_P{P}_t1.txt"] if k[0] == op)
            for k in keys:
                cells = []
                for t in turns:
                    c, cp, d, dp = tabs[f"ratio_torch_P{P}_t{t}.txt"][k]
                    e = tabs[f"ratio_engine_P{P}_t{t}.txt"][(eop, k[1])]
                    best = min(c, d) / e
                    within += best <= 1.3
                    total += 1
                    cells.append(f"{e:.0f} | {c:.0f} [{cp:.0f}] | {d:.0f} [{dp:.0f}] | {best:.2f}x")
                print(f"    {size(k[1]):>8} | " + " || ".join(cells))
        print(f"  within 1.3x through the faster entry: {within} of {total} points")


if __name__ == "__main__":
    main(sys.argv[1])
