"""Where a tensor-store read's time goes, without the store: the same bytes (a 629 MB bf16
state dict of 200 tensors, packed at 64-byte offsets in one source buffer, as a writer's
buffer holds them) copied into the reader's tensors in the ways a read can copy them.

    python tests/cuda/copy_shapes_probe.py [--device cuda|cpu] [--threads N]

Rows: one flat copy of the whole buffer (the floor); torch._foreach_copy_ into 200 separate
tensors (what a read runs today); the same into 200 views of one flat tensor (a reader whose
tensors sit back to back); a copy_ per tensor; loom's own copy (loom._C.copy_cpu or copy_cuda)
into the 200 tensors and as one flat copy (on CPU with plain and streaming stores forced, on
CUDA also with the spread kernel alone, no driver copies for large pieces); what a store read runs (run_copies over
copy_groups: runs of tensors back to back joined); and, CUDA only, a device synchronize alone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, device, reps: int) -> tuple[float, float]:
    fn()
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)
    sync()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return 1e3 * statistics.median(samples), 1e3 * samples[int(0.9 * (len(samples) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    count, rows, cols = 200, 1536, 1024
    per = rows * cols * 2
    total = count * per
    src = torch.ones(total, dtype=torch.uint8, device=device)
    src_views = [src.narrow(0, i * per, per).view(torch.bfloat16).view(rows, cols) for i in range(count)]
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    flat_views = [flat.narrow(0, i * per, per).view(torch.bfloat16).view(rows, cols) for i in range(count)]
    separate = [torch.empty(rows, cols, dtype=torch.bfloat16, device=device) for _ in range(count)]
    adjacent = sum(separate[i + 1].data_ptr() == separate[i].data_ptr() + per for i in range(count - 1))
    cases = {
        "flat copy (floor)": lambda: flat.copy_(src),
        "foreach into 200 tensors": lambda: torch._foreach_copy_(separate, src_views),
        "foreach into flat views": lambda: torch._foreach_copy_(flat_views, src_views),
        "copy_ per tensor": lambda: [d.copy_(s) for d, s in zip(separate, src_views)],
    }
    from loom import _C
    from loom.tensor_store._parts import copy_groups, run_copies

    if device.type == "cpu":
        cases["loom copy into 200 tensors"] = lambda: _C.copy_cpu(separate, src_views)
        cases["  plain stores"] = lambda: _C.copy_cpu(separate, src_views, streaming=False)
        cases["  streaming stores"] = lambda: _C.copy_cpu(separate, src_views, streaming=True)
        cases["loom flat copy"] = lambda: _C.copy_cpu([flat], [src])
    else:
        cases["loom copy into 200 tensors"] = lambda: _C.copy_cuda(separate, src_views)
        cases["  spread kernel alone"] = lambda: _C.copy_cuda(separate, src_views, 1 << 62)
        cases["loom flat copy"] = lambda: _C.copy_cuda([flat], [src])
        cases["  spread kernel alone "] = lambda: _C.copy_cuda([flat], [src], 1 << 62)
    groups = copy_groups(separate, src_views)
    cases[f"store read ({len(groups)} groups)"] = lambda: run_copies(groups)
    if device.type == "cuda":
        cases["synchronize alone"] = lambda: None
    print(f"loom's last-level cache size here: {_C.last_level_cache_bytes() / 2**20:.0f} MiB")
    print(f"{total / 1e6:.0f} MB in {count} tensors on {device}, {torch.get_num_threads()} threads; "
          f"{adjacent} of {count - 1} separate tensors sit right after the previous one")
    print(f"{'':28} {'median ms':>10} {'p90 ms':>8} {'GB/s':>8}")
    for name, fn in cases.items():
        median, p90 = timed(fn, device, args.reps)
        print(f"{name:28} {median:10.3f} {p90:8.3f} {total / median / 1e6:8.1f}")


if __name__ == "__main__":
    main()
