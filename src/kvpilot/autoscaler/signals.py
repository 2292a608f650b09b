"""What the policy observes: per-pod engine signals and the fleet they add up to.

A metric source fills one :class:`PodSignals` per *ready* pod, with ``None`` for every value
it could not read (an empty PromQL vector, a failed scrape, a series absent from
``/metrics``). ``None`` means missing, never zero (cases C15, C17). Pods that exist but are
not ready yet (pulling the image, loading weights) are only counted, in
:attr:`FleetSignals.pending_replicas`.

Where each value comes from on our engine (architecture.md, "Metrics"):

================================  ===========================================================
field                             engine metric
================================  ===========================================================
``kv_usage``                      ``kvpilot:gpu_cache_usage_factor`` (0..1, evictable = free)
``num_waiting``                   ``kvpilot:num_requests_waiting``
``waiting_tokens``                ``kvpilot:num_waiting_tokens``
``num_running``                   ``kvpilot:num_requests_running``
``preemption_rate``               rate of ``kvpilot:num_preemptions_total`` (1/s), e.g.
                                  ``rate(...[1m])`` or :func:`counter_rate` on two scrapes
``kv_capacity_tokens``            ``kvpilot:kv_cache_capacity_tokens`` (= ``num_gpu_blocks`` x
                                  ``block_size`` of ``kvpilot:cache_config_info``)
``prompt_token_rate``             rate of ``kvpilot:prefix_cache_queries_total`` (prompt
                                  tokens looked up in the prefix cache per second)
``cached_token_rate``             rate of ``kvpilot:prefix_cache_hits_total`` (of those, the
                                  tokens the prefix cache held: prefill not computed)
``FleetSignals.max_num_seqs``     the engines' ``--max-num-seqs`` (the operator passes the CR's
                                  ``spec.engine.maxNumSeqs``, the flag it sets on every pod)
``FleetSignals.router_queued``    requests the router pods hold that no engine counts yet:
                                  ``max(0, sum of vllm_router_running_requests - sum of
                                  engine running + waiting)`` over the ready engines (the
                                  router exports no queue gauge; see the metric sources)
================================  ===========================================================

The router's held requests join the engines' waiting count (:attr:`FleetLoad.num_waiting`),
so the queue-drain rule and the scale-down consolidation check see a burst the router is
holding before any engine queues it. Their prompt lengths are unknown (the router exports
none), so they add requests, not tokens.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


def _check_optional(name: str, pod: str, value: float | None, upper: float | None = None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"pod {pod!r}: {name} must be a number or None; got {value!r}")
    if value < 0 or (upper is not None and value > upper) or math.isinf(value):
        allowed = f"[0, {upper}]" if upper is not None else ">= 0 and finite"
        raise ValueError(f"pod {pod!r}: {name} must be {allowed} or None; got {value!r}")


@dataclass(frozen=True)
class LatencyWindow:
    """How much one latency histogram grew over the last read window (a Prometheus
    ``increase()`` of ``_bucket`` and ``_sum``, or the difference of two scrapes).

    Attributes:
        buckets: ``(upper_bound_seconds, cumulative_count)`` pairs, bounds strictly
            increasing, counts non-decreasing, the last bound ``math.inf`` (its count is
            the number of observations in the window). Counts are floats: PromQL's
            ``increase()`` extrapolates.
        sum_seconds: increase of the histogram's ``_sum`` (seconds, >= 0).

    Raises:
        ValueError: bounds not increasing, no ``+Inf`` bucket, counts decreasing or
            negative, a negative or non-finite sum.
    """

    buckets: tuple[tuple[float, float], ...]
    sum_seconds: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "buckets", tuple((float(b), float(c)) for b, c in self.buckets))
        if not self.buckets or self.buckets[-1][0] != math.inf:
            raise ValueError(f"buckets must end with the +Inf bucket; got {self.buckets!r}")
        prev_bound, prev_count = -math.inf, 0.0
        for bound, count in self.buckets:
            if not bound > prev_bound or math.isnan(bound):
                raise ValueError(f"bucket bounds must increase; got {bound} after {prev_bound}")
            if math.isnan(count) or count < prev_count:
                raise ValueError(f"bucket counts must be >= 0 and cumulative; got {count} after {prev_count}")
            prev_bound, prev_count = bound, count
        if math.isnan(self.sum_seconds) or math.isinf(self.sum_seconds) or self.sum_seconds < 0:
            raise ValueError(f"sum_seconds must be >= 0 and finite; got {self.sum_seconds!r}")

    @property
    def count(self) -> float:
        """Observations in the window."""
        return self.buckets[-1][1]

    @property
    def mean(self) -> float | None:
        """Mean observation (seconds); None for an empty window."""
        return self.sum_seconds / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0 < q < 1) in seconds, interpolated linearly inside its
        bucket as PromQL's ``histogram_quantile`` does (the first bucket starts at 0; a
        quantile in the +Inf bucket is the highest finite bound). None for an empty window.

        Raises:
            ValueError: ``q`` outside (0, 1).
        """
        if not 0.0 < q < 1.0:
            raise ValueError(f"quantile must be in (0, 1); got {q}")
        total = self.count
        if total <= 0:
            return None
        rank = q * total
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in self.buckets:
            if count >= rank:
                if bound == math.inf:
                    return lower_bound
                if count == lower_count:
                    return bound
                return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
            lower_bound, lower_count = bound, count
        return lower_bound  # unreachable: the +Inf bucket holds every observation


