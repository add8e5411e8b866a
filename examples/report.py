"""What an example writes when run with ``--report DIR``, for tests/python/test_frameworks.py:
per rank, the loss of every step, a digest of the final weights (equal on every rank when the
ranks stayed in step), and the loom operations this process ran (from loom's flight record,
which proves that loom carried the traffic). Not needed to use loom."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch

import loom


def weights_digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 of the tensors' bytes, in order."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def write_report(directory: str | None, rank: int, losses: list[float], weights: Iterable[torch.Tensor]) -> None:
    """Writes DIR/rank<r>.json (nothing without a directory). The file appears whole or not at
    all (written aside, then renamed), so a reader that finds it can trust it even if this
    process dies later."""
    if directory is None:
        return
    record = {
        "rank": rank,
        "losses": [float(x) for x in losses],
        "weights": weights_digest(weights),
        "loom_ops": dict(Counter(r["operation"] for r in loom.flight_record())),
    }
    Path(directory).mkdir(parents=True, exist_ok=True)
    aside = Path(directory) / f".rank{rank}.json.part"
    aside.write_text(json.dumps(record))
    aside.replace(Path(directory) / f"rank{rank}.json")
