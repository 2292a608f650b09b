"""The windows and checks around a scale decision (pure helpers of :func:`decide`):
HPA-style scale-up stabilization, the continuous below-target run a scale-down needs, the
forecast's settling after a step down, and the consolidation check."""

from __future__ import annotations

from kvpilot.autoscaler.forecast import Trend
from kvpilot.autoscaler.latency import (
    MIN_INFORMED_READS,
    MIN_WINDOW_OBSERVATIONS,
    LatencyView,
)
from kvpilot.autoscaler.rules import Candidate
from kvpilot.autoscaler.signals import FleetLoad
from kvpilot.autoscaler.spec import AutoscalingSpec
from kvpilot.autoscaler.state import PolicyState

# A gap between observations longer than this many intervals breaks a window's continuity.
MAX_GAP_INTERVALS = 3.0


def settled_demand(
    demand: tuple[tuple[float, float], ...], state: PolicyState, spec: AutoscalingSpec
) -> tuple[tuple[float, float], ...]:
    """Demand samples the forecast may fit. After a scale-down the load moves onto fewer
    pods and their usage rises for a while by construction (and by more than N/(N-1):
    bigger batches decode slower, so requests hold their KV longer); that self-inflicted
    rise is no trend. Samples from the first ``forecast_window_seconds`` after the step
    are dropped."""
    if state.last_scale_down_time is None:
        return demand
    start = state.last_scale_down_time + spec.forecast_window_seconds
    return tuple(p for p in demand if p[0] >= start)


def stabilized_up(
    state: PolicyState, now: float, spec: AutoscalingSpec, reactive: Candidate | None
) -> Candidate | None:
    """HPA scale-up stabilization: the lowest reactive recommendation over the window."""
    if reactive is None or spec.scale_up_stabilization_seconds <= 0:
        return reactive
    start = now - spec.scale_up_stabilization_seconds
    past = [r.reactive for r in state.recommendations if r.time >= start and r.reactive is not None]
    lowest = min(past, default=reactive.replicas)
    if lowest is None or lowest >= (reactive.replicas or 0):
        return reactive
    return Candidate(
        reactive.rule,
        lowest,
        reactive.signal,
        reactive.value,
        f"{reactive.detail} (stabilized to {lowest}, the lowest in"
        f" {spec.scale_up_stabilization_seconds:.0f} s)",
    )


def below_target_for(state: PolicyState, now: float, spec: AutoscalingSpec, current: int) -> float:
    """Seconds the recommendations have been continuously complete and below ``current``."""
    max_gap = MAX_GAP_INTERVALS * spec.interval_seconds
    since = now
    later = now
    for rec in reversed(state.recommendations):
        if rec.replicas is None or rec.replicas >= current or later - rec.time > max_gap:
            break
        since = later = rec.time
    return now - since


def consolidation_blocker(
    load: FleetLoad,
    trend: Trend | None,
    latest_demand: float | None,
    fewer: int,
    spec: AutoscalingSpec,
    latency: LatencyView | None = None,
) -> str | None:
    """Why ``fewer`` replicas could not absorb the load under target, or ``None``.

    Source: llm-d WVA simulates the worst case before removing a replica; ours checks the
    KV usage, the batch saturation, the queue, the forecast at the horizon and the alarm
    against ``fewer``, and with ``spec.autoscaling.slo`` the predicted latency
    (:func:`latency_blocker`).
    """
    if fewer < 1:
        return "cannot go below one replica"
    usage = load.used_tokens / load.capacity_per_replica / fewer
    ceiling = spec.target_cache_usage * (1.0 - spec.tolerance)
    if usage > ceiling:
        return (
            f"{fewer} replicas would run at {usage:.1%} KV usage > {ceiling:.1%}"
            f" (target less the tolerance band)"
        )
    sat = load.saturation(fewer)
    sat_ceiling = spec.target_saturation * (1.0 - spec.tolerance)
    if sat is not None and sat > sat_ceiling:
        return (
            f"{fewer} replicas would run {load.num_running:.0f} requests at {sat:.1%} of their"
            f" {load.max_num_seqs} batch slots > {sat_ceiling:.1%} (target less the tolerance"
            " band)"
        )
    queue = load.num_waiting / fewer
    if queue > spec.target_queue_depth:
        return f"{fewer} replicas would queue {queue:.1f} each > {spec.target_queue_depth:g}"
    if load.preempting_pods or load.max_usage >= spec.starvation_usage:
        return "a pod is preempting or near a full KV cache"
    if trend is not None and latest_demand is not None and trend.slope > 0:
        ahead = trend.at(spec.forecast_horizon_seconds)
        if ahead > spec.target_cache_usage * fewer:
            return (
                f"the {spec.forecast_horizon_seconds:.0f} s forecast ({ahead:.2f} replica-eq)"
                f" would exceed {spec.target_cache_usage:.0%} of {fewer} replicas"
            )
    return latency_blocker(latency, fewer, spec)


