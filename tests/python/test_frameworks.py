"""Every recipe of docs/FRAMEWORKS.md, run for real: the example script under torchrun on 2
ranks, once on loom and once on Gloo. The losses agree within 1e-5 relative, every rank ends
with the same weights, and loom's flight record shows that loom carried the collectives the
framework needs (and that the Gloo run used none of loom)."""

from __future__ import annotations

import pytest

from frameworks import assert_same_training, require, run_example

# recipe: (script, arguments, how the loom run names its backend, modules it needs, loom
# operations the framework must have run)
RECIPES = {
    "torchrun_ddp": ("train_ddp.py", [], "loom", [], {"all_reduce"}),
    "fsdp2": ("train_fsdp2.py", [], "loom", [], {"all_gather", "reduce_scatter"}),
    "device_mesh_tp": ("train_tp.py", [], "loom", [], {"all_reduce"}),
    # loom.ops.all_reduce_ between hand-sharded layers; the Gloo run calls dist.all_reduce.
    "tp_inference": ("infer_tp.py", [], "loom", [], {"all_reduce"}),
    "hf_trainer": ("hf_trainer.py", [], "loom", ["transformers", "accelerate"], {"all_reduce"}),
    "accelerate": ("accelerate_ddp.py", [], "loom", ["accelerate"], {"all_reduce"}),
    "lightning": ("lightning_ddp.py", [], "loom", ["lightning"], {"all_reduce"}),
    # strategy="ddp" after loom.make_default(): Lightning reads torch's default backend map.
    "lightning_default": ("lightning_ddp.py", [], "default", ["lightning"], {"all_reduce"}),
    "deepspeed_zero3": ("deepspeed_zero.py", ["--zero-stage", "3"], "loom", ["deepspeed"],
                        {"all_gather", "reduce_scatter"}),
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_matches_gloo(recipe, tmp_path):
    script, extra, loom_backend, modules, needed = RECIPES[recipe]
    require(*modules)
    on_loom = run_example(script, loom_backend, extra, tmp_path)
    on_gloo = run_example(script, "gloo", extra, tmp_path)
    assert_same_training(recipe, on_loom, on_gloo, needed)
