"""Tables of torch_over_engine_h200.txt, torch_over_engine_eager_h200.txt and
torch_over_engine_p16_h200.txt (P = 16 twice, P = 4 and 8 once): main through
c10d ("loom"), torch.ops.loom ("direct") and, in the other two files, loom.ops ("eager"), each
over the engine's out-of-place median (loom-bench run just before it), per P and turn; the
criterion is at most 1.3x from 64 KiB through any entry.

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
    """{file: {(op, bytes): values}}: loom.bench files give {entry: (median, p90)},
    loom-bench files the out-of-place median."""
    tabs = collections.defaultdict(dict)
    name = op = None
    entries = []
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
        if line.strip().startswith("size "):
            entries = re.findall(r"(\w+) us", line)
            continue
        r = re.match(r"\s+(\d+) ([KM]iB)((?:\s+[\d.]+)+)", line)
        if r and op:
            v = [float(x) for x in r[3].split()]
            tabs[name][(op, int(r[1]) * UNIT[r[2]])] = {
                e: (v[3 * i], v[3 * i + 1]) for i, e in enumerate(entries)}
    return tabs


def size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def main(path):
    tabs = read(path)
    found = {re.match(r"ratio_torch_P(\d+)_t(\d+)", n).groups() for n in tabs if n.startswith("ratio_torch")}
    for P in sorted({int(p) for p, _ in found}):
        turns = sorted(int(t) for p, t in found if int(p) == P)
        names = list(next(iter(tabs[f"ratio_torch_P{P}_t1.txt"].values())))
        print(f"\nP = {P}: per turn, engine µs | " + " | ".join(f"{n} µs [p90]" for n in names) +
              " | the fastest entry over the engine")
        within = total = 0
        for op, eop in ENGINE_OP.items():
            print(f"  {op}")
            keys = sorted(k for k in tabs[f"ratio_torch_P{P}_t1.txt"] if k[0] == op)
            for k in keys:
                cells = []
                for t in turns:
                    row = tabs[f"ratio_torch_P{P}_t{t}.txt"][k]
                    e = tabs[f"ratio_engine_P{P}_t{t}.txt"][(eop, k[1])]
                    best = min(m for m, _ in row.values()) / e
                    within += best <= 1.3
                    total += 1
                    cells.append(f"{e:.0f} | " + " | ".join(f"{m:.0f} [{p:.0f}]" for m, p in row.values())
                                 + f" | {best:.2f}x")
                print(f"    {size(k[1]):>8} | " + " || ".join(cells))
        print(f"  within 1.3x through the fastest entry: {within} of {total} points")


if __name__ == "__main__":
    main(sys.argv[1])
