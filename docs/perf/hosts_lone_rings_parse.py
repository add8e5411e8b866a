#!/usr/bin/env python3
"""A/B of one call's loom-bench runs in turns: each variant's median time (out of place, or with
--in-place out of place and in place, every run) per layout, link, op and size over the base
variant's. Where a variant chooses the base's pattern, its ratio measures the runs' swing.

    python3 hosts_lone_rings_parse.py CALL_LOG [--in-place] [--base B] VARIANT...
    (CALL_LOG: one call's log cut out of a raw file. hosts_lone_rings_h200host.txt: call 1's
    base is E, its variant L; calls 2-4's base is A. With --in-place:
    hosts_bcast_chain_h200host.txt call 1 base A, variants C16 C32 C64 T; call 2 base O,
    variant N; hosts_bcast_spread_h200host.txt call 4 base O, variant S)
"""
import collections
import re
import statistics as st
import sys

args = sys.argv[2:]
in_place = "--in-place" in args
args = [a for a in args if a != "--in-place"]
base_variant = "A"
if args[:1] == ["--base"]:
    base_variant, args = args[1], args[2:]
runs = collections.defaultdict(list)
variant = op = None
for line in open(sys.argv[1]):
    m = re.match(r"--- at \d+ s: variant (\w+) hosts (\d+) ranks (\d+)", line)
    if m:
        link = " 10G" if "--link-gbit 10" in line else ""
        variant = (m.group(1), f"{m.group(2)}x{int(m.group(3)) // int(m.group(2))}{link}")
        continue
    if line.startswith("---"):
        variant = None
    m = re.match(r"# (all_reduce|all_gather|reduce_scatter|broadcast|all_to_all)\s", line)
    if m:
        op = m.group(1)
        continue
    if variant and re.match(r"\s+\d+\s+\d+\s+[\d.]+", line):
        f = line.split()
        runs[(variant[1], op, int(f[0]), variant[0])] += [float(f[2])] + ([float(f[7])] if in_place else [])
ratios = {v: [] for v in args}
for layout, op, size in sorted({k[:3] for k in runs}):
    base = runs.get((layout, op, size, base_variant))
    if not base:
        continue
    shown = (f"{size / 2**20:5.2f} MiB" if size >= 2**20 else
             f"{size / 2**10:5.0f} KiB" if size >= 2**10 else f"{size:5d} B  ")
    row = f"{layout:8s} {op:14s} {shown}  {base_variant} {st.median(base):8.0f} us"
    for v in ratios:
        if runs.get((layout, op, size, v)):
            r = st.median(runs[(layout, op, size, v)]) / st.median(base)
            ratios[v].append(r)
            row += f"  {v} {r:.2f}"
    print(row)
for v, r in ratios.items():
    r.sort()
    print(f"{v}: median {st.median(r):.2f}, faster at {sum(x < 1 for x in r)} of {len(r)}, {r[0]:.2f}-{r[-1]:.2f}")
