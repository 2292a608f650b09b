"""What a metric source is asked for and what it answers: the one hand-off between the
sources (Prometheus, pod scraping) and the autoscaler loop.

::

    EnginePod(name, ip, port)  x N ready pods
        --MetricsSource.read(pods, now)-->
    MetricsReading(pods=(PodSignals, ...), generated tokens/s, mean context, reachable, problem)

Every value a source could not read is ``None``: a failed scrape, an empty PromQL vector,
a series absent from ``/metrics``, a NaN or out-of-range sample. ``None`` is missing data,
never zero (cases C15, C17); the policy holds the count on it and never scales down.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpilot.autoscaler import PodSignals
from kvpilot.operator.constants import ENGINE_PORT, METRICS_PATH


@dataclass(frozen=True)
class EnginePod:
    """A ready engine pod to read.

    Attributes:
        name: the pod's name (the ``pod`` label Prometheus attaches to its series).
        ip: ``status.podIP`` (the pods source scrapes it; None = not known).
        port: the engine's HTTP port.
    """

    name: str
    ip: str | None = None
    port: int = ENGINE_PORT

    @property
    def metrics_url(self) -> str | None:
        """``http://IP:PORT/metrics`` (IPv6 in brackets), or None without an IP."""
        if not self.ip:
            return None
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"http://{host}:{self.port}{METRICS_PATH}"


@dataclass(frozen=True)
class MetricsReading:
    """One read of the fleet.

    Attributes:
        source: ``prometheus`` or ``pods``.
        pods: one :class:`PodSignals` per pod asked for, in the same order.
        generated_tokens_per_second: summed over the pods; None unless every pod reported
            its rate (a partial sum would understate throughput and overstate cost).
        mean_context_tokens: (prompt + generated tokens) per finished request, over the
            pods' lifetime counters; None before any request finished.
        reachable: False when the source answered nothing at all (Prometheus down, every
            scrape failed): MetricsAvailable=False, reason SourceUnreachable.
        problem: one line on what could not be read and why (None when all was read).
    """

    source: str
    pods: tuple[PodSignals, ...]
    generated_tokens_per_second: float | None = None
    mean_context_tokens: float | None = None
    reachable: bool = True
    problem: str | None = None

    @property
    def kv_capacity_tokens(self) -> float | None:
        """Per-replica KV capacity: the median over the pods that reported one."""
        caps = [p.kv_capacity_tokens for p in self.pods if p.kv_capacity_tokens is not None]
        return float(statistics.median(caps)) if caps else None


class MetricsSource(Protocol):
    """Reads engine signals for a set of ready pods. Implementations never raise for an
    unreachable or empty source: they return a reading with ``None`` values and say why."""

    name: str

    def read(self, pods: Sequence[EnginePod], now: float) -> MetricsReading:
        """Signals for ``pods`` at ``now`` (seconds; the same clock on every call, used
        for counter rates)."""
        ...

    def close(self) -> None:
        """Release connections; the source is not used again."""
        ...


def valid(value: float | None, upper: float | None = None) -> float | None:
    """``value`` if it is a finite number in [0, upper]; otherwise None (missing). An
    exporter bug (NaN, negative, usage above 1) must not reach the policy as load."""
    if value is None or not math.isfinite(value) or value < 0:
        return None
    if upper is not None and value > upper:
        return None
    return float(value)


def pod_signals(name: str, kv_usage: float | None, num_waiting: float | None,
                waiting_tokens: float | None, num_running: float | None,
                preemption_rate: float | None, kv_capacity_tokens: float | None) -> PodSignals:
    """A :class:`PodSignals` from raw readings, each validated by :func:`valid`."""
    capacity = valid(kv_capacity_tokens)
    return PodSignals(
        name=name,
        kv_usage=valid(kv_usage, 1.0),
        num_waiting=valid(num_waiting),
        waiting_tokens=valid(waiting_tokens),
        num_running=valid(num_running),
        preemption_rate=valid(preemption_rate),
        kv_capacity_tokens=capacity if capacity else None,
    )


def mean_context(prompt_tokens: float, generated_tokens: float,
                 finished_requests: float) -> float | None:
    """Tokens per finished request (prompt + generated), or None before any finished."""
    if finished_requests <= 0:
        return None
    return (prompt_tokens + generated_tokens) / finished_requests
