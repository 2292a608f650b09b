"""Arrival times of a Poisson process.

At ``rate`` arrivals per second the gaps between arrivals are independent exponential
draws with mean ``1 / rate`` seconds (the memoryless open-loop load of ``vllm bench
serve`` and SGLang's ``bench_serving``). ``rate = inf`` sends everything at time 0.
"""

from __future__ import annotations

import math
import random


def poisson_arrival_times(count: int, rate: float, rng: random.Random) -> list[float]:
    """Offsets in seconds from the start of the run, non-decreasing, ``count`` of them.

    The first arrival is at 0 (the run starts with a request, not with an idle wait);
    each later one follows the previous by an Exp(rate) gap. Consumes ``count - 1`` draws
    from ``rng`` when ``rate`` is finite, none when it is infinite.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * count
    times: list[float] = []
    t = 0.0
    for i in range(count):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times
