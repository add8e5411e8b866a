"""DeepSpeed ZeRO training on CPUs through loom.

    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/deepspeed_zero.py [--zero-stage 3]

`deepspeed.init_distributed(dist_backend="loom")` makes loom the process group under DeepSpeed's
communication layer: ZeRO's all_gather, reduce_scatter and all_reduce then run on loom.
"""

import argparse

import deepspeed
import torch
import torch.nn as nn

import loom  # noqa: F401  (registers the "loom" backend)
from report import write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--zero-stage", type=int, default=3, choices=[0, 1, 2, 3])
    parser.add_argument("--backend", default="loom")
    parser.add_argument("--report", help="write losses and a weights digest here (for the tests)")
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend=args.backend)
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    teacher = nn.Linear(32, 8)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 8))
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "zero_optimization": {"stage": args.zero_stage},
        "zero_allow_untested_optimizer": True,  # a plain torch optimizer, no compiled DeepSpeed op
    }
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    data = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for step in range(args.steps):
        x = torch.randn(args.batch, 32, generator=data)
        with torch.no_grad():
            y = teacher(x)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if rank == 0:
        print(f"DeepSpeed ZeRO-{args.zero_stage} on {engine.world_size} ranks ({args.backend}): "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    # Under ZeRO-3 each rank holds a shard of every parameter: gather them to compare.
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=args.zero_stage == 3):
        write_report(args.report, rank, losses, params)
    if losses[-1] >= losses[0]:
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    main()
