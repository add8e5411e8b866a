#!/usr/bin/env python3
"""Tables of docs/PERFORMANCE.md, "Lanes", from docs/perf/hosts_lanes_h200host.txt: per layout,
op and size, the medians over the runs of each lane count (engine: loom-bench's out-of-place
time per call; through torch: loom.bench's median per call), the ratio 2 lanes / 1, and, through
torch, Gloo's time over each; then call 6 (a segment per lane, A/B) and call 7 (as committed,
beside Gloo).

    python3 docs/perf/hosts_lanes_parse.py docs/perf/hosts_lanes_h200host.txt"""
import re
import statistics
import sys
from collections import defaultdict

from bench_text import size as sized, torch_table

ENGINE_OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
med = statistics.median


def calls(path):
    """{call number: [lines]} of the raw file, each call begun by "######## call N"."""
    out, call = {}, None
    for line in open(path, encoding="utf-8"):
        m = re.match(r"######## call (\d+)", line)
        if m:
            call = m[1]
            out[call] = []
        elif line.startswith("########"):
            call = None
        elif call is not None:
            out[call].append(line)
    return out


def runs(lines, label):
    """The runs of one call, each begun by a "[N s] ..." line that `label` (a regex) matches:
    [(its match, [the run's lines])]."""
    out = []
    for line in lines:
        m = re.search(r"\[\d+ s\] " + label + "$", line.strip())
        if m:
            out.append((m, []))
        elif out:
            out[-1][1].append(line)
    return out


def engine_rows(lines, per_op):
    """A loom-bench run's rows as kept by the scripts (bytes, time, p90, busbw, #wrong), in
    the order of ENGINE_OPS, `per_op` sizes each: {(op, bytes): µs}. Fails on wrong results."""
    rows = [line.split() for line in lines if len(line.split()) == 5 and line.split()[0].isdigit()]
    assert all(r[4] == "0" for r in rows), "a run had wrong results"
    return {(ENGINE_OPS[i // per_op], int(r[0])): float(r[1]) for i, r in enumerate(rows)}


def collect(pairs):
    """{key + (tag,): [values]} from (tag, {key: value}) pairs."""
    out = defaultdict(list)
    for tag, table in pairs:
        for key, value in table.items():
            out[key + (tag,)].append(value)
    return out


def torch_runs(lines, label, tag, entry):
    """(tag(match), {(op, bytes): median µs of column entry(tag)}) per loom.bench run."""
    for m, run in runs(lines, label):
        t = tag(m)
        yield t, {k: v[entry(t)][0] for k, v in torch_table(run).items()}


def main():
    raw = calls(sys.argv[1])
    # (op, bytes, (layout, lanes)) -> [µs]
    engine = collect(((m[1], int(m[2])), engine_rows(run, 3))
                     for m, run in runs(raw["3"], r"layout (\S+) lanes (\d)"))
    print("engine (loom-bench, out-of-place us per call): layout, op, size, 1 lane, 2 lanes, 2/1")
    for layout, op, b in sorted({(k[2][0], k[0], k[1]) for k in engine},
                                key=lambda k: (k[0], ENGINE_OPS.index(k[1]), k[2])):
        one, two = engine[(op, b, (layout, 1))], engine[(op, b, (layout, 2))]
        print(f"  {layout} {op:15s} {b >> 20:3d} MiB  {med(one):9.0f}  {med(two):9.0f}  {med(two) / med(one):.2f}")

    # (op, bytes, "1" | "2" | "gloo") -> [µs]
    torch = collect(torch_runs(raw["4"], r"(loom lanes (\d)|gloo)", lambda m: m[2] or "gloo",
                               lambda t: "gloo" if t == "gloo" else "loom"))
    print("through torch, 2 x 1 (loom.bench us per call): op, size, 1 lane, 2 lanes, 2/1, Gloo/1 lane, Gloo/2 lanes")
    for op, b in dict.fromkeys(k[:2] for k in torch):
        one, two, gloo = torch[(op, b, "1")], torch[(op, b, "2")], torch[(op, b, "gloo")]
        print(f"  {op:22s} {sized(b):7s} {med(one):8.0f}  {med(two):8.0f}  {med(two) / med(one):.2f}"
              f"  {med(gloo) / med(one):.2f}x  {med(gloo) / med(two):.2f}x")

    split = collect((m[1], engine_rows(run, 4)) for m, run in runs(raw["6"], r"2x1 ([AB])"))
    print("call 6, 2 x 1, two lanes: op, size, usual segments (A), one per lane (B), B/A (engine us)")
    for op, b in sorted({k[:2] for k in split}, key=lambda k: (ENGINE_OPS.index(k[0]), k[1])):
        usual, per_lane = split[(op, b, "A")], split[(op, b, "B")]
        print(f"  {op:15s} {b >> 20} MiB  {med(usual):7.0f}  {med(per_lane):7.0f}  {med(per_lane) / med(usual):.2f}")

    after = collect(torch_runs(raw["7"], r"(loom|gloo)", lambda m: m[1], lambda t: t))
    print("call 7, through torch, 2 x 1 as committed: op, size, loom, Gloo, Gloo/loom (us)")
    for op, b in dict.fromkeys(k[:2] for k in after):
        loom, gloo = after[(op, b, "loom")], after[(op, b, "gloo")]
        print(f"  {op:22s} {sized(b):7s} {med(loom):7.0f}  {med(gloo):7.0f}  {med(gloo) / med(loom):.2f}x")


if __name__ == "__main__":
    main()
