"""Reads what loom-bench and `python -m loom.bench` print, as the raw files in this folder
hold it (several outputs joined by `tail -n +1`, each under "==> name <=="), for the
parsers beside it."""
import re

UNIT = {"KiB": 1 << 10, "MiB": 1 << 20}
# loom.bench's op names (torch's) to loom-bench's.
ENGINE_OP = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "broadcast": "broadcast",
             "all_to_all_single": "all_to_all"}


def files(path):
    """{name: [lines]} of a `tail -n +1` concatenation, in file order."""
    out, name = {}, None
    for line in open(path):
        m = re.match(r"==> (\S+) <==", line)
        if m:
            name = m[1]
            out[name] = []
        elif name is not None:
            out[name].append(line)
    return out


def engine_runs(name, lines):
    """The loom-bench runs of one file, each begun by a "# ... loom-bench -n ..." line:
    [(that line, {(op, bytes): out-of-place median µs})]. Fails on any wrong result."""
    runs, op = [], None
    for line in lines:
        if re.match(r"# .*loom-bench -n", line):
            runs.append((line, {}))
            continue
        h = re.match(r"# (\w+)\s+float32", line)
        if h:
            op = h[1]
            continue
        r = re.match(r"\s+(\d+)\s+\d+\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\d+)", line)
        if r:
            assert r[3] == "0", f"{name}: wrong results at {op} {r[1]}"
            runs[-1][1][(op, int(r[1]))] = float(r[2])
    return runs


def torch_table(lines):
    """One loom.bench run: {(op, bytes): {entry: (median µs, p90 µs)}}, the entries as its
    columns name them (loom, direct, eager, ...)."""
    table, op, entries = {}, None, []
    for line in lines:
        if line.startswith("## "):
            op = line[3:].strip()
            continue
        if line.strip().startswith("size "):
            entries = re.findall(r"(\w+) us", line)
            continue
        r = re.match(r"\s+(\d+) ([KM]iB)((?:\s+[\d.]+)+)", line)
        if r and op:
            v = [float(x) for x in r[3].split()]
            table[(op, int(r[1]) * UNIT[r[2]])] = {
                e: (v[3 * i], v[3 * i + 1]) for i, e in enumerate(entries)}
    return table


def size(b):
    """64 KiB, 2 MiB."""
    return f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
