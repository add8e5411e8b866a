"""The statistics every loom benchmark reports, defined once."""

from __future__ import annotations

import math
from typing import Sequence


def p90(ordered: Sequence[float]):
    """The nearest-rank 90th percentile of `ordered` (sorted, not empty): the smallest value
    at least 90% of the values do not exceed, as loom-bench reports it (with fewer than 10
    values, the largest)."""
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
