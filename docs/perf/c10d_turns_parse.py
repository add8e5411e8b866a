#!/usr/bin/env python3
"""python -m loom.bench runs (backends loom,fake) of two builds in turns ("# [B] python3 -m
loom.bench --ranks P ..." and "# [C] ..." lines, as .device scripts write them): per P and op,
each build's loom time and loom - fake per size as the median over its runs, then the median
over 8 B-1 KiB, and C / B of loom's time per size (median and range).

    python3 docs/perf/c10d_turns_parse.py docs/perf/per_call_cuts_c10d_h200.txt
"""

import re
import statistics
import sys
from collections import defaultdict

UNITS = {"B": 1, "KiB": 1024, "MiB": 1 << 20}


def parse(path):
    """(P, build) -> one {(op, bytes): (loom µs, fake µs)} per run."""
    runs = defaultdict(list)
    current = op = None
    for line in open(path):
        header = re.match(r"# \[(\w)\] python3 -m loom\.bench --ranks (\d+)", line)
        if header:
            current = {}
            runs[(int(header.group(2)), header.group(1))].append(current)
            continue
        section = re.match(r"## (\w+)$", line.strip())
        if section:
            op = section.group(1)
            continue
        fields = line.split()
        if current is not None and op and len(fields) >= 8 and fields[1] in UNITS:
            try:
                size = int(float(fields[0]) * UNITS[fields[1]])
                current[(op, size)] = (float(fields[2]), float(fields[5]))
            except ValueError:
                continue
    return runs


def main():
    runs = parse(sys.argv[1])
    for ranks in sorted({p for p, _ in runs}):
        base, new = runs[(ranks, "B")], runs[(ranks, "C")]
        print(f"P = {ranks} ({len(base)} runs of B, {len(new)} of C), medians over 8 B-1 KiB of "
              "each size's median over the runs, µs")
        for op in dict.fromkeys(k[0] for k in base[0]):
            keys = [k for k in base[0] if k[0] == op]
            row = {}
            for name, build in (("B", base), ("C", new)):
                loom = [statistics.median(r[k][0] for r in build) for k in keys]
                excess = [statistics.median(r[k][0] - r[k][1] for r in build) for k in keys]
                row[name] = (loom, excess)
            ratios = [c / b for b, c in zip(row["B"][0], row["C"][0])]
            print(f"   {op:24s} loom B {statistics.median(row['B'][0]):5.1f}  C "
                  f"{statistics.median(row['C'][0]):5.1f}   loom - fake B "
                  f"{statistics.median(row['B'][1]):4.1f}  C {statistics.median(row['C'][1]):4.1f}"
                  f"   C/B {statistics.median(ratios):.3f} [{min(ratios):.2f}-{max(ratios):.2f}]")


if __name__ == "__main__":
    main()
