"""Summarises docs/perf/cuda_root_checks.txt: per call, MPS or not, P, op and size, the
medians of each old (HEAD 611a383) and new run, and new over old (the lower medians'
ratio, then the higher ones')."""

import collections
import re
import sys


def main(path: str) -> None:
    runs = collections.defaultdict(list)
    call, build, mps = None, None, False
    for line in open(path):
        m = re.match(r"######## call (\d): output", line)
        if m:
            call, build, mps = int(m.group(1)), None, "under MPS" in line
            continue
        m = re.match(r"== \[\d+ s\] bench (old|new) (?:P=)?(\d)", line)
        if m:
            build = m.group(1)
            continue
        if line.startswith("== [") and line.rstrip().endswith("MPS"):
            mps = True
            continue
        m = re.match(r"P=(\d) (\w+)\s+(\d+) B loom  median\s+([\d.]+) us", line)
        if m and build:
            key = (call, mps, int(m.group(1)), m.group(2), int(m.group(3)))
            runs[key + (build,)].append(float(m.group(4)))
    points = sorted({k[:5] for k in runs})
    for key in points:
        old, new = runs[key + ("old",)], runs[key + ("new",)]
        if not old or not new:
            continue
        call, mps, p, op, size = key
        print(f"call {call} {'MPS' if mps else 'no MPS'} P={p} {op:<10} {size:>8} B: "
              f"old {old} new {new} new/old {min(new) / min(old):.2f}-{max(new) / max(old):.2f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/perf/cuda_root_checks.txt")
