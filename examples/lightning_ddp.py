"""A Lightning training run on loom, with DDP across the ranks.

    torchrun --nproc-per-node 2 examples/lightning_ddp.py [--steps 50]
    torchrun --nproc-per-node 2 examples/lightning_ddp.py --backend default

Name the backend in the strategy: `DDPStrategy(process_group_backend="loom")`. Or make loom the
default CPU backend with `loom.make_default()` (or LOOM_DEFAULT=1) and keep `strategy="ddp"`:
Lightning then finds loom in torch's default backend map (`--backend default` shows that).
"""

import argparse
import os

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.strategies import DDPStrategy

import loom
from report import write_report


class Regression(L.LightningModule):
    """An MLP that learns a fixed random linear map; keeps its losses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.teacher = nn.Linear(32, 8).requires_grad_(False)
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 8))
        self.losses = []

    def training_step(self, batch, _index):
        (x,) = batch
        loss = nn.functional.mse_loss(self.net(x), self.teacher(x))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--backend", default="loom", help="a backend name, or 'default' for strategy='ddp'")
    parser.add_argument("--report", help="write losses and a weights digest here (for the tests)")
    args = parser.parse_args()

    if args.backend == "default":
        loom.make_default()
        strategy = "ddp"
    else:
        strategy = DDPStrategy(process_group_backend=args.backend)
    module = Regression()
    data = torch.randn(args.steps * args.batch * 2, 32, generator=torch.Generator().manual_seed(1000))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=args.batch)
    # Under torchrun, Lightning wants as many CPU "devices" as torchrun started processes here.
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, loader)
    rank, losses = trainer.global_rank, module.losses
    if rank == 0:
        print(f"Lightning on {trainer.world_size} ranks "
              f"({torch.distributed.get_backend()}): loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    write_report(args.report, rank, losses, module.net.parameters())
    if losses[-1] >= losses[0]:
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    main()
