"""The scaling decision: one pure function, :func:`decide`, a pipeline of named stages.

::

    signals, state, spec, now
      -> observe        load over the ready pods; history pruned to the windows
      -> (no KV usage)  hold current: MetricsAvailable=False           [missing_metrics]
      -> assess         demand sample, trend, starvation episode, the five rule candidates,
                        this interval's recommendation recorded
      -> propose_up     the forecast and the alarm now, reactive rules stabilized
      -> propose_hold_or_down   the first hold check that applies, else one step down
      -> bound          clamp to [min, max]; direction, limited, last-scale times -> Decision

Decision table (first row that applies wins; ``current`` = ready + pending)::

  no ready pod reported KV usage   -> hold current (clamped to [min, max]); MetricsAvailable=False
  up = max(forecast, starvation,   -> if up > current: scale UP to up now (no window waits
       reactive over up-window)       for the forecast or the alarm)
  highest candidate >= current     -> hold ("at target")
  current at minReplicas           -> hold ("at the lower bound")
  any ready pod missing a signal   -> hold (never down on missing data)
  window not a full, continuous    -> hold (scale-down stabilization)
    run of recommendations < current
  settling after the last step     -> hold (the next step waits for the load to move)
  consolidation check fails        -> hold (current - 1 would not absorb the load under target:
                                      KV usage, batch saturation, queue, forecast, alarm,
                                      and with an SLO the predicted ITL/TTFT)
  otherwise                        -> scale DOWN by one
  finally                          -> clamp to [min, max]; report which bound limited it

``reactive`` is the highest of headroom, saturation, queue drain and latency; with
``scaleUpStabilizationSeconds`` > 0 it is the lowest such value over that window (HPA's
scale-up stabilization). Missing pods count as zero load, as HPA counts pods without
metrics on a scale-up, so partial data can justify a scale-up but never a scale-down.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from kvpilot.autoscaler import rules, zero
from kvpilot.autoscaler.decision import Decision, Proposal, bound
from kvpilot.autoscaler.forecast import Trend, fit_trend, still_rising
from kvpilot.autoscaler.latency import (
    MIN_SAMPLE_OBSERVATIONS,
    PRIORS,
    LatencyModel,
    LatencyView,
    itl_samples,
    observed_itl,
    pooled,
    prefill_capacity,
    prefill_per_step,
    prefix_rates,
    prefix_unreported,
    ttft_view,
)
from kvpilot.autoscaler.rules import NO_HISTOGRAMS, Candidate
from kvpilot.autoscaler.signals import FleetLoad, FleetSignals, aggregate
from kvpilot.autoscaler.spec import AutoscalingSpec
from kvpilot.autoscaler.state import PolicyState, Recommendation
from kvpilot.autoscaler.windows import (
    below_target_for,
    consolidation_blocker,
    settled_demand,
    stabilized_up,
)

__all__ = ["Decision", "decide"]


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
    load, state = observe(signals, state, spec, now)
    if spec.scale_to_zero and signals.current_replicas == 0:
        return zero.at_zero(signals, load, state, spec, now)
    if load.usage_reported == 0:
        decision = missing_metrics(signals, load, state, spec, now)
    else:
        interval = assess(signals, load, state, spec, now)
        proposal = propose_up(interval, spec) or propose_hold_or_down(interval, spec)
        decision = bound(proposal, interval.current, interval.candidates, load, interval.state,
                         spec, now)
        decision = with_latency(decision, interval.latency, spec)
    if spec.scale_to_zero:
        return zero.after_decision(decision, signals, load, spec, now)
    return decision


@dataclass(frozen=True)
class Interval:
    """What the stages after :func:`assess` read: one interval, fully observed.

    Attributes:
        now: the caller's clock.
        current / ready: ready + pending, and ready replicas.
        load: the fleet's load (:func:`~kvpilot.autoscaler.signals.aggregate`).
        trend: KV demand's least-squares trend over the settled window, or None.
        latest_demand: this interval's demand (replica-equivalents), None if incomplete.
        candidates: headroom, saturation, queue drain, forecast, starvation, latency (this
            order).
        state: the history with this interval's demand and recommendation recorded.
        latency: what the latency rule and check read (None without an SLO).
    """

    now: float
    current: int
    ready: int
    load: FleetLoad
    trend: Trend | None
    latest_demand: float | None
    candidates: tuple[Candidate, ...]
    state: PolicyState
    latency: LatencyView | None = None

    def rule(self, name: str) -> Candidate:
        return next(c for c in self.candidates if c.rule == name)

    @property
    def highest(self) -> Candidate:
        """The candidate asking for the most replicas (headroom always answers here)."""
        found = _highest(*self.candidates)
        if found is None or found.replicas is None:
            raise AssertionError("headroom answers whenever KV usage was reported")
        return found

    @property
    def reactive(self) -> Candidate | None:
        return _highest(self.rule("headroom"), self.rule("saturation"), self.rule("queue_drain"),
                        self.rule("latency"))


def observe(
    signals: FleetSignals, state: PolicyState, spec: AutoscalingSpec, now: float
) -> tuple[FleetLoad, PolicyState]:
    """The fleet's load, and the history pruned to what the windows can still use."""
    rec_window = max(spec.scale_down_stabilization_seconds, spec.scale_up_stabilization_seconds)
    return aggregate(signals), state.pruned(now, spec.forecast_window_seconds, rec_window)


