"""Where the time of loom's collectives went, from LOOM_TRACE files.

Reads the `<prefix>.<pid>.json` files that processes run with LOOM_TRACE=<prefix> wrote and,
for each rank (process), collective and size (its count times its element size), prints the
calls' median and p90 time and what the calling thread did during them (each named span
summed per call: phase and slot waits, copies, reductions, the wait for helpers, and the
rest, "between spans"), for the faster and the slower half of the calls and for the slow
ones (over 1.5x the median). The helpers' parts are summed too, with how long after the
call's start the last helper to join began its first part (a helper asleep joins late), and
how many of the calls had two busy threads (copying, reducing, a helper's part; of any
process) on one CPU at once, so that each ran at most half the time, and how many had a wait
that fell asleep (its wake-up then the scheduler's). Across hosts, what the network threads
did during the calls (the rail thread's receives, reductions and waits on the network, the
send thread's sends and waits for bytes to send), per call. Across the ranks of one machine
(whose steady clocks agree), per collective and size: how far after the first the last rank
began each call, how far apart they had left the call before, and how long the last one had
been out of it (a spread carried over from the call before can be waits that woke late). Calls through
torch (the plugin's "c10d call" and "direct op" spans) get a line each per path, collective and
size: how long they took and how much of it came before and after the engine's collective.

    LOOM_TRACE=/tmp/t/run torchrun --nproc-per-node 4 train.py
    python -m loom.trace /tmp/t/run
"""

import argparse
import bisect
import glob
import json
import os
import statistics
import sys
from typing import NamedTuple, Optional

from ._stats import p90 as percentile90

# Spans that open a collective on the calling thread (comm_state.cc names them after it).
COLLECTIVES = {
    "all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "gather",
    "scatter", "barrier", "collective",
}
# Collectives that no rank leaves before every rank has come.
UNROOTED = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier"}
# Spans the torch plugin opens around a call through torch (launch.h, direct_ops.cc).
WRAPPERS = ("c10d call", "direct op")
# What a CUDA call does inside that span in place of a collective: queue its work on the GPU
# (cuda_executor.cc); its number is 0, so the call's own (the c10d OpType) names it.
CUDA_ENQUEUE = "cuda enqueue"
# c10d's OpType values (torch/csrc/distributed/c10d/Work.hpp), as a CUDA call's line names them.
C10D_OP_TYPES = {
    0: "broadcast", 1: "all_reduce", 2: "all_reduce_coalesced", 3: "reduce", 4: "all_gather",
    5: "all_gather_into_tensor", 6: "all_gather_coalesced", 7: "gather", 8: "scatter",
    9: "reduce_scatter", 10: "all_to_all_single", 11: "all_to_all", 12: "send", 13: "recv",
    14: "recv_anysource", 15: "barrier", 16: "reduce_scatter_tensor", 17: "coalesced",
    19: "reduce_scatter_tensor_coalesced",
}
# Spans during which a thread keeps its CPU busy.
BUSY = ("copy", "reduction", "helper part")
# Spans that lie inside other parts of a call (a local step holds its waits and copies; a
# wait that fell asleep is part of its phase or slot wait), so not added to what is covered.
NESTED = ("local step", "asleep")


class Span(NamedTuple):
    begin: float  # µs
    end: float
    name: str
    n: int  # the span's number: a collective's size in bytes
    cpu: int  # where it began; -1 in files older than the field


class Call(NamedTuple):
    key: tuple  # (collective, bytes)
    begin: float
    end: float
    parts: dict  # span name -> µs on the calling thread
    helper_us: float
    last_join: Optional[float]  # µs after the call's start the last helper began, if any
    shared_cpu: bool  # two busy threads on one CPU at once during the call


