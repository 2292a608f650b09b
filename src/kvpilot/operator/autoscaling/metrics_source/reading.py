"""What a metric source is asked for and what it answers: the one hand-off between the
sources (Prometheus, pod scraping) and the autoscaler loop.

::

    EnginePod(name, ip, port)  x N ready pods   (+ the router pods, when there are any)
        --MetricsSource.read(pods, now, routers)-->
    MetricsReading(pods=(PodSignals, ...), generated tokens/s, mean context, KV window,
                   reachable, problem, router_queued)

Every value a source could not read is ``None``: a failed scrape, an empty PromQL vector,
a series absent from ``/metrics``, a NaN or out-of-range sample. ``None`` is missing data,
never zero (cases C15, C17); the policy holds the count on it and never scales down.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from kvpilot.autoscaler import LatencyWindow, PodSignals
from kvpilot.operator.constants import ENGINE_PORT, METRICS_PATH


@dataclass(frozen=True)
class EnginePod:
    """A ready pod to read: an engine, or a router (then ``port`` is its metrics port).

    Attributes:
        name: the pod's name (the ``pod`` label Prometheus attaches to its series).
        ip: ``status.podIP`` (the pods source scrapes it; None = not known).
        port: the engine's HTTP port (a router's Prometheus port).
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
        router_queued: requests the router pods hold that no ready engine counts yet
            (:func:`router_queued`); None when no router series was read (no router, a
            routing policy that exports none, or every router scrape failed), which the
            autoscaler counts as 0.
        requests_finished: the engines' finished requests, summed over ``pods`` (lifetime
            counters); None unless every pod reported it (scale to zero reads a change
            as traffic).
        requests_without_engine: router attempts that found no engine since the previous
            read (scale to zero's activation signal; the autoscaler loop fills it from
            :mod:`kvpilot.operator.autoscaling.activation`, the sources leave 0).
        kv_window_tokens: the sliding window W (tokens) behind which the engines free KV
            blocks (every layer of the model slides), from the ``sliding_window`` label
            of the cache-config info series (:func:`fleet_kv_window`); a request then
            holds at most ``(cdiv(W, block_size) + 1) x block_size`` tokens. None = no
            window: full attention, an engine too old to export the label, or unknown.
    """

    source: str
    pods: tuple[PodSignals, ...]
    generated_tokens_per_second: float | None = None
    mean_context_tokens: float | None = None
    reachable: bool = True
    problem: str | None = None
    router_queued: float | None = None
    requests_finished: float | None = None
    requests_without_engine: float = 0.0
    kv_window_tokens: int | None = None

    @property
    def kv_capacity_tokens(self) -> float | None:
        """Per-replica KV capacity: the median over the pods that reported one."""
        caps = [p.kv_capacity_tokens for p in self.pods if p.kv_capacity_tokens is not None]
        return float(statistics.median(caps)) if caps else None


class MetricsSource(Protocol):
    """Reads engine signals for a set of ready pods. Implementations never raise for an
    unreachable or empty source: they return a reading with ``None`` values and say why."""

    name: str

    def read(self, pods: Sequence[EnginePod], now: float,
             routers: Sequence[EnginePod] = ()) -> MetricsReading:
        """Signals for ``pods`` at ``now`` (seconds; the same clock on every call, used
        for counter rates), and the demand the fleet's ready ``routers`` hold
        (``router_queued``; the Prometheus source selects router series by label and does
        not need them listed)."""
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
                preemption_rate: float | None, kv_capacity_tokens: float | None,
                itl: LatencyWindow | None = None, ttft: LatencyWindow | None = None,
                step_tokens: float | None = None, prompt_token_rate: float | None = None,
                cached_token_rate: float | None = None) -> PodSignals:
    """A :class:`PodSignals` from raw readings, each number validated by :func:`valid`
    (the latency windows are validated when built)."""
    capacity = valid(kv_capacity_tokens)
    return PodSignals(
        name=name,
        kv_usage=valid(kv_usage, 1.0),
        num_waiting=valid(num_waiting),
        waiting_tokens=valid(waiting_tokens),
        num_running=valid(num_running),
        preemption_rate=valid(preemption_rate),
        kv_capacity_tokens=capacity if capacity else None,
        itl=itl,
        ttft=ttft,
        step_tokens=valid(step_tokens),
        prompt_token_rate=valid(prompt_token_rate),
        cached_token_rate=valid(cached_token_rate),
    )


def parse_kv_window(value: object) -> int | None:
    """The ``sliding_window`` label of the cache-config info series as a window in
    tokens: a positive decimal integer; None for anything else (absent, vLLM's
    ``"None"``, garbage). Estimates only, so it never raises."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    if not (text.isascii() and text.isdigit()):
        return None
    window = int(text)
    return window if window > 0 else None


