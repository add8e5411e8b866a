"""A Hugging Face accelerate training loop on loom.

    torchrun --nproc-per-node 2 examples/accelerate_ddp.py [--steps 50]

`import loom`, then ask accelerate for the backend by name; it wraps the model in DDP, whose
gradient all_reduce runs on loom.
"""

import argparse

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

import loom  # noqa: F401  (registers "loom" and teaches accelerate its name)
from report import write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--backend", default="loom")
    parser.add_argument("--report", help="write losses and a weights digest here (for the tests)")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend=args.backend)])
    rank = accelerator.process_index
    torch.manual_seed(0)
    teacher = nn.Linear(32, 8)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    data = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for step in range(args.steps):
        x = torch.randn(args.batch, 32, generator=data)
        with torch.no_grad():
            y = teacher(x)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()
        losses.append(loss.item())
    if accelerator.is_main_process:
        print(f"accelerate ({accelerator.distributed_type}, {accelerator.num_processes} processes, "
              f"{args.backend}): loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    write_report(args.report, rank, losses, accelerator.unwrap_model(model).parameters())
    accelerator.end_training()
    if losses[-1] >= losses[0]:
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    main()
