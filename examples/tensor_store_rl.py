"""RL-style weight sync through loom's tensor store: rank 0 trains a policy, every other rank
is a generator that refreshes its copy of the policy at every step (as torchstore's
torchstore_rl example does), on CUDA when there is a GPU (several ranks may share one) and
on CPU otherwise.

    torchrun --nproc-per-node 3 examples/tensor_store_rl.py [--steps 20] [--device cpu|cuda] [--lend]

On-policy: the trainer trains step k on the rollouts of policy k-1, and each generator asks
for version k while the trainer still trains, so it copies the weights as the trainer writes
them. Each generator checks that what it got is bit for bit what the
trainer put (a checksum of the bytes, compared through the job's Store). Rank 0 prints one
line per step and "bit-exact: yes" at the end.

With --lend the trainer lends its own weights instead of putting a copy: the generators copy
straight out of the trainer's parameters, which it reclaims before each optimizer step (the
generators have read the previous version by then: they sent their rollouts).
"""

import argparse
import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn

import loom  # noqa: F401  (registers the "loom" backend)
from loom.tensor_store import TensorStore


def checksum(state_dict: dict) -> str:
    """SHA-256 of every tensor's bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        digest.update(state_dict[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def policy(device: torch.device) -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 64)).to(device=device, dtype=torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lend", action="store_true", help="lend the trainer's weights instead of copying them")
    args = parser.parse_args()

    dist.init_process_group("loom")  # the store needs only the job's Store; loom runs the barriers
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device)
    store = dist.distributed_c10d._get_default_store()
    ts = TensorStore()
    torch.manual_seed(0)
    model = policy(device)
    if rank == 0:  # the trainer
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        data = torch.Generator(device="cpu").manual_seed(1)
        if args.lend:
            ts.make_lendable(model)  # once: the parameters move into memory the store lends
        publish = ts.lend_state_dict if args.lend else ts.put_state_dict
        for step in range(1, args.steps + 1):
            if step > 1:  # on-policy: train on the rollouts of the previous policy
                store.wait([f"rollouts/{step - 1}/all"])
            x = torch.randn(32, 256, generator=data).to(device, torch.bfloat16)
            loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if args.lend and step > 1:
                ts.reclaim("policy")  # the weights are about to change
            opt.step()
            version = publish(model.state_dict(), "policy")
            store.set(f"trainer/{version}", checksum(model.state_dict()))
        dist.barrier()  # the generators have read every version (the trainer's buffers live until then)
        mismatches = [r for r in range(1, world) if store.get(f"gen{r}/result").decode() != "ok"]
        for step in range(1, args.steps + 1):
            print(f"step {step}: trainer {store.get(f'trainer/{step}').decode()}, generators "
                  f"{sorted({store.get(f'gen{r}/{step}').decode() for r in range(1, world)})}")
        print(f"bit-exact: {'yes' if not mismatches else 'no, ranks ' + str(mismatches)}")
    else:  # a generator: refresh at every step, then generate with the new weights
        weights = model.state_dict()
        bad = 0
        for step in range(1, args.steps + 1):
            ts.get_state_dict("policy", weights, version=step)  # waits for it; copies it as it is written
            got = checksum(weights)
            store.set(f"gen{rank}/{step}", got)
            bad += got != store.get(f"trainer/{step}").decode()
            with torch.no_grad():  # the rollouts the trainer waits for
                model(torch.zeros(4, 256, device=device, dtype=torch.bfloat16))
            if store.add(f"rollouts/{step}", 1) == world - 1:
                store.set(f"rollouts/{step}/all", "1")
        store.set(f"gen{rank}/result", "ok" if bad == 0 else f"{bad} steps differ")
        dist.barrier()
    ts.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
