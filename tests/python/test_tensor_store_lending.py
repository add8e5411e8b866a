"""loom.tensor_store lending a writer's own tensors (bit-exact, reclaimed before changes, never
read torn, what cannot be lent safely refused) and broadcast mode."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from store_samples import DTYPES, refresh_until, sample


class _Policy(torch.nn.Module):
    """A small model with what lending must keep working: a tied weight (one tensor under
    two names), a buffer, and parameters an optimizer holds."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.embed = torch.nn.Embedding(32, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def train_step(self, optimizer, step: int) -> None:
        tokens = torch.arange(step, step + 8) % 32
        loss = self.head(torch.relu(self.mid(self.embed(tokens)))).logsumexp(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        self.steps += 1


def _reference_weights(steps: int) -> dict:
    """The writer's state dict after `steps` training steps, computed without the store."""
    model = _Policy()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(1, steps + 1):
        model.train_step(optimizer, step)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _lending(rank, world):
    from loom.tensor_store import TensorStore, TensorStoreError

    ts = TensorStore(timeout=timedelta(seconds=60))
    out = {}
    if rank == 0:
        model = _Policy()
        params = list(model.parameters())
        optimizer = torch.optim.Adam(params, lr=0.01)
        ts.make_lendable(model)
        # Identities kept: the optimizer and the tied weight still see the lent memory.
        assert list(model.parameters()) == params and model.head.weight is model.embed.weight
        assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in params)
        out["v1"] = ts.lend_state_dict(model.state_dict(), "policy")
        for step in (1, 2, 0):
            dist.barrier()  # the version is out
            dist.barrier()  # readers have read it
            if step:
                with ts.updating("policy"):
                    model.train_step(optimizer, step)
        # A reader that asks for the latest while it is reclaimed waits for the next lend.
        ts.reclaim("policy")
        dist.barrier()
        time.sleep(0.3)
        model.train_step(optimizer, 3)
        out["v4"] = ts.lend_state_dict(model.state_dict(), "policy")
        dist.barrier()
        ts.reclaim("policy")
        dist.barrier()  # readers ask for version 4, reclaimed
        dist.barrier()
        return out
    mine = _Policy().state_dict()
    for steps in (0, 1, 2):
        dist.barrier()
        ts.get_state_dict("policy", mine)
        reference = _reference_weights(steps)
        assert all(torch.equal(mine[k], reference[k]) for k in reference), f"version after {steps} steps"
        dist.barrier()
    dist.barrier()  # the writer has reclaimed: these reads wait for version 4
    started = time.monotonic()
    ts.get_state_dict("policy", mine, **({"version": 4} if rank == 2 else {}))  # the latest, or by number
    out["waited"] = time.monotonic() - started
    reference = _reference_weights(3)
    assert all(torch.equal(mine[k], reference[k]) for k in reference)
    assert ts.latest_version("policy") == 4
    dist.barrier()
    dist.barrier()  # the writer has reclaimed version 4
    with pytest.raises(TensorStoreError, match="reclaimed that lent version"):
        ts.get_state_dict("policy", mine, version=4)
    # An older version by number: reclaimed when the next was lent (it said "never completed").
    with pytest.raises(TensorStoreError, match=r"version=2\): that lent version was reclaimed when a "
                                               r"newer one was lent .*the latest is 4"):
        ts.get_state_dict("policy", mine, version=2)
    dist.barrier()
    return out


def test_lent_state_dict_read_bit_exact_and_reclaimed_before_changes():
    results = run_ranks(3, _lending)
    assert results[0]["v1"] == 1 and results[0]["v4"] == 4
    for reader in results[1:]:
        assert reader["waited"] > 0.2  # it waited for the lend, not read the reclaimed version


def _lending_torn(rank, world, steps):
    from loom.tensor_store import TensorStore

    ts = TensorStore(timeout=timedelta(seconds=60))
    seen = []
    if rank == 0:  # the trainer changes its lent tensors as fast as it can, one value per step
        weights = {"w": torch.zeros(1 << 18), "b": torch.zeros(1 << 10, dtype=torch.bfloat16)}
        ts.make_lendable(weights)
        ts.lend_state_dict(weights, "policy")
        for step in range(1, steps + 1):
            with ts.updating("policy"):
                for t in weights.values():
                    t.fill_(step)
        dist.barrier()
    else:
        mine = {"w": torch.empty(1 << 18), "b": torch.empty(1 << 10, dtype=torch.bfloat16)}
        seen = refresh_until(ts, mine, steps, " of a lent version")
        dist.barrier()
    return seen