def load(path):
    """The spans of one process as {tid: [Span sorted by start]}."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    threads = {}
    for e in events:
        threads.setdefault(e["tid"], []).append(
            Span(e["ts"], e["ts"] + e["dur"], e["name"], e["args"]["n"], e["args"].get("cpu", -1)))
    for spans in threads.values():
        spans.sort(key=lambda s: (s.begin, -s.end))  # an enclosing span before what it holds
    return threads


def inside(spans, starts, begin, end):
    """The spans of one thread that start within [begin, end)."""
    i = bisect.bisect_left(starts, begin)
    while i < len(spans) and spans[i].begin < end:
        yield spans[i]
        i += 1


class BusyCpus:
    """Every process's busy spans, to ask whether two threads shared a CPU in a window."""

    def __init__(self, processes):
        per_cpu = {}
        for threads in processes:
            for tid, spans in threads.items():
                for s in spans:
                    if s.name in BUSY and s.cpu >= 0 and s.end > s.begin:
                        per_cpu.setdefault(s.cpu, []).append((s.begin, s.end, tid))
        # The times when two threads were busy on one CPU, merged over the CPUs into sorted,
        # disjoint [begin, end) intervals, so each window asks a bisection, not a scan (a
        # scan back by the longest span made a sweep's million small calls quadratic).
        shared = sorted(interval for spans in per_cpu.values() for interval in _crowded(spans))
        self.intervals = []
        for b, e in shared:
            if self.intervals and b <= self.intervals[-1][1]:
                self.intervals[-1][1] = max(self.intervals[-1][1], e)
            else:
                self.intervals.append([b, e])
        self.starts = [b for b, _ in self.intervals]

    def shared(self, begin, end):
        """True if busy spans of two threads overlapped on one CPU within [begin, end)."""
        i = bisect.bisect_right(self.starts, begin) - 1  # the last interval starting by begin
        if i >= 0 and self.intervals[i][1] > begin and begin < end:
            return True
        return i + 1 < len(self.intervals) and self.intervals[i + 1][0] < end


def _crowded(spans):
    """The [begin, end) intervals in which spans (begin, end, tid) of at least two threads
    overlap; a sweep over their ends (an end before a begin at the same time: the spans are
    half open)."""
    events = sorted([(b, 1, tid) for b, _, tid in spans] + [(e, 0, tid) for _, e, tid in spans])
    active, threads, since = {}, 0, None
    for t, opens, tid in events:
        before = threads
        count = active.get(tid, 0) + (1 if opens else -1)
        active[tid] = count
        if opens and count == 1:
            threads += 1
        elif not opens and count == 0:
            threads -= 1
        if before < 2 <= threads:
            since = t
        elif threads < 2 <= before:
            if t > since:
                yield since, t
            since = None


def calls_of(threads, busy):
    """Every collective call of a process."""
    callers = {tid: s for tid, s in threads.items() if any(x.name in COLLECTIVES for x in s)}
    helpers = {tid: s for tid, s in threads.items() if tid not in callers}
    helper_starts = {tid: [x.begin for x in s] for tid, s in helpers.items()}
    calls = []
    for spans in callers.values():
        starts = [x.begin for x in spans]
        for call in spans:
            if call.name not in COLLECTIVES:
                continue
            parts = {}
            covered = 0.0
            for s in inside(spans, starts, call.begin, call.end):
                # The call itself, a nested collective (a local step of another), or a plugin
                # span that began with it: not a part.
                if s.name in COLLECTIVES or s.name in WRAPPERS:
                    continue
                parts[s.name] = parts.get(s.name, 0.0) + (s.end - s.begin)
                if s.name not in NESTED:
                    covered += s.end - s.begin
            parts["between spans"] = max(0.0, (call.end - call.begin) - covered)
            helper_us, joins = 0.0, []
            for tid, hspans in helpers.items():
                mine = [s for s in inside(hspans, helper_starts[tid], call.begin, call.end)
                        if s.name == "helper part"]
                helper_us += sum(s.end - s.begin for s in mine)
                if mine:
                    joins.append(mine[0].begin - call.begin)
            calls.append(Call((call.name, call.n), call.begin, call.end, parts, helper_us,
                              max(joins, default=None), busy.shared(call.begin, call.end)))
    return calls


