"""Tables of rooted_own_copy_h200.txt: loom-bench's broadcast, gather and scatter, out of
place, with the root's own copy after the last chunk (A, b39ca66) and chunk by chunk beside
the others' (B: a try, not kept; docs/PERFORMANCE.md, "The root's own copy, chunk by
chunk, tried"), in turns A B B A at P = 4, 8 and 16; per point the median over each build's
two runs (out of place, then in place for reference) and B over A; then, per build, the
out-of-place median over the in-place one from 4 MiB (both from the same runs, so the
runs' drift cancels): what the root's own copy costs a broadcast.

    python3 docs/perf/rooted_own_copy_parse.py docs/perf/rooted_own_copy_h200.txt
"""
import re
import statistics
import sys

from bench_text import files

ROW = re.compile(r"\s+(\d+)\s+\d+\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\d+)\s+([\d.]+)\s+[\d.]+"
                 r"\s+[\d.]+\s+[\d.]+\s+(\d+)")


def runs(name, lines):
    """[(build, {(op, bytes): (oop µs, ip µs)})] in file order; fails on any wrong result."""
    out, op = [], None
    for line in lines:
        m = re.match(r"# .*loom-bench -n \d+ .*\(build (\w)\)", line)
        if m:
            out.append((m[1], {}))
            continue
        h = re.match(r"# (\w+)\s+float32", line)
        if h:
            op = h[1]
            continue
        r = ROW.match(line)
        if r:
            assert r[3] == "0" and r[5] == "0", f"{name}: wrong results at {op} {r[1]}"
            out[-1][1][(op, int(r[1]))] = (float(r[2]), float(r[4]))
    return out


def size(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"


def main(path):
    for name, lines in files(path).items():
        m = re.match(r"rooted_P(\d+)", name)
        if not m:
            continue
        rs = runs(name, lines)
        print(f"\nP = {m[1]} ({' '.join(b for b, _ in rs)}): out of place, µs (median of two runs) "
              "| B / A | in place A, B")
        for op in ("broadcast", "gather", "scatter"):
            print(f"  {op}")
            ratios = []
            for key in sorted(k for k in rs[0][1] if k[0] == op):
                med = {X: statistics.median(t[key][0] for b, t in rs if b == X) for X in "AB"}
                ip = {X: statistics.median(t[key][1] for b, t in rs if b == X) for X in "AB"}
                ratios.append(med["B"] / med["A"])
                print(f"    {size(key[1]):>8} | A {med['A']:8.1f} | B {med['B']:8.1f} | "
                      f"{ratios[-1]:.2f}x | {ip['A']:8.1f} {ip['B']:8.1f}")
            print(f"    B / A from {min(ratios):.2f}x to {max(ratios):.2f}x, "
                  f"median {statistics.median(ratios):.2f}x")
        def excess(X):  # out of place over in place, 4-32 MiB
            return " ".join(f"{median(rs, X, b, 0) / median(rs, X, b, 1):.2f}"
                            for b in (4 << 20, 8 << 20, 16 << 20, 32 << 20))
        print(f"  broadcast out of place over in place, 4/8/16/32 MiB: A {excess('A')}; "
              f"B {excess('B')}")


def median(rs, X, b, column):
    """Build X's median broadcast of b bytes over its runs: out of place (0) or in place (1)."""
    return statistics.median(t[("broadcast", b)][column] for x, t in rs if x == X)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/perf/rooted_own_copy_h200.txt")
