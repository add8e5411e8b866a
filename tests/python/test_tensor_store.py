"""loom.tensor_store across real processes: values and state dicts read back bit-exact, DTensor
resharding between groups, versions, torn-read protection, writers and readers killed
mid-transfer, buffers freed, and the errors bad requests get."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.uint8,
          torch.bool, torch.complex64]


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g).to(dtype)


def _store_buffers() -> tuple[int, int]:
    """(descriptors, mappings) this process holds of tensor-store regions."""
    fds = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fds += "loom-tensor-store" in os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    with open("/proc/self/maps") as f:
        maps = sum("loom-tensor-store" in line for line in f)
    return fds, maps


def _values(rank, world):
    from loom.tensor_store import TensorStore

    ts = TensorStore()
    if rank == 0:
        for i, dtype in enumerate(DTYPES):
            ts.put(f"t/{dtype}", _sample(dtype, (3, 5, 7), i))
        ts.put("t/strided", _sample(torch.float32, (8, 6), 99).t()[1:, ::2])
        ts.put("t/scalar", torch.tensor(2.5))
        ts.put("t/empty", torch.empty(0, 4))
        ts.put("obj", {"lr": 1e-4, "names": ["a", "b"]})
    dist.barrier()
    out = {}
    for i, dtype in enumerate(DTYPES):
        got = ts.get(f"t/{dtype}")
        assert got.dtype == dtype and torch.equal(got, _sample(dtype, (3, 5, 7), i)), dtype
        into = torch.zeros(3, 5, 7, dtype=dtype)
        assert ts.get(f"t/{dtype}", inplace_tensor=into) is into and torch.equal(into, got)
        part = ts.get(f"t/{dtype}", tensor_slice_spec=((1, 2, 3), (2, 2, 4)))
        assert torch.equal(part, got[1:3, 2:4, 3:7])
    assert torch.equal(ts.get("t/strided"), _sample(torch.float32, (8, 6), 99).t()[1:, ::2])
    assert ts.get("t/scalar").item() == 2.5 and ts.get("t/empty").shape == (0, 4)
    out["obj"] = ts.get("obj")
    batch = ts.get_batch(["t/scalar", "obj"])
    out["batch"] = (batch["t/scalar"].item(), batch["obj"]["lr"])
    out["keys"] = ts.keys("t/")
    out["exists"] = (ts.exists("obj"), ts.exists("nope"))
    dist.barrier()
    if rank == 0:
        ts.delete("obj")
    dist.barrier()
    out["after_delete"] = (ts.exists("obj"), "obj" in ts.keys())
    return out


def test_values_round_trip_bit_exact():
    for out in run_ranks(3, _values):
        assert out["obj"] == {"lr": 1e-4, "names": ["a", "b"]}
        assert out["batch"] == (2.5, 1e-4)
        assert len(out["keys"]) == len(DTYPES) + 3 and all(k.startswith("t/") for k in out["keys"])
        assert out["exists"] == (True, False)
        assert out["after_delete"] == (False, False)


def _lora_state_dict(step: int) -> dict:
    """A LoRA-shaped state dict, as the seed's example: adapters per layer, metadata beside."""
    sd: dict = {"meta": {"step": step, "rank": 8, "alpha": 16.0}}
    for layer in range(4):
        sd[f"layers.{layer}"] = {
            "q_proj": {"lora_A": _sample(torch.bfloat16, (8, 256), 100 * step + layer),
                       "lora_B": _sample(torch.bfloat16, (256, 8), 100 * step + layer + 50)},
            "v_proj": {"lora_A": _sample(torch.bfloat16, (8, 256), 100 * step + layer + 7),
                       "lora_B": _sample(torch.bfloat16, (256, 8), 100 * step + layer + 57)},
        }
    return sd


def _checksum(sd: dict) -> float:
    from loom.tensor_store._layout import flatten

    return sum(float(v.double().sum()) for _, v in flatten(sd) if isinstance(v, torch.Tensor))


def _lora(rank, world):
    from loom.tensor_store import TensorStore

    ts = TensorStore()
    if rank == 0:
        assert ts.put_state_dict(_lora_state_dict(1), "lora") == 1
        assert ts.latest_version("lora") == 1
    dist.barrier()
    fresh = ts.get_state_dict("lora")
    mine = _lora_state_dict(0)  # the reader's own tensors, filled in place
    before = mine["layers.2"]["v_proj"]["lora_B"]
    filled = ts.get_state_dict("lora", mine)
    assert filled["layers.2"]["v_proj"]["lora_B"] is before
    want = _lora_state_dict(1)
    # The reader's copies are planned once per state dict; a tensor swapped for another
    # object (or a resized one) must make a new plan, not write into the old tensor.
    dist.barrier()
    if rank == 0:
        ts.put_state_dict(_lora_state_dict(2), "lora")
    dist.barrier()
    swapped = torch.zeros(256, 8, dtype=torch.bfloat16)
    old = mine["layers.3"]["q_proj"]["lora_B"]
    mine["layers.3"]["q_proj"]["lora_B"] = swapped
    ts.get_state_dict("lora", mine)
    assert torch.equal(swapped, _lora_state_dict(2)["layers.3"]["q_proj"]["lora_B"])
    assert torch.equal(old, want["layers.3"]["q_proj"]["lora_B"])  # untouched since
    filled = ts.get_state_dict("lora", mine, version=1)
    mine["layers.3"]["q_proj"]["lora_B"] = old
    from loom.tensor_store._layout import flatten

    for (path, a), (_, b) in zip(sorted(flatten(want)), sorted(flatten(filled))):
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), path
    dist.barrier()  # the writer's buffers live as long as its store
    return _checksum(fresh), _checksum(filled), _checksum(want), filled["meta"]