def missing_metrics(
    signals: FleetSignals, load: FleetLoad, state: PolicyState, spec: AutoscalingSpec, now: float
) -> Decision:
    """No ready pod reported KV usage: hold, and record an incomplete interval (it breaks
    the scale-down window)."""
    current, ready = signals.current_replicas, signals.ready_replicas
    state = _record(state, now, None, None)
    why = "no ready pod" if ready == 0 else f"none of {ready} ready pods reported KV usage"
    hold = Proposal(current, "missing_metrics", None, None,
                    f"metrics missing ({why}): holding {current}")
    return bound(hold, current, (), load, state, spec, now, metrics_available=False)


def assess(
    signals: FleetSignals, load: FleetLoad, state: PolicyState, spec: AutoscalingSpec, now: float
) -> Interval:
    """Record the demand sample, fit the trend, track the starvation episode, ask the five
    rules, and record what they recommended (the windows read it next time)."""
    current, ready = signals.current_replicas, signals.ready_replicas
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
    forecast = rules.forecast(trend, latest_demand, current, spec, drain.replicas is not None,
                              rising)
    view, state = observe_latency(signals, load, state, spec, forecast, trend, latest_demand)
    candidates = (
        rules.headroom(load, current, spec),
        rules.saturation(load, current, spec),
        drain,
        forecast,
        rules.starvation(load, ready, current, spec, state.starvation_base_replicas),
        rules.latency(view, current, spec),
    )
    interval = Interval(now, current, ready, load, trend, latest_demand, candidates, state, view)
    # The scale-down window remembers what the sizing rules asked for (headroom, saturation,
    # forecast, latency): busy batches keep their replicas as a full KV cache does, and so
    # does a latency the smaller fleet would miss.
    # A queue or a full pod is pressure to answer now, not load to keep capacity for once
    # gone: while either lasts, its candidate holds the count and the consolidation check
    # refuses to step down.
    held = _highest(interval.rule("headroom"), interval.rule("saturation"), interval.rule("forecast"),
                    interval.rule("latency"))
    reactive = interval.reactive
    state = _record(
        state,
        now,
        held.replicas if load.complete and held else None,
        reactive.replicas if reactive else None,
    )
    return replace(interval, state=state)


