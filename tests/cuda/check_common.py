"""What the parts of check_cuda.py share (check_premul.py and check_failures.py too): the
sizes they run and the comparison with a CPU reference."""

from __future__ import annotations

import torch

# 70k float32 elements take the two-shot all_reduce where it is used: three or more ranks
# with a GPU each (ranks sharing a GPU, and two ranks, reduce one-shot at every size; cuda_check.sh
# forces two-shot with LOOM_CUDA_ONE_SHOT_BYTES=0)
SIZES = [0, 1, 7, 1000, 70_000]
LARGE = 3_000_000  # float32: more than one step of the default 8 MiB chunk


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got = got.cpu()
    if got.dtype.is_floating_point or got.dtype.is_complex:
        torch.testing.assert_close(got, want, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, want), f"{what}: got {got[:8].tolist()} want {want[:8].tolist()}"
