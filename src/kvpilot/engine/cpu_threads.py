"""How many CPU threads torch should use.

torch defaults to one thread per core of the machine, but a container limited by a CPU
quota (Kubernetes ``resources.limits.cpu``) gets fewer: OpenMP threads then wait on each
other and a step can run ten times slower. We use the smallest of the affinity mask and
the cgroup quota, unless ``OMP_NUM_THREADS`` says otherwise.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by the cgroup quota (v2 ``cpu.max`` or v1 ``cfs_quota/period``), or
    None when unlimited or unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 else None
    except (OSError, ValueError):
        return None


def cpu_threads(root: Path = Path("/sys/fs/cgroup")) -> int:
    """Threads for torch on CPU: ``OMP_NUM_THREADS`` if set, else min(affinity, quota)."""
    env = os.environ.get("OMP_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        available = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        available = min(available, max(1, math.floor(limit)))
    return max(1, available)
