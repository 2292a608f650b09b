"""Summary statistics the benchmarks and the fleet simulator share (standard library only).

One definition of a percentile for every figure kvpilot reports: linear interpolation
between order statistics, numpy's default (``method="linear"``) and what ``vllm bench
serve`` reports, so p50 of ``[1, 2, 3, 4]`` is 2.5 and p99 of ``1..100`` is 99.01.
Standard library only (an import-linter contract), so the autoscaler's simulator, the
``kvpilot bench`` client and the scripts under ``benchmarks/`` can all import it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["percentile"]


def percentile(values: Iterable[float], pct: float) -> float:
    """The ``pct``-th percentile (0..100) of ``values``, in any order, interpolating
    linearly between the two nearest order statistics.

    Raises:
        ValueError: no values, or ``pct`` outside [0, 100].
    """
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    if not 0 <= pct <= 100:
        raise ValueError(f"pct must be in [0, 100], got {pct}")
    rank = (len(ordered) - 1) * pct / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
