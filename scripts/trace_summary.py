#!/usr/bin/env python3
"""Where the time of loom's collectives went, from LOOM_TRACE files.

Reads the `<prefix>.<pid>.json` files that processes run with LOOM_TRACE=<prefix> wrote and,
for each rank (process), collective and size (its count times its element size), prints the
calls' median and p90 time and what the calling thread did during them (each named span
summed per call: phase and slot waits, copies, reductions, the wait for helpers, and the
rest, "between spans"), for the faster and the slower half of the calls and for the slow
ones (over 1.5x the median). The helpers' parts are summed too, with how long after the
call's start the last helper to join began its first part (a helper asleep joins late).
Calls through torch (the plugin's "c10d call" and "direct op" spans) get a line each per
path, collective and size: how long they took and how much of it came before and after the
engine's collective.

    LOOM_TRACE=/tmp/t loom-bench -n 4 -b 1M -e 1M -o all_reduce
    python3 scripts/trace_summary.py /tmp/t
"""

import argparse
import bisect
import glob
import json
import statistics
import sys

# Spans that open a collective on the calling thread (comm_state.cc names them after it).
COLLECTIVES = {
    "all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "gather",
    "scatter", "barrier", "collective",
}


def load(path):
    """The spans of one process as {tid: [events sorted by start]}."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    threads = {}
    for e in events:
        threads.setdefault(e["tid"], []).append(
            (e["ts"], e["ts"] + e["dur"], e["name"], e["args"]["n"]))
    for spans in threads.values():
        spans.sort()
    return threads


def inside(spans, starts, begin, end):
    """The spans of one thread that start within [begin, end)."""
    i = bisect.bisect_left(starts, begin)
    while i < len(spans) and spans[i][0] < end:
        yield spans[i]
        i += 1


def calls_of(threads):
    """Every collective call of a process: ((name, bytes), start, end, {span name: µs}, helper
    µs, how long after the call's start the last helper began its first part)."""
    callers = {tid: s for tid, s in threads.items() if any(n in COLLECTIVES for _, _, n, _ in s)}
    helpers = {tid: s for tid, s in threads.items() if tid not in callers}
    helper_starts = {tid: [b for b, _, _, _ in s] for tid, s in helpers.items()}
    calls = []
    for tid, spans in callers.items():
        for i, (begin, end, name, size) in enumerate(spans):
            if name not in COLLECTIVES:
                continue
            parts = {}
            covered = 0.0
            j = i + 1
            while j < len(spans) and spans[j][0] < end:
                b, e, n, _ = spans[j]
                if n in COLLECTIVES:  # a nested collective (a local step of another)
                    j += 1
                    continue
                parts[n] = parts.get(n, 0.0) + (e - b)
                if n != "local step":
                    covered += e - b
                j += 1
            parts["between spans"] = max(0.0, (end - begin) - covered)
            helper_us, joins = 0.0, []
            for htid, hspans in helpers.items():
                mine = [(b, e) for b, e, n, _ in inside(hspans, helper_starts[htid], begin, end)
                        if n == "helper part"]
                helper_us += sum(e - b for b, e in mine)
                if mine:
                    joins.append(mine[0][0] - begin)
            calls.append(((name, size), begin, end, parts, helper_us, max(joins, default=None)))
    return calls


# Spans the torch plugin opens around a call through torch (launch.h, direct_ops.cc).
WRAPPERS = ("c10d call", "direct op")


def torch_calls_of(threads):
    """Every call through torch that ran a collective on its own thread: ((path, collective,
    bytes), its µs, µs before the collective began, µs after it ended)."""
    calls = []
    for spans in threads.values():
        starts = [b for b, _, _, _ in spans]
        for begin, end, name, _ in spans:
            if name not in WRAPPERS:
                continue
            inner = [s for s in inside(spans, starts, begin, end) if s[2] in COLLECTIVES]
            if inner:
                b, e, n, size = inner[0]
                calls.append(((name, n, size), end - begin, b - begin, end - inner[-1][1]))
    return calls


def describe_torch(calls):
    """Per path, collective and size: the calls' median µs and what they spent outside the
    engine's collective, for the faster and the slower half."""
    lines = []
    for key in sorted({c[0] for c in calls}):
        mine = sorted((c for c in calls if c[0] == key), key=lambda c: c[1])
        half = len(mine) // 2
        path, name, size = key
        text = f"  {path} {name} of {size} B: {len(mine)} calls, median {statistics.median(c[1] for c in mine):.1f} µs"
        for label, part in (("faster half", mine[:max(1, half)]), ("slower half", mine[half:])):
            text += (f"; {label}: before the collective {statistics.fmean(c[2] for c in part):.1f}, "
                     f"after it {statistics.fmean(c[3] for c in part):.1f}")
        lines.append(text)
    return lines


def describe(calls, label):
    """One line: how many calls, and the mean µs of each part over them."""
    if not calls:
        return f"    {label}: none"
    names = sorted({n for c in calls for n in c[3]})
    mean = {n: statistics.fmean(c[3].get(n, 0.0) for c in calls) for n in names}
    text = ", ".join(f"{n} {mean[n]:.1f}" for n in names if mean[n] >= 0.05)
    helper = statistics.fmean(c[4] for c in calls)
    joins = [c[5] for c in calls if c[5] is not None]
    if helper > 0:
        text += f"; helpers' parts {helper:.1f}"
        if joins:
            text += f", the last helper joins {statistics.fmean(joins):.1f} after the call starts"
    call = statistics.fmean(c[2] - c[1] for c in calls)
    return f"    {label} ({len(calls)} calls, mean µs): call {call:.1f} = {text}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prefix", help="the LOOM_TRACE prefix the processes ran with")
    parser.add_argument("--slow", type=float, default=1.5,
                        help="a call is slow above this multiple of its median (default 1.5)")
    args = parser.parse_args()
    paths = sorted(glob.glob(glob.escape(args.prefix) + ".*.json"))
    if not paths:
        sys.exit(f"trace_summary: no {args.prefix}.<pid>.json files (was LOOM_TRACE set?)")
    for path in paths:
        threads = load(path)
        calls = calls_of(threads)
        print(f"{path}:")
        for line in describe_torch(torch_calls_of(threads)):
            print(line)
        for key in sorted({c[0] for c in calls}):
            mine = [c for c in calls if c[0] == key]
            times = sorted(c[2] - c[1] for c in mine)
            median = statistics.median(times)
            p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
            name, size = key
            label = name if name == "barrier" else f"{name} of {size} B"
            print(f"  {label}: {len(mine)} calls, median {median:.1f} µs, p90 {p90:.1f} µs")
            print(describe([c for c in mine if c[2] - c[1] <= median], "faster half"))
            print(describe([c for c in mine if c[2] - c[1] > median], "slower half"))
            slow = [c for c in mine if c[2] - c[1] > args.slow * median]
            if slow:
                print(describe(slow, f"slow, over {args.slow}x the median"))


if __name__ == "__main__":
    main()
