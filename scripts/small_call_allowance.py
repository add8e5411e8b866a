#!/usr/bin/env python3
"""Issue 9's small-call allowance from one log: for each P and op, c10d - fake - engine per
size (loom through dist.*, torch's no-op `fake` backend, loom-bench's time for the same size
and form: in place for all_reduce and broadcast, which dist.* calls in place, out of place
for the others), its range and median from 8 B to 1 KiB, and its median to 4 KiB; and the
same for loom.ops's eager functions (eager - engine: what the direct entry adds to the
engine, with no floor to subtract).

The log holds, per P, a `loom-bench -n P -b 8 -e 4K ...` run followed by a
`python3 -m loom.bench --ranks P --max-bytes 4K --backends loom,direct,eager,fake` run, each
announced by a line starting with "# " that names the command (as .device scripts write).
A second loom-bench run of P with `--after-barrier` (every call timed alone after a barrier
on rank 0, as loom.bench times calls through torch) gives a second engine time, and each
difference is then printed against both: back-to-back calls' mean, and single calls.

    python3 scripts/small_call_allowance.py docs/perf/small_calls_out_h200.txt
"""

import re
import statistics
import sys

ENGINE_OPS = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
              "reduce_scatter": "reduce_scatter_tensor", "broadcast": "broadcast",
              "all_to_all": "all_to_all_single"}
UNITS = {"B": 1, "KiB": 1024, "MiB": 1 << 20}


IN_PLACE = {"all_reduce", "broadcast"}  # how loom.bench calls them through dist.*


def parse(lines):
    """(engine µs by timing -> (P, op, bytes), torch µs by (P, op, bytes) -> {backend: µs});
    the timings are "back-to-back" and, where the log has them, "after a barrier"."""
    engine, torch_times = {"back-to-back": {}, "after a barrier": {}}, {}
    ranks = mode = op = None
    backends = []
    for line in lines:
        engine_run = re.search(r"loom-bench -n (\d+)", line)
        torch_run = re.search(r"loom\.bench --ranks (\d+) .*--backends (\S+)", line)
        if line.startswith("# ") and engine_run:
            ranks, mode = int(engine_run.group(1)), "engine"
            timing = "after a barrier" if "--after-barrier" in line else "back-to-back"
            continue
        if line.startswith("# ") and torch_run:
            ranks, mode = int(torch_run.group(1)), "torch"
            backends = torch_run.group(2).split(",")
            continue
        if line.startswith("# ") and ("bash " in line or "python3 " in line):
            mode = None
        fields = line.split()
        if mode == "engine":
            m = re.match(r"# (\w+)\s+float32", line)
            if m:
                op = ENGINE_OPS[m.group(1)]
            elif len(fields) > 7 and fields[0].isdigit():
                column = 7 if op in IN_PLACE else 2
                engine[timing][(ranks, op, int(fields[0]))] = float(fields[column])
        elif mode == "torch":
            m = re.match(r"## (\w+)", line)
            if m:
                op = m.group(1)
            elif len(fields) >= 2 + 3 * len(backends) and fields[1] in UNITS:
                size = int(float(fields[0]) * UNITS[fields[1]])
                torch_times[(ranks, op, size)] = {
                    b: float(fields[2 + 3 * i]) for i, b in enumerate(backends)}
    return engine, torch_times


def summary(values_small, values_all) -> str:
    return (f"{min(values_small):6.2f}..{max(values_small):5.2f}, median "
            f"{statistics.median(values_small):5.2f}   (to 4 KiB: {statistics.median(values_all):5.2f})")


def main() -> int:
    engines, torch_times = parse(open(sys.argv[1], errors="replace").read().splitlines())
    for ranks in sorted({k[0] for k in torch_times}):
        print(f"P = {ranks}: µs per size, 8 B-1 KiB range and median")
        for op in ENGINE_OPS.values():
            for timing, engine in engines.items():
                rows = [(size, t, engine[(ranks, op, size)])
                        for (p, o, size), t in sorted(torch_times.items())
                        if p == ranks and o == op and (ranks, op, size) in engine]
                if not rows:
                    continue
                c10d = [t["loom"] - t["fake"] - e for _, t, e in rows]
                small = [v for (size, _, _), v in zip(rows, c10d) if size <= 1024]
                label = f"{op:24s}" if timing == "back-to-back" else " " * 24
                print(f"  {label} c10d - fake - engine ({timing:15s}) {summary(small, c10d)}")
                if "eager" in rows[0][1]:
                    eager = [t["eager"] - e for _, t, e in rows]
                    small = [v for (size, _, _), v in zip(rows, eager) if size <= 1024]
                    print(f"  {'':24s} eager - engine       ({timing:15s}) {summary(small, eager)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
