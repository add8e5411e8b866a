"""loom.tensor_store across real processes: values and state dicts read back bit-exact, DTensor
resharding between groups, versions, buffers freed, reads as a version is written, plans
that follow tensors changed in place, and the errors bad requests get. Faults are in
test_tensor_store_faults.py, lending and broadcast mode in test_tensor_store_lending.py,
the async forms and their cancellation in test_tensor_store_async.py."""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from store_samples import DTYPES, sample, store_buffers, sync


def _values(rank, world):
    from loom.tensor_store import TensorStore

    ts = TensorStore()
    if rank == 0:
        for i, dtype in enumerate(DTYPES):
            ts.put(f"t/{dtype}", sample(dtype, (3, 5, 7), i))
        ts.put("t/strided", sample(torch.float32, (8, 6), 99).t()[1:, ::2])
        ts.put("t/scalar", torch.tensor(2.5))
        ts.put("t/empty", torch.empty(0, 4))
        ts.put("obj", {"lr": 1e-4, "names": ["a", "b"]})
    dist.barrier()
    out = {}
    for i, dtype in enumerate(DTYPES):
        got = ts.get(f"t/{dtype}")
        assert got.dtype == dtype and torch.equal(got, sample(dtype, (3, 5, 7), i)), dtype
        into = torch.zeros(3, 5, 7, dtype=dtype)
        assert ts.get(f"t/{dtype}", inplace_tensor=into) is into and torch.equal(into, got)
        part = ts.get(f"t/{dtype}", tensor_slice_spec=((1, 2, 3), (2, 2, 4)))
        assert torch.equal(part, got[1:3, 2:4, 3:7])
    assert torch.equal(ts.get("t/strided"), sample(torch.float32, (8, 6), 99).t()[1:, ::2])
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
            "q_proj": {"lora_A": sample(torch.bfloat16, (8, 256), 100 * step + layer),
                       "lora_B": sample(torch.bfloat16, (256, 8), 100 * step + layer + 50)},
            "v_proj": {"lora_A": sample(torch.bfloat16, (8, 256), 100 * step + layer + 7),
                       "lora_B": sample(torch.bfloat16, (256, 8), 100 * step + layer + 57)},
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
    full = {"wq": sample(torch.float32, (7, 10), 1), "wo": sample(torch.bfloat16, (10, 7), 2),
            "norm": sample(torch.float32, (10,), 3)}
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
    big = sample(torch.float32, (6, 9), 4)
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


def _versions(rank, world):
    from loom.tensor_store import TensorStore, TensorStoreError

    ts = TensorStore(keep=3)
    if rank == 0:
        for step in (1, 2, 3, 4):
            ts.put("x", torch.full((4,), float(step)))
        with pytest.raises(ValueError, match="versions must be integers that grow"):
            ts.put("x", torch.zeros(4), version=4)
        # Not a Python int: said so (it read as a version that does not grow).
        with pytest.raises(ValueError, match=r"versions are Python ints \(got float"):
            ts.put("x", torch.zeros(4), version=11.0)
        assert ts.put("x", torch.full((4,), 10.0), version=10) == 10
        assert store_buffers()[0] == 3  # keep=3: three regions alive, the rest freed
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


def _leaks(rank, world):
    from loom.tensor_store import TensorStore

    ts = TensorStore()
    counts = {}
    if rank == 0:
        for step in range(6):
            ts.put_state_dict({"w": torch.full((1000,), float(step)), "cfg": step}, "sd")
            ts.put("t", torch.full((10,), float(step)))
        counts["writer"] = store_buffers()
    dist.barrier()
    if rank == 1:
        for _ in range(3):
            ts.get_state_dict("sd")
            ts.get("t")
        counts["reader"] = store_buffers()
    dist.barrier()
    if rank == 0:
        ts.delete("sd")
        counts["after_delete"] = store_buffers()
        ts.close()
        counts["after_close"] = store_buffers()
        # Nothing more is lent from a closed store: no lendable buffer is made for it either
        # (one was, silently, where its put and lend refused).
        with pytest.raises(RuntimeError, match=r"make_lendable: this TensorStore is closed"):
            ts.make_lendable({"w": torch.ones(4)})
        assert store_buffers() == counts["after_close"]
    counts["dropped"] = _dropped(rank, world)
    return counts


