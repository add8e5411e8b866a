#!/usr/bin/env python3
"""Parses the raw output of stop 65's device calls (files of the call joined, each after a
line '==> NAME <=='):

    python3 docs/perf/finished_work_parse.py docs/perf/finished_work_turns_h200.txt
    python3 docs/perf/finished_work_parse.py docs/perf/helpers_through_torch_h200.txt

For call 2: per P, build (B, C) and op, the medians over 8 B-1 KiB of loom's time through
c10d, the no-op `fake` backend's and their difference, each run's median then the median of
the runs; the allowance (c10d - fake - engine, the engine in place for all_reduce and
broadcast as dist.* calls them, back to back and after a barrier); and from 64 KiB, c10d and
the direct op against the engine's two timings. For call 3: the engine and each variant's
runs through torch, µs per size.
"""

import re
import statistics
import sys

UNITS = {"B": 1, "KiB": 1024, "MiB": 1 << 20}
ENGINE_OPS = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
              "reduce_scatter": "reduce_scatter_tensor", "broadcast": "broadcast",
              "all_to_all": "all_to_all_single"}
IN_PLACE = {"all_reduce", "broadcast"}


def sections(path):
    """{name: [lines]} of the joined file."""
    out, name = {}, None
    for line in open(path, errors="replace"):
        m = re.match(r"==> (\S+) <==", line)
        if m:
            name = m.group(1)
            out[name] = []
        elif name:
            out[name].append(line)
    return out


def engine(lines, in_place_column=True):
    """{(timing, label): {(op, bytes): µs}}; label is what follows the command's options."""
    times, key, op = {}, None, None
    for line in lines:
        if line.startswith("# loom-bench -n"):
            timing = "after a barrier" if "--after-barrier" in line else "back to back"
            label = re.search(r"\((.*)\)", line)
            key = (timing, label.group(1) if label else "")
            times.setdefault(key, {})
            continue
        m = re.match(r"# (\w+)\s+float32", line)
        if m:
            op = ENGINE_OPS[m.group(1)]
            continue
        f = line.split()
        if key and op and len(f) > 7 and f[0].isdigit():
            column = 7 if in_place_column and op in IN_PLACE else 2
            times[key][(op, int(f[0]))] = float(f[column])
    return times


def torch_run(lines):
    """{(op, bytes): (first backend µs, second backend µs)}."""
    out, op = {}, None
    for line in lines:
        m = re.match(r"## (\w+)", line)
        if m:
            op = m.group(1)
            continue
        f = line.split()
        if len(f) >= 8 and f[1] in UNITS:
            out[(op, int(float(f[0]) * UNITS[f[1]]))] = (float(f[2]), float(f[5]))
    return out


def spread(values):
    values = sorted(values)
    return f"{statistics.median(values):6.2f} [{values[0]:.2f}..{values[-1]:.2f}]"


def call2(parts):
    for p in (4, 8):
        eng = engine(parts[f"engine_small_{p}.txt"])
        runs = {b: [torch_run(v) for k, v in parts.items() if re.match(rf"c10d_P{p}_r\d+_{b}\.txt", k)]
                for b in "BC"}
        print(f"P = {p}: medians over 8 B-1 KiB, per run, then median [range] of the runs")
        for op in ("all_reduce", "reduce_scatter_tensor", "broadcast", "all_to_all_single"):
            print(f"  {op}")
            for b in "BC":
                def per_run(f):
                    return [statistics.median(f(r, size) for (o, size), r in run.items()
                                              if o == op and size <= 1024) for run in runs[b]]
                loom = per_run(lambda r, s: r[0])
                diff = per_run(lambda r, s: r[0] - r[1])
                line = f"    {b} ({len(runs[b])} runs): loom {spread(loom)}  loom - fake {spread(diff)}"
                for timing in ("back to back", "after a barrier"):
                    e = eng[(timing, "")]
                    allow = per_run(lambda r, s: r[0] - r[1] - e[(op, s)])
                    line += f"  - engine ({timing}) {spread(allow)}"
                print(line)
    for p in (4, 8):
        eng = engine(parts[f"engine_large_{p}.txt"], in_place_column=False)
        runs, current = [], None
        for line in parts[f"torch_large_{p}.txt"]:
            if line.startswith("# python3 -m loom.bench"):
                current = []
                runs.append(current)
            if current is not None:
                current.append(line)
        runs = [torch_run(r) for r in runs]
        print(f"P = {p}, from 64 KiB: µs; engine (out of place) back to back, after a barrier; "
              f"c10d and direct by run; c10d's median over the engine's")
        for key in sorted(runs[0]):
            b, a = eng[("back to back", "")][key], eng[("after a barrier", "")][key]
            c = [r[key][0] for r in runs]
            d = [r[key][1] for r in runs]
            cm = statistics.median(c)
            print(f"  {key[0]:24s}{key[1] >> 10:6d} KiB  engine {b:7.1f} {a:7.1f}  c10d "
                  f"{'/'.join(f'{x:.1f}' for x in c):>13s}  direct {'/'.join(f'{x:.1f}' for x in d):>13s}"
                  f"  x{cm / b:4.2f} x{cm / a:4.2f}")


def call3(parts):
    for p in (4, 8):
        print(f"P = {p}: all_reduce µs by size")
        for (timing, label), times in engine(parts[f"engine_{p}.txt"], in_place_column=False).items():
            print(f"  engine {label:18s} {timing:16s} " +
                  "  ".join(f"{s >> 10}K {t:6.1f}" for (_, s), t in sorted(times.items())))
        for name in sorted((k for k in parts if k.startswith(f"torch_P{p}_")),
                           key=lambda k: int(re.search(r"_r(\d+)_", k).group(1))):
            run = torch_run(parts[name])
            variant = name.split("_")[-1][:-4]
            print(f"  torch {variant:3s} c10d / direct      " +
                  "  ".join(f"{s >> 10}K {c:6.1f}/{d:6.1f}" for (_, s), (c, d) in sorted(run.items())))


def main() -> int:
    parts = sections(sys.argv[1])
    (call2 if "engine_small_4.txt" in parts else call3)(parts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