def observe_latency(
    signals: FleetSignals,
    load: FleetLoad,
    state: PolicyState,
    spec: AutoscalingSpec,
    forecast: Candidate,
    trend: Trend | None,
    latest_demand: float | None,
) -> tuple[LatencyView | None, PolicyState]:
    """Feed this read's ITL samples to the model and gather what the latency rule reads.

    No SLO: no view, and a model left from an earlier SLO is dropped. A new percentile
    starts the model over (its samples were read at the old one). No pod with a latency
    histogram: the model is not touched (nothing to learn, nothing to forget) and the view
    says so. The load the ITL is sized for is running plus waiting requests (the
    router's held ones included), times the KV forecast's growth at the horizon while
    the forecast rule triggers (its noise guards apply).
    """
    slo = spec.slo
    if slo is None:
        return None, (replace(state, latency=None) if state.latency is not None else state)
    model = state.latency
    if model is None or model.percentile != slo.percentile:
        model = LatencyModel(slo.percentile)
    pods = signals.pods
    histograms = any(p.itl is not None or p.ttft is not None for p in pods)
    if histograms:
        samples, observations = itl_samples(pods, slo.percentile)
        model = model.update(samples, observations)
    state = replace(state, latency=model)
    growth = 1.0
    if forecast.replicas is not None and trend is not None and latest_demand:
        growth = max(1.0, trend.at(spec.forecast_horizon_seconds) / latest_demand)
    itl_now, itl_count = observed_itl(pods, slo.percentile)
    itl_window = pooled([p.itl for p in pods if p.itl is not None])
    itl_mean = (itl_window.mean if itl_window is not None
                and itl_window.count >= MIN_SAMPLE_OBSERVATIONS else None)
    requests = (load.num_running + load.num_waiting) * growth
    prior = PRIORS[slo.profile]
    fit = model.fit(prior) if slo.itl_seconds is not None else None
    # One replica's prefill capacity on the plane: the fit's level and per-token cost
    # once the data has measured one (d > 0), the prior's before (and without an ITL
    # target, which fits nothing).
    a, d = (fit.a, fit.d) if fit is not None and fit.d > 0 else (prior.a, prior.d)
    prefill_rate = prefill_capacity(a, d, signals.max_num_batched_tokens)
    rates = prefix_rates(pods)
    if fit is not None and fit.d > 0 and requests > 0:
        # The prefill term folded into the per-request slope: for a fixed fleet load both
        # the batch and the prefill tokens per step fall as 1 / n with n replicas, so
        # a + c R/n + d P/n = a + (c + d P/R) R/n (P: the fleet's prefill tokens per
        # step, grown with the load like R). Only where prefill dominates the slope
        # (d P/R > c): with a minor prefill share the split between c and d is mostly
        # noise, and the two-parameter line sized those fleets better in the
        # simulator's ramp (benchmarks/README-autoscaler.md), so it is kept there.
        prefill = prefill_per_step(pods) * growth
        if fit.d * prefill / requests > fit.c:
            fit = replace(fit, c=fit.c + fit.d * prefill / requests)
        else:
            fit = model.fit(prior, prefill=False)
    view = LatencyView(
        percentile_label=slo.quantile_label,
        histograms=histograms,
        fit=fit,
        observed_itl=itl_now,
        ttft=(ttft_view(pods, load, slo.percentile, prefill_rate)
              if slo.ttft_seconds is not None else None),
        requests=requests,
        growth=growth,
        max_num_seqs=signals.max_num_seqs,
        itl_observations=itl_count,
        ready=signals.ready_replicas,
        itl_mean=itl_mean,
        prefill_rate=prefill_rate,
        prefill_computed=None if rates is None else rates[0],
        prefix_handover=None if rates is None else rates[1],
        prefix_unreported=prefix_unreported(pods),
    )
    return view, state


def with_latency(decision: Decision, view: LatencyView | None, spec: AutoscalingSpec
                 ) -> Decision:
    """The decision with the latency view attached (``Decision.latency``) and, for a fleet
    with an SLO whose engines export no latency histogram, the reason saying it is sized
    on saturation (:data:`~kvpilot.autoscaler.rules.NO_HISTOGRAMS`)."""
    if spec.slo is None or view is None:
        return decision
    reason = decision.reason
    if not view.histograms:
        reason = f"{reason} ({NO_HISTOGRAMS})"
    return replace(decision, reason=reason, latency=view.to_dict())


def propose_up(interval: Interval, spec: AutoscalingSpec) -> Proposal | None:
    """Scale up when any urgent rule (forecast, starvation) or a reactive one, stabilized
    over the scale-up window, asks for more than ``current``; None otherwise."""
    up_reactive = stabilized_up(interval.state, interval.now, spec, interval.reactive)
    urgent = _highest(interval.rule("forecast"), interval.rule("starvation"))
    up = _highest(up_reactive, urgent)
    if up is None or up.replicas is None or up.replicas <= interval.current:
        return None
    return Proposal(up.replicas, up.rule, up.signal, up.value, up.detail)