def test_buffers_are_bounded_and_freed():
    writer, reader = run_ranks(2, _leaks)
    assert writer["writer"][0] == 4  # 2 keys x 2 kept versions, one region each
    assert writer["after_delete"][0] == 2 and writer["after_close"] == (0, 0)
    # Readers hold mappings, no descriptors: the writer's two buffers of each key at most.
    assert reader["reader"][0] == 0 and reader["reader"][1] <= 4
    assert writer["dropped"] and reader["dropped"]


def _dropped(rank, world):
    """A store dropped without close(), as a script's last line or a replaced object drops it,
    frees its buffers and mappings with its last reference: no reference cycle holds them
    until Python's cycle collector runs (here it never does)."""
    import gc
    import weakref

    from loom.tensor_store import TensorStore

    before = store_buffers()
    gc.disable()
    try:
        ts = TensorStore(namespace="dropped")
        if rank == 0:
            ts.put_state_dict({"w": torch.ones(1000), "cfg": 1}, "sd")
        dist.barrier()
        if rank == 1:
            ts.get_state_dict("sd")
            ts.get_state_dict("sd", {"w": torch.empty(1000), "cfg": None})
        dist.barrier()
        alive = weakref.ref(ts)
        del ts
        assert alive() is None, "the store outlived its last reference"
        return store_buffers() == before
    finally:
        gc.enable()


