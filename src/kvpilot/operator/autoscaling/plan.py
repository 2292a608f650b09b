"""One autoscaler interval for one InferenceDeployment, planned as a pure function.

::

    FleetObservation  (Deployment count, ready pods, pending)
    MetricsReading    (PodSignals per ready pod, FinOps inputs, requests held at the router,
                       with scale to zero: finished requests, attempts that found no engine)
    PolicyState       (from the last decision, or from status)
    InferenceSpec, previous conditions, now
        --plan_autoscale-->  AutoscalePlan
                               decision         kvpilot.autoscaler.decide(): the scaling
                                                decision itself
                               requested        the count for the Deployment, or None
                               requested_reason rule, signal, value (Event, lastScaleReason)
                               status           signals, capacity, cost, autoscaler.*
                               conditions       MetricsAvailable, ScalingActive, ScalingLimited
                               events           MetricsUnavailable / MetricsRestored

Nothing here reads a clock, the API or the network; the loop in
:mod:`kvpilot.operator.autoscaling.loop` does that and applies the plan. The count goes to
the Deployment only when the policy moved it (``requested``); a hold never writes it, so a
surge pod during a rollout is not mistaken for a replica to keep.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvpilot.autoscaler import Decision, FleetSignals, PolicyState, decide
from kvpilot.autoscaler.latency import (
    MIN_SAMPLE_OBSERVATIONS,
    MIN_TTFT_OBSERVATIONS,
    pooled,
    prefix_rates,
)
from kvpilot.operator.autoscaling.fleet import FleetObservation
from kvpilot.operator.autoscaling.metrics_source import MetricsReading
from kvpilot.operator.reconcile import Event
from kvpilot.operator.spec import InferenceSpec
from kvpilot.operator.status.autoscaler import (
    CapacityEstimate,
    CostEstimate,
    ObservedSignals,
    autoscaler_status,
    metrics_condition,
    scaling_active_condition,
    scaling_limited_condition,
    transition_events,
)
from kvpilot.operator.status.conditions import Condition
from kvpilot.sizing import capacity as finops


@dataclass(frozen=True)
class AutoscalePlan:
    """What one interval's decision changes (the loop applies it).

    Attributes:
        decision: the policy's answer (its ``state`` is the next PolicyState).
        requested: the replica count to apply to the Deployment, or None to leave it.
        requested_reason: rule, signal and value behind ``requested`` (Event, lastScaleReason).
        status: status merge-patch fragments (no conditions).
        conditions: MetricsAvailable, ScalingActive, ScalingLimited.
        events: MetricsUnavailable / MetricsRestored on a transition.
    """

    decision: Decision
    requested: int | None
    requested_reason: str
    status: dict[str, Any]
    conditions: tuple[Condition, ...]
    events: tuple[Event, ...]


def scale_reason(decision: Decision) -> str:
    """``rule forecast, kv_demand=3.21: <the policy's sentence>``."""
    what = f"rule {decision.rule}"
    if decision.signal is not None:
        value = "n/a" if decision.value is None else f"{decision.value:.4g}"
        what += f", {decision.signal}={value}"
    return f"{what}: {decision.reason}"


def observed_signals(reading: MetricsReading) -> ObservedSignals:
    """Fleet-wide figures over the pods that reported each value (None if none did). The
    p90 latencies come from the pooled histogram windows once they hold 20 ITL or 10 TTFT
    observations (the latency model's own minimums)."""
    def values(field: str) -> list[float]:
        return [v for v in (getattr(p, field) for p in reading.pods) if v is not None]

    def total(field: str) -> float | None:
        found = values(field)
        return sum(found) if found else None

    usage = values("kv_usage")
    itl = pooled([p.itl for p in reading.pods if p.itl is not None])
    ttft = pooled([p.ttft for p in reading.pods if p.ttft is not None])
    looked_up = sum(p.prompt_token_rate for p in reading.pods
                    if p.prompt_token_rate is not None and p.cached_token_rate is not None)
    rates = prefix_rates(reading.pods)
    return ObservedSignals(
        source=reading.source,
        ready_pods=len(reading.pods),
        cache_usage=sum(usage) / len(usage) if usage else None,
        max_cache_usage=max(usage) if usage else None,
        requests_running=total("num_running"),
        requests_waiting=total("num_waiting"),
        waiting_tokens=total("waiting_tokens"),
        preemption_rate=total("preemption_rate"),
        itl_p90=(itl.quantile(0.9) if itl is not None and itl.count >= MIN_SAMPLE_OBSERVATIONS
                 else None),
        ttft_p90=(ttft.quantile(0.9) if ttft is not None and ttft.count >= MIN_TTFT_OBSERVATIONS
                  else None),
        prefix_cache_hit_rate=(1.0 - rates[0] / looked_up
                               if rates is not None and looked_up > 0 else None),
        prefill_tokens_per_second=None if rates is None else rates[0],
    )


