#!/usr/bin/env python3
"""Tables of docs/PERFORMANCE.md, "Lanes", from docs/perf/hosts_lanes_h200host.txt: per layout,
op and size, the medians over the runs of each lane count (engine: loom-bench's out-of-place
time per call; through torch: loom.bench's median per call), the ratio 2 lanes / 1, and, through
torch, Gloo's time over each.

    python3 docs/perf/hosts_lanes_parse.py docs/perf/hosts_lanes_h200host.txt"""
import re
import statistics
import sys
from collections import defaultdict

ENGINE_OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]


def parse(path):
    engine = defaultdict(list)  # (layout, op, bytes, lanes) -> [us]
    torch = defaultdict(list)  # (op, size, backend) -> [us]; backend "1", "2" or "gloo"
    part = None
    for line in open(path, encoding="utf-8"):
        if line.startswith("######## call"):
            part = line.split()[2]
            continue
        if part == "3":
            m = re.search(r"layout (\S+) lanes (\d)", line)
            if m:
                layout, lanes, row = m.group(1), int(m.group(2)), 0
                continue
            f = line.split()
            if len(f) == 5 and f[0].isdigit():
                op = ENGINE_OPS[row // 3]
                row += 1
                engine[(layout, op, int(f[0]), lanes)].append(float(f[1]))
        elif part == "4":
            m = re.search(r"\] (loom lanes (\d)|gloo)$", line.strip())
            if m:
                backend = m.group(2) or "gloo"
                continue
            m = re.match(r"## (\S+)", line)
            if m:
                op = m.group(1)
                continue
            f = line.split()
            if len(f) >= 4 and f[1] in ("KiB", "MiB"):
                torch[(op, f[0] + " " + f[1], backend)].append(float(f[2]))
    return engine, torch


def main():
    engine, torch = parse(sys.argv[1])
    med = statistics.median
    print("engine (loom-bench, out-of-place us per call): layout, op, size, 1 lane, 2 lanes, 2/1")
    for layout, op, size in sorted({k[:3] for k in engine}, key=lambda k: (k[0], ENGINE_OPS.index(k[1]), k[2])):
        one, two = engine[(layout, op, size, 1)], engine[(layout, op, size, 2)]
        print(f"  {layout} {op:15s} {size >> 20:3d} MiB  {med(one):9.0f}  {med(two):9.0f}  {med(two) / med(one):.2f}")
    print("through torch, 2 x 1 (loom.bench us per call): op, size, 1 lane, 2 lanes, 2/1, Gloo/1 lane, Gloo/2 lanes")
    seen = []
    for op, size, _ in torch:
        if (op, size) not in seen:
            seen.append((op, size))
    for op, size in seen:
        one, two, gloo = torch[(op, size, "1")], torch[(op, size, "2")], torch[(op, size, "gloo")]
        print(f"  {op:22s} {size:7s} {med(one):8.0f}  {med(two):8.0f}  {med(two) / med(one):.2f}"
              f"  {med(gloo) / med(one):.2f}x  {med(gloo) / med(two):.2f}x")


if __name__ == "__main__":
    main()