def _labelled(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from loom.tensor_store import TensorStore

    ts = TensorStore(rank=7, timeout=timedelta(seconds=20))  # a label, the same on both ranks
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(16.0).reshape(8, 2)
    ts.put("sharded", distribute_tensor(full, mesh, [Shard(0)]))
    dist.barrier()
    out = torch.equal(ts.get("sharded"), full)
    dist.barrier()
    return out


def test_a_meshs_parts_follow_global_ranks_whatever_the_stores_label():
    assert run_ranks(2, _labelled) == [True, True]


def test_a_reader_maps_at_most_keep_buffers_of_writers_it_read():
    # One writer after another (a trainer restarted), each read once into the same state
    # dict: the reader's cached plans of copies used to keep every writer's buffer mapped, up
    # to 2 * keep + 1, after ReaderMappings had let go of all but `keep`.
    from loom.tensor_store import TensorStore

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    reader = TensorStore(store, serve_remote=False)  # keep=2
    mine = {"w": torch.empty(1 << 16)}
    mapped = []
    try:
        for i in range(5):
            writer = TensorStore(store, serve_remote=False)
            writer.put_state_dict({"w": torch.full((1 << 16,), float(i))}, "k", version=i + 1)
            reader.get_state_dict("k", mine)
            assert mine["w"].unique().tolist() == [float(i)]
            writer.close()
            mapped.append(store_buffers()[1])  # the writer's memory lives on in these mappings
    finally:
        reader.close()
    assert max(mapped) <= 2, mapped


def _many_keys(rank, world):
    from loom.tensor_store import TensorStore

    ts = TensorStore()
    if rank == 0:  # a step's key each step, deleted once read
        for step in range(80):
            ts.put(f"step{step}", torch.full((1000,), float(step)))
    dist.barrier()
    out = {}
    if rank == 1:
        out["read"] = all(float(ts.get(f"step{step}")[0]) == step for step in range(80))
        out["mapped"] = store_buffers()[1]
        ts.delete("step79")  # this rank's own delete lets go at once
        out["after_delete"] = store_buffers()[1]
    dist.barrier()
    return out


def test_a_reader_lets_go_of_keys_it_read_long_ago():
    reader = run_ranks(2, _many_keys)[1]
    # One mapping per key read (one buffer each), of the last 64 keys; the deleted one's gone.
    assert reader == {"read": True, "mapped": 64, "after_delete": 63}


def _errors(rank, world):
    from torch.distributed.tensor import Partial, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    from loom.tensor_store import TensorStore, TensorStoreError, _store

    ts = TensorStore()
    with pytest.raises(ValueError, match="an int of at least 2"):
        TensorStore(keep=1)
    with pytest.raises(ValueError, match=r"keep=3.0; an int of at least 2"):  # used to fail at the fourth put
        TensorStore(keep=3.0)
    with pytest.raises(ValueError, match=r"bucket_bytes=0; a positive number of bytes"):
        TensorStore(bucket_bytes=0)
    if rank == 0:
        ts.put("f32", torch.zeros(4, 4))
        ts.put("obj", [1, 2])
    dist.barrier()
    with pytest.raises(KeyError, match=r"rank %d\): get\('missing'\): no such key" % rank):
        ts.get("missing")
    # get_state_dict shares get's read, and its errors name the verb called.
    with pytest.raises(KeyError, match=r"rank %d\): get_state_dict\('missing'\): no such key" % rank):
        ts.get_state_dict("missing")
    with pytest.raises(ValueError, match=r"get_state_dict\('f32', version=0\): versions are integers from 1"):
        ts.get_state_dict("f32", version=0)
    with pytest.raises(TimeoutError, match=r"get_state_dict\('f32', version=9\): not put within"):
        ts.get_state_dict("f32", version=9, timeout=0.2)
    with pytest.raises(KeyError, match=r"get\('missing'\)"):  # the verb ends with its call
        ts.get("missing")
    with pytest.raises(TypeError, match=r"keys\(prefix=...\): prefix is a str \(or None\), got int"):
        ts.keys(5)
    with pytest.raises(ValueError, match="'f32'.*stored as torch.float32; the tensor to fill is torch.bfloat16"):
        ts.get("f32", inplace_tensor=torch.zeros(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"'f32'.*shape \[4, 5\]; the stored block is \[4, 4\]"):
        ts.get("f32", inplace_tensor=torch.zeros(4, 5))
    with pytest.raises(ValueError, match="slice at .3, 0. of shape .2, 4. is not within"):
        ts.get("f32", tensor_slice_spec=((3, 0), (2, 4)))
    with pytest.raises(ValueError, match="'obj'.*is an object, not a tensor"):
        ts.get("obj", inplace_tensor=torch.zeros(2))
    # Containers of the wrong kind, and a target that cannot take one value per element (an
    # expanded tensor: torch's own error came after the copies into the others), by name.
    with pytest.raises(TypeError, match=r"get\('f32'\): inplace_tensor is a tensor to fill .*got list"):
        ts.get("f32", inplace_tensor=[torch.zeros(4, 4)])
    with pytest.raises(TypeError, match=r"get_state_dict\('f32'\): user_state_dict is a .*dict.*got list"):
        ts.get_state_dict("f32", [torch.zeros(4, 4)])
    with pytest.raises(ValueError, match=r"'f32'.*the tensor to fill has elements that share memory"):
        ts.get("f32", inplace_tensor=torch.zeros(1, 4).expand(4, 4))
    # A sparse one was called expanded (COO) or met torch's own error (CSR).
    for sparse in (torch.zeros(4, 4).to_sparse(), torch.zeros(4, 4).to_sparse_csr()):
        with pytest.raises(ValueError, match=r"'f32'.*the tensor to fill is sparse_(coo|csr); it must be a dense"):
            ts.get("f32", inplace_tensor=sparse)
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
    # A bool is no version (True would be stored as the text "True", breaking every reader of
    # the namespace), nor is 0; a timeout may be a number of seconds, not a string.
    with pytest.raises(ValueError, match=r"put\('b%d', version=True\): versions are Python ints \(got bool" % rank):
        ts.put(f"b{rank}", torch.zeros(1), version=True)
    with pytest.raises(ValueError, match=r"put_state_dict\('b%d', version=True\): versions are Python ints" % rank):
        ts.put_state_dict({"w": torch.zeros(1)}, f"b{rank}", version=True)  # it used to say put('b0', ...)
    assert f"b{rank}" not in ts.keys()
    with pytest.raises(ValueError, match=r"get\('f32', version=0\): versions are integers from 1"):
        ts.get("f32", version=0)
    with pytest.raises(ValueError, match=r"get\('f32', version=1.0\): versions are Python ints \(got float"):
        ts.get("f32", version=1.0)
    assert torch.equal(ts.get("f32", timeout=5), torch.zeros(4, 4))
    assert torch.equal(TensorStore(timeout=5.5).get("f32"), torch.zeros(4, 4))
    with pytest.raises(TypeError, match=r"get\('f32'\): timeout must be a datetime.timedelta or a number of seconds, not str"):
        ts.get("f32", timeout="5")
    # Spans no wait can take are refused by name (they raised Python's own OverflowError).
    for bad in (float("inf"), float("nan"), 1e15, -1, timedelta.max):
        with pytest.raises(ValueError, match=r"get\('f32'\): timeout must be from 0 to 1e\+09 seconds"):
            ts.get("f32", timeout=bad)
    with pytest.raises(ValueError, match=r"loom tensor store: timeout must be from 0"):
        TensorStore(timeout=float("inf"))
    # Slices that are not slices, an object asked for by slice, and inference tensors (which
    # copy_ may not fill outside inference mode) are refused by name.
    with pytest.raises(ValueError, match=r"'f32'.*slice at \[0, 0\] of shape \[-1, 4\] is not within"):
        ts.get("f32", tensor_slice_spec=((0, 0), (-1, 4)))
    with pytest.raises(ValueError, match=r"'f32'.*tensor_slice_spec must be \(offsets, local_shape\)"):
        ts.get("f32", tensor_slice_spec=5)
    with pytest.raises(ValueError, match=r"'f32'.*tensor_slice_spec has 2 offsets but 1 sizes"):
        ts.get("f32", tensor_slice_spec=((0, 0), (4,)))
    with pytest.raises(ValueError, match="'obj'.*is an object, not a tensor: get it without tensor_slice_spec"):
        ts.get("obj", tensor_slice_spec=((0,), (1,)))
    with torch.inference_mode():
        frozen = torch.zeros(4, 4)
    with pytest.raises(RuntimeError, match="a tensor to fill is an inference tensor"):
        ts.get("f32", inplace_tensor=frozen)
    with torch.inference_mode():
        assert ts.get("f32", inplace_tensor=frozen) is frozen
    # Tensors whose bytes are not their values are refused before the put changes anything.
    refused = {"sparse": torch.eye(3).to_sparse(), "csr": torch.eye(3).to_sparse_csr(),
               "quantized": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)}
    for kind, value in refused.items():
        key = f"{kind}{rank}"
        with pytest.raises(ValueError, match=rf"rank {rank}\): put_state_dict\('{key}'\): 'layer.w' is a "
                                             rf"{'quantized' if kind == 'quantized' else 'sparse'} tensor"):
            ts.put_state_dict({"layer": {"w": value}, "b": torch.ones(2)}, key)
        assert ts._get_now(f"k/{key}/mode") is None and ts._get_now(f"k/{key}/v1/writers") is None
        assert key not in (ts._get_now("index") or b"").decode().split("\n")
        assert ts.put(key, value.to_dense() if kind != "quantized" else value.dequantize()) == 1
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
    from torch.distributed.tensor import Shard
    target = distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)])
    with pytest.raises(ValueError, match="a DTensor to fill says which block it reads; pass it without tensor_slice_spec"):
        ts.get("f32", inplace_tensor=target, tensor_slice_spec=((0, 0), (2, 2)))
    # Values pickle cannot store, or the reader cannot load, are named with their entry (they
    # raised pickle's own errors, naming neither).
    with pytest.raises(TypeError, match=rf"put_state_dict\('odd{rank}'\): 'opt.step' is not a tensor and cannot be pickled \("):
        ts.put_state_dict({"w": torch.ones(2), "opt": {"step": lambda: 1}}, f"odd{rank}")
    if rank == 0:
        ts.put_state_dict({"w": torch.ones(2), "o": _LoadsNowhere()}, "unloadable")
    dist.barrier()
    with pytest.raises(TensorStoreError, match=r"'unloadable' version 1: the object at 'o' cannot be unpickled "
                                               r"here \(RuntimeError: .*the tensors this get was filling hold"):
        ts.get_state_dict("unloadable", {"w": torch.zeros(2), "o": None})
    dist.barrier()  # the writer's buffers live as long as its store
    return True


