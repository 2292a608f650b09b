"""The conditions the autoscaler owns, and the Events on their transitions (pure).

================  ======  =====================  ==============================================
type              status  reason                 when
================  ======  =====================  ==============================================
MetricsAvailable  True    SignalsReported        every ready pod reported every signal
                  True    PartialData            some did not: scaling up still works, scaling
                                                 down is held (never down on missing data)
                  False   NoReadyPods            nothing to read yet
                  False   SourceUnreachable      Prometheus down / every scrape failed (C15)
                  False   NoData                 answered, but no KV usage for any ready pod:
                                                 a wrong metric name or label (C17)
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

from collections.abc import Iterable, Mapping
from typing import Any

from kvpilot.autoscaler import Decision
from kvpilot.operator.conditions import Condition
from kvpilot.operator.metrics_source import MetricsReading
from kvpilot.operator.reconcile import Event

MESSAGE_LIMIT = 1024


def _short(message: str) -> str:
    return message if len(message) <= MESSAGE_LIMIT else message[: MESSAGE_LIMIT - 3] + "..."


def _missing_summary(reading: MetricsReading) -> str:
    parts = [f"{p.name} ({', '.join(p.missing)})" for p in reading.pods if p.missing]
    more = f" and {len(parts) - 3} more" if len(parts) > 3 else ""
    return "; ".join(parts[:3]) + more


def metrics_condition(reading: MetricsReading, decision: Decision, pending: int) -> Condition:
    """MetricsAvailable from what the source returned and what the policy could use."""
    ready = len(reading.pods)
    src = reading.source
    held = f"holding {decision.desired_replicas} replicas"
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