def torch_calls_of(threads):
    """Every call through torch that ran a collective (or queued a CUDA call) on its own
    thread: ((path, collective, bytes), its µs, µs before the collective began, µs after it
    ended, the collective's µs)."""
    calls = []
    for spans in threads.values():
        starts = [s.begin for s in spans]
        for wrapper in spans:
            if wrapper.name not in WRAPPERS:
                continue
            inner = [s for s in inside(spans, starts, wrapper.begin, wrapper.end)
                     if s.name in COLLECTIVES or s.name == CUDA_ENQUEUE]
            if inner:
                first = inner[0]
                size = wrapper.n if first.name == CUDA_ENQUEUE else first.n
                calls.append(((wrapper.name, first.name, size), wrapper.end - wrapper.begin,
                              first.begin - wrapper.begin, wrapper.end - inner[-1].end,
                              sum(s.end - s.begin for s in inner)))
    return calls


def describe_torch(calls):
    """Per path, collective and size: the calls' median µs and what they spent outside the
    engine's collective, for the faster and the slower half."""
    lines = []
    for key in sorted({c[0] for c in calls}):
        mine = sorted((c for c in calls if c[0] == key), key=lambda c: c[1])
        half = len(mine) // 2
        path, name, size = key
        op = C10D_OP_TYPES.get(size, f"call of op type {size}")
        what = f"CUDA {op}" if name == CUDA_ENQUEUE else f"{name} of {size} B"
        inner = "the enqueue" if name == CUDA_ENQUEUE else "the collective"
        text = (f"  {path} {what}: {len(mine)} calls, "
                f"median {statistics.median(c[1] for c in mine):.1f} µs, "
                f"{inner} {statistics.median(c[4] for c in mine):.1f}")
        for label, part in (("faster half", mine[:max(1, half)]), ("slower half", mine[half:])):
            text += (f"; {label}: before {inner} {statistics.fmean(c[2] for c in part):.1f}, "
                     f"after it {statistics.fmean(c[3] for c in part):.1f}")
        lines.append(text)
    return lines


def describe(calls, label):
    """One line: how many calls, and the mean µs of each part over them."""
    if not calls:
        return f"    {label}: none"
    names = sorted({n for c in calls for n in c.parts})
    mean = {n: statistics.fmean(c.parts.get(n, 0.0) for c in calls) for n in names}
    text = ", ".join(f"{n} {mean[n]:.1f}" for n in names if mean[n] >= 0.05)
    helper = statistics.fmean(c.helper_us for c in calls)
    joins = [c.last_join for c in calls if c.last_join is not None]
    if helper > 0:
        text += f"; helpers' parts {helper:.1f}"
        if joins:
            text += f", the last helper joins {statistics.fmean(joins):.1f} after the call starts"
    shared = sum(c.shared_cpu for c in calls)
    text += f"; a CPU shared by two busy threads in {shared} of {len(calls)}"
    slept = sum(c.parts.get("asleep", 0.0) > 0 for c in calls)
    text += f"; a wait fell asleep in {slept}"
    call = statistics.fmean(c.end - c.begin for c in calls)
    return f"    {label} ({len(calls)} calls, mean µs): call {call:.1f} = {text}"


def thread_role(spans):
    """What a thread other than a collective's caller is, by the spans it has."""
    names = {s.name for s in spans}
    if "rail job" in names:
        return "rail thread"
    if "send" in names:
        return "send thread"
    return "helper" if names <= {"helper part"} else "other thread"


def describe_others(threads, calls):
    """One line: what each thread beside the callers (a network thread across hosts) spent
    inside the given calls, µs per call in each span (nested spans counted each)."""
    windows = sorted((c.begin, c.end) for c in calls)
    starts = [b for b, _ in windows]
    parts = []
    for tid, spans in sorted(threads.items()):
        role = thread_role(spans)
        if role == "helper" or any(x.name in COLLECTIVES for x in spans):
            continue  # helpers are summed with their calls; callers have their own lines
        sums = {}
        for s in spans:
            i = bisect.bisect_right(starts, s.begin) - 1
            for b, e in windows[max(0, i):i + 2]:
                if s.end > b and s.begin < e:  # the part of the span inside a call
                    sums[s.name] = sums.get(s.name, 0.0) + min(s.end, e) - max(s.begin, b)
        if sums:
            text = ", ".join(f"{n} {v / len(calls):.1f}" for n, v in
                             sorted(sums.items(), key=lambda kv: -kv[1]) if v / len(calls) >= 0.05)
            parts.append(f"{role} {tid}: {text}")
    return f"    other threads (µs per call): {'; '.join(parts)}" if parts else None


