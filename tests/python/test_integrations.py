"""How frameworks find loom with nothing loom-specific but `import loom`: accelerate and the
transformers Trainer accept backend "loom" and never run a loom job as single-rank training;
make_default() reaches the readers of torch's default backend map; LOOM_REPLACES_GLOO=1 (and
only it) puts code that asks for "gloo" on loom, saying so once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from frameworks import ENV, failure, gloo_died_after_reporting, launch, require, torchrun

LOG_LINE = "so process groups asked for as 'gloo' run on loom"

# Each probe writes its facts to rank<RANK>.json in the current directory (the ranks' stdout
# would interleave).
TELL = """
    def tell(facts):
        with open(f".rank{os.environ['RANK']}.json.part", "w") as f:
            json.dump(facts, f)
        os.replace(f".rank{os.environ['RANK']}.json.part", f"rank{os.environ['RANK']}.json")
"""

# What accelerate made of the run and what carried it.
ACCELERATE_PROBE = """
    import json, os, sys
    import torch, torch.distributed as dist
    {first}
    from accelerate import PartialState
    state = PartialState(**json.loads(sys.argv[1]))
    t = torch.ones(2)
    dist.all_reduce(t)
    tell({{"kind": str(state.distributed_type), "processes": state.num_processes,
          "backend": dist.get_backend(), "sum": t.tolist(),
          "loom_ops": len(loom.flight_record()) if "loom" in sys.modules else 0}})
"""


def write_probe(path: Path, body: str) -> Path:
    """`body` (indented like the constants here) as a script with tell() defined."""
    lines = textwrap.dedent(body).splitlines()
    imports = [i for i, line in enumerate(lines) if line.startswith(("import", "from"))]
    at = imports[-1] + 1 if imports else 0
    path.write_text("\n".join(lines[:at] + textwrap.dedent(TELL).splitlines() + lines[at:]) + "\n")
    return path


def read_facts(directory: Path, ranks: int = 2) -> list[dict]:
    """What each rank's probe told, in rank order."""
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in range(ranks)]


def probe(tmp_path: Path, kwargs: dict, env: dict | None = None, loom_first: bool = True,
          on_gloo: bool = False) -> tuple[list[dict], str]:
    """Runs ACCELERATE_PROBE on 2 ranks; returns each rank's facts and torchrun's stderr.
    `on_gloo`: the run is on Gloo only, so one that told its facts and then died of Gloo's
    abort at interpreter exit (frameworks.gloo_died_after_reporting) is used as it is."""
    body = ACCELERATE_PROBE.format(first="import loom" if loom_first else "")
    if not loom_first:  # loom after accelerate: the adapter must still reach accelerate
        body = body.replace("from accelerate import PartialState\n",
                            "from accelerate import PartialState\n    import loom\n")
    run = tmp_path / ("probe-" + str(len(list(tmp_path.glob("probe-*")))))
    run.mkdir()
    script = write_probe(run / "probe.py", body)
    done, cmd = launch(script, [json.dumps(kwargs)], cwd=run, env=env)
    if done.returncode != 0 and on_gloo and gloo_died_after_reporting("gloo", done.stderr, run, 2):
        warnings.warn(f"the Gloo run aborted at exit after telling its facts:\n{done.stderr[-1500:]}")
    else:
        assert done.returncode == 0, failure(done, cmd)
    return read_facts(run), done.stderr


def test_accelerate_without_cpu_flag_is_distributed_on_loom(tmp_path):
    # Without cpu=True on a host with no accelerator, accelerate alone would run each rank on
    # its own; with backend "loom" the run is distributed (multi-CPU) and loom carries it.
    # loom is imported after accelerate here: the adapter reaches it either way.
    require("accelerate")
    facts, _ = probe(tmp_path, {"backend": "loom"}, loom_first=False)
    for f in facts:
        assert f["kind"] == "DistributedType.MULTI_CPU" and f["processes"] == 2, f
        assert f["backend"] == "loom" and f["sum"] == [2.0, 2.0] and f["loom_ops"] > 0, f


def test_accelerate_alone_with_loom_is_an_error():
    require("accelerate")
    code = "import loom\nfrom accelerate import PartialState\nPartialState(backend='loom')\n"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "RANK")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**env, **ENV})
    assert done.returncode != 0
    assert "started alone" in done.stderr and "torchrun --nproc-per-node" in done.stderr, done.stderr[-2000:]


def test_replace_gloo_is_opt_in_and_logged_once_per_process(tmp_path):
    require("accelerate")
    # accelerate asks for "gloo" by name for CPU runs.
    facts, stderr = probe(tmp_path, {"cpu": True}, env={"LOOM_REPLACES_GLOO": "1"})
    assert all(f["backend"] == "loom" and f["loom_ops"] > 0 for f in facts), facts
    assert stderr.count(LOG_LINE) == 2, stderr  # one line from each of the 2 processes
    facts, stderr = probe(tmp_path, {"cpu": True}, env={"LOOM_REPLACES_GLOO": "0"}, on_gloo=True)
    assert all(f["backend"] == "gloo" and f["loom_ops"] == 0 for f in facts), facts
    assert LOG_LINE not in stderr


def test_loom_default_reaches_accelerate(tmp_path):
    require("accelerate")
    facts, _ = probe(tmp_path, {}, env={"LOOM_DEFAULT": "1"})
    for f in facts:
        assert f["kind"] == "DistributedType.MULTI_CPU" and f["backend"] == "loom" and f["loom_ops"] > 0, f