def test_lent_versions_are_never_read_torn():
    results = run_ranks(3, _lending_torn, 200)
    for seen in results[1:]:
        assert seen == sorted(seen) and seen[-1] == 200


def _lending_errors(rank, world):
    from loom.tensor_store import TensorStore

    ts = TensorStore(timeout=timedelta(seconds=2))
    if rank == 0:
        plain = {"w": torch.ones(4)}
        with pytest.raises(ValueError, match=r"'w' is not in memory this store lends.*make_lendable"):
            ts.lend_state_dict(plain, "a")
        model = torch.nn.Linear(4, 4)
        aliases = model.state_dict()
        with pytest.raises(ValueError, match="'weight' shares its memory with another tensor"):
            ts.make_lendable(aliases)
        with pytest.raises(ValueError, match="'weight' shares its memory"):
            ts.make_lendable(model)  # the aliases above still hold its memory
        del aliases
        ts.make_lendable(model)
        ts.make_lendable(model)  # again: nothing left to move
        with pytest.raises(TypeError, match="only tensors can be lent"):
            ts.lend_state_dict({**model.state_dict(), "step": 3}, "a")
        with pytest.raises(ValueError, match="not contiguous"):
            ts.lend("a", model.weight.t())
        # Views whose memory holds other values than they show (readers got the memory's
        # values, unconjugated, with no error).
        with pytest.raises(ValueError, match="'w' is a negative view, whose memory holds the values "
                                             "before the negation"):
            ts.lend_state_dict({"w": torch._neg_view(model.weight)}, "a")
        waves = {"z": torch.tensor([1 + 2j, 3 - 4j])}
        ts.make_lendable(waves)
        with pytest.raises(ValueError, match="the value is a conjugate view.*put\\(\\) this one"):
            ts.lend("z", waves["z"].conj())
        with pytest.raises(ValueError, match=r"lend_state_dict\('a', version=0\): versions must be integers that "
                                             r"grow"):  # it used to say put('a', version=0)
            ts.lend_state_dict(model.state_dict(), "a", version=0)
        assert ts.lend_state_dict(model.state_dict(), "a") == 1
        with pytest.raises(ValueError, match="share a buffer with key 'a'"):
            ts.lend("b", model.bias)
        with pytest.raises(ValueError, match="a key is either put or lent"):
            ts.put("a", torch.ones(2))
        ts.put("c", torch.ones(2))
        with pytest.raises(ValueError, match="a key is either put or lent"):
            ts.lend("c", model.bias)
        with pytest.raises(KeyError, match="lends no such key"):
            ts.reclaim("c")
        with pytest.raises(TypeError, match="Module or a state dict"):
            ts.make_lendable([model.weight])
        dist.barrier()
        dist.barrier()  # readers have read "a"
        ts.close()  # withdraws "a": nobody guards those tensors any more
        dist.barrier()
        dist.barrier()
        return "ok"
    dist.barrier()
    assert ts.get_state_dict("a")["weight"].shape == (4, 4)
    dist.barrier()
    dist.barrier()  # closed: a read of the latest finds no key, not unguarded bytes
    with pytest.raises(KeyError, match="no such key"):
        ts.get_state_dict("a")
    dist.barrier()
    return "ok"


def test_lending_refuses_what_it_cannot_lend_safely():
    assert run_ranks(2, _lending_errors) == ["ok", "ok"]


