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

from bench_text import files, size, torch_table


def main(path):
    runs = collections.defaultdict(list)  # (P, build, entry, bytes) -> medians in run order
    for name, lines in files(path).items():
        P, build = re.match(r"a2a_P(\d+)_r\d+_(\w)\.txt", name).groups()
        for (_, b), entries in torch_table(lines).items():
            for e, (median, _) in entries.items():
                runs[(int(P), build, e, b)].append(median)
    for P in sorted({k[0] for k in runs}):
        for e in ("loom", "eager"):
            print(f"\nP = {P}, all_to_all through {e}: A (default) runs | B (1M) runs | B/A")
            for b in sorted({k[3] for k in runs if k[0] == P and k[2] == e}):
                a, bb = runs[(P, "A", e, b)], runs[(P, "B", e, b)]
                print(f"  {size(b):>8} | {' '.join(f'{x:.0f}' for x in a)} | "
                      f"{' '.join(f'{x:.0f}' for x in bb)} | "
                      f"{statistics.median(bb) / statistics.median(a):.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