# The share of the remaining replicas' prefill capacity that the fleet's computed prefill
# plus the handover of one pod's cached prefixes may take (latency_blocker). Half: the
# handover is a burst (each moved session prefills its context again on its next turn),
# and the steps that carry it also carry the decodes.
HANDOVER_PREFILL_CEILING = 0.5


def latency_blocker(view: LatencyView | None, fewer: int, spec: AutoscalingSpec) -> str | None:
    """Why ``fewer`` replicas would miss ``spec.autoscaling.slo``, or ``None``.

    Each target must hold with the tolerance band to spare (``target x (1 - tolerance)``),
    as the KV and saturation checks do:

    * ITL, trusted fit: the prediction at ``fewer`` replicas with the load's own response
      (:func:`closed_loop_itl`): fewer replicas slow every decode, so requests stay longer
      and the batch grows by more than ``current / fewer``.
    * ITL, fit not trusted yet: the prior never lets the fleet go. An ITL observed now
      over the band holds (fewer replicas are not faster). While the window holds
      enough observations to learn from (``MIN_WINDOW_OBSERVATIONS``), the step down
      waits until the fit is trusted (a few reads). With less traffic than that there is
      no latency to measure and none the other checks do not cover: no hold.
    * TTFT: the prediction at ``fewer`` (its queue wait grows as 1/``fewer``).
    * Prefix-cache handover (ours): a replica that goes takes its prefix cache with it,
      and behind a prefix-aware router the sessions it held prefill their whole context
      again on the replicas that remain, on their next turn. With the engines'
      prefix-cache counters, the fleet's computed prefill plus the largest one pod's
      cache saves (the pod that goes is the ReplicaSet's choice) must fit in
      :data:`HANDOVER_PREFILL_CEILING` of ``fewer`` replicas' prefill capacity
      (:func:`kvpilot.autoscaler.latency.prefill_capacity`). While some pods report
      the counters and others do not (a pod's first read, an image mid-rollout), the
      step waits: the silent pod may hold the largest cache. KV usage cannot see it: the
      cache is evictable, so a fleet of warm caches reads as nearly empty. In the
      simulator's agentic trace a fleet of two at 5% KV usage and ITL 5 ms went to one
      and its TTFT p90 rose to 4.6 s (its hit rate fell from 92% to 54%) until ten
      replicas were started.

    A target no count meets (ITL at one request per replica, TTFT's base already over it)
    does not hold the fleet: keeping replicas that cannot help is no protection. No SLO, or no
    latency histograms (the fallback to saturation): None.
    """
    slo = spec.slo
    if slo is None or view is None or not view.histograms or fewer < 1:
        return None
    keep = 1.0 - spec.tolerance
    label = view.percentile_label
    fit = view.fit
    if slo.itl_seconds is not None and fit is not None:
        ceiling = slo.itl_seconds * keep
        if fit.predict(1.0) < ceiling:  # else no count meets it: nothing to protect
            if fit.trusted:
                batch = view.batch(fewer)
                predicted = closed_loop_itl(view, fewer)
                if predicted > ceiling:
                    return (f"{fewer} replicas would run {batch:.1f} requests each at a"
                            f" predicted ITL {label} of {predicted * 1000:.0f} ms >"
                            f" {ceiling * 1000:.0f} ms (the SLO less the tolerance band)")
            elif view.observed_itl is not None and view.observed_itl > ceiling:
                return (f"the ITL {label} observed with {view.ready} replicas,"
                        f" {view.observed_itl * 1000:.0f} ms, is already over"
                        f" {ceiling * 1000:.0f} ms (the SLO less the tolerance band)")
            elif view.itl_observations >= MIN_WINDOW_OBSERVATIONS:
                return (f"the ITL model has {fit.informed_reads} of {MIN_INFORMED_READS}"
                        " informed reads: the prior never scales down")
    ttft = view.ttft
    if slo.ttft_seconds is not None and ttft is not None:
        ceiling = slo.ttft_seconds * keep
        predicted = ttft.predict(fewer)
        if ttft.base < ceiling and predicted > ceiling:
            return (f"{fewer} replicas would queue {ttft.waiting_tokens:.0f} prompt tokens to a"
                    f" predicted TTFT {label} of {predicted * 1000:.0f} ms >"
                    f" {ceiling * 1000:.0f} ms (the SLO less the tolerance band)")
    if view.prefix_handover is not None and view.prefix_unreported:
        return (f"{view.prefix_unreported} of {view.ready} ready pods report no prefix-cache"
                " rates (a pod's first read, or an image without"
                " kvpilot:prefix_cache_hits_total): the cache a step down could lose is"
                " unknown")
    handover = view.prefill_utilization(fewer)
    if handover is not None and handover > HANDOVER_PREFILL_CEILING:
        return (f"{fewer} replicas would prefill {view.prefill_computed:.0f} tokens/s plus"
                f" the {view.prefix_handover:.0f} tokens/s one pod's prefix cache saves,"
                f" {handover:.0%} of their prefill capacity"
                f" ({view.prefill_rate:.0f} tokens/s each) >"
                f" {HANDOVER_PREFILL_CEILING:.0%}")
    return None


