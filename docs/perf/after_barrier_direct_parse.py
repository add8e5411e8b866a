"""Table of after_barrier_direct_h200.txt: per P, op and size, each turn's engine median
back to back, the engine after a barrier (loom-bench --after-barrier, rank 0's single call),
and torch.ops.loom through loom.bench, with the direct entry over each engine timing.

    python3 docs/perf/after_barrier_direct_parse.py docs/perf/after_barrier_direct_h200.txt
"""
import sys

from bench_text import engine_runs, files, torch_table

TORCH_OP = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
            "all_to_all_single": "all_to_all"}


def read(path):
    """{file: {(op, bytes): median µs}}, ops by the engine's names."""
    tabs = {}
    for name, lines in files(path).items():
        if name.startswith("engine"):
            tabs[name] = engine_runs(name, lines)[0][1]
        else:
            tabs[name] = {(TORCH_OP[op], b): v["direct"][0]
                          for (op, b), v in torch_table(lines).items() if op in TORCH_OP}
    return tabs


def main(path):
    tabs = read(path)
    for P in (4, 8):
        print(f"\nP = {P}, each turn: back to back | after a barrier | direct µs "
              f"(direct over each)")
        for op in TORCH_OP.values():
            for b in sorted({k[1] for k in tabs[f"engine_P{P}_t1.txt"] if k[0] == op}):
                cells = []
                for t in (1, 2):
                    e = tabs[f"engine_P{P}_t{t}.txt"][(op, b)]
                    a = tabs[f"engine_P{P}_t{t}_barrier.txt"][(op, b)]
                    d = tabs[f"torch_P{P}_t{t}.txt"][(op, b)]
                    cells.append(f"{e:4.0f} {a:4.0f} {d:4.0f} ({d / e:.2f}x, {d / a:.2f}x)")
                print(f"  {op:14} {b >> 10:5} KiB | " + " || ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1])