def test_lora_state_dict_round_trip():
    results = run_ranks(3, _lora)
    for fresh, filled, want, meta in results:
        assert fresh == filled == want
        assert meta == {"step": 1, "rank": 8, "alpha": 16.0}


def _reshard(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from loom.tensor_store import TensorStore

    ts = TensorStore()
    # Ranks 0-1 train (FSDP: Shard(0) over their pair), ranks 2-3 generate (tensor parallel:
    # column and row shards over theirs); shapes do not divide evenly on purpose.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("role", "shard"))
    pair = mesh["shard"]
    full = {"wq": _sample(torch.float32, (7, 10), 1), "wo": _sample(torch.bfloat16, (10, 7), 2),
            "norm": _sample(torch.float32, (10,), 3)}
    if rank < 2:
        sd = {name: distribute_tensor(t, pair, [Shard(0)]) for name, t in full.items()}
        sd["step"] = 5
        ts.put_state_dict(sd, "policy")
    ts.latest_version("policy")
    dist.barrier()
    out = {}
    if rank >= 2:
        mine = {"wq": distribute_tensor(torch.zeros(7, 10), pair, [Shard(1)]),
                "wo": distribute_tensor(torch.zeros(10, 7, dtype=torch.bfloat16), pair, [Shard(0)]),
                "norm": distribute_tensor(torch.zeros(10), pair, [Replicate()]), "step": None}
        got = ts.get_state_dict("policy", mine)
        for name, t in full.items():
            assert torch.equal(got[name].full_tensor(), t), name
        out["step"] = got["step"]
        out["plain"] = torch.equal(ts.get_state_dict("policy")["wq"], full["wq"])
    # 2-D writers with a replicated mesh dimension (each shard stored once) read back by the
    # same ranks under another layout.
    big = _sample(torch.float32, (6, 9), 4)
    ts.put("grid", distribute_tensor(big, mesh, [Shard(0), Replicate()]))
    dist.barrier()
    target = distribute_tensor(torch.zeros(6, 9), mesh, [Replicate(), Shard(1)])
    ts.get("grid", inplace_tensor=target)
    out["grid"] = torch.equal(target.full_tensor(), big)
    dist.barrier()  # writers' buffers live as long as their stores: keep them until all have read
    return out


def test_dtensor_resharding_between_groups():
    results = run_ranks(4, _reshard)
    assert all(r["grid"] for r in results)
    assert results[2] == results[3] == {"step": 5, "plain": True, "grid": True}


def _refresh_until(ts, mine: dict, last: float, what: str) -> list[float]:
    """A generator's loop: reads the latest version of "policy" into `mine` until it has seen
    `last`, checking that every read is one whole version (every tensor one value)."""
    seen: list[float] = []
    while not seen or seen[-1] < last:
        if not ts.exists("policy"):
            continue
        ts.get_state_dict("policy", mine)
        values = {float(mine["w"].min()), float(mine["w"].max()), float(mine["b"].min()), float(mine["b"].max())}
        assert len(values) == 1, f"a torn read{what}: {values}"
        seen.append(values.pop())
    return seen


def _rl_loop(rank, world, steps):
    from loom.tensor_store import TensorStore

    ts = TensorStore()
    seen = []
    if rank == 0:  # the trainer: a new version as fast as it can, each filled with its step
        weights = {"w": torch.zeros(1 << 16), "b": torch.zeros(1 << 10, dtype=torch.bfloat16)}
        for step in range(1, steps + 1):
            for t in weights.values():
                t.fill_(step)
            ts.put_state_dict(weights, "policy")
        dist.barrier()  # the writer's buffers live as long as its TensorStore: hold it
    else:  # generators: refresh whenever they can; every read must be one whole version
        mine = {"w": torch.empty(1 << 16), "b": torch.empty(1 << 10, dtype=torch.bfloat16)}
        seen = _refresh_until(ts, mine, steps, "")
        # The final version waited for by number, as a generator that wants step N does.
        ts.get_state_dict("policy", mine, version=steps)
        assert float(mine["w"][0]) == steps
        dist.barrier()
    return seen


def test_rl_loop_never_reads_a_torn_version():
    results = run_ranks(3, _rl_loop, 60)
    for seen in results[1:]:
        assert seen == sorted(seen) and seen[-1] == 60


def _versions(rank, world):
    from loom.tensor_store import TensorStore, TensorStoreError

    ts = TensorStore(keep=3)
    if rank == 0:
        for step in (1, 2, 3, 4):
            ts.put("x", torch.full((4,), float(step)))
        with pytest.raises(ValueError, match="versions must be integers that grow"):
            ts.put("x", torch.zeros(4), version=4)
        assert ts.put("x", torch.full((4,), 10.0), version=10) == 10
        assert _store_buffers()[0] == 3  # keep=3: three regions alive, the rest freed
    dist.barrier()
    out = {"latest": ts.latest_version("x"), "v3": ts.get("x", version=3)[0].item(),
           "v10": ts.get("x")[0].item()}
    with pytest.raises(TensorStoreError, match="version=2.*no longer kept"):
        ts.get("x", version=2)
    with pytest.raises(TimeoutError, match="'x', version=11.*not put within"):
        ts.get("x", version=11, timeout=timedelta(milliseconds=300))
    dist.barrier()
    if rank == 1:  # a version that does not exist yet is waited for
        time.sleep(0.3)
        ts_writer = TensorStore(keep=3)
        ts_writer.put("y", torch.ones(2), version=7)
        dist.barrier()
    else:
        if rank == 0:
            out["waited"] = ts.get("y", version=7, timeout=timedelta(seconds=60)).tolist()
        dist.barrier()
    return out


def test_versions_latest_given_kept_and_waited_for():
    results = run_ranks(3, _versions)
    for r in results:
        assert (r["latest"], r["v3"], r["v10"]) == (10, 3.0, 10.0)
    assert results[0]["waited"] == [1.0, 1.0]


def _async(rank, world):
    from loom.tensor_store import AsyncTensorStore

    async def main():
        ts = AsyncTensorStore()
        if rank == 0:
            await ts.put("a", torch.arange(5))
            await ts.put_state_dict({"w": torch.ones(3)}, "sd")
        await asyncio.to_thread(dist.barrier)
        got = await ts.get("a")
        sd = await ts.get_state_dict("sd")
        out = got.tolist(), sd["w"].tolist(), await ts.exists("a"), await ts.keys()
        await asyncio.to_thread(dist.barrier)  # the writer's buffers live as long as its store
        return out

    return asyncio.run(main())


def test_async_forms():
    for got, w, exists, keys in run_ranks(2, _async):
        assert got == [0, 1, 2, 3, 4] and w == [1.0, 1.0, 1.0] and exists and keys == ["a", "sd"]


def _leaks(rank, world):
    from loom.tensor_store import TensorStore

    ts = TensorStore()
    counts = {}
    if rank == 0:
        for step in range(6):
            ts.put_state_dict({"w": torch.full((1000,), float(step)), "cfg": step}, "sd")
            ts.put("t", torch.full((10,), float(step)))
        counts["writer"] = _store_buffers()
    dist.barrier()
    if rank == 1:
        for _ in range(3):
            ts.get_state_dict("sd")
            ts.get("t")
        counts["reader"] = _store_buffers()
    dist.barrier()
    if rank == 0:
        ts.delete("sd")
        counts["after_delete"] = _store_buffers()
        ts.close()
        counts["after_close"] = _store_buffers()
    return counts


def test_buffers_are_bounded_and_freed():
    writer, reader = run_ranks(2, _leaks)
    assert writer["writer"][0] == 4  # 2 keys x 2 kept versions, one region each
    assert writer["after_delete"][0] == 2 and writer["after_close"] == (0, 0)
    # Readers hold mappings, no descriptors: the writer's two buffers of each key at most.
    assert reader["reader"][0] == 0 and reader["reader"][1] <= 4


def _sync(store, name, timeout=60):
    store.wait([name], timedelta(seconds=timeout))


def _writer_dies(rank, world):
    from loom.tensor_store import TensorStore, TensorStoreError
    from loom.tensor_store import _parts

    store = dist.distributed_c10d._get_default_store()
    ts = TensorStore()
    if rank == 0:
        ts.put("w", torch.full((1 << 16,), 1.0))
        ts.put("w", torch.full((1 << 16,), 2.0))
        store.set("v2", "1")
        _sync(store, "read")

        def write_then_die(self, pieces, bucket_bytes):  # v3 dies half-written, in v1's region
            self.region.begin_write()
            _parts.typed_view(self.data, pieces[0][1], pieces[0][0].dtype, (100,)).copy_(pieces[0][0][:100])
            self.region.set_progress(400)
            store.set("dying", "1")
            _sync(store, "mapped3")  # a reader is waiting for the rest of v3
            os.kill(os.getpid(), signal.SIGKILL)

        _parts.OwnedBuffer.write = write_then_die
        ts.put("w", torch.full((1 << 16,), 3.0))
        raise AssertionError("the writer should have died")
    _sync(store, "v2")
    pid = ts._parts("w", None, None)[1][0].buffers[0].pid
    if rank == 1:  # reads v2 while the writer lives (and so maps it)
        assert float(ts.get("w")[0]) == 2.0
    if store.add("readers", 1) == 2:
        store.set("read", "1")
    if rank == 1:
        while os.path.exists(f"/proc/{pid}"):  # the writer dies mid-put
            time.sleep(0.01)
        got = ts.get("w")  # v3 never completed: v2 is the latest, and whole
        return ts.latest_version("w"), float(got.min()), float(got.max())
    # Rank 2 waits for v3 as it is written (its part is published before its bytes), and is
    # told when the writer dies; it never mapped v2, so reading that is refused with a reason.
    _sync(store, "dying")
    version, parts = ts._parts("w", 3, None)
    ts._mapped_buffer(parts[0], 0)
    store.set("mapped3", "1")
    with pytest.raises(TensorStoreError, match=r"version 3: rank 0 \(pid \d+\) died while writing it"):
        ts.get("w", version=3)
    with pytest.raises(TensorStoreError, match="rank 0.*(exited|released)"):
        ts.get("w")
    return "told"


def test_writer_killed_mid_put_leaves_previous_version():
    results = run_ranks(3, _writer_dies, killed=(0,), finalize=False)
    assert results == ["killed", (2, 2.0, 2.0), "told"]


def _reader_dies(rank, world):
    from loom.tensor_store import TensorStore

    store = dist.distributed_c10d._get_default_store()
    ts = TensorStore()
    if rank == 0:
        ts.put("w", torch.full((1 << 18,), 1.0))
        store.set("v1", "1")
        while os.path.exists(f"/proc/{int(store.get('reader_pid'))}"):
            time.sleep(0.01)
        for step in (2, 3, 4):  # the writer goes on; its buffers stay bounded
            ts.put("w", torch.full((1 << 18,), float(step)))
        store.set("v4", "1")
        _sync(store, "read4")  # its buffers live as long as its TensorStore
        return _store_buffers()[0]
    _sync(store, "v1")
    if rank == 1:  # killed in the middle of copying a version out
        store.set("reader_pid", str(os.getpid()))
        import loom.tensor_store._read_plan as read_plan

        read_plan.run_copies = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
        ts.get("w")
        raise AssertionError("the reader should have died")
    _sync(store, "v4")
    got = float(ts.get("w")[0])
    store.set("read4", "1")
    return got


def test_reader_killed_mid_get_leaves_writer_and_others_unharmed():
    results = run_ranks(3, _reader_dies, killed=(1,), finalize=False)
    assert results == [2, "killed", 4.0]


def _errors(rank, world):
    from torch.distributed.tensor import Partial, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    from loom.tensor_store import TensorStore, _store

    ts = TensorStore()
    with pytest.raises(ValueError, match="at least 2 versions"):
        TensorStore(keep=1)
    if rank == 0:
        ts.put("f32", torch.zeros(4, 4))
        ts.put("obj", [1, 2])
    dist.barrier()
    with pytest.raises(KeyError, match=r"rank %d\): get\('missing'\): no such key" % rank):
        ts.get("missing")
    with pytest.raises(ValueError, match="'f32'.*stored as torch.float32; the tensor to fill is torch.bfloat16"):
        ts.get("f32", inplace_tensor=torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"'f32'.*shape \[4, 5\]; the stored block is \[4, 4\]"):
        ts.get("f32", inplace_tensor=torch.zeros(4, 5))
    with pytest.raises(ValueError, match="slice at .3, 0. of shape .2, 4. is not within"):
        ts.get("f32", tensor_slice_spec=((3, 0), (2, 4)))
    with pytest.raises(ValueError, match="'obj'.*is an object, not a tensor"):
        ts.get("obj", inplace_tensor=torch.zeros(2))
    with pytest.raises(ValueError, match="keys are non-empty strings"):
        ts.put("", torch.zeros(1))
    with pytest.raises(ValueError, match=r"'f32' version 1 is a tensor, not a state dict: use get"):
        ts.get_state_dict("f32", {"other": torch.zeros(4, 4)})
    with pytest.raises(ValueError, match=r"'f32' version 1 is a tensor, not a state dict: use get"):
        ts.get_state_dict("f32")
    with pytest.raises(ValueError, match=r"'obj' version 1 is an object, not a state dict: use get"):
        ts.get_state_dict("obj", {"other": torch.zeros(4, 4)}, strict=False)
    with pytest.raises(KeyError, match=r"delete\('missing'\): no such key"):
        ts.delete("missing")
    real = _store._available_memory
    _store._available_memory = lambda: 1 << 20  # as if the host had 1 MiB free
    try:
        with pytest.raises(MemoryError, match=rf"put\('big{rank}'\) needs 4194304 bytes of shared memory"):
            ts.put(f"big{rank}", torch.zeros(1 << 20))  # a key per writer (see _two_writers)
        # The refused put gave its number back: the key can be put once memory allows.
        assert ts.put(f"big{rank}", torch.zeros(4)) == 1
    finally:
        _store._available_memory = real
    mesh = init_device_mesh("cpu", (world,))
    partial = distribute_tensor(torch.ones(4), mesh, [Partial()]) if hasattr(torch.distributed.tensor, "Partial") else None
    if partial is not None:
        with pytest.raises(ValueError, match=r"rank \d\): 'partial' is a DTensor placed Partial.*redistribute"):
            ts.put("partial", partial)
    dist.barrier()  # the writer's buffers live as long as its store
    return True


def test_bad_requests_get_clear_errors():
    assert run_ranks(2, _errors) == [True, True]


def _as_written(rank, world, versions):
    from loom.tensor_store import TensorStore
    from loom.tensor_store import _read_plan

    # Small buckets, so that a reader waiting for a version copies its front while the
    # writer still writes its back.
    ts = TensorStore(bucket_bytes=256 << 10)
    shapes = [(256, 256)] * 32  # 8 MiB of float32 in 32 tensors
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        from loom.tensor_store import _parts

        copies = _parts.run_copies

        def slow_copies(*args):  # a writer slower than its reader, as a trainer's bigger puts are
            time.sleep(0.002)
            copies(*args)

        _parts.run_copies = slow_copies
        weights = {f"w{i}": torch.empty(shape) for i, shape in enumerate(shapes)}
        for v in range(1, versions + 1):
            store.wait([f"asking{v}"])  # the reader already waits for this version
            for t in weights.values():
                t.fill_(v)
            ts.put_state_dict(weights, "policy")
        dist.barrier()
        return None
    pipelined = []
    run = _read_plan.ReadPlan._run_as_written

    def counted(self, writing):
        pipelined.append(len(writing))
        return run(self, writing)

    _read_plan.ReadPlan._run_as_written = counted
    mine = {f"w{i}": torch.empty(shape) for i, shape in enumerate(shapes)}
    for v in range(1, versions + 1):  # each asked for before it is put
        store.set(f"asking{v}", "1")
        ts.get_state_dict("policy", mine, version=v)
        values = {float(t.min()) for t in mine.values()} | {float(t.max()) for t in mine.values()}
        assert values == {float(v)}, f"version {v} read as {values}"
    dist.barrier()
    return len(pipelined)


def test_reading_a_version_as_it_is_written():
    results = run_ranks(2, _as_written, 10)
    assert results[1] > 0, "no version was read while it was written"


def test_examples_run_under_torchrun(tmp_path):
    """The two examples of docs/STORE.md, as a user runs them (on CPU here)."""
    from frameworks import EXAMPLES, torchrun

    done = torchrun(EXAMPLES / "tensor_store_rl.py", ["--steps", "8", "--device", "cpu"], tmp_path, ranks=3)
    assert "bit-exact: yes" in done.stdout and "step 8: trainer" in done.stdout, done.stdout
    done = torchrun(EXAMPLES / "tensor_store_rl.py", ["--steps", "8", "--device", "cpu", "--lend"], tmp_path, ranks=3)
    assert "bit-exact: yes" in done.stdout and "step 8: trainer" in done.stdout, done.stdout
    done = torchrun(EXAMPLES / "tensor_store_state_dict.py", ["--layers", "4", "--device", "cpu"], tmp_path, ranks=3)
    assert "bit-exact: yes" in done.stdout and "(32 tensors)" in done.stdout, done.stdout


def _filled(value: float) -> dict:
    """Eight 4 KiB tensors: eight buckets of 4 KiB."""
    return {f"t{i}": torch.full((1024,), value) for i in range(8)}


def _failed_put(rank, world):
    from loom.tensor_store import TensorStore, TensorStoreError
    from loom.tensor_store import _parts

    store = dist.distributed_c10d._get_default_store()
    ts = TensorStore(bucket_bytes=4096)
    if rank == 0:
        ts.put_state_dict(_filled(1.0), "w")
        _sync(store, "asking2")
        copies, calls = _parts.run_copies, []

        def fail_second_bucket(*args):
            calls.append(1)
            if len(calls) == 2:
                _sync(store, "reading2")  # the reader has the first bucket of version 2
                raise RuntimeError("injected: a copy failed")
            copies(*args)

        _parts.run_copies = fail_second_bucket
        with pytest.raises(RuntimeError, match="injected"):
            ts.put_state_dict(_filled(2.0), "w")
        _parts.run_copies = copies
        store.set("failed2", "1")
        _sync(store, "checked")
        return ts.put_state_dict(_filled(3.0), "w")
    # The reader waits for version 2 and starts copying it as it is written; the write fails.
    store.set("asking2", "1")
    run = _parts.MappedBuffer.state

    def signal_once_writing(self, generation):
        state = run(self, generation)
        if state == "writing" and not store.check(["reading2"]):
            store.set("reading2", "1")
        return state

    _parts.MappedBuffer.state = signal_once_writing
    with pytest.raises(TensorStoreError, match="version=2"):
        ts.get_state_dict("w", version=2)
    _sync(store, "failed2")
    latest = ts.latest_version("w")
    value = {float(t.max()) for t in ts.get_state_dict("w").values()} | {float(t.min()) for t in ts.get_state_dict("w").values()}
    store.set("checked", "1")
    return latest, value


def test_a_put_that_fails_midway_is_never_read():
    results = run_ranks(2, _failed_put)
    assert results == [3, (1, {1.0})]


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
        seen = _refresh_until(ts, mine, steps, " of a lent version")
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


def test_copies_of_tensors_back_to_back_are_joined():
    from loom.tensor_store._parts import copy_groups, run_copies

    src = torch.arange(64, dtype=torch.float32)
    flat = torch.zeros(64)
    dsts = [flat[0:16], flat[16:40], flat[40:64]]  # back to back: one copy of bytes
    srcs = [src[0:16], src[16:40], src[40:64]]
    groups = copy_groups(dsts, srcs)
    assert [len(g.dsts) for g in groups] == [1] and groups[0].dsts[0].dtype == torch.uint8
    run_copies(groups)
    assert torch.equal(flat, src)
    # A gap on either side, another storage, or a strided view: copied separately, still right.
    apart = [torch.zeros(16), flat[16:40].fill_(0), torch.zeros(64)[::2][:24]]
    groups = copy_groups(apart + [flat[40:64].fill_(0)], [src[0:16], src[16:40], src[40:64], src[40:64]])
    # The strided pair goes to a group of its own, so the last two contiguous pairs join.
    assert sorted((g.how, len(g.dsts)) for g in groups) == [("batched", 1), ("cpu", 2)]
    run_copies(groups)
    assert torch.equal(apart[0], src[0:16]) and torch.equal(flat[16:64], torch.cat([src[16:40], src[40:64]]))
    assert torch.equal(apart[2], src[40:64])


def test_parallel_cpu_copy_matches_copy_and_refuses_bad_pairs():
    from loom import _C

    torch.manual_seed(0)
    sizes = [1, 63, 4096, 4097, 1 << 20, 3 * (1 << 20) + 5, 0, 17]  # slices end inside pairs
    srcs = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
    # Destinations at odd addresses, so streaming stores start mid-line.
    dsts = [torch.zeros(n + 1, dtype=torch.uint8)[1:] for n in sizes]
    for job_bytes in (0, 1 << 40):  # plain stores, then streaming ones
        for d in dsts:
            d.zero_()
        _C.copy_cpu(dsts, srcs, job_bytes)
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    floats = torch.randn(1000)
    into = torch.empty(1000)
    _C.copy_cpu([into], [floats])
    assert torch.equal(into, floats)
    with pytest.raises(ValueError, match="pair 0 must be contiguous CPU tensors of one device, dtype and size"):
        _C.copy_cpu([torch.empty(10)], [torch.empty(10, dtype=torch.float64)])
    with pytest.raises(ValueError, match="pair 1 must be contiguous"):
        _C.copy_cpu([into, torch.empty(20)[::2]], [floats, torch.empty(10)])
    with pytest.raises(ValueError, match="2 destinations and 1 sources"):
        _C.copy_cpu([into, into], [floats])


def _broadcast_sample(step: int, receiver: bool) -> dict:
    """A state dict for broadcast mode: every dtype (1-9 KiB each, packed into 6 KiB buckets
    or, at 3 KiB and more, sent alone), a larger tensor, a strided tensor on receivers,
    nesting and an object leaf."""
    layers = enumerate(DTYPES * 3)  # enough packed buckets that both bucket buffers are reused
    out = {"layers": {f"{i}": {"w": _sample(dtype, (9, 130), step * 31 + i)} for i, dtype in layers},
           # Sent alone; strided on receivers, which must then take it through a staging copy.
           "embed": torch.full((1024, 64), -1.0).t() if receiver else torch.full((64, 1024), float(step)),
           "t": _sample(torch.float32, (6, 4), step).t().contiguous().t() if receiver else _sample(torch.float32, (6, 4), step),
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
    # A version that does not grow is refused on every member, naming the writer.
    with pytest.raises(ValueError, match=r"rank 1: versions must be integers that grow; the last of this key is 3"):
        ts.broadcast_state_dict(mine, "policy", src=writer, version=2)
    return versions


def test_broadcast_mode_delivers_the_writers_state_dict_to_every_member():
    assert run_ranks(3, _broadcast_mode) == [[1, 2, 3]] * 3


def _lazy_views(rank, world):
    from loom.tensor_store import TensorStore

    ts = TensorStore()
    c = _sample(torch.complex64, (4, 3), 5)
    x = torch.arange(1.0, 9.0)
    # Values as the user sees them: a conjugate and a negative view, alone and back to back
    # with a plain tensor in one state dict (where copies of neighbours are joined).
    sd = {"conj": c.conj(), "neg": torch._neg_view(x), "plain": torch.ones(3)}
    want = {name: t.resolve_conj().resolve_neg() for name, t in sd.items()}
    if rank == 0:
        ts.put("conj", c.conj())
        ts.put("neg", torch._neg_view(x))
        ts.put_state_dict(sd, "sd")
    dist.barrier()
    if rank == 1:
        assert torch.equal(ts.get("conj"), want["conj"]) and torch.equal(ts.get("neg"), want["neg"])
        got = ts.get_state_dict("sd")
        assert all(torch.equal(got[name], want[name]) for name in want)
        # Into the reader's own conjugate and negative views: they show the stored values.
        into = {"conj": torch.zeros(4, 3, dtype=torch.complex64).conj(), "neg": torch._neg_view(torch.zeros(8)),
                "plain": torch.zeros(3)}
        ts.get_state_dict("sd", into)
        assert all(torch.equal(into[name].resolve_conj().resolve_neg(), want[name]) for name in want)
    dist.barrier()
    return True


def test_conjugate_and_negative_views_are_stored_by_value():
    assert run_ranks(2, _lazy_views) == [True, True]


def _changed_in_place(rank, world):
    from loom.tensor_store import TensorStore

    store = dist.distributed_c10d._get_default_store()
    ts = TensorStore()
    if rank == 0:  # the writer: its tensors change dtype under the same objects, as module.to() does
        sd = {"w": torch.arange(8, dtype=torch.float32), "b": torch.full((8,), 7.0)}
        ts.put_state_dict(sd, "sd")
        for t in sd.values():
            t.data = t.data.to(torch.float64)
        sd["w"].data += 100
        ts.put_state_dict(sd, "sd")
        store.set("put2", "1")
        for v in (3, 4):
            _sync(store, f"ask{v}")
            ts.put_state_dict({"w": torch.full((8,), float(v)), "b": torch.full((8,), float(v))}, "sd")
            store.set(f"put{v}", "1")
        dist.barrier()
        return None
    _sync(store, "put2")
    got = ts.get_state_dict("sd")
    assert got["w"].dtype == got["b"].dtype == torch.float64
    assert got["w"].tolist() == [100.0 + i for i in range(8)] and got["b"].tolist() == [7.0] * 8
    # The reader's tensors, back to back in one buffer, read once, then moved to new memory
    # and then resized under the same objects: its next reads follow them.
    flat = torch.zeros(16, dtype=torch.float64)
    mine = {"w": flat[:8], "b": flat[8:]}
    ts.get_state_dict("sd", mine)
    moved = torch.zeros(16, dtype=torch.float64)
    mine["w"].data, mine["b"].data = moved[:8], moved[8:]
    store.set("ask3", "1")
    _sync(store, "put3")
    with pytest.raises(ValueError, match="is stored as torch.float32"):  # the writer changed dtype back
        ts.get_state_dict("sd", mine)
    mine["w"].data, mine["b"].data = moved[:8].float(), moved[8:].float()
    ts.get_state_dict("sd", mine)
    assert mine["w"].tolist() == mine["b"].tolist() == [3.0] * 8
    assert flat.tolist() == [100.0 + i for i in range(8)] + [7.0] * 8  # the old memory untouched
    mine["w"].resize_(4)
    store.set("ask4", "1")
    _sync(store, "put4")
    with pytest.raises(ValueError, match=r"'w': the tensor to fill has shape \[4\]; the stored block is \[8\]"):
        ts.get_state_dict("sd", mine)
    dist.barrier()
    return None


def test_plans_follow_tensors_changed_in_place():
    run_ranks(2, _changed_in_place)


def _failed_puts(rank, world):
    from loom.tensor_store import TensorStore
    from loom.tensor_store import _parts

    ts = TensorStore()
    if rank == 0:
        ts.put("w", torch.full((1024,), 1.0))
        ts.put("w", torch.full((1024,), 2.0))
        copies = _parts.run_copies

        def interrupted(*args):
            raise KeyboardInterrupt("injected: the put is interrupted midway")

        _parts.run_copies = interrupted
        for step in (3, 4):  # two puts in a row fail: neither may retire version 2
            with pytest.raises(KeyboardInterrupt):
                ts.put("w", torch.full((1024,), float(step)))
        _parts.run_copies = copies
    dist.barrier()
    out = (ts.latest_version("w"), float(ts.get("w")[0]))
    dist.barrier()
    if rank == 0:  # the writer goes on after them, its latest version kept
        assert ts.put("w", torch.full((1024,), 5.0)) == 5
    dist.barrier()
    out = out, float(ts.get("w", version=2)[0]), float(ts.get("w")[0])
    dist.barrier()  # the writer's buffers live as long as its store
    return out


def test_failed_puts_leave_the_latest_version_readable():
    assert run_ranks(2, _failed_puts) == [((2, 2.0), 2.0, 5.0)] * 2


def _retired_while_opened(rank, world):
    from loom.tensor_store import TensorStore, TensorStoreError

    store = dist.distributed_c10d._get_default_store()
    ts = TensorStore()
    # Sizes too different for one version's buffer to be reused by the next: a put that
    # retires a version (the one before the one before it) frees its buffer.
    sizes = {1: 1 << 10, 2: 1 << 16, 3: 1 << 19, 4: 1 << 10, 5: 1 << 16}
    if rank == 0:
        ts.put("w", torch.full((sizes[1],), 1.0))
        store.set("put1", "1")
        for v in (2, 3, 4, 5):
            _sync(store, f"go{v}")
            ts.put("w", torch.full((sizes[v],), float(v)))
            store.set(f"put{v}", "1")
        _sync(store, "read")
        return None

    def racing(reader, puts):
        """Between looking the version up and opening its buffer, the writer puts `puts`."""
        looked_up = reader._parts

        def parts(*args):
            reader._parts = looked_up
            found = looked_up(*args)
            for v in puts:
                store.set(f"go{v}", "1")
            _sync(store, f"put{puts[-1]}")
            return found

        reader._parts = parts

    _sync(store, "put1")
    racing(ts, (2, 3))
    got = ts.get("w")  # looked up version 1, whose buffer is gone when opened: read again
    out = [float(got.min()), float(got.max()), got.numel()]
    other = TensorStore()  # a reader that never mapped version 3
    racing(other, (4, 5))
    with pytest.raises(TensorStoreError, match=r"'w' version 3: cannot open the buffer of rank 0"):
        other.get("w", version=3)  # a version asked for by number is not swapped for a newer one
    store.set("read", "1")
    return out


def test_read_of_the_latest_that_races_its_buffer_release_is_retried():
    assert run_ranks(2, _retired_while_opened)[1] == [3.0, 3.0, 1 << 19]


def _in_place_gets(rank, world):
    from loom.tensor_store import TensorStore

    ts = TensorStore()
    if rank == 0:
        ts.put("w", torch.full((4,), 5.0))
        ts.put_state_dict({"w": torch.full((4,), 5.0)}, "sd")
    dist.barrier()
    out = {}
    if rank == 1:
        # A tensor saved for backward and then refreshed: backward refuses, as after copy_.
        for read in (lambda w: ts.get("w", inplace_tensor=w), lambda w: ts.get_state_dict("sd", {"w": w})):
            x = torch.ones(4, requires_grad=True)
            w = torch.full((4,), 2.0)
            y = (x * w).sum()
            read(w)
            assert w._version > 0 and w.tolist() == [5.0] * 4
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.backward()
        # get fills a Parameter (contiguous, or a strided view of one) as copy_ does: refused
        # while grad mode is on, filled under torch.no_grad().
        for make in (lambda: torch.nn.Parameter(torch.zeros(4)), lambda: torch.nn.Parameter(torch.zeros(8))[::2]):
            p = make()
            with pytest.raises(RuntimeError, match="requires grad.*torch.no_grad"):
                ts.get("w", inplace_tensor=p)
            assert p.tolist() == [0.0] * 4
            with torch.no_grad():
                ts.get("w", inplace_tensor=p)
            assert p.tolist() == [5.0] * 4 and p.requires_grad
        # get_state_dict fills them as load_state_dict does, whatever the grad mode.
        model = torch.nn.Linear(4, 1, bias=False)
        before = model.weight._version
        ts.get_state_dict("sd", {"w": model.weight.view(4)})
        assert model.weight._version > before and model.weight.requires_grad
        out["param"] = model.weight.tolist()
    dist.barrier()
    return out


def test_in_place_gets_follow_copy_semantics():
    assert run_ranks(2, _in_place_gets)[1] == {"param": [[5.0] * 4]}


def _two_writers(rank, world):
    from loom.tensor_store import TensorStore

    store = dist.distributed_c10d._get_default_store()
    ts = TensorStore()
    if rank == 0:
        assert ts.put("k", torch.full((4,), 1.0)) == 1
    dist.barrier()
    if rank == 1:  # another rank goes on with the key: it numbers from the latest
        assert ts.put("k", torch.full((4,), 2.0)) == 2
    dist.barrier()
    out = [float(ts.get("k")[0])]
    dist.barrier()
    if rank == 0:  # its own count says 2, which rank 1 has put: refused, nothing lost
        with pytest.raises(ValueError, match=r"put\('k'\): version 2 of that key was put by rank\(s\) 1"
                                             r".*the latest is 2.*version= above it"):
            ts.put("k", torch.full((4,), 3.0))
        assert ts.put("k", torch.full((4,), 4.0), version=3) == 3
    dist.barrier()
    out.append(float(ts.get("k")[0]))
    dist.barrier()
    # Lends are numbered the same way: rank 0 lends "m" (1), rank 1 goes on (2), and rank 0's
    # lend again, numbered 2 by its own count, is refused.
    ts.make_lendable({"t": (lent := torch.full((4,), 5.0 + rank))})
    if rank == 0:
        assert ts.lend("m", lent) == 1
    dist.barrier()
    if rank == 1:
        assert ts.lend("m", lent) == 2
    dist.barrier()
    if rank == 0:
        with pytest.raises(ValueError, match=r"lend\('m'\): version 2 of that key was put by rank\(s\) 1"):
            ts.lend("m", lent)
        store.set("refused", "1")
    _sync(store, "refused")
    out.append(float(ts.get("m")[0]))  # rank 1's lend is the latest, whole
    dist.barrier()
    return out


def test_two_writers_of_a_key_never_publish_the_same_version():
    assert run_ranks(2, _two_writers) == [[2.0, 4.0, 6.0], [2.0, 4.0, 6.0]]
