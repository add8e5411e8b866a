"""Tables of helper_pieces_h200.txt: per call, P, collective and size, each run's median
(and p90) per build, and the median of one build's run medians over the first build's.

    python3 docs/perf/helper_pieces_parse.py docs/perf/helper_pieces_h200.txt
"""
import collections
import re
import statistics
import sys

SIZES = ["64 KiB", "128 KiB", "256 KiB", "512 KiB", "1 MiB", "2 MiB", "4 MiB"]
OPS = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
       "broadcast"]


def read(path):
    """{call: {(P, op, size, build): [(median, p90)]}} through torch, and
    {call: {(P, mode, op, bytes, build): [median]}} of loom-bench."""
    torch, engine = collections.defaultdict(lambda: collections.defaultdict(list)), \
        collections.defaultdict(lambda: collections.defaultdict(list))
    call = name = op = build = mode = None
    for line in open(path):
        m = re.match(r"==> (call\d)/(\S+) <==", line)
        if m:
            call, name, op, build = m[1], m[2], None, None
            continue
        if name is None:
            continue
        t = re.match(r"torch_P(\d+)_r\d+_(\w)\.txt", name)
        if t:
            if line.startswith("## "):
                op = line[3:].strip()
            r = re.match(r"\s+(\d+ [KM]iB)\s+([\d.]+)\s+([\d.]+)", line)
            if r and op in OPS:
                torch[call][(int(t[1]), op, r[1], t[2])].append((float(r[2]), float(r[3])))
            continue
        e = re.match(r"engine_P(\d+)\.txt", name)
        if e:
            h = re.match(r"# loom-bench .*?(--after-barrier)? \(build (\w), turn", line)
            if h:
                build, mode = h[2], "after a barrier" if h[1] else "back to back"
                continue
            h = re.match(r"# (\w+)\s+float32", line)
            if h:
                op = h[1]
                continue
            r = re.match(r"\s+(\d+)\s+\d+\s+([\d.]+)\s+[\d.]+", line)
            if r and build:
                engine[call][(int(e[1]), mode, op, int(r[1]), build)].append(float(r[2]))
    return torch, engine


def ratio(values, base):
    if not values or not base:
        return ""
    return f"{statistics.median(values) / statistics.median(base):.2f}"


def main(path):
    torch, engine = read(path)
    for call, tab in torch.items():
        builds = sorted({k[3] for k in tab})
        for P in sorted({k[0] for k in tab}):
            for op in OPS:
                rows = [s for s in SIZES if (P, op, s, builds[0]) in tab]
                if not rows:
                    continue
                print(f"\n{call} through c10d, P = {P}, {op}: each run's median µs [p90]; "
                      f"ratios: median of runs over {builds[0]}'s")
                for s in rows:
                    cells = []
                    for X in builds:
                        runs = tab.get((P, op, s, X), [])
                        cells.append(f"{X}: " + ", ".join(f"{a:.0f} [{b:.0f}]" for a, b in runs))
                    base = [a for a, _ in tab[(P, op, s, builds[0])]]
                    ratios = " ".join(
                        f"{X}/{builds[0]} {ratio([a for a, _ in tab.get((P, op, s, X), [])], base)}"
                        for X in builds[1:])
                    print(f"  {s:>8} | " + " | ".join(cells) + f" | {ratios}")
    for call, tab in engine.items():
        builds = sorted({k[4] for k in tab})
        for P in sorted({k[0] for k in tab}):
            for mode in ("back to back", "after a barrier"):
                for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
                    sizes = sorted({k[3] for k in tab if k[:3] == (P, mode, op)})
                    if not sizes:
                        continue
                    print(f"\n{call} loom-bench, P = {P}, {op}, {mode}: each run's median µs")
                    for b in sizes:
                        cells = [f"{X}: " + ", ".join(f"{v:.0f}" for v in tab[(P, mode, op, b, X)])
                                 for X in builds]
                        base = tab[(P, mode, op, b, builds[0])]
                        ratios = " ".join(f"{X}/{builds[0]} {ratio(tab[(P, mode, op, b, X)], base)}"
                                          for X in builds[1:])
                        print(f"  {b >> 10:>5} KiB | " + " | ".join(cells) + f" | {ratios}")


if __name__ == "__main__":
    main(sys.argv[1])
