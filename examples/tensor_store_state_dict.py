"""A multi-tensor LoRA-shaped state dict round trip through loom's tensor store, as
torchstore's torchstore_state_dict example: rank 0 (the trainer) puts its adapters, every
other rank (a generator) gets them into its own state dict, and the checksums must match bit
for bit. On CUDA when there is a GPU (several ranks may share one), on CPU otherwise.

    torchrun --nproc-per-node 2 examples/tensor_store_state_dict.py [--layers 8] [--device cpu|cuda]
"""

import argparse
import hashlib

import torch
import torch.distributed as dist

import loom  # noqa: F401  (registers the "loom" backend)
from loom.tensor_store import TensorStore


def lora_state_dict(layers: int, rank: int, hidden: int, device: torch.device, seed: int) -> dict:
    """Adapters for the attention projections of every layer, bf16, with their settings."""
    g = torch.Generator().manual_seed(seed)
    sd = {"config": {"r": rank, "alpha": 2 * rank, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}}
    for layer in range(layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[f"model.layers.{layer}.self_attn.{proj}"] = {
                "lora_A.weight": torch.randn(rank, hidden, generator=g).to(device, torch.bfloat16),
                "lora_B.weight": torch.randn(hidden, rank, generator=g).to(device, torch.bfloat16),
            }
    return sd


def checksum(sd: dict, prefix: str = "") -> str:
    """SHA-256 over every leaf, tensors by their bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(sd):
        value = sd[name]
        if isinstance(value, dict):
            digest.update(checksum(value, prefix + name + ".").encode())
        elif isinstance(value, torch.Tensor):
            digest.update((prefix + name).encode())
            digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(f"{prefix}{name}={value!r}".encode())
    return digest.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    dist.init_process_group("loom")
    rank = dist.get_rank()
    device = torch.device(args.device)
    store = dist.distributed_c10d._get_default_store()
    ts = TensorStore()
    if rank == 0:
        adapters = lora_state_dict(args.layers, args.lora_rank, args.hidden, device, seed=1)
        ts.put_state_dict(adapters, "lora")
        store.set("trainer/checksum", checksum(adapters))
        dist.barrier()  # every generator has its copy
        sums = {r: store.get(f"gen{r}/checksum").decode() for r in range(1, dist.get_world_size())}
        same = all(s == checksum(adapters) for s in sums.values())
        tensors = sum(isinstance(t, torch.Tensor) for v in adapters.values() if isinstance(v, dict) for t in v.values())
        print(f"trainer {checksum(adapters)} ({tensors} tensors); generators {sums}")
        print(f"bit-exact: {'yes' if same else 'no'}")
    else:
        mine = lora_state_dict(args.layers, args.lora_rank, args.hidden, device, seed=rank + 100)
        got = ts.get_state_dict("lora", mine, version=1)  # waits for the put; fills in place
        store.set(f"gen{rank}/checksum", checksum(got))
        dist.barrier()
    ts.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
