"""Status fragments the autoscaler timer writes: the last observed signals,
capacity and cost estimates, and the policy's decision and state.

Each function returns a status merge patch fragment whose keys are all declared in the
CRD (case C14). A signal that could not be read is written as ``None``, which a merge
patch turns into "remove the key": a missing value shows as empty in ``kubectl get``,
never as a stale number or as zero (cases C15, C17).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvpilot.operator.conditions import to_rfc3339


def _count(value: float | None) -> int | None:
    """A gauge read as float (Prometheus values are floats) -> a whole count, or None."""
    if value is None or not math.isfinite(value):
        return None
    return round(value)


def _real(value: float | None, digits: int = 6) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(float(value), digits)


@dataclass(frozen=True)
class ObservedSignals:
    """Fleet-wide engine signals at one observation; None = missing (not zero).

    Attributes:
        source: ``prometheus`` or ``pods``.
        ready_pods: ready engine pods observed.
        cache_usage: mean non-evictable KV usage over ready pods (0..1).
        max_cache_usage: the highest pod's usage.
        requests_running / requests_waiting: summed over pods.
        waiting_tokens: prompt tokens not yet prefilled, summed over pods.
        preemption_rate: preemptions per second, summed over pods.
    """

    source: str
    ready_pods: int
    cache_usage: float | None = None
    max_cache_usage: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    waiting_tokens: float | None = None
    preemption_rate: float | None = None

    def to_status(self, now: datetime) -> dict[str, Any]:
        return {"signals": {
            "observedTime": to_rfc3339(now),
            "source": self.source,
            "readyPods": self.ready_pods,
            "cacheUsage": _real(self.cache_usage),
            "maxCacheUsage": _real(self.max_cache_usage),
            "requestsRunning": _count(self.requests_running),
            "requestsWaiting": _count(self.requests_waiting),
            "waitingTokens": _count(self.waiting_tokens),
            "preemptionRate": _real(self.preemption_rate),
        }}


@dataclass(frozen=True)
class CapacityEstimate:
    """Per-replica KV capacity (tokens) and how many requests of the observed mean
    context fit at once; None = unknown."""

    kv_capacity_tokens_per_replica: float | None
    mean_context_tokens: float | None
    max_concurrent_requests_estimate: float | None

    def to_status(self) -> dict[str, Any]:
        return {"capacity": {
            "kvCapacityTokensPerReplica": _count(self.kv_capacity_tokens_per_replica),
            "meanContextTokens": _real(self.mean_context_tokens, 1),
            "maxConcurrentRequestsEstimate": _count(self.max_concurrent_requests_estimate),
        }}


@dataclass(frozen=True)
class CostEstimate:
    """``finops.costPerReplicaHour`` x replicas, and cost per million generated tokens
    (None when no tokens were generated or no price is set)."""

    cost_per_hour: float | None
    cost_per_million_tokens: float | None

    def to_status(self) -> dict[str, Any]:
        return {"cost": {
            "costPerHour": _real(self.cost_per_hour, 4),
            "costPerMillionTokens": _real(self.cost_per_million_tokens, 4),
        }}


def json_number(value: Any) -> Any:
    """``value`` with every non-finite float (inf, nan) anywhere inside replaced by None.

    JSON has no Infinity: the API server refuses the whole patch ("invalid JSON patch",
    HTTP 400), so one ``inf`` (the forecast's "never exhausted") would stop every status
    write. None is "unknown" here, as everywhere in status (the schema has it nullable).
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: json_number(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_number(v) for v in value]
    return value


def autoscaler_status(decision: Mapping[str, Any], policy_state: Mapping[str, Any],
                      now: datetime) -> dict[str, Any]:
    """``status.autoscaler``: the decision summary (``Decision.to_dict()`` of
    kvpilot.autoscaler) stamped with ``now``, and the policy state to restore after a
    restart (``PolicyState.to_dict()``); numbers JSON can carry (:func:`json_number`)."""
    return {"autoscaler": {
        "lastDecision": {**json_number(dict(decision)), "time": to_rfc3339(now)},
        "policyState": json_number(dict(policy_state)),
    }}
