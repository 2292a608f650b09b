"""The scaling decision: one pure function, :func:`decide`.

Decision table (first row that applies wins; ``current`` = ready + pending)::

  no ready pod reported KV usage   -> hold current (clamped to [min, max]); MetricsAvailable=False
  up = max(forecast, starvation,   -> if up > current: scale UP to up now (no window waits
       reactive over up-window)       for the forecast or the alarm)
  highest candidate >= current     -> hold ("at target")
  any ready pod missing a signal   -> hold (never down on missing data: C15, C17)
  window not a full, continuous    -> hold (scale-down stabilization)
    run of recommendations < current
  consolidation check fails        -> hold (current - 1 would not absorb the load under target)
  otherwise                        -> scale DOWN by one
  finally                          -> clamp to [min, max]; report which bound limited it

``reactive`` is the higher of headroom and queue drain; with
``scaleUpStabilizationSeconds`` > 0 it is the lowest such value over that window (HPA's
scale-up stabilization). Missing pods count as zero load, as HPA counts pods without
metrics on a scale-up, so partial data can justify a scale-up but never a scale-down.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpilot.autoscaler import rules
from kvpilot.autoscaler.forecast import fit_trend, still_rising
from kvpilot.autoscaler.rules import Candidate
from kvpilot.autoscaler.signals import FleetLoad, FleetSignals, aggregate
from kvpilot.autoscaler.spec import AutoscalingSpec
from kvpilot.autoscaler.state import PolicyState, Recommendation
from kvpilot.autoscaler.windows import (
    below_target_for,
    consolidation_blocker,
    settled_demand,
    stabilized_up,
)


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

    def to_dict(self) -> dict[str, object]:
        """JSON-ready summary (without the state) for status and logs."""
        return {
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


def decide(
    signals: FleetSignals, state: PolicyState, spec: AutoscalingSpec, now: float
) -> Decision:
    """Decide the replica count for one interval. Pure: reads its arguments, mutates
    nothing, and returns the next state inside the :class:`Decision`.

    Args:
        signals: one :class:`PodSignals` per ready pod (``None`` = missing) and the count of
            pending pods.
        state: what the previous call returned in ``Decision.state`` (or ``PolicyState()``).
        spec: targets, bounds and windows.
        now: the caller's clock, seconds (monotonic or wall, but the same one every call).
    """
    current = signals.current_replicas
    ready = signals.ready_replicas
    load = aggregate(signals)
    rec_window = max(spec.scale_down_stabilization_seconds, spec.scale_up_stabilization_seconds)
    state = state.pruned(now, spec.forecast_window_seconds, rec_window)

    if load.usage_reported == 0:
        state = _record(state, now, None, None)
        why = "no ready pod" if ready == 0 else f"none of {ready} ready pods reported KV usage"
        return _finish(
            spec,
            now,
            current,
            current,
            "missing_metrics",
            None,
            None,
            f"metrics missing ({why}): holding {current}",
            (),
            load,
            state,
            False,
        )

    latest_demand = None
    if load.complete:
        latest_demand = load.demand_tokens / load.capacity_per_replica
        state = replace(state, demand=(*state.demand, (now, latest_demand)))
    settled = settled_demand(state.demand, state, spec)
    trend = fit_trend(settled, now)
    rising = still_rising(settled, now, spec.forecast_window_seconds)
    drain = rules.queue_drain(load, ready, current, spec)
    # A starvation episode lasts while some pod starves; it remembers the ready count it
    # began at (that count + 1 is the alarm's whole answer).
    if rules.is_starving(load, spec):
        if state.starvation_base_replicas is None:
            state = replace(state, starvation_base_replicas=ready)
    elif state.starvation_base_replicas is not None:
        state = replace(state, starvation_base_replicas=None)
    candidates = (
        rules.headroom(load, current, spec),
        drain,
        rules.forecast(trend, latest_demand, current, spec, drain.replicas is not None, rising),
        rules.starvation(load, ready, current, spec, state.starvation_base_replicas),
    )
    by_rule = {c.rule: c for c in candidates}
    reactive = _highest(by_rule["headroom"], by_rule["queue_drain"])
    urgent = _highest(by_rule["forecast"], by_rule["starvation"])
    highest = _highest(*candidates)
    assert highest is not None  # headroom always answers once usage was reported
    # The scale-down window remembers what the sizing rules asked for (headroom, forecast).
    # A queue or a full pod is pressure to answer now, not load to keep capacity for once
    # gone: while either lasts, its candidate holds the count and the consolidation check
    # refuses to step down.
    held = _highest(by_rule["headroom"], by_rule["forecast"])
    state = _record(
        state,
        now,
        held.replicas if load.complete and held else None,
        reactive.replicas if reactive else None,
    )

    # Scale up: the forecast and the alarm act now; reactive rules may be stabilized.
    up_reactive = stabilized_up(state, now, spec, reactive)
    up = _highest(up_reactive, urgent)
    if up is not None and up.replicas is not None and up.replicas > current:
        return _finish(
            spec,
            now,
            current,
            up.replicas,
            up.rule,
            up.signal,
            up.value,
            up.detail,
            candidates,
            load,
            state,
            True,
        )

    assert highest.replicas is not None
    if highest.replicas >= current:
        return _finish(
            spec,
            now,
            current,
            current,
            "hold",
            highest.signal,
            highest.value,
            f"at target: {highest.detail}",
            candidates,
            load,
            state,
            True,
        )
    if current <= spec.min_replicas:
        return _finish(
            spec,
            now,
            current,
            highest.replicas,
            "hold",
            highest.signal,
            highest.value,
            f"at the lower bound: {highest.detail}",
            candidates,
            load,
            state,
            True,
        )
    if not load.complete:
        return _finish(
            spec,
            now,
            current,
            current,
            "hold",
            None,
            None,
            f"never scale down on missing data: no signal from {', '.join(load.missing_pods[:5])}",
            candidates,
            load,
            state,
            True,
        )
    held_for = below_target_for(state, now, spec, current)
    if held_for < spec.scale_down_stabilization_seconds:
        return _finish(
            spec,
            now,
            current,
            current,
            "hold",
            highest.signal,
            highest.value,
            f"below target for {held_for:.0f} s of the"
            f" {spec.scale_down_stabilization_seconds:.0f} s scale-down window"
            f" ({highest.rule} asks {highest.replicas})",
            candidates,
            load,
            state,
            True,
        )
    settle = spec.forecast_window_seconds
    used = load.used_tokens / load.capacity_per_replica
    near_target = used / (current - 1) > spec.target_cache_usage / 2 if current > 1 else True
    recent = state.last_scale_down_time is not None and now - state.last_scale_down_time < settle
    if recent and near_target:
        return _finish(
            spec,
            now,
            current,
            current,
            "hold",
            highest.signal,
            highest.value,
            f"settling: the last step down was {now - state.last_scale_down_time:.0f} s ago;"
            f" the next waits {settle:.0f} s so it is judged on the load after it",
            candidates,
            load,
            state,
            True,
        )
    blocker = consolidation_blocker(load, trend, latest_demand, current - 1, spec)
    if blocker:
        return _finish(
            spec,
            now,
            current,
            current,
            "hold",
            highest.signal,
            highest.value,
            f"consolidation check: {blocker}",
            candidates,
            load,
            state,
            True,
        )
    return _finish(
        spec,
        now,
        current,
        current - 1,
        "scale_down",
        "kv_usage",
        used / (current - 1),
        f"below target for a full {spec.scale_down_stabilization_seconds:.0f} s window;"
        f" {current - 1} replicas absorb the load at"
        f" {used / (current - 1):.1%} KV usage",
        candidates,
        load,
        state,
        True,
    )


def _highest(*candidates: Candidate | None) -> Candidate | None:
    answered = [c for c in candidates if c is not None and c.replicas is not None]
    return max(answered, key=lambda c: c.replicas or 0) if answered else None


def _record(
    state: PolicyState, now: float, replicas: int | None, reactive: int | None
) -> PolicyState:
    rec = Recommendation(now, replicas, reactive)
    return replace(state, recommendations=(*state.recommendations, rec))


def _finish(
    spec: AutoscalingSpec,
    now: float,
    current: int,
    asked: int,
    rule: str,
    signal: str | None,
    value: float | None,
    reason: str,
    candidates: tuple[Candidate, ...],
    load: FleetLoad,
    state: PolicyState,
    available: bool,
) -> Decision:
    desired = min(max(asked, spec.min_replicas), spec.max_replicas)
    limited = "max" if asked > spec.max_replicas else "min" if asked < spec.min_replicas else None
    if desired != asked:
        bound = spec.max_replicas if limited == "max" else spec.min_replicas
        reason = f"{reason} (limited to {limited}Replicas={bound})"
        moved_by_bounds = (desired > current) != (asked > current) or asked == current
        if desired != current and moved_by_bounds:  # the count moves only for the bounds
            rule = "bounds"
    direction = "up" if desired > current else "down" if desired < current else "hold"
    if direction != "hold":
        state = replace(state, last_scale_time=now)
        if direction == "down":
            state = replace(state, last_scale_down_time=now)
    return Decision(
        desired,
        current,
        direction,
        rule,
        signal,
        value,
        reason,
        candidates,
        asked,
        limited,
        available,
        load.missing_pods,
        state,
    )