def _usable(value: float | None) -> float | None:
    """``value`` when it is a finite, non-negative number, else None."""
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def finops_estimates(reading: MetricsReading, replicas: int, cost_per_replica_hour: float | None,
                     block_size: int) -> tuple[CapacityEstimate, CostEstimate]:
    """Capacity per replica, concurrent requests at the mean context, cost per hour for
    ``replicas`` and per million generated tokens (kvpilot.sizing.capacity formulas).
    With the engines' KV window (every layer slides) a request counts at most
    ``(cdiv(W, block_size) + 1) x block_size`` tokens, as the engine holds no more."""
    # Estimates only: an input a source could not vouch for is left out, never raised on
    # (an exception here would stop the scaling decision that follows).
    # Tensor parallelism needs nothing here: kvpilot:kv_cache_capacity_tokens is the whole
    # engine's KV pool in tokens (each GPU of a tensor-parallel engine holds its share of
    # the heads for every one of those tokens), so one replica's capacity is read, never
    # derived from per-GPU memory.
    kv = _usable(reading.kv_capacity_tokens)
    context = _usable(reading.mean_context_tokens)
    rate = _usable(reading.generated_tokens_per_second)
    window = reading.kv_window_tokens
    if not (isinstance(window, int) and not isinstance(window, bool) and window > 0):
        window = None
    concurrent = None
    if kv is not None and context:
        concurrent = finops.max_concurrent_requests(int(kv), context, block_size, sliding_window=window)
    hourly = per_million = None
    if cost_per_replica_hour is not None:
        hourly = finops.cost_per_hour(cost_per_replica_hour, replicas)
        if rate is not None:
            per_million = finops.cost_per_million_tokens(hourly, rate)
    return (CapacityEstimate(kv, context, concurrent), CostEstimate(hourly, per_million))


def plan_autoscale(observation: FleetObservation, reading: MetricsReading, state: PolicyState,
                   spec: InferenceSpec, previous_conditions: Iterable[Mapping[str, Any]] | None,
                   now: datetime) -> AutoscalePlan:
    """Run the policy for one interval and describe what it changes (pure).

    Args:
        observation: the Deployment's count and its ready and pending pods; must have a
            Deployment (``deployment_replicas`` not None).
        reading: the metric source's answer for ``observation.ready``, same order.
        state: the policy state the previous decision returned.
        spec: the validated spec, with ``autoscaling`` set.
        previous_conditions: ``status.conditions`` as stored (for transition Events).
        now: timezone-aware; the policy's clock is ``now.timestamp()``.

    Raises:
        ValueError: no Deployment in ``observation``, or ``spec.autoscaling`` unset.
    """
    if observation.deployment_replicas is None:
        raise ValueError("no engine Deployment yet: nothing to scale")
    auto = spec.autoscaling
    if auto is None:
        raise ValueError("spec.autoscaling is not set: nothing to autoscale")
    # Requests held at the router join the waiting count; unknown (no router) counts as 0.
    held = reading.router_queued if reading.router_queued is not None else 0.0
    # The engines run at most spec.engine.maxNumSeqs requests each and schedule at most
    # spec.engine.maxNumBatchedTokens per step: the operator sets both flags on every pod
    # (managed flags), so the spec is the truth for saturation and the TTFT model's budget.
    decision = decide(FleetSignals(reading.pods, observation.pending_replicas, held,
                                   reading.requests_without_engine, reading.requests_finished,
                                   max_num_seqs=spec.engine.max_num_seqs,
                                   max_num_batched_tokens=spec.engine.max_num_batched_tokens),
                      state, auto, now.timestamp())
    requested = None
    if (decision.direction != "hold"
            and decision.desired_replicas != observation.deployment_replicas):
        requested = decision.desired_replicas
    capacity, cost = finops_estimates(reading, decision.desired_replicas,
                                      spec.cost_per_replica_hour, spec.engine.block_size)
    status: dict[str, Any] = {}
    status.update(observed_signals(reading).to_status(now))
    status.update(capacity.to_status())
    status.update(cost.to_status())
    status.update(autoscaler_status(decision.to_dict(), decision.state.to_dict(), now))
    metrics = metrics_condition(reading, decision, observation.pending_replicas,
                                auto.scale_to_zero)
    conditions = (
        metrics,
        scaling_active_condition(decision),
        scaling_limited_condition(decision, auto.min_replicas, auto.max_replicas),
    )
    return AutoscalePlan(decision, requested, scale_reason(decision), status, conditions,
                         transition_events(previous_conditions, metrics))
