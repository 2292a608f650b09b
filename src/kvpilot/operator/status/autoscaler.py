"""The part of ``status`` the autoscaler loop owns, built purely from one interval's
reading and decision: the last observed signals, capacity and cost estimates, the
policy's decision and state, and three conditions with the Events on their transitions.

Each ``to_status``/``*_status`` returns a status merge patch fragment whose keys are all
declared in the CRD's status schema (the API server would prune any other). A signal that
could not be read is written as ``None``, which a merge patch turns into "remove the key":
a missing value shows as empty in ``kubectl get``, never as a stale number or as zero
(a down source or a misspelled metric is missing data, not an idle fleet).

Conditions:

================  ======  =====================  ==============================================
type              status  reason                 when
================  ======  =====================  ==============================================
MetricsAvailable  True    SignalsReported        every ready pod reported every signal
                  True    PartialData            some did not: scaling up still works, scaling
                                                 down is held (never down on missing data)
                  True    ScaledToZero           at zero replicas by design (minReplicas 0):
                                                 nothing to read, nothing missing
                  False   NoReadyPods            nothing to read yet
                  False   SourceUnreachable      Prometheus down / every scrape failed
                  False   NoData                 answered, but no KV usage for any ready pod:
                                                 a wrong metric name or label
ScalingActive     True    ScaledUp/ScaledDown/   the policy decided (message: rule and reason)
                          Holding
                  False   MissingMetrics         no data: the count is held
ScalingLimited    True    TooManyReplicas        maxReplicas cut the recommendation
                  True    TooFewReplicas         minReplicas raised it
                  False   DesiredWithinRange
================  ======  =====================  ==============================================

Events: a Warning ``MetricsUnavailable`` when MetricsAvailable turns False and a Normal
``MetricsRestored`` when it turns True again: one pair per outage, not one per interval.
``NoReadyPods`` (every pod still starting, as after each create) is no outage: no Event.
Scaling Events (``ScaledUp``/``ScaledDown``) come from the reconcile that applies the count.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvpilot.autoscaler import Decision
from kvpilot.operator.autoscaling.metrics_source import MetricsReading
from kvpilot.operator.reconcile import Event
from kvpilot.operator.status.conditions import Condition, to_rfc3339


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
        itl_p90 / ttft_p90: the fleet's pooled inter-token latency and time to first
            token at p90 over the read window (seconds), from the engines' histograms.
        prefix_cache_hit_rate: prompt tokens the prefix caches held over those looked up,
            over the window (0..1).
        prefill_tokens_per_second: prompt tokens the fleet prefilled (looked up less
            held) per second over the window.
    """

    source: str
    ready_pods: int
    cache_usage: float | None = None
    max_cache_usage: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    waiting_tokens: float | None = None
    preemption_rate: float | None = None
    itl_p90: float | None = None
    ttft_p90: float | None = None
    prefix_cache_hit_rate: float | None = None
    prefill_tokens_per_second: float | None = None

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
            "itlP90Seconds": _real(self.itl_p90),
            "ttftP90Seconds": _real(self.ttft_p90),
            "prefixCacheHitRate": _real(self.prefix_cache_hit_rate),
            "prefillTokensPerSecond": _real(self.prefill_tokens_per_second, 1),
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


MESSAGE_LIMIT = 1024


def _short(message: str) -> str:
    return message if len(message) <= MESSAGE_LIMIT else message[: MESSAGE_LIMIT - 3] + "..."


def _missing_summary(reading: MetricsReading) -> str:
    parts = [f"{p.name} ({', '.join(p.missing)})" for p in reading.pods if p.missing]
    more = f" and {len(parts) - 3} more" if len(parts) > 3 else ""
    return "; ".join(parts[:3]) + more


def metrics_condition(reading: MetricsReading, decision: Decision, pending: int,
                      scale_to_zero: bool = False) -> Condition:
    """MetricsAvailable from what the source returned and what the policy could use. A
    fleet at zero by design (``minReplicas: 0``, nothing starting) has nothing to read and
    is not missing anything: True, reason ScaledToZero."""
    ready = len(reading.pods)
    src = reading.source
    held = f"holding {decision.desired_replicas} replicas"
    if ready == 0 and pending == 0 and scale_to_zero:
        return Condition("MetricsAvailable", "True", "ScaledToZero",
                         "no engine pod at zero replicas; the router's held requests are"
                         f" watched every second ({decision.reason})")
    if ready == 0:
        return Condition("MetricsAvailable", "False", "NoReadyPods",
                         f"no ready engine pod to read ({pending} starting); {held}")
    if not reading.reachable:
        return Condition("MetricsAvailable", "False", "SourceUnreachable",
                         _short(f"{reading.problem or src + ' unreachable'}; {held}"))
    if not decision.metrics_available:
        detail = reading.problem or f"no ready pod reported KV usage through {src}"
        return Condition("MetricsAvailable", "False", "NoData", _short(f"{detail}; {held}"))
    incomplete = [p for p in reading.pods if p.missing]
    if incomplete:
        message = (f"{len(incomplete)} of {ready} ready pods are missing signals:"
                   f" {_missing_summary(reading)}; scale-down is held")
        if reading.problem:
            message += f" ({reading.problem})"
        return Condition("MetricsAvailable", "True", "PartialData", _short(message))
    return Condition("MetricsAvailable", "True", "SignalsReported",
                     f"{ready} of {ready} ready pods reported every signal through {src}")


def scaling_active_condition(decision: Decision) -> Condition:
    if not decision.metrics_available:
        return Condition("ScalingActive", "False", "MissingMetrics", _short(decision.reason))
    reason = {"up": "ScaledUp", "down": "ScaledDown"}.get(decision.direction, "Holding")
    return Condition("ScalingActive", "True", reason,
                     _short(f"rule {decision.rule}: {decision.reason}"))


def scaling_limited_condition(decision: Decision, min_replicas: int,
                              max_replicas: int) -> Condition:
    asked = decision.unclamped_replicas
    if decision.limited == "max":
        return Condition(
            "ScalingLimited", "True", "TooManyReplicas",
            f"the load asks for {asked} replicas; capped at maxReplicas={max_replicas}")
    if decision.limited == "min":
        return Condition(
            "ScalingLimited", "True", "TooFewReplicas",
            f"the load asks for {asked} replicas; kept at minReplicas={min_replicas}")
    return Condition("ScalingLimited", "False", "DesiredWithinRange",
                     f"{decision.desired_replicas} is within [{min_replicas}, {max_replicas}]")


def _previous(conditions: Iterable[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any]:
    for cond in conditions or ():
        if cond.get("type") == type_:
            return cond
    return {}


def _is_outage(status: str | None, reason: str | None) -> bool:
    """False metrics are an outage unless no pod is ready yet: a fleet whose pods are all
    starting has nothing to read, which is not a broken source."""
    return status == "False" and reason != "NoReadyPods"


def transition_events(previous: Iterable[Mapping[str, Any]] | None,
                      metrics: Condition) -> tuple[Event, ...]:
    """An Event when a metrics outage starts or ends (judged from the conditions stored
    before); pods that are all still starting (``NoReadyPods``) are neither."""
    before = _previous(previous, "MetricsAvailable")
    was_out = _is_outage(before.get("status"), before.get("reason"))
    if _is_outage(metrics.status, metrics.reason) and not was_out:
        return (Event("Warning", "MetricsUnavailable", f"{metrics.reason}: {metrics.message}"),)
    if metrics.status == "True" and was_out:
        return (Event("Normal", "MetricsRestored", metrics.message),)
    return ()
