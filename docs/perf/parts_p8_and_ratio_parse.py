"""Tables of parts_p8_and_ratio_h200.txt (one device call, three parts):
  parts  P = 8, parts from 256 KiB (A) against 64 KiB (C), through c10d and in the engine;
  ratio  main through c10d over the engine's out-of-place time, every op, 64 KiB-16 MiB;
  swing  P = 4 all_reduce through c10d, six runs, LOOM_BIND=1 in every other one.

    python3 docs/perf/parts_p8_and_ratio_parse.py docs/perf/parts_p8_and_ratio_h200.txt
"""
import collections
import re
import statistics
import sys

from bench_text import ENGINE_OP, engine_runs, files, size, torch_table

def read(path):
    """{file name: {(op, bytes): (median, p90)}} for loom.bench files (c10d's column), and
    {file name: {(build, op, bytes): [oop median per run]}} for loom-bench files."""
    torch, engine = {}, {}
    for name, lines in files(path).items():
        if "engine" in name:
            engine[name] = collections.defaultdict(list)
            for header, table in engine_runs(name, lines):
                build = re.search(r"\(build (\w)\)", header)[1]
                for (op, b), median in table.items():
                    engine[name][(build, op, b)].append(median)
        elif name != "host.txt":
            torch[name] = {k: v["loom"] for k, v in torch_table(lines).items()}
    return torch, engine


def med(values):
    return statistics.median(values)


def parts(torch, engine):
    runs = {X: [t for n, t in torch.items() if n.startswith("parts_torch") and n.endswith(f"_{X}.txt")]
            for X in "AC"}
    print("\nP = 8 through c10d, parts from 256 KiB (A) against 64 KiB (C): each run's median µs, "
          "in run order; C/A = median of C's runs over median of A's")
    for op in ENGINE_OP:
        keys = sorted(k for k in runs["A"][0] if k[0] == op)
        if not keys:
            continue
        print(f"  {op}")
        for k in keys:
            a, c = [t[k][0] for t in runs["A"]], [t[k][0] for t in runs["C"]]
            print(f"    {size(k[1]):>8} | A {' '.join(f'{v:.0f}' for v in a)} | "
                  f"C {' '.join(f'{v:.0f}' for v in c)} | C/A {med(c) / med(a):.2f}")
    tab = engine["parts_engine_P8.txt"]
    print("\nP = 8 engine (loom-bench, out of place), A C C A: each run's median µs; C/A as above")
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        print(f"  {op}")
        for b in sorted({k[2] for k in tab if k[1] == op}):
            a, c = tab[("A", op, b)], tab[("C", op, b)]
            print(f"    {size(b):>8} | A {' '.join(f'{v:.0f}' for v in a)} | "
                  f"C {' '.join(f'{v:.0f}' for v in c)} | C/A {med(c) / med(a):.2f}")


def ratio(torch, engine):
    for P, turns in ((4, (1, 2)), (8, (1,))):
        print(f"\nP = {P}, main: through c10d (median [p90]) over the engine's out-of-place "
              f"median, turn by turn (criterion: at most 1.3x from 64 KiB)")
        for op, eop in ENGINE_OP.items():
            print(f"  {op}")
            keys = sorted(k for k in torch[f"ratio_torch_P{P}_t1.txt"] if k[0] == op)
            for k in keys:
                cells = []
                for t in turns:
                    c10d, p90 = torch[f"ratio_torch_P{P}_t{t}.txt"][k]
                    e = engine[f"ratio_engine_P{P}_t{t}.txt"][("C", eop, k[1])][0]
                    cells.append(f"{c10d:.0f} [{p90:.0f}] / {e:.0f} = {c10d / e:.2f}x")
                print(f"    {size(k[1]):>8} | " + " | ".join(cells))


def swing(torch):
    print("\nP = 4 all_reduce through c10d, main, runs in order (LOOM_BIND 0 1 0 1 0 1): "
          "median µs [p90]")
    names = sorted(n for n in torch if n.startswith("swing"))
    for b in sorted({k[1] for k in torch[names[0]]}):
        cells = [f"{torch[n][('all_reduce', b)][0]:.0f} [{torch[n][('all_reduce', b)][1]:.0f}]"
                 for n in names]
        unbound = [torch[n][("all_reduce", b)][0] for n in names if "bind0" in n]
        bound = [torch[n][("all_reduce", b)][0] for n in names if "bind1" in n]
        print(f"  {size(b):>8} | " + " | ".join(cells) +
              f" | max/min unbound {max(unbound) / min(unbound):.2f}, bound {max(bound) / min(bound):.2f}")


def main(path):
    torch, engine = read(path)
    parts(torch, engine)
    ratio(torch, engine)
    swing(torch)


if __name__ == "__main__":
    main(sys.argv[1])
