"""Waits on oversubscribed cores: the A/B of docs/PERFORMANCE.md from the raw runs of
oversubscribed_waits_2core.txt (old = LOOM_SPIN_US=20, the default before; new = the
default now). Per P: the time per call of new over old (medians over the rounds of each
point's median and p90), and Gloo's over new's."""
import math
import re
import statistics
import sys
from collections import defaultdict

UNIT = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}


def runs(path):
    """[(P, version, {(op, bytes): (loom median, loom p90, gloo median)})] in file order."""
    out, op = [], None
    for line in open(path):
        h = re.match(r"# P=(\d+) round \d+ (old|new):", line)
        if h:
            out.append((int(h[1]), h[2], {}))
            continue
        if line.startswith("## "):
            op = line[3:].strip()
            continue
        r = re.match(r"\s+([\d.]+) (B|KiB|MiB)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s+([\d.]+)", line)
        if r and out and op != "steadiness":
            size = round(float(r[1]) * UNIT[r[2]])
            out[-1][2][(op, size)] = (float(r[3]), float(r[4]), float(r[5]))
    return out


def main(path):
    by = defaultdict(lambda: defaultdict(list))  # P -> (version, op, size) -> [rows]
    for p, version, table in runs(path):
        for key, row in table.items():
            by[p][(version,) + key].append(row)
    for p in sorted(by):
        points = sorted({k[1:] for k in by[p]})
        ratios = {"median": [], "p90": []}
        small, large, faster, gloo = [], [], 0, []
        for point in points:
            old, new = by[p][("old",) + point], by[p][("new",) + point]
            om, nm = (statistics.median(r[0] for r in rows) for rows in (old, new))
            op90, np90 = (statistics.median(r[1] for r in rows) for rows in (old, new))
            ratios["median"].append(nm / om)
            ratios["p90"].append(np90 / op90)
            (small if point[1] < 64 << 10 else large).append(nm / om)
            faster += nm < om
            gloo.append(statistics.median(r[2] for r in new) / nm)
        g = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))
        rounds = len(by[p][("old",) + points[0]])
        print(f"P = {p} ({rounds} rounds, {len(points)} points, 5 ops x sizes): new/old time "
              f"geomean {g(ratios['median']):.2f} (below 64 KiB {g(small):.2f}, from 64 KiB "
              f"{g(large):.2f}), range {min(ratios['median']):.2f}-{max(ratios['median']):.2f}, "
              f"new faster at {faster}; p90 new/old geomean {g(ratios['p90']):.2f}; "
              f"Gloo/new {min(gloo):.1f}-{max(gloo):.1f}x")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "oversubscribed_waits_2core.txt")
