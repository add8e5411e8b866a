#!/usr/bin/env python3
"""The multi-host targets from one call of `python3 -m loom.bench ... --backends loom,gloo`
runs (hosts_targets_9239312_h200host.txt): per layout and op, Gloo's time over loom's (the
bench's last column) up to 32 KiB (how many points reach 5x), at 64 KiB, and from 1 MiB.

    python3 hosts_targets_parse.py CALL_LOG
"""
import collections
import re
import sys

UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}
ratios = collections.defaultdict(list)  # (layout, op) -> [(bytes, gloo/loom)]
layout = op = None
for line in open(sys.argv[1]):
    m = re.match(r"--- at \d+ s: (?:round \d |lone )layout (\w+)", line)
    if m:
        layout = m.group(1)
        continue
    if line.startswith("---"):
        layout = None
    m = re.match(r"## (\w+)", line)
    if m:
        op = m.group(1)
        continue
    m = re.match(r"\s+(\d+) (B|KiB|MiB)\s.*\s([\d.]+)x$", line)
    if m and layout:
        ratios[(layout, op)].append((int(m.group(1)) * UNITS[m.group(2)], float(m.group(3))))
for (layout, op), points in sorted(ratios.items()):
    small = [x for b, x in points if b <= 32 << 10]
    at64 = [x for b, x in points if b == 64 << 10]
    big = [x for b, x in points if b >= 1 << 20]
    row = f"{layout} {op:24s}"
    if small:
        row += f"  8 B-32 KiB {min(small):.1f}-{max(small):.1f}x (5x or more at {sum(x >= 5 for x in small)} of {len(small)})"
    if at64:
        row += f"  64 KiB {min(at64):.1f}-{max(at64):.1f}x"
    if big:
        row += f"  1-16 MiB {min(big):.1f}-{max(big):.1f}x (3x or more at {sum(x >= 3 for x in big)} of {len(big)})"
    print(row)