def _refuse_to_load():
    raise RuntimeError("this class exists in the writer's program only")


class _LoadsNowhere:
    """A value whose unpickling fails, as one of a class the reader cannot import does."""

    def __reduce__(self):
        return _refuse_to_load, ()


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


def _lazy_views(rank, world):
    from loom.tensor_store import TensorStore

    ts = TensorStore()
    c = sample(torch.complex64, (4, 3), 5)
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
            sync(store, f"ask{v}")
            ts.put_state_dict({"w": torch.full((8,), float(v)), "b": torch.full((8,), float(v))}, "sd")
            store.set(f"put{v}", "1")
        dist.barrier()
        return None
    sync(store, "put2")
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
    sync(store, "put3")
    with pytest.raises(ValueError, match="is stored as torch.float32"):  # the writer changed dtype back
        ts.get_state_dict("sd", mine)
    mine["w"].data, mine["b"].data = moved[:8].float(), moved[8:].float()
    ts.get_state_dict("sd", mine)
    assert mine["w"].tolist() == mine["b"].tolist() == [3.0] * 8
    assert flat.tolist() == [100.0 + i for i in range(8)] + [7.0] * 8  # the old memory untouched
    mine["w"].resize_(4)
    store.set("ask4", "1")
    sync(store, "put4")
    with pytest.raises(ValueError, match=r"'w': the tensor to fill has shape \[4\]; the stored block is \[8\]"):
        ts.get_state_dict("sd", mine)
    dist.barrier()
    return None


