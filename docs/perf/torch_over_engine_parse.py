"""Tables of torch_over_engine_h200.txt, torch_over_engine_eager_h200.txt and
torch_over_engine_p16_h200.txt (P = 16 twice, P = 4 and 8 once): main through
c10d ("loom"), torch.ops.loom ("direct") and, in the other two files, loom.ops ("eager"), each
over the engine's out-of-place median (loom-bench run just before it), per P and turn; the
criterion is at most 1.3x from 64 KiB through any entry.

    python3 docs/perf/torch_over_engine_parse.py docs/perf/torch_over_engine_h200.txt
"""
import re
import sys

from bench_text import ENGINE_OP, engine_runs, files, size, torch_table

def read(path):
    """{file: table}: loom.bench files give {(op, bytes): {entry: (median, p90)}},
    loom-bench files {(op, bytes): out-of-place median}."""
    tabs = {}
    for name, lines in files(path).items():
        if name.startswith("ratio_engine"):
            tabs[name] = engine_runs(name, lines)[0][1]
        elif name.startswith("ratio_torch"):
            tabs[name] = torch_table(lines)
    return tabs


def main(path):
    tabs = read(path)
    found = {re.match(r"ratio_torch_P(\d+)_t(\d+)", n).groups()
             for n in tabs if n.startswith("ratio_torch")}
    for P in sorted({int(p) for p, _ in found}):
        turns = sorted(int(t) for p, t in found if int(p) == P)
        names = list(next(iter(tabs[f"ratio_torch_P{P}_t1.txt"].values())))
        print(f"\nP = {P}: per turn, engine µs | " + " | ".join(f"{n} µs [p90]" for n in names) +
              " | the fastest entry over the engine")
        within = total = 0
        for op, eop in ENGINE_OP.items():
            print(f"  {op}")
            keys = sorted(k for k in tabs[f"ratio_torch_P{P}_t1.txt"] if k[0] == op)
            for k in keys:
                cells = []
                for t in turns:
                    row = tabs[f"ratio_torch_P{P}_t{t}.txt"][k]
                    e = tabs[f"ratio_engine_P{P}_t{t}.txt"][(eop, k[1])]
                    best = min(m for m, _ in row.values()) / e
                    within += best <= 1.3
                    total += 1
                    cells.append(f"{e:.0f} | " + " | ".join(f"{m:.0f} [{p:.0f}]" for m, p in row.values())
                                 + f" | {best:.2f}x")
                print(f"    {size(k[1]):>8} | " + " || ".join(cells))
        print(f"  within 1.3x through the fastest entry: {within} of {total} points")


if __name__ == "__main__":
    main(sys.argv[1])
