#!/usr/bin/env python3
"""loom-bench runs of two builds in turns ("# [B] loom-bench ..." and "# [C] ..." lines, as
.device scripts write them): per P and timing (back to back, after a barrier), C over B of
each point's median over the rounds, per op: the median and range over 8 B-1 KiB, out of
place and in place, and how many points C was faster at.

    python3 docs/perf/per_call_turns_parse.py docs/perf/per_call_cuts_call2_h200.txt
"""

import re
import statistics
import sys
from collections import defaultdict

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")


def parse(path):
    """(timing, P, build) -> one {(op, bytes, form): µs} per run of that build."""
    runs = defaultdict(list)
    current = op = None
    for line in open(path):
        header = re.match(r"# \[(\w)\] loom-bench -n (\d+) .*?(--after-barrier)?$", line.strip())
        if header:
            timing = "after a barrier" if header.group(3) else "back to back"
            current = {}
            runs[(timing, int(header.group(2)), header.group(1))].append(current)
            op = None
            continue
        table = re.match(r"# (\w+)\s+float32", line)
        if table:
            op = table.group(1)
            continue
        fields = line.split()
        if current is not None and op and len(fields) >= 12 and fields[0].isdigit():
            current[(op, int(fields[0]), "oop")] = float(fields[2])
            current[(op, int(fields[0]), "ip")] = float(fields[7])
    return runs


def main():
    runs = parse(sys.argv[1])
    for timing in ("back to back", "after a barrier"):
        for ranks in (1, 4, 8, 16):
            base = [r for r in runs.get((timing, ranks, "B"), []) if r]
            new = [r for r in runs.get((timing, ranks, "C"), []) if r]
            if not base or not new:
                continue
            print(f"{timing}, P = {ranks} ({len(base)} runs of B, {len(new)} of C): "
                  "C / B per point (each the median over its runs)")
            for op in OPS:
                ratios, b_times, c_times = [], [], []
                for key in (k for k in base[0] if k[0] == op):
                    b = statistics.median(r[key] for r in base if key in r)
                    c = statistics.median(r[key] for r in new if key in r)
                    ratios.append(c / b)
                    b_times.append(b)
                    c_times.append(c)
                faster = sum(r < 1 for r in ratios)
                print(f"   {op:15s} C/B {statistics.median(ratios):.3f} "
                      f"[{min(ratios):.2f}-{max(ratios):.2f}]  B {statistics.median(b_times):.2f} us"
                      f"  C {statistics.median(c_times):.2f} us  (C faster at {faster} of "
                      f"{len(ratios)} points)")


if __name__ == "__main__":
    main()
