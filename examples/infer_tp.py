"""Tensor-parallel inference on CPUs with loom.ops: a hand-sharded model whose layers end in one
small all_reduce each, the call CPU inference engines make between layers.

    torchrun --nproc-per-node 2 examples/infer_tp.py [--steps 16]

A toy next-token model (embedding, blocks of MLPs with a residual, an output head) is built the
same on every rank; each rank keeps its slice of every block: the columns of the first linear
layer, the rows of the second (Megatron's column- and row-parallel split). A block's output is
then a sum of the ranks' partial results, which `loom.ops.all_reduce_` adds up in place,
skipping c10d's Work and future (docs/PERFORMANCE.md, "loom.ops": a few KiB in a few µs). It
decodes greedily and checks every step's logits against the whole model run on one rank.
"""

import argparse
import math

import torch
import torch.distributed as dist
import torch.nn as nn

import loom  # noqa: F401  (registers the "loom" backend)
import loom.ops
from report import write_report

VOCAB, WIDTH, HIDDEN, BLOCKS = 97, 64, 256, 4


class Block(nn.Module):
    """x + W2 gelu(W1 x): the MLP of a transformer block."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class Model(nn.Module):
    """Embedding, BLOCKS blocks, output head: logits for the next token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor, blocks=None) -> torch.Tensor:
        """The logits, through `blocks` in place of this model's own (a rank's shards)."""
        x = self.embed(tokens).mean(dim=0)  # a bag of the tokens so far: no attention needed
        for block in blocks or self.blocks:
            x = block(x)
        return self.head(x)


class ShardedBlock(nn.Module):
    """One rank's slice of a Block: columns [lo, hi) of `up` and the same rows of `down`. The
    ranks' outputs sum to the block's; the bias of `down` is added once, by rank 0."""

    def __init__(self, block: Block, rank: int, world: int, all_reduce_) -> None:
        super().__init__()
        lo, hi = HIDDEN * rank // world, HIDDEN * (rank + 1) // world
        self.up_w = block.up.weight[lo:hi].detach().clone()
        self.up_b = block.up.bias[lo:hi].detach().clone()
        self.down_w = block.down.weight[:, lo:hi].detach().clone()
        self.down_b = block.down.bias.detach().clone() if rank == 0 else None
        self.all_reduce_ = all_reduce_

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = nn.functional.gelu(x @ self.up_w.T + self.up_b) @ self.down_w.T
        if self.down_b is not None:
            partial += self.down_b
        self.all_reduce_(partial)  # the ranks' partial sums -> the block's output, in place
        return x + partial


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="tokens to generate")
    parser.add_argument("--backend", default="loom")
    parser.add_argument("--report", help="write per-step log-probabilities here (for the tests)")
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.backend == "loom":
        name = dist.group.WORLD.group_name
        all_reduce_ = lambda t: loom.ops.all_reduce_(t, "sum", name)  # noqa: E731
    else:  # the same model over another backend, for comparison
        all_reduce_ = dist.all_reduce
    torch.manual_seed(0)
    model = Model().eval()  # the same weights on every rank
    shards = [ShardedBlock(b, rank, world, all_reduce_) for b in model.blocks]

    tokens = torch.tensor([1, 2, 3])
    log_probs = []
    with torch.no_grad():
        for step in range(args.steps):
            logits = model(tokens, shards)
            whole = model(tokens)
            if not torch.allclose(logits, whole, rtol=1e-5, atol=1e-5):
                raise SystemExit(f"step {step}: the sharded logits differ from the whole model's by "
                                 f"{(logits - whole).abs().max().item():.3g}")
            scores = torch.log_softmax(logits, dim=-1)
            token = int(scores.argmax())
            log_probs.append(float(scores[token]))
            tokens = torch.cat([tokens, torch.tensor([token])])
    if rank == 0:
        print(f"tensor-parallel inference on {world} ranks ({args.backend}): generated "
              f"{tokens[3:].tolist()}, mean log-probability "
              f"{sum(log_probs) / len(log_probs):.4f}", flush=True)
    assert all(math.isfinite(p) for p in log_probs)
    write_report(args.report, rank, log_probs, model.parameters())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