def fleet_kv_window(windows: Sequence[int | None]) -> int | None:
    """One window for the fleet from those of the pods that reported a KV capacity: the
    largest (the fewest requests fit) when every such pod has one, else None (a pod
    without a window, such as an older engine or a full-attention model in the middle
    of a rollout, holds whole contexts: no cap is the safe estimate)."""
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)


def mean_context(prompt_tokens: float, generated_tokens: float,
                 finished_requests: float) -> float | None:
    """Tokens per finished request (prompt + generated), or None before any finished."""
    if finished_requests <= 0:
        return None
    return (prompt_tokens + generated_tokens) / finished_requests


def fleet_requests_finished(per_pod: Sequence[float | None]) -> float | None:
    """The finished-request counters of the ready pods, summed; None when any is missing
    or not a counter value (a partial sum would look like traffic, or hide it), and for
    an empty fleet."""
    values = [valid(v) for v in per_pod]
    if not values or None in values:
        return None
    return float(sum(v for v in values if v is not None))


def worker_address(url: str) -> tuple[str, int] | None:
    """``(host, port)`` of a router's worker URL (``http://10.0.0.7:8000``,
    ``http://[fd00::7]:8000``), the scheme's default port when none is written; None for
    anything else."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts.hostname.lower(), port if port is not None else (
        443 if parts.scheme == "https" else 80)


def router_queued(in_flight: Mapping[str, float], pods: Sequence[EnginePod],
                  signals: Sequence[PodSignals]) -> float | None:
    """Requests the routers hold that no ready engine counts yet (requests, >= 0).

    ``in_flight`` is the routers' ``vllm_router_running_requests`` per worker URL, summed
    over the router pods: requests each router assigned to that engine and has not seen
    finish. vllm-router 0.1.17 exports no gauge of the requests it holds (found by
    experiment; docs/autoscaling.md, "Demand held at the router"), so the held demand is
    the difference between what the routers have in flight and what the engines count::

        router_queued = max(0, sum over matched engines of
                               (in_flight[engine] - (num_running + num_waiting)))

    where a worker URL matches the ready pod whose ``(ip, port)`` it names and whose
    running and waiting counts were both read. What the difference holds: requests between
    the router's choice and the engine scheduler (in transit, in the engine's HTTP layer or
    input queue, in a router retry back-off). Workers that match no ready pod are left
    out: a draining or not-yet-ready pod's requests are not demand the fleet lacks. The
    sum is clamped once, over all matched engines, so the skew between scrapes (a router
    and an engine are not read at the same instant) cancels across pods instead of adding
    up; requests sent to an engine directly (not through a router) can hide held ones.

    Returns None when ``in_flight`` is empty (no router series), 0.0 when no worker
    matched a pod that reported both counts.
    """
    if not in_flight:
        return None
    by_address: dict[tuple[str, int], PodSignals] = {}
    for pod, signal in zip(pods, signals):
        if pod.ip and signal.num_running is not None and signal.num_waiting is not None:
            by_address[(pod.ip.lower().strip("[]"), pod.port)] = signal
    routed = counted = 0.0
    seen: set[tuple[str, int]] = set()
    for url, value in in_flight.items():
        address = worker_address(url)
        if address is None or valid(value) is None or address not in by_address:
            continue
        routed += value
        if address not in seen:  # two URLs for one engine: its own count once
            seen.add(address)
            signal = by_address[address]
            counted += (signal.num_running or 0.0) + (signal.num_waiting or 0.0)
    return max(0.0, routed - counted)