def _lending_empty(rank, world):
    from loom.tensor_store import TensorStore

    ts = TensorStore()
    out = {}
    if rank == 0:  # a module with an empty parameter and an empty buffer among the others
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.arange(6.0))
        model.register_buffer("none", torch.zeros(0, 4))
        model.tail = torch.nn.Parameter(torch.zeros(0))
        ts.make_lendable(model)
        ts.make_lendable(model)  # again: nothing left to move, the empty ones included
        out["buffers"] = len(ts._lendable)
        out["v"] = ts.lend_state_dict(model.state_dict(), "m")
        alone = {"e": torch.empty(0, 3)}  # a state dict of nothing but an empty tensor
        ts.make_lendable(alone)
        out["alone"] = ts.lend_state_dict(alone, "alone")
    dist.barrier()
    if rank == 1:
        got = ts.get_state_dict("m")
        out["m"] = {name: (list(t.shape), t.tolist()) for name, t in sorted(got.items())}
        out["alone"] = list(ts.get_state_dict("alone")["e"].shape)
    dist.barrier()
    return out


def test_a_module_with_empty_tensors_can_be_lent():
    writer, reader = run_ranks(2, _lending_empty)
    assert writer == {"buffers": 1, "v": 1, "alone": 1}
    assert reader == {"m": {"none": ([0, 4], []), "tail": ([0], []), "w": ([6], [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])},
                      "alone": [0, 3]}


def _broadcast_sample(step: int, receiver: bool) -> dict:
    """A state dict for broadcast mode: every dtype (1-9 KiB each, packed into 6 KiB buckets
    or, at 3 KiB and more, sent alone), a larger tensor, a strided tensor on receivers,
    nesting and an object leaf."""
    layers = enumerate(DTYPES * 3)  # enough packed buckets that both bucket buffers are reused
    out = {"layers": {f"{i}": {"w": sample(dtype, (9, 130), step * 31 + i)} for i, dtype in layers},
           # Sent alone; strided on receivers, which must then take it through a staging copy.
           "embed": torch.full((1024, 64), -1.0).t() if receiver else torch.full((64, 1024), float(step)),
           "t": sample(torch.float32, (6, 4), step).t().contiguous().t() if receiver else sample(torch.float32, (6, 4), step),
           "meta": {"step": step}}
    if receiver:  # contents that must all be overwritten
        for layer in out["layers"].values():
            layer["w"].zero_() if layer["w"].dtype != torch.bool else layer["w"].fill_(True)
        out["t"].fill_(-1.0)
        out["meta"] = {"step": -1}
    return out


def _broadcast_mode(rank, world):
    from loom.tensor_store import TensorStore

    ts = TensorStore(bucket_bytes=6 << 10)  # several buckets per call, and tensors alone
    writer = 1  # a writer that is not rank 0
    mine = _broadcast_sample(0, receiver=rank != writer)
    assert rank == writer or not (mine["t"].is_contiguous() or mine["embed"].is_contiguous())
    versions = []
    for step in (1, 2, 3):
        if rank == writer:
            mine = _broadcast_sample(step, receiver=False)
        versions.append(ts.broadcast_state_dict(mine, "policy", src=writer))
        expected = _broadcast_sample(step, receiver=False)
        for i in range(3 * len(DTYPES)):
            assert torch.equal(mine["layers"][f"{i}"]["w"], expected["layers"][f"{i}"]["w"]), (step, i)
        assert torch.equal(mine["embed"], expected["embed"]) and torch.equal(mine["t"], expected["t"])
        assert mine["meta"] == {"step": step}
    # A subgroup, another writer, a version given.
    pair = dist.new_group([0, 2], backend="loom")
    if rank in (0, 2):
        sd = {"x": torch.arange(1000, dtype=torch.int64) * (rank + 1)}
        v = ts.broadcast_state_dict(sd, "pair", src=2, group=pair, version=7)
        assert v == 7 and torch.equal(sd["x"], torch.arange(1000) * 3)
    # One rank's state dict does not fit the writer's: every member raises, naming it.
    wrong = {"x": torch.zeros(5 if rank == 2 else 4)}
    with pytest.raises(ValueError, match=r"broadcast_state_dict\('bad'\): rank 2: 'x' is torch.float32 \[5\]"):
        ts.broadcast_state_dict(wrong, "bad", src=0)
    # One member's bad arguments are every member's error, naming it (the others waited in
    # the broadcasts for the timeout).
    with pytest.raises(ValueError, match=r"rank 2: needs a dict, got list"):
        ts.broadcast_state_dict([1] if rank == 2 else {"x": torch.zeros(4)}, "args", src=0)
    with pytest.raises(ValueError, match=r"rank 1: .*keys are non-empty strings"):
        ts.broadcast_state_dict({"x": torch.zeros(4)}, "" if rank == 1 else "args", src=0)
    # A version that does not grow is refused on every member, naming the writer.
    with pytest.raises(ValueError, match=r"rank 1: versions must be integers that grow; the last of this key is 3"):
        ts.broadcast_state_dict(mine, "policy", src=writer, version=2)
    with pytest.raises(ValueError, match=r"rank 1: versions are Python ints \(got bool"):
        ts.broadcast_state_dict(mine, "policy", src=writer, version=True)
    # A writer's leaf that cannot be pickled is every member's error, not the writer's alone.
    locked = {"w": torch.ones(2), "lock": threading.Lock() if rank == writer else None}
    with pytest.raises(ValueError, match=r"rank 1: a leaf of its state dict cannot be pickled"):
        ts.broadcast_state_dict(locked, "locked", src=writer)
    # Members whose stores cut other buckets (the writer's 6 KiB, theirs 1 KiB or the default)
    # take the writer's: the same broadcasts on every rank, and the group lives on.
    other = TensorStore(namespace="other", bucket_bytes={0: 1 << 10, writer: 6 << 10, 2: 64 << 20}[rank])
    if rank == writer:
        mine = _broadcast_sample(4, receiver=False)
    other.broadcast_state_dict(mine, "policy", src=writer)
    assert torch.equal(mine["embed"], _broadcast_sample(4, receiver=False)["embed"])
    dist.barrier()
    return versions