def propose_hold_or_down(interval: Interval, spec: AutoscalingSpec) -> Proposal:
    """The first hold check that applies (:data:`HOLD_CHECKS`, in order), else one step
    down."""
    for check in HOLD_CHECKS:
        hold = check(interval, spec)
        if hold is not None:
            return hold
    return step_down(interval, spec)


def _hold(interval: Interval, reason: str, *, asked: int | None = None,
          quiet: bool = False) -> Proposal:
    """Keep ``current`` (or propose ``asked``), citing the highest candidate's signal."""
    top = interval.highest
    return Proposal(
        interval.current if asked is None else asked,
        "hold",
        None if quiet else top.signal,
        None if quiet else top.value,
        reason,
    )


def at_target(interval: Interval, spec: AutoscalingSpec) -> Proposal | None:
    top = interval.highest
    if top.replicas is not None and top.replicas >= interval.current:
        return _hold(interval, f"at target: {top.detail}")
    return None


def at_lower_bound(interval: Interval, spec: AutoscalingSpec) -> Proposal | None:
    top = interval.highest
    if interval.current <= spec.floor:
        return _hold(interval, f"at the lower bound: {top.detail}", asked=top.replicas)
    return None


def data_missing(interval: Interval, spec: AutoscalingSpec) -> Proposal | None:
    missing = interval.load.missing_pods
    if missing:
        return _hold(interval, "never scale down on missing data: no signal from"
                     f" {', '.join(missing[:5])}", quiet=True)
    return None


def window_not_full(interval: Interval, spec: AutoscalingSpec) -> Proposal | None:
    held_for = below_target_for(interval.state, interval.now, spec, interval.current)
    window = spec.scale_down_stabilization_seconds
    if held_for < window:
        top = interval.highest
        return _hold(interval, f"below target for {held_for:.0f} s of the {window:.0f} s"
                     f" scale-down window ({top.rule} asks {top.replicas})")
    return None


def settling(interval: Interval, spec: AutoscalingSpec) -> Proposal | None:
    """Right after a step down, wait one forecast window before the next while the load
    per remaining pod is still near the target (so the next step sees the moved load)."""
    current, now, last = interval.current, interval.now, interval.state.last_scale_down_time
    settle = spec.forecast_window_seconds
    near_target = _used(interval) / (current - 1) > spec.target_cache_usage / 2 if current > 1 else True
    if last is not None and now - last < settle and near_target:
        return _hold(interval, f"settling: the last step down was {now - last:.0f} s ago;"
                     f" the next waits {settle:.0f} s so it is judged on the load after it")
    return None


def consolidation_blocked(interval: Interval, spec: AutoscalingSpec) -> Proposal | None:
    blocker = consolidation_blocker(interval.load, interval.trend, interval.latest_demand,
                                    interval.current - 1, spec, interval.latency)
    return _hold(interval, f"consolidation check: {blocker}") if blocker else None


HOLD_CHECKS: tuple[Callable[[Interval, AutoscalingSpec], Proposal | None], ...] = (
    at_target, at_lower_bound, data_missing, window_not_full, settling, consolidation_blocked,
)


def step_down(interval: Interval, spec: AutoscalingSpec) -> Proposal:
    """One replica fewer: every hold check passed."""
    fewer = interval.current - 1
    usage = _used(interval) / fewer
    sat = interval.load.saturation(fewer)
    batches = "" if sat is None else f" and {sat:.1%} of their batch slots"
    return Proposal(
        fewer,
        "scale_down",
        "kv_usage",
        usage,
        f"below target for a full {spec.scale_down_stabilization_seconds:.0f} s window;"
        f" {fewer} replicas absorb the load at {usage:.1%} KV usage{batches}",
    )


def _used(interval: Interval) -> float:
    """Tokens held, in replica-equivalents."""
    return interval.load.used_tokens / interval.load.capacity_per_replica


def _highest(*candidates: Candidate | None) -> Candidate | None:
    answered = [c for c in candidates if c is not None and c.replicas is not None]
    return max(answered, key=lambda c: c.replicas or 0) if answered else None


def _record(
    state: PolicyState, now: float, replicas: int | None, reactive: int | None
) -> PolicyState:
    rec = Recommendation(now, replicas, reactive)
    return replace(state, recommendations=(*state.recommendations, rec))