@dataclass(frozen=True)
class PodSignals:
    """One ready pod's signals at one instant. ``None`` = missing (not zero).

    Attributes:
        name: pod name (for reasons and the missing-pod list).
        kv_usage: non-evictable share of the KV cache, 0..1.
        num_waiting: requests queued, not yet scheduled.
        waiting_tokens: prompt tokens not yet prefilled.
        num_running: requests scheduled (prefilling or decoding).
        preemption_rate: preemptions per second over the last interval.
        kv_capacity_tokens: KV pool size in tokens (blocks x block size), > 0.
        itl: ``kvpilot:inter_token_latency_seconds`` over the last window, or None when
            the engine exports no such histogram (older engines) or it could not be read.
        ttft: ``kvpilot:time_to_first_token_seconds`` over the last window, or None.
        step_tokens: mean tokens scheduled per engine step over the last window (prefill
            chunks plus one per decoding request; ``kvpilot:iteration_tokens_total``'s
            ``_sum`` / ``_count`` increase), or None. The latency signals are not load
            signals: a pod without them is not "missing"; the policy falls back to the
            saturation signals and says so.
        prompt_token_rate / cached_token_rate: prompt tokens per second looked up in the
            pod's prefix cache, and those it held (tokens/s, cached <= prompt), over the
            last window; None when not exported. Like the latency signals, not load
            signals: the consolidation check reads them (a replica removed takes its
            cached prefixes with it, and the sessions it held prefill them again on the
            pods that remain; :func:`kvpilot.autoscaler.windows.latency_blocker`).
    """

    name: str
    kv_usage: float | None = None
    num_waiting: float | None = None
    waiting_tokens: float | None = None
    num_running: float | None = None
    preemption_rate: float | None = None
    kv_capacity_tokens: float | None = None
    itl: LatencyWindow | None = None
    ttft: LatencyWindow | None = None
    step_tokens: float | None = None
    prompt_token_rate: float | None = None
    cached_token_rate: float | None = None

    def __post_init__(self) -> None:
        _check_optional("kv_usage", self.name, self.kv_usage, upper=1.0)
        _check_optional("step_tokens", self.name, self.step_tokens)
        _check_optional("prompt_token_rate", self.name, self.prompt_token_rate)
        _check_optional("cached_token_rate", self.name, self.cached_token_rate)
        for name in ("itl", "ttft"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, LatencyWindow):
                raise ValueError(f"pod {self.name!r}: {name} must be a LatencyWindow or None; got {value!r}")
        for name in ("num_waiting", "waiting_tokens", "num_running", "preemption_rate"):
            _check_optional(name, self.name, getattr(self, name))
        _check_optional("kv_capacity_tokens", self.name, self.kv_capacity_tokens)
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens <= 0:
            raise ValueError(
                f"pod {self.name!r}: kv_capacity_tokens must be > 0 or None;"
                f" got {self.kv_capacity_tokens}"
            )

    @property
    def missing(self) -> tuple[str, ...]:
        """Names of the load signals this pod did not report (capacity excluded: it is
        static and borrowed from peers when absent)."""
        return tuple(name for name in _LOAD_FIELDS if getattr(self, name) is None)