TRAINER_PROBE = """
    import json, os, sys
    import torch
    import loom
    from transformers import HfArgumentParser, TrainingArguments
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(sys.argv[1:])
    tell({"mode": str(args.parallel_mode), "world": args.world_size,
          "backend": torch.distributed.get_backend()})
"""


def test_trainer_runs_distributed_on_loom_and_its_cli_workaround(tmp_path):
    require("transformers", "accelerate")
    script = write_probe(tmp_path / "trainer_probe.py", TRAINER_PROBE)
    out = ["--output_dir", str(tmp_path / "out"), "--report_to", "none"]
    # The Trainer's parser fixes its list of backends in code: "loom" is refused there...
    refused = subprocess.run([sys.executable, str(script), *out, "--ddp_backend", "loom"],
                             capture_output=True, text=True, timeout=300, env={**os.environ, **ENV})
    assert refused.returncode != 0 and "invalid choice: 'loom'" in refused.stderr, refused.stderr[-2000:]
    # ...so the command line asks for gloo with LOOM_REPLACES_GLOO=1, which runs on loom, and
    # without --use_cpu the ranks still train together (no silent single-rank run).
    torchrun(script, [*out, "--ddp_backend", "gloo"], cwd=tmp_path, env={"LOOM_REPLACES_GLOO": "1"})
    for f in read_facts(tmp_path):
        assert f == {"mode": "ParallelMode.DISTRIBUTED", "world": 2, "backend": "loom"}, f


def test_trainer_argument_without_use_cpu_is_distributed(tmp_path):
    require("transformers", "accelerate")
    script = write_probe(tmp_path / "trainer_args.py", """
        import json, os
        import loom
        from transformers import TrainingArguments
        args = TrainingArguments(output_dir="out", ddp_backend="loom", report_to=[])
        tell({"mode": str(args.parallel_mode), "world": args.world_size, "device": args.device.type})
    """)
    torchrun(script, [], cwd=tmp_path)
    assert read_facts(tmp_path) == [{"mode": "ParallelMode.DISTRIBUTED", "world": 2, "device": "cpu"}] * 2


def test_make_default_sets_the_map_and_keeps_pre_imported_init(tmp_path):
    # Code that imported init_process_group before loom was made the default still gets loom,
    # and readers of the default map (Lightning's strategy="ddp") see it.
    script = write_probe(tmp_path / "default.py", """
        import json, os
        import torch, torch.distributed as dist
        from torch.distributed import init_process_group
        from torch.nn.parallel import DistributedDataParallel as DDP
        import loom
        loom.make_default()
        init_process_group()
        model = DDP(torch.nn.Linear(4, 2))
        model(torch.ones(3, 4)).sum().backward()
        tell({"map": dist.Backend.default_device_backend_map["cpu"],
              "for_cpu": dist.get_default_backend_for_device("cpu"),
              "backend": dist.get_backend(),
              "ops": sorted({r["operation"] for r in loom.flight_record()})})
    """)
    torchrun(script, [], cwd=tmp_path)
    for f in read_facts(tmp_path):
        assert f["map"] == "loom" and f["for_cpu"] == "loom", f
        assert f["backend"] in ("loom", "cpu:loom,cuda:nccl") and "all_reduce" in f["ops"], f


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_malformed_switch_is_an_error_naming_it(value):
    done = subprocess.run([sys.executable, "-c", "import loom"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LOOM_REPLACES_GLOO": value})
    assert done.returncode != 0 and "LOOM_REPLACES_GLOO" in done.stderr and "set it to 1" in done.stderr, done.stderr


def test_accelerate_adapter_on_a_gpu_run(monkeypatch):
    # A stand-in for accelerate.state on a GPU host (this machine has none): accelerate would
    # prepare a multi-GPU run. Plain "loom" carries CUDA tensors (its CUDA path), but not
    # those of an accelerator it has no path for (XPU here); the device map can.
    import enum
    import types

    from loom._integrations import accelerate as adapter

    kinds = enum.Enum("DistributedType", "NO MULTI_CPU MULTI_GPU")

    class PartialState:
        def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
            return ("nccl" if backend is None else backend), kinds.MULTI_GPU

    adapter.patch(types.SimpleNamespace(PartialState=PartialState, DistributedType=kinds))
    monkeypatch.setenv("LOCAL_RANK", "0")
    # loom registers for CUDA where torch has it, as on that host.
    import torch.distributed as dist

    monkeypatch.setitem(dist.Backend.backend_capability, "loom", ["cpu", "cuda"])
    monkeypatch.setattr(adapter, "_accelerator_type", lambda: "cuda")
    assert PartialState()._prepare_backend(backend="loom") == ("loom", kinds.MULTI_GPU)
    monkeypatch.setattr(adapter, "_accelerator_type", lambda: "xpu")
    with pytest.raises(ValueError, match="carries no 'xpu' tensors.*cpu:loom,xpu:<its backend>"):
        PartialState()._prepare_backend(backend="loom")
    monkeypatch.setattr(adapter, "_accelerator_type", lambda: "cuda")
    assert PartialState()._prepare_backend(backend="cpu:loom,cuda:nccl") == ("cpu:loom,cuda:nccl", kinds.MULTI_GPU)
    # Backends that do not run on loom reach accelerate untouched.
    assert PartialState()._prepare_backend(backend="nccl") == ("nccl", kinds.MULTI_GPU)
    assert PartialState()._prepare_backend() == ("nccl", kinds.MULTI_GPU)
