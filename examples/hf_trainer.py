"""A Hugging Face transformers Trainer run on loom: a tiny GPT-2 built from a config (nothing
downloaded) learns random token sequences, with DDP across the ranks.

    torchrun --nproc-per-node 2 examples/hf_trainer.py [--steps 50]

`import loom` is all it takes: `TrainingArguments(ddp_backend="loom")` then runs DDP through
loom. (The Trainer's command-line parser lists its backends in code and rejects "loom"; from
the command line, pass `--ddp_backend gloo` with LOOM_REPLACES_GLOO=1 set instead.)
"""

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import loom  # noqa: F401  (registers "loom" and teaches accelerate, which the Trainer uses, its name)
from report import write_report


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random sequences; the model learns to predict each from its prefix."""

    def __init__(self, samples: int, length: int, vocab: int):
        self.ids = torch.randint(vocab, (samples, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class LossLog(TrainerCallback):
    """Keeps the loss the Trainer logs at every step."""

    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--backend", default="loom")
    parser.add_argument("--report", help="write losses and a weights digest here (for the tests)")
    args = parser.parse_args()

    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    losses = LossLog()
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out, ddp_backend=args.backend, use_cpu=True, max_steps=args.steps,
            per_device_train_batch_size=8, learning_rate=1e-2, lr_scheduler_type="constant",
            logging_steps=1, save_strategy="no",
            report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(256, 32, 128),
                          callbacks=[losses])
        trainer.train()
        rank = training.process_index
        if rank == 0:
            print(f"Trainer on {training.world_size} ranks ({args.backend}): "
                  f"loss {losses.losses[0]:.4f} -> {losses.losses[-1]:.4f}", flush=True)
        write_report(args.report, rank, losses.losses, model.parameters())
    if losses.losses[-1] >= losses.losses[0]:
        raise SystemExit("the loss did not go down")


if __name__ == "__main__":
    main()