_LOAD_FIELDS = ("kv_usage", "num_waiting", "waiting_tokens", "num_running", "preemption_rate")


@dataclass(frozen=True)
class FleetSignals:
    """The whole observation the policy decides on.

    Attributes:
        pods: one entry per ready pod (serving, counted as supply and as load).
        pending_replicas: pods asked for but not ready yet (created, scheduling, loading);
            counted as supply so the same pressure is not answered twice.
        router_queued: requests held at the request router that no ready engine counts yet
            (requests, >= 0); 0 without a router or when its metric is missing.
        requests_without_engine: attempts the router made since the last read that found
            no engine to send a request to (vllm-router's ``no_available_workers`` errors;
            >= 0, 0 when unknown). Above 0 while the fleet is at zero, a request is waiting
            for an engine: the scale-to-zero activation (:mod:`kvpilot.autoscaler.zero`).
        requests_finished: the ready engines' lifetime count of finished requests, summed
            (None when any ready pod did not report it). Scale to zero reads a change
            between two reads as traffic.
        max_num_seqs: requests one engine runs at most (its ``--max-num-seqs``, >= 1), the
            denominator of saturation; None when unknown (the saturation rule then has no
            opinion, and the fleet is sized on KV and the queue alone).
        max_num_batched_tokens: the engines' token budget per step
            (``--max-num-batched-tokens``, >= 1), the denominator of ``step_tokens``;
            None when unknown.
    """

    pods: tuple[PodSignals, ...]
    pending_replicas: int = 0
    router_queued: float = 0.0
    requests_without_engine: float = 0.0
    requests_finished: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "pods", tuple(self.pods))
        if isinstance(self.pending_replicas, bool) or not isinstance(self.pending_replicas, int):
            raise ValueError(f"pending_replicas must be an int; got {self.pending_replicas!r}")
        if self.pending_replicas < 0:
            raise ValueError(f"pending_replicas must be >= 0; got {self.pending_replicas}")
        _check_optional("router_queued", "router", self.router_queued)
        if self.router_queued is None:
            raise ValueError("router_queued must be a number (0 when unknown); got None")
        _check_optional("requests_without_engine", "router", self.requests_without_engine)
        if self.requests_without_engine is None:
            raise ValueError("requests_without_engine must be a number (0 when unknown); got None")
        _check_optional("requests_finished", "fleet", self.requests_finished)
        if self.max_num_seqs is not None and (
            isinstance(self.max_num_seqs, bool) or not isinstance(self.max_num_seqs, int)
            or self.max_num_seqs < 1
        ):
            raise ValueError(f"max_num_seqs must be an int >= 1 or None; got {self.max_num_seqs!r}")
        if self.max_num_batched_tokens is not None and (
            isinstance(self.max_num_batched_tokens, bool) or not isinstance(self.max_num_batched_tokens, int)
            or self.max_num_batched_tokens < 1
        ):
            raise ValueError(
                f"max_num_batched_tokens must be an int >= 1 or None; got {self.max_num_batched_tokens!r}")
        names = [p.name for p in self.pods]
        if len(set(names)) != len(names):
            raise ValueError(f"pod names must be unique; got {names}")

    @property
    def ready_replicas(self) -> int:
        return len(self.pods)

    @property
    def current_replicas(self) -> int:
        """Supply: ready plus pending."""
        return len(self.pods) + self.pending_replicas


