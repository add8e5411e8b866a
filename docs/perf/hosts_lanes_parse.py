#!/usr/bin/env python3
"""Tables of docs/PERFORMANCE.md, "Lanes", from docs/perf/hosts_lanes_h200host.txt: per layout,
op and size, the medians over the runs of each lane count (engine: loom-bench's out-of-place
time per call; through torch: loom.bench's median per call), the ratio 2 lanes / 1, and, through
torch, Gloo's time over each; then call 6 (a segment per lane, A/B) and call 7 (as committed,
beside Gloo).

    python3 docs/perf/hosts_lanes_parse.py docs/perf/hosts_lanes_h200host.txt"""
import re
import statistics
import sys
from collections import defaultdict

ENGINE_OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]


def parse(path):
    engine = defaultdict(list)  # (layout, op, bytes, lanes) -> [us]
    torch = defaultdict(list)  # (op, size, backend) -> [us]; backend "1", "2" or "gloo"
    split = defaultdict(list)  # call 6: (op, bytes, "A" or "B") -> [us]
    after = defaultdict(list)  # call 7: (op, size, "loom" or "gloo") -> [us]
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
        elif part == "6":
            m = re.search(r"2x1 ([AB])$", line.strip())
            if m:
                side, row = m.group(1), 0
                continue
            f = line.split()
            if len(f) == 5 and f[0].isdigit():
                split[(ENGINE_OPS[row // 4], int(f[0]), side)].append(float(f[1]))
                row += 1
        elif part == "7":
            m = re.search(r"\] (loom|gloo)$", line.strip())
            if m:
                backend = m.group(1)
                continue
            m = re.match(r"## (\S+)", line)
            if m:
                op = m.group(1)
                continue
            f = line.split()
            if len(f) >= 4 and f[1] in ("KiB", "MiB"):
                after[(op, f[0] + " " + f[1], backend)].append(float(f[2]))
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
    return engine, torch, split, after


def main():
    engine, torch, split, after = parse(sys.argv[1])
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
    print("call 6, 2 x 1, two lanes: op, size, usual segments (A), one per lane (B), B/A (engine us)")
    for op, size in sorted({k[:2] for k in split}, key=lambda k: (ENGINE_OPS.index(k[0]), k[1])):
        a, b = split[(op, size, "A")], split[(op, size, "B")]
        print(f"  {op:15s} {size >> 20} MiB  {med(a):7.0f}  {med(b):7.0f}  {med(b) / med(a):.2f}")
    print("call 7, through torch, 2 x 1 as committed: op, size, loom, Gloo, Gloo/loom (us)")
    seen = []
    for op, size, _ in after:
        if (op, size) not in seen:
            seen.append((op, size))
    for op, size in seen:
        loom, gloo = after[(op, size, "loom")], after[(op, size, "gloo")]
        print(f"  {op:22s} {size:7s} {med(loom):7.0f}  {med(gloo):7.0f}  {med(gloo) / med(loom):.2f}x")


if __name__ == "__main__":
    main()