def top_level_calls(threads):
    """A process's collectives in the order it began them, as Spans, leaving out those that
    lie inside another (a local step's), from whichever thread ran them (a blocking call runs
    on the caller's, an asynchronous one on the collective thread); None if two overlapped
    (several groups at once: their calls cannot be matched across processes by order)."""
    spans = sorted((x for s in threads.values() for x in s if x.name in COLLECTIVES),
                   key=lambda x: (x.begin, -x.end))
    calls, end = [], float("-inf")
    for x in spans:
        if x.begin >= end:
            calls.append(x)
            end = x.end
        elif x.end > end:
            return None  # begun inside another call and ended after it: not nested
    return calls


def across_ranks(processes):
    """Lines on how far apart the processes (ranks of one communicator on one machine, whose
    steady clocks agree) began each collective and size, and where that came from: the
    spread of their leaving the call before, and the time the rank that began last had been
    out of it. Empty for one process; a line saying why where the calls cannot be matched."""
    if len(processes) < 2:
        return []
    sequences = [top_level_calls(threads) for threads in processes]
    why = None
    if any(seq is None for seq in sequences):
        why = "a process ran overlapping collectives (several groups at once?)"
    elif any(not seq for seq in sequences):
        why = "a process ran no collective on the CPU path"
    elif len({len(seq) for seq in sequences}) > 1:
        why = (f"the processes ran {min(map(len, sequences))} to {max(map(len, sequences))} "
               "collectives (several groups, or a recorder that filled up?)")
    elif any((seq[i].name, seq[i].n) != (sequences[0][i].name, sequences[0][i].n)
             for seq in sequences for i in range(len(seq))):
        why = "the processes' collectives differ in order (several groups?)"
    else:
        # An unrooted collective keeps every rank in it until all have come (a rooted one's
        # root may leave first): such calls that never overlap come from different runs or
        # machines, whose clocks say nothing about each other.
        meeting = [calls for calls in zip(*sequences) if calls[0].name in UNROOTED]
        apart = sum(max(x.begin for x in calls) >= min(x.end for x in calls) for calls in meeting)
        if 2 * apart > len(meeting):
            why = (f"{apart} of {len(meeting)} calls that every rank must meet in never "
                   "overlapped across the processes (files of several runs or machines?)")
    if why:
        return [f"across ranks: not compared: {why}"]
    per_key = {}
    for i in range(1, len(sequences[0])):
        began = [seq[i].begin for seq in sequences]
        left = [seq[i - 1].end for seq in sequences]
        last = max(range(len(sequences)), key=lambda r: began[r])
        per_key.setdefault((sequences[0][i].name, sequences[0][i].n), []).append(
            (max(began) - min(began), max(left) - min(left), began[last] - left[last]))
    if not per_key:
        return []
    lines = [f"across {len(sequences)} ranks (µs, medians over each call after the first): how far "
             "after the first rank the last began; how far apart they had left the call before; "
             "how long the rank that began last had been out of it. A spread carried from the "
             "call before, with that rank back quickly, can be waits that woke late rather than "
             "work of its own (for a rooted call, the root leaving first is its algorithm)"]
    for (name, size), rows in sorted(per_key.items()):
        label = name if name == "barrier" else f"{name} of {size} B"
        spread = [r[0] for r in rows]
        lines.append(f"  across ranks, {label}: {len(rows)} calls, the last began "
                     f"{statistics.median(spread):.1f} after the first (p90 "
                     f"{percentile90(sorted(spread)):.1f}); they had left the call before "
                     f"{statistics.median(r[1] for r in rows):.1f} apart; the last had been out "
                     f"of it {statistics.median(r[2] for r in rows):.1f}")
    return lines


