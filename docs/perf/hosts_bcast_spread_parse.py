#!/usr/bin/env python3
"""The spread small broadcast through torch (hosts_bcast_spread_h200host.txt): per layout and
size, each variant's median over its runs of the per-run median time (`python3 -m loom.bench`,
rank 0, the root), S over O, and Gloo's time (its one run) over S's.

    python3 hosts_bcast_spread_parse.py CALL_LOG
"""
import collections
import re
import statistics as st
import sys

UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}
runs = collections.defaultdict(list)  # (layout, size, variant) -> per-run medians
key = None
for line in open(sys.argv[1]):
    m = re.match(r"--- at \d+ s: torch variant (\w+) hosts (\d+) ranks (\d+) .*--backends (\w+)", line)
    if m:
        v = "gloo" if m.group(4) == "gloo" else m.group(1)
        key = (f"{m.group(2)}x{int(m.group(3)) // int(m.group(2))}", v)
        continue
    if line.startswith("---"):
        key = None
    m = re.match(r"\s+(\d+) (B|KiB|MiB)\s+([\d.]+)\s", line)
    if key and m:
        runs[(key[0], int(m.group(1)) * UNITS[m.group(2)], key[1])].append(float(m.group(3)))
ratios = collections.defaultdict(list)
for layout, size in sorted({k[:2] for k in runs}):
    o, s, g = (runs.get((layout, size, v)) for v in ("O", "S", "gloo"))
    if not (o and s):
        continue
    row = f"{layout} {size:6d} B  O {st.median(o):6.1f} us ({len(o)} runs)  S {st.median(s):6.1f} us ({len(s)})  S/O {st.median(s) / st.median(o):.2f}"
    ratios[layout].append(st.median(s) / st.median(o))
    if g:
        row += f"  gloo {st.median(g):6.1f} us  gloo/S {st.median(g) / st.median(s):.1f}x  gloo/O {st.median(g) / st.median(o):.1f}x"
    print(row)
for layout, r in ratios.items():
    r.sort()
    print(f"{layout}: S/O median {st.median(r):.2f}, {r[0]:.2f}-{r[-1]:.2f}")
