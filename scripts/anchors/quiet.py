"""Is the machine quiet? Before each stage of scripts/anchors/run.sh: what else is using CPU
(processes over 2% of a core in a 0.5 s sample, from /proc) and, with --kill NAME...,
ends the processes of this user that run one of those programs (a word of their command
line that is NAME, NAME.py, or a path ending in either, as `loom-bench`, `python3 -m
loom.bench` and `python3 .../mpi4py_bench.py` do), never this run's own ancestors: an
earlier stage's ranks or launchers that outlived it would otherwise take cores from the next
stage's ranks.

    python3 scripts/anchors/quiet.py [--kill PATTERN ...]

Prints one line: "quiet" or the busy processes ("pid name cores"), then what it killed.
"""

from __future__ import annotations

import os
import signal
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def cpu_ticks() -> dict[int, tuple[str, int]]:
    """pid -> (command name, user + system ticks so far)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(entry)] = (name, int(fields[11]) + int(fields[12]))
    return out


def cmdline(pid: int) -> list[str]:
    """The words of a process's command line ([] if it is gone or has none)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [w.decode(errors="replace") for w in f.read().split(b"\0") if w]
    except OSError:
        return []


def runs_one_of(words: list[str], names: list[str]) -> bool:
    """True if a word of the command line is one of `names`, as a program, a script (.py) or
    a module, with or without a path."""
    for word in words:
        base = os.path.basename(word)
        if base in names or (base.endswith(".py") and base[:-3] in names):
            return True
    return False


def owned_by_me(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def ancestors() -> set[int]:
    """This process and every process above it: the run that asked is never a straggler,
    whatever its command line holds."""
    pids, pid = set(), os.getpid()
    while pid >= 1 and pid not in pids:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            pid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def main(argv: list[str]) -> int:
    names = argv[argv.index("--kill") + 1:] if "--kill" in argv else []
    me = ancestors()
    killed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in me or not names:
            continue
        pid = int(entry)
        words = cmdline(pid)
        if owned_by_me(pid) and runs_one_of(words, names):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(f"{pid} {' '.join(words)[:80]}")
            except OSError:
                pass
    if killed:
        time.sleep(0.2)  # let the kernel reap them before sampling
    before, start = cpu_ticks(), time.monotonic()
    time.sleep(0.5)
    after, seconds = cpu_ticks(), time.monotonic() - start
    busy = []
    for pid, (name, ticks) in after.items():
        if pid in me or pid not in before:
            continue
        cores = (ticks - before[pid][1]) / TICK / seconds
        if cores > 0.02:
            busy.append(f"{pid} {name} {cores:.2f}")
    print("-- machine: " + ("quiet" if not busy else "busy: " + ", ".join(busy)))
    for k in killed:
        print(f"-- killed a straggler of an earlier stage: {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
