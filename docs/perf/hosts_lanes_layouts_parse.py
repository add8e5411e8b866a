#!/usr/bin/env python3
"""The table of docs/PERFORMANCE.md, "Lanes" (the issue's layouts), from
docs/perf/hosts_lanes_layouts_h200host.txt: per layout, op and size, loom's median through
torch with one lane and with two (the median of each count's two runs), two over one, and
Gloo's time over loom's with one lane (the default there).

    python3 docs/perf/hosts_lanes_layouts_parse.py docs/perf/hosts_lanes_layouts_h200host.txt"""
import re
import statistics
import sys
from collections import defaultdict

from bench_text import size, torch_table


def runs(path):
    """[(label, layout, [lines])] of the raw file, each run begun by its "[N s] ..." line."""
    out = []
    for line in open(path, encoding="utf-8"):
        m = re.search(r"\] (loom lanes (\d)|gloo), hosts (\d+), ranks (\d+)$", line.strip())
        if m:
            label = f"lanes {m[2]}" if m[2] else "gloo"
            out.append((label, f"{m[3]} x {int(m[4]) // int(m[3])}", []))
        elif out:
            out[-1][2].append(line)
    return out


def main(path):
    times = defaultdict(list)  # (layout, op, bytes, label) -> medians
    for label, layout, lines in runs(path):
        for (op, nbytes), entries in torch_table(lines).items():
            times[(layout, op, nbytes, label)].append(next(iter(entries.values()))[0])
    keys = sorted({k[:3] for k in times}, key=lambda k: (k[0], k[1], k[2]))
    print("| layout | op | size | 1 lane, µs | 2 lanes, µs | 2 / 1 | Gloo / 1 lane |")
    print("|---|---|---|---|---|---|---|")
    for layout, op, nbytes in keys:
        one = statistics.median(times[(layout, op, nbytes, "lanes 1")])
        two = statistics.median(times[(layout, op, nbytes, "lanes 2")])
        gloo = statistics.median(times[(layout, op, nbytes, "gloo")])
        print(f"| {layout} | {op} | {size(nbytes)} | {one:.0f} | {two:.0f} | {two / one:.2f}x "
              f"| {gloo / one:.2f}x |")


if __name__ == "__main__":
    main(sys.argv[1])