@dataclass(frozen=True)
class FleetLoad:
    """The fleet's load, added up over the ready pods that reported it.

    Token quantities are in tokens when a KV capacity is known for the fleet; otherwise
    (``capacity_known`` False) they are in "replica units" (capacity 1 per replica) and
    ``waiting_tokens`` cannot be converted, so it is 0.

    Attributes:
        capacity_per_replica: KV tokens per replica (median of the reporting pods).
        used_tokens: sum over pods of kv_usage x capacity (missing usage adds 0).
        waiting_tokens: queued prompt tokens (missing adds 0).
        num_waiting / num_running: request counts (missing adds 0); ``num_waiting``
            includes ``router_queued``.
        router_queued: requests held at the router (part of ``num_waiting``).
        max_usage: highest per-pod kv_usage reported (0 if none).
        preempting_pods: pods whose preemption rate is > 0.
        missing_pods: names of ready pods with any missing load signal.
        usage_reported: ready pods that reported kv_usage.
        max_num_seqs: requests one engine runs at most (None = unknown).
        running_reported: ready pods that reported num_running.
    """

    capacity_per_replica: float
    capacity_known: bool
    used_tokens: float
    waiting_tokens: float
    num_waiting: float
    num_running: float
    max_usage: float
    preempting_pods: tuple[str, ...]
    missing_pods: tuple[str, ...]
    usage_reported: int
    router_queued: float = 0.0
    max_num_seqs: int | None = None
    running_reported: int = 0

    def saturation(self, replicas: int) -> float | None:
        """Running requests per replica over ``max_num_seqs`` if the fleet had ``replicas``
        replicas (0..1 while every request fits a batch; None when ``max_num_seqs`` is
        unknown, no pod reported its running count, or ``replicas`` < 1)."""
        if self.max_num_seqs is None or self.running_reported == 0 or replicas < 1:
            return None
        return self.num_running / replicas / self.max_num_seqs

    @property
    def demand_tokens(self) -> float:
        """KV the fleet needs now: what is held plus the queued prompts."""
        return self.used_tokens + self.waiting_tokens

    @property
    def complete(self) -> bool:
        return not self.missing_pods


def aggregate(signals: FleetSignals) -> FleetLoad:
    """Add up the ready pods' signals (pure). Missing values add nothing and are listed;
    the router's held requests are added to the waiting count."""
    caps = [p.kv_capacity_tokens for p in signals.pods if p.kv_capacity_tokens is not None]
    capacity_known = bool(caps)
    capacity = float(statistics.median(caps)) if caps else 1.0
    used = waiting_tokens = waiting = running = max_usage = 0.0
    preempting: list[str] = []
    missing: list[str] = []
    reported = running_reported = 0
    for pod in signals.pods:
        cap = pod.kv_capacity_tokens if pod.kv_capacity_tokens is not None else capacity
        if pod.kv_usage is not None:
            used += pod.kv_usage * cap
            max_usage = max(max_usage, pod.kv_usage)
            reported += 1
        if pod.waiting_tokens is not None and capacity_known:
            waiting_tokens += pod.waiting_tokens
        waiting += pod.num_waiting or 0.0
        if pod.num_running is not None:
            running += pod.num_running
            running_reported += 1
        if pod.preemption_rate:
            preempting.append(pod.name)
        if pod.missing:
            missing.append(pod.name)
    return FleetLoad(
        capacity_per_replica=capacity,
        capacity_known=capacity_known,
        used_tokens=used,
        waiting_tokens=waiting_tokens,
        num_waiting=waiting + signals.router_queued,
        num_running=running,
        max_usage=max_usage,
        preempting_pods=tuple(preempting),
        missing_pods=tuple(missing),
        usage_reported=reported,
        router_queued=float(signals.router_queued),
        max_num_seqs=signals.max_num_seqs,
        running_reported=running_reported,
    )


def counter_rate(
    previous: float | None, previous_time: float | None, value: float | None, now: float
) -> float | None:
    """Per-second rate of a Prometheus counter between two scrapes (for pod scraping).

    Returns ``None`` when either sample is missing or no time has passed. A counter that went
    down was reset (pod restart): the new value is the increase since the reset, as
    PromQL's ``rate()`` assumes.
    """
    if previous is None or previous_time is None or value is None or now <= previous_time:
        return None
    increase = value - previous if value >= previous else value
    return increase / (now - previous_time)
