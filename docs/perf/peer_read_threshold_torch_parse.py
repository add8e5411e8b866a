"""Table of peer_read_threshold_torch_h200.txt: all_to_all through c10d ("loom") and loom.ops
("eager") with LOOM_PEER_READ_BYTES at its default (A: 256K at 8 or more ranks) and at 1M
(B: staged below 1 MiB), runs in turns A B B A A B per P; each run's median µs and the
median of B's runs over A's.

    python3 docs/perf/peer_read_threshold_torch_parse.py docs/perf/peer_read_threshold_torch_h200.txt
"""
import collections
import re
import statistics
import sys


def main(path):
    runs = collections.defaultdict(list)  # (P, build, entry, size) -> medians in run order
    name = None
    entries = []
    for line in open(path):
        m = re.match(r"==> a2a_P(\d+)_r\d+_(\w)\.txt <==", line)
        if m:
            name = (int(m[1]), m[2])
            continue
        if line.strip().startswith("size "):
            entries = re.findall(r"(\w+) us", line)
            continue
        r = re.match(r"\s+(\d+ [KM]iB)((?:\s+[\d.]+)+)", line)
        if r and name:
            v = [float(x) for x in r[2].split()]
            for i, e in enumerate(entries):
                runs[(name[0], name[1], e, r[1])].append(v[3 * i])
    for P in sorted({k[0] for k in runs}):
        for e in ("loom", "eager"):
            print(f"\nP = {P}, all_to_all through {e}: A (default) runs | B (1M) runs | B/A")
            for size in dict.fromkeys(k[3] for k in runs if k[0] == P and k[2] == e):
                a, b = runs[(P, "A", e, size)], runs[(P, "B", e, size)]
                print(f"  {size:>8} | {' '.join(f'{x:.0f}' for x in a)} | "
                      f"{' '.join(f'{x:.0f}' for x in b)} | {statistics.median(b) / statistics.median(a):.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
