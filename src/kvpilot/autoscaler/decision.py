"""What the policy answers: the :class:`Decision` dataclass, and :func:`bound`, the last
stage of :func:`kvpilot.autoscaler.policy.decide`, which turns a stage's
:class:`Proposal` into a Decision: clamp to [min, max], say which bound limited it, and
stamp the last-scale times in the next state."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvpilot.autoscaler.rules import Candidate
from kvpilot.autoscaler.signals import FleetLoad
from kvpilot.autoscaler.spec import AutoscalingSpec
from kvpilot.autoscaler.state import PolicyState

# The rules that may leave the fleet at zero replicas (kvpilot.autoscaler.zero).
ZERO_RULES = ("scale_to_zero", "scaled_to_zero")


@dataclass(frozen=True)
class Proposal:
    """What a stage of the policy asks for, before the bounds.

    Attributes:
        replicas: the total asked for (may lie outside [min, max]).
        rule: a candidate's name, ``scale_down``, ``hold`` or ``missing_metrics``.
        signal / value: the metric behind it and its value (None when none applies).
        reason: one sentence with the numbers.
    """

    replicas: int
    rule: str
    signal: str | None
    value: float | None
    reason: str


@dataclass(frozen=True)
class Decision:
    """What to do, and why.

    Attributes:
        desired_replicas: the count to write to the Deployment (within [min, max]).
        current_replicas: ready + pending at decision time.
        direction: ``up``, ``down`` or ``hold``.
        rule: the rule that decided: a candidate's name, ``scale_down``, ``hold``,
            ``missing_metrics`` or ``bounds``.
        signal / value: the metric behind that rule and its value.
        reason: one sentence for the Event and ``status.lastScaleReason``.
        candidates: every rule's answer, in a fixed order.
        unclamped_replicas: what the rules asked for before [min, max].
        limited: ``max`` / ``min`` when a bound cut the answer (ScalingLimited=True).
        metrics_available: False when no ready pod reported KV usage (MetricsAvailable).
        missing_pods: ready pods with at least one missing signal.
        state: the history to pass to the next call.
        latency: with ``spec.autoscaling.slo``, the latency model's view of this interval
            (:meth:`kvpilot.autoscaler.latency.LatencyView.to_dict`: fitted ITL line,
            trust, observed ITL/TTFT, the load sized for); None without an SLO.
    """

    desired_replicas: int
    current_replicas: int
    direction: str
    rule: str
    signal: str | None
    value: float | None
    reason: str
    candidates: tuple[Candidate, ...]
    unclamped_replicas: int
    limited: str | None
    metrics_available: bool
    missing_pods: tuple[str, ...]
    state: PolicyState
    latency: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, object]:
        """JSON-ready summary (without the state) for status and logs; ``latency`` only
        with an SLO."""
        out: dict[str, object] = {
            "desiredReplicas": self.desired_replicas,
            "currentReplicas": self.current_replicas,
            "direction": self.direction,
            "rule": self.rule,
            "signal": self.signal,
            "value": None if self.value is None else round(self.value, 6),
            "reason": self.reason,
            "limited": self.limited,
            "metricsAvailable": self.metrics_available,
            "missingPods": list(self.missing_pods),
            "candidates": [c.to_dict() for c in self.candidates],
        }
        if self.latency is not None:
            out["latency"] = dict(self.latency)
        return out


def bound(
    proposal: Proposal,
    current: int,
    candidates: tuple[Candidate, ...],
    load: FleetLoad,
    state: PolicyState,
    spec: AutoscalingSpec,
    now: float,
    metrics_available: bool = True,
) -> Decision:
    """The Decision for ``proposal``: clamped to [floor, max_replicas] (0 only for the
    scale-to-zero rules, :data:`ZERO_RULES`, with ``minReplicas: 0``) (the reason
    then says which bound, and the rule becomes ``bounds`` when only the bound moves the
    count); ``direction`` against ``current``; and ``state`` with ``last_scale_time`` (and
    ``last_scale_down_time``) set to ``now`` when the count moves. Pure."""
    asked, rule, reason = proposal.replicas, proposal.rule, proposal.reason
    floor = 0 if asked == 0 and spec.scale_to_zero and proposal.rule in ZERO_RULES else spec.floor
    desired = min(max(asked, floor), spec.max_replicas)
    limited = "max" if asked > spec.max_replicas else "min" if asked < floor else None
    if desired != asked:
        limit = spec.max_replicas if limited == "max" else floor
        reason = f"{reason} (limited to {limited}Replicas={limit})"
        moved_by_bounds = (desired > current) != (asked > current) or asked == current
        if desired != current and moved_by_bounds:  # the count moves only for the bounds
            rule = "bounds"
    direction = "up" if desired > current else "down" if desired < current else "hold"
    if direction != "hold":
        state = replace(state, last_scale_time=now)
        if direction == "down":
            state = replace(state, last_scale_down_time=now)
    return Decision(
        desired_replicas=desired,
        current_replicas=current,
        direction=direction,
        rule=rule,
        signal=proposal.signal,
        value=proposal.value,
        reason=reason,
        candidates=candidates,
        unclamped_replicas=asked,
        limited=limited,
        metrics_available=metrics_available,
        missing_pods=load.missing_pods,
        state=state,
    )