def closed_loop_itl(view: LatencyView, fewer: int) -> float:
    """The ITL (seconds) ``fewer`` replicas would settle at, with the load's response.

    The fit predicts ITL from the batch, and the batch comes from the requests in flight
    now; but by Little's law the requests in flight are the arrival rate times the time
    each spends, which for a decoding request is its output length times the ITL. At the
    same arrival rate, ``fewer`` replicas therefore hold ``requests x ITL' / ITL_now``
    requests, ``ITL_now`` being the fit's value at the current count. The fixed point of
    ``ITL' = a + c x (requests / fewer) x ITL' / ITL_now`` is::

        ITL' = a / (1 - x),    x = c x requests / (fewer x ITL_now)

    It equals ``ITL_now`` at the current count and is unbounded (``math.inf``) for
    ``x >= 1``: a count whose decodes could not keep up with the arrivals. The requests'
    duration scales with their mean ITL, which need not move like the fit's quantile: with
    ``m`` the lower of ``ITL_now`` and the window's mean (the faster growth),
    ``k = c x requests / (n x m)`` and ``ITL' = ITL_now x (1 - k_current) / (1 - k_fewer)``
    (the same as above when ``m = ITL_now``). On ``steady_high_concurrency`` (p90 19 ms,
    mean 11 ms on 4 replicas) the quantile alone predicted 30 ms for 3 replicas, right
    for the ITL, but their batches then filled ``max_num_seqs`` and requests queued past
    the TTFT target; with the mean, 3 replicas cannot keep up and the step is held. With the open-loop
    ``a + c x requests / fewer``, a fleet that over-scaled on a burst was taken down to a
    count whose predicted 12 ms became 60-180 ms once its queue built up (the SLO
    simulation, ``burst``), then scaled back up a start-up too late. Never below the
    open-loop prediction. The latency rule sizes on the same loop
    (:meth:`LatencyView.itl_replicas`); on the way up the open loop is the larger.
    """
    return view.closed_loop(fewer)