def test_broadcast_mode_delivers_the_writers_state_dict_to_every_member():
    assert run_ranks(3, _broadcast_mode) == [[1, 2, 3]] * 3


def _broadcast_parameters(rank, world):
    from loom.tensor_store import TensorStore

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Linear(64, 32))

    # 4 KiB buckets: the convolution's weight (864 B) is packed, the linear one (8 KiB) goes
    # alone. The receivers' are Parameters that are not contiguous (channels_last, and a
    # transposed weight), filled with grad mode on as load_state_dict fills them.
    ts = TensorStore(bucket_bytes=4 << 10)
    mine = model(rank)
    if rank != 0:
        mine = mine.to(memory_format=torch.channels_last)
        mine[1].weight = torch.nn.Parameter(torch.zeros(64, 32).t())
        assert not (mine[0].weight.is_contiguous() or mine[1].weight.is_contiguous())
    params = list(mine.parameters())
    ts.broadcast_state_dict(mine.state_dict(keep_vars=True), "policy", src=0)
    assert list(mine.parameters()) == params and all(p.requires_grad for p in params)
    want = model(0).state_dict()
    return sorted(name for name, value in mine.state_dict().items() if torch.equal(value, want[name]))


def _broadcast_lazy_views(rank, world):
    from loom.tensor_store import TensorStore

    # 4 KiB buckets: "big" tensors (8 KiB) go alone, "small" ones are packed. The writer sends
    # conjugate and negative views, a receiver fills negative views; values move, as copy_
    # moves them (alone, the conjugate view was refused by torch on the writer only, leaving
    # the others in the broadcast; the negative view was left unfilled).
    ts = TensorStore(bucket_bytes=4 << 10)
    values = torch.complex(torch.arange(1.0, 1025.0), -torch.arange(1.0, 1025.0))
    real = torch.arange(1.0, 2049.0)
    if rank == 0:
        sd = {"big_conj": values.conj(), "big_neg": torch._neg_view(-real), "small": torch._neg_view(-real[:8])}
    else:
        sd = {"big_conj": torch.zeros(1024, dtype=torch.complex64), "big_neg": torch._neg_view(torch.zeros(2048)),
              "small": torch._neg_view(torch.zeros(8))}
    ts.broadcast_state_dict(sd, "lazy", src=0)
    return [torch.equal(sd["big_conj"], values.conj()), torch.equal(sd["big_neg"], real),
            torch.equal(sd["small"], real[:8])]


def test_broadcast_mode_moves_conjugate_and_negative_views_by_value():
    assert run_ranks(2, _broadcast_lazy_views) == [[True, True, True]] * 2


