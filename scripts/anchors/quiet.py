"""Is the machine quiet? Before each stage of scripts/anchors/run.sh: what else is using CPU
(processes over 2% of a core in a 0.5 s sample, from /proc) and, with --kill PATTERN...,
ends the processes of this user whose command line holds a pattern: an earlier stage's ranks
or launchers that outlived it would otherwise take cores from the next stage's ranks.

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


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def ancestors() -> set[int]:
    """This process and every process above it: the run that asked is never a straggler,
    whatever its command line holds."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            pid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def main(argv: list[str]) -> int:
    patterns = argv[argv.index("--kill") + 1:] if "--kill" in argv else []
    me = ancestors()
    killed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in me or not patterns:
            continue
        pid = int(entry)
        line = cmdline(pid)
        if any(p in line for p in patterns):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(f"{pid} {line[:80]}")
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