def test_plans_follow_tensors_changed_in_place():
    run_ranks(2, _changed_in_place)


@contextlib.contextmanager
def one_process_store():
    """A TensorStore of this process alone, over a HashStore, closed after."""
    from loom.tensor_store import TensorStore

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    ts = TensorStore(store, serve_remote=False)
    try:
        yield ts
    finally:
        ts.close()


def test_the_same_tensors_under_other_names_are_stored_under_those_names():
    # A writer's plan is kept while it puts the same tensor objects; the names are part of
    # it: swapped or renamed entries are stored as named, not as the last put named them.
    x, y = torch.full((4,), 1.0), torch.full((4,), 2.0)
    with one_process_store() as ts:
        ts.put_state_dict({"a": x, "b": y}, "k")
        ts.put_state_dict({"b": x, "a": y}, "k")  # swapped
        got = ts.get_state_dict("k")
        assert (got["a"][0].item(), got["b"][0].item()) == (2.0, 1.0), got
        ts.put_state_dict({"c": x, "d": y}, "k")  # renamed
        mine = {"c": torch.empty(4), "d": torch.empty(4)}
        ts.get_state_dict("k", mine)  # strict: every name must be stored
        assert (mine["c"][0].item(), mine["d"][0].item()) == (1.0, 2.0), mine
        # A dict read once with strict=False is still checked when read with strict=True.
        partial = {"c": torch.empty(4), "e": torch.empty(4)}
        ts.get_state_dict("k", partial, strict=False)
        with pytest.raises(KeyError, match=r"names differ \(strict=True\): not stored: 'e'; stored but "
                                           r"not asked for: 'd'"):
            ts.get_state_dict("k", partial, strict=True)
        # A nested entry against a flat one whose key holds the dots: both read 'b.c' before.
        ts.put_state_dict({"b": {"c": x}}, "nested")
        with pytest.raises(KeyError, match=r"not stored: \['b.c'\]; stored but not asked for: \['b'\]\['c'\]"):
            ts.get_state_dict("nested", {"b.c": torch.empty(4)})


