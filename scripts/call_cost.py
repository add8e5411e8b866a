#!/usr/bin/env python3
"""What a small blocking call costs loom beyond torch's no-op backend, in instructions.

Timing a few-microsecond call on a shared machine swings with its load; callgrind counts
instructions, which do not. Each backend runs twice under valgrind, once with no timed calls
and once with --calls, so everything but the calls (start-up, init_process_group, warm-up)
cancels; what is left is divided by the calls. World size 1, 8 bytes of float32 (an
all_reduce unless --op says otherwise): loom's own layers and c10d's, with the engine's
collective reduced to a copy.

    python3 scripts/call_cost.py                 # loom, direct, eager and fake, 5000 calls each
    python3 scripts/call_cost.py --op all_to_all --backends loom,fake
    python3 scripts/call_cost.py --keep /tmp/cg  # also keep the profiles

A kept profile (`/tmp/cg/loom.5000` against `/tmp/cg/loom.0`) shows where the calls went:
`callgrind_annotate --inclusive=yes --tree=calling /tmp/cg/loom.5000`.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

BACKENDS = ("loom", "direct", "eager", "fake")
OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")
WARM_UP = 200


def c10d_call(op: str, t, out):
    """One blocking call of `op` through torch.distributed on 2-element float32 tensors."""
    import torch.distributed as dist

    if op == "all_reduce":
        return lambda: dist.all_reduce(t)
    if op == "broadcast":
        return lambda: dist.broadcast(t, src=0)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(out, t)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(out, t)
    return lambda: dist.all_to_all_single(out, t)


def direct_call(op: str, t, name: str, ops=None):
    """The same through torch.ops.loom (or `ops`: loom.ops's eager functions)."""
    import torch

    ops = ops or torch.ops.loom
    if op == "all_reduce":
        return lambda: ops.all_reduce_(t, "sum", name)
    if op == "broadcast":
        return lambda: ops.broadcast_(t, 0, name)
    if op == "all_gather":
        return lambda: ops.all_gather_into_tensor(t, 1, name)
    if op == "reduce_scatter":
        return lambda: ops.reduce_scatter_tensor(t, "sum", 1, name)
    return lambda: ops.all_to_all_single(t, [], [], name)


def run_calls(backend: str, op: str, calls: int, store: str) -> None:
    """The measured process: init, warm-up, then `calls` blocking calls of `op`."""
    import torch
    import torch.distributed as dist

    import loom  # noqa: F401  (registers the backend and torch.ops.loom)

    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    else:
        dist.init_process_group("loom", rank=0, world_size=1, init_method="file://" + store)
    t, out = torch.zeros(2), torch.zeros(2)
    if backend in ("direct", "eager"):
        import loom.ops

        call = direct_call(op, t, dist.group.WORLD.group_name, loom.ops if backend == "eager" else None)
    else:
        call = c10d_call(op, t, out)
    for _ in range(WARM_UP + calls):
        call()
    os._exit(0)  # the same exit for every run: no teardown to count


def instructions(backend: str, op: str, calls: int, out: str) -> int:
    """Instructions of one process under callgrind that makes `calls` timed calls."""
    store = out + ".store"  # the FileStore of init_process_group: a fresh path per run
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
           os.path.abspath(__file__), "--run", backend, "--op", op, "--calls", str(calls),
           "--store", store]
    # One hash seed for every run: dict layouts (and so the instructions of everything
    # around the calls) then match between the two runs that are subtracted.
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    found = re.search(r"I\s+refs:\s+([\d,]+)", result.stderr)
    if result.returncode != 0 or not found:
        sys.exit(f"call_cost: {backend} with {calls} calls failed under valgrind:\n"
                 + result.stderr[-2000:])
    return int(found.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000, help="timed calls per run")
    parser.add_argument("--op", default="all_reduce", choices=OPS,
                        help="the collective (all_gather and reduce_scatter: the tensor forms, "
                             "all_to_all: all_to_all_single)")
    parser.add_argument("--backends", default=",".join(BACKENDS),
                        help="comma-separated subset of loom (c10d), direct (torch.ops.loom), "
                             "eager (loom.ops), fake (torch's no-op backend)")
    parser.add_argument("--keep", help="a folder to keep the callgrind profiles in")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # the measured process
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_calls(args.run, args.op, args.calls, args.store)
        return
    if not shutil.which("valgrind"):
        sys.exit("call_cost: needs valgrind (apt-get install -y valgrind)")
    folder = args.keep or tempfile.mkdtemp(prefix="loom_call_cost_")
    os.makedirs(folder, exist_ok=True)
    per_call = {}
    for backend in args.backends.split(","):
        if backend not in BACKENDS:
            sys.exit(f"call_cost: unknown backend {backend!r}; pick from {', '.join(BACKENDS)}")
        print(f"{backend}: two runs under callgrind (a few minutes) ...", flush=True)
        base = instructions(backend, args.op, 0, os.path.join(folder, f"{backend}.0"))
        full = instructions(backend, args.op, args.calls,
                            os.path.join(folder, f"{backend}.{args.calls}"))
        per_call[backend] = (full - base) / args.calls
    print(f"\ninstructions per blocking 8-byte {args.op}, world size 1 ({args.calls} calls):")
    for backend, n in per_call.items():
        beyond = f"  ({n - per_call['fake']:+,.0f} against fake)" if "fake" in per_call else ""
        print(f"  {backend:7s} {n:10,.0f}{beyond}")
    if not args.keep:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