# Timelines past this many bytes in all take minutes to read: main() then says which file
# it is reading (a P = 16 run of tiny calls, a million spans per rank, is gigabytes).
LARGE_BYTES = 100 << 20


def trace_files(prefix):
    """The files LOOM_TRACE=<prefix> left, by name (FileNotFoundError if none)."""
    paths = sorted(glob.glob(glob.escape(str(prefix)) + ".*.json"))
    if not paths:
        raise FileNotFoundError(f"no {prefix}.<pid>.json files (was LOOM_TRACE={prefix} set?)")
    return paths


class UnreadableTraces(Exception):
    """None of the files under a prefix is a whole timeline."""


def warn_skipped(path, error):
    """Says on stderr that `path` is left out of the summary, and why."""
    print(f"loom.trace: skipping {path}: not a whole timeline ({type(error).__name__}: {error}); "
          f"was its process still writing it, or killed while it wrote?", file=sys.stderr, flush=True)


def summary(prefix, slow=1.5, reading=None, skipped=warn_skipped):
    """The summary's lines for the files LOOM_TRACE=<prefix> left (FileNotFoundError if none);
    `reading(i, n, path)`, if given, is called before each file is read, `skipped(path, error)`
    for each file that is not a whole timeline (left out; UnreadableTraces if all are)."""
    paths = trace_files(prefix)
    processes, readable = [], []
    for i, path in enumerate(paths):
        if reading:
            reading(i, len(paths), path)
        try:
            processes.append(load(path))
        except (ValueError, KeyError, TypeError) as error:  # JSON cut short, or not a timeline
            skipped(path, error)
            continue
        readable.append(path)
    if not readable:
        raise UnreadableTraces(f"none of the {len(paths)} files {prefix}.<pid>.json is a whole timeline")
    paths = readable
    # Whether the files come from one run is not checked: they hold pids and steady-clock
    # times alone (no host, no run id), and one run across machines that write to one shared
    # folder leaves time ranges as far apart as two runs of one machine do.
    busy = BusyCpus(processes)
    lines = []
    for path, threads in zip(paths, processes):
        calls = calls_of(threads, busy)
        lines.append(f"{path}:")
        lines += describe_torch(torch_calls_of(threads))
        for key in sorted({c.key for c in calls}):
            mine = [c for c in calls if c.key == key]
            times = sorted(c.end - c.begin for c in mine)
            median = statistics.median(times)
            p90 = percentile90(times)
            name, size = key
            label = name if name == "barrier" else f"{name} of {size} B"
            lines.append(f"  {label}: {len(mine)} calls, median {median:.1f} µs, p90 {p90:.1f} µs")
            lines.append(describe([c for c in mine if c.end - c.begin <= median], "faster half"))
            lines.append(describe([c for c in mine if c.end - c.begin > median], "slower half"))
            slowest = [c for c in mine if c.end - c.begin > slow * median]
            if slowest:
                lines.append(describe(slowest, f"slow, over {slow}x the median"))
            others = describe_others(threads, mine)
            if others:
                lines.append(others)
    return lines + across_ranks(processes)


def main():
    parser = argparse.ArgumentParser(prog="python -m loom.trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("prefix", help="the LOOM_TRACE prefix the processes ran with")
    parser.add_argument("--slow", type=float, default=1.5,
                        help="a call is slow above this multiple of its median (default 1.5)")
    args = parser.parse_args()

    def reading(i, n, path):
        print(f"loom.trace: reading {path} ({i + 1} of {n}, {os.path.getsize(path) >> 20} MiB)",
              file=sys.stderr, flush=True)

    try:
        large = sum(os.path.getsize(p) for p in trace_files(args.prefix)) > LARGE_BYTES
        lines = summary(args.prefix, args.slow, reading if large else None)
    except (FileNotFoundError, UnreadableTraces) as e:
        sys.exit(f"loom.trace: {e}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