def _broadcast_unfillable(rank, world):
    from loom.tensor_store import TensorStore

    # 4 KiB buckets: "big" (8 KiB) goes alone, "small" is packed. A receiver whose tensor
    # cannot be filled in place is every member's error, found before any broadcast. One whose
    # elements share memory used to raise on that receiver alone, after the broadcasts had
    # begun (the writer went on as if all was well, and members with buckets still to come
    # waited in them until their timeout). An inference tensor outside inference mode, which
    # copy_ and get() refuse, used to be filled where loom's own copies or the broadcast
    # itself wrote it, and refused where torch's copy ran: now refused alike.
    ts = TensorStore(bucket_bytes=4 << 10)
    refused = []
    for case in ("expanded", "inference"):
        big = torch.ones(2048) if rank == 0 else torch.zeros(1).expand(2048)
        if rank == 1 and case == "inference":
            with torch.inference_mode():
                big = torch.zeros(2048)
        try:
            ts.broadcast_state_dict({"big": big, "small": torch.zeros(4)}, f"w_{case}", src=0)
        except ValueError as error:
            refused.append("rank 1: 'big'" in str(error))
    sd = {"x": torch.full((4,), float(rank))}
    ts.broadcast_state_dict(sd, "after", src=0)  # the group goes on
    return refused, sd["x"].tolist()


def test_broadcast_mode_refuses_a_receivers_unfillable_tensor_on_every_member():
    assert run_ranks(2, _broadcast_unfillable) == [([True, True], [0.0] * 4)] * 2


def test_broadcast_mode_fills_parameters_that_are_not_contiguous():
    assert run_ranks(3, _broadcast_parameters) == [["0.bias", "0.weight", "1.bias", "1.weight"]] * 3


def _broadcast_saved_for_backward(rank, world):
    from loom.tensor_store import TensorStore

    # 1 KiB buckets: "small" is packed into one, "big" (4 KiB) goes alone.
    ts = TensorStore(bucket_bytes=1 << 10)
    small, big = torch.zeros(4), torch.zeros(1024)
    if rank == 0:
        small += 7
        big += 7
        ts.broadcast_state_dict({"small": small, "big": big}, "w", src=0)
        return None
    x = torch.ones(4, requires_grad=True)
    y = (x * small).sum() + (x.repeat(256) * big).sum()  # saves both for backward
    versions = (small._version, big._version)
    ts.broadcast_state_dict({"small": small, "big": big}, "w", src=0)
    assert small._version > versions[0] and big._version > versions[1], versions
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    return small.tolist()


def test_broadcast_mode_fills_tensors_as_copy_does_for_autograd():
    # A value saved for backward and then overwritten by a broadcast is refused by backward,
    # as after load_state_dict, instead of giving a gradient from the new values.
    assert run_ranks(2, _broadcast_saved_for_backward)[1] == [7.0] * 4


def _broadcast_cancelled(rank, world):
    import asyncio

    from loom.tensor_store import AsyncTensorStore, TensorStore

    if rank == 0:  # the writer broadcasts a second after the receiver's cancel
        time.sleep(1.0)
        TensorStore().broadcast_state_dict({"w": torch.full((4,), 7.0), "obj": "from-src"}, "k", src=0)
        return None
    ats = AsyncTensorStore()
    mine = {"w": torch.zeros(4), "obj": "mine"}

    async def main():
        with pytest.raises((asyncio.TimeoutError, TimeoutError)):
            await asyncio.wait_for(ats.broadcast_state_dict(mine, "k", src=0), 0.2)
        at_the_end = (mine["w"].tolist(), mine["obj"])
        mine["w"].fill_(5.0)  # the caller's again
        await asyncio.sleep(0.5)
        return at_the_end, (mine["w"].tolist(), mine["obj"])

    return asyncio.run(main())


def test_a_cancelled_broadcast_takes_its_part_and_then_touches_nothing():
    # A collective cannot stop (the other members wait in it): the cancel ends once this
    # member's part is done. It used to return at once, and the broadcast filled the
    # receiver's tensors and replaced its objects later, over what it had written since.
    assert run_ranks(2, _broadcast_cancelled)[1] == (([7.0] * 4, "from-src"), ([5.0] * 4, "from-src"))