def test_targets_that_cannot_be_filled_are_refused_by_name():
    # A tensor to fill where an object is stored (it was replaced in the dict, leaving a model's
    # parameter as it was), a tensor on the meta device (nothing to fill) and one whose
    # elements share memory: all refused.
    with one_process_store() as ts:
        ts.put_state_dict({"w": torch.ones(4), "extra": "step 3"}, "sd")
        mine = {"w": torch.zeros(4), "extra": torch.zeros(1)}
        with pytest.raises(ValueError, match="'extra' is an object, not a tensor"):
            ts.get_state_dict("sd", mine)
        assert isinstance(mine["extra"], torch.Tensor)
        with torch.device("meta"):
            meta = {"w": torch.empty(4), "extra": None}
        with pytest.raises(ValueError, match="'w': the tensor to fill is on the meta device"):
            ts.get_state_dict("sd", meta)
        ts.put("t", torch.ones(4))
        with pytest.raises(ValueError, match="the tensor to fill is on the meta device"):
            ts.get("t", inplace_tensor=torch.empty(4, device="meta"))
        # An expanded tensor beside one that can be filled: refused by name before either is.
        ts.put_state_dict({"a": torch.ones(4), "b": torch.full((4,), 2.0)}, "two")
        mine = {"a": torch.zeros(4), "b": torch.zeros(1).expand(4)}
        with pytest.raises(ValueError, match="'b': the tensor to fill has elements that share memory"):
            ts.get_state_dict("two", mine)
        assert mine["a"].tolist() == [0.0] * 4


def test_a_key_put_and_deleted_again_and_again_is_listed_once():
    with one_process_store() as ts:
        for _ in range(20):
            ts.put("step", torch.ones(2))
            ts.delete("step")
        ts.put("step", torch.ones(2))
        assert ts.keys() == ["step"]
        assert ts._store.get("index").decode().split() == ["step"]  # the index does not grow


def test_a_key_left_saying_it_is_lent_with_nothing_lent_is_refused_with_the_reason():
    # What a deleter that died between its two deletes left behind before they were
    # reordered: the mode "lent" without a latest version. A get of its next version asked
    # about it again and again, recursing until Python's limit.
    from loom.tensor_store import TensorStoreError

    with one_process_store() as ts:
        ts._store.set("k/k/mode", "lent")
        with pytest.raises(TensorStoreError, match="says it is lent but no version of it is"):
            ts.get("k", version=1, timeout=timedelta(seconds=5))
        ts.put("k", torch.ones(2))  # putting it again mends it
        assert ts.get("k", version=1).tolist() == [1.0, 1.0]


def _deleted_by_another(rank, world):
    from loom.tensor_store import TensorStore

    ts = TensorStore()
    if rank == 0:
        ts.put("k", torch.zeros(3))
    dist.barrier()
    out = None
    if rank == 1:  # deletes a key it never put, then puts it: numbered past the writer's
        ts.delete("k")
        assert not ts.exists("k")
        out = ts.put("k", torch.ones(3)), ts.get("k").tolist()
    dist.barrier()
    return out


def test_a_key_deleted_by_another_rank_is_put_again_by_it():
    # The first writer still keeps version 1: a new writer's first put takes 2, not 1 (which
    # was refused as "put by rank 0").
    assert run_ranks(2, _deleted_by_another)[1] == (2, [1.0] * 3)


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


def _strided_parameters(rank, world):
    from loom.tensor_store import TensorStore

    def model():
        torch.manual_seed(rank)  # other values on every rank
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Linear(4, 4))

    ts = TensorStore()
    if rank == 0:
        ts.put_state_dict(model().state_dict(), "m")
    dist.barrier()
    out = None
    if rank == 1:
        want = ts.get_state_dict("m")
        # Parameters that are not contiguous (channels_last convolution weights), filled with
        # grad mode on, as load_state_dict fills them: the same objects, still requiring grad.
        mine = model().to(memory_format=torch.channels_last)
        params = list(mine.parameters())
        assert not params[0].is_contiguous() and torch.is_grad_enabled()
        ts.get_state_dict("m", mine.state_dict(keep_vars=True))
        assert list(mine.parameters()) == params and all(p.requires_grad for p in params)
        out = sorted(name for name, value in mine.state_dict().items() if torch.equal(value, want[name]))
    dist.barrier()
    return out


def test_get_state_dict_fills_parameters_that_are_not_contiguous():
    assert run_ranks(2, _strided_parameters)[1] == ["0.bias", "0.weight", "1.bias", "1.weight"]
