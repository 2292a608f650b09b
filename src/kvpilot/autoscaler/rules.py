"""The six candidate rules. Each turns the fleet's load into a replica count (or no
opinion) with the signal and value behind it; :func:`kvpilot.autoscaler.policy.decide`
takes the highest.

Units: loads are in *replica-equivalents* (tokens divided by one replica's KV capacity), so
"3.2" means the KV of 3.2 full replicas. Counts are totals (ready + pending): pending pods
are supply, so a candidate that asks for no more than the current total adds nothing
(llm-d WVA counts pending replicas the same way, to avoid cascade scale-ups).

Every rule is pure and total: no I/O, no clock, no exceptions on valid inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.autoscaler.forecast import Trend, seconds_to_exhaustion
from kvpilot.autoscaler.latency import (
    MIN_INFORMED_READS,
    PREFILL_UTILIZATION_TARGET,
    LatencyView,
    ceil_replicas,
)
from kvpilot.autoscaler.signals import FleetLoad
from kvpilot.autoscaler.spec import AutoscalingSpec

# What a fleet with an SLO but no latency histogram (an older engine) is told, in the
# latency candidate and appended to the decision's reason.
NO_HISTOGRAMS = "no latency histograms: sizing on saturation"


@dataclass(frozen=True)
class Candidate:
    """One rule's answer.

    Attributes:
        rule: ``headroom``, ``saturation``, ``queue_drain``, ``forecast``,
            ``starvation`` or ``latency``.
        replicas: the total it asks for, or ``None`` for no opinion (not triggered or no
            data).
        signal: the metric it read.
        value: that metric's value (units in ``detail``).
        detail: one human sentence with the numbers.
    """

    rule: str
    replicas: int | None
    signal: str
    value: float | None
    detail: str

    def to_dict(self) -> dict[str, object]:
        return {
            "rule": self.rule,
            "replicas": self.replicas,
            "signal": self.signal,
            "value": None if self.value is None else round(self.value, 6),
            "detail": self.detail,
        }


def headroom(load: FleetLoad, current: int, spec: AutoscalingSpec) -> Candidate:
    """Keep mean KV usage at the target, with a tolerance band.

    Source: Kubernetes HPA (``pkg/controller/podautoscaler/replica_calculator.go``):
    ``desired = ceil(current x usage / target)``, and no change while ``|usage/target - 1|``
    is within the tolerance (0.1). As HPA does for pods without metrics on a scale-up,
    pending pods count with zero usage, i.e. as supply. Usage is non-evictable KV, so a warm
    prefix cache does not look like load.
    """
    if load.usage_reported == 0 or current == 0:
        return Candidate("headroom", None, "kv_usage", None, "no pod reported KV usage")
    used = load.used_tokens / load.capacity_per_replica
    mean_usage = used / current
    ratio = mean_usage / spec.target_cache_usage
    if abs(ratio - 1.0) <= spec.tolerance:
        return Candidate(
            "headroom",
            current,
            "kv_usage",
            mean_usage,
            f"mean KV usage {mean_usage:.1%} is within {spec.tolerance:.0%} of the target"
            f" {spec.target_cache_usage:.0%}: keep {current}",
        )
    replicas = ceil_replicas(used / spec.target_cache_usage)
    return Candidate(
        "headroom",
        replicas,
        "kv_usage",
        mean_usage,
        f"mean KV usage {mean_usage:.1%} over {current} replicas vs target"
        f" {spec.target_cache_usage:.0%}: {replicas} replicas hold it at target",
    )


def saturation(load: FleetLoad, current: int, spec: AutoscalingSpec) -> Candidate:
    """Keep running requests per replica at ``target_saturation`` of ``max_num_seqs``.

    Sources: Knative KPA and AIBrix size on in-flight requests per pod against a target
    concurrency; llm-d's saturation-based scaling reads the batch as well as the KV cache.
    Ours: ``desired = ceil(running / (max_num_seqs x target_saturation))``, with HPA's
    tolerance band around the target. The KV rules alone shrink a fleet whose batches are
    busy but whose cache is nearly empty (short prompts, a full ``--max-num-seqs``): after
    the step every request lands on fewer batches and queues. No opinion when
    ``max_num_seqs`` is unknown or no pod reported its running count.
    """
    sat = load.saturation(current)
    if sat is None or load.max_num_seqs is None:
        why = ("max_num_seqs unknown" if load.max_num_seqs is None
               else "no pod reported its running requests")
        return Candidate("saturation", None, "num_running", None, why)
    ratio = sat / spec.target_saturation
    if abs(ratio - 1.0) <= spec.tolerance:
        return Candidate(
            "saturation",
            current,
            "num_running",
            sat,
            f"{load.num_running:.0f} running requests are {sat:.1%} of {current} x"
            f" {load.max_num_seqs} batch slots, within {spec.tolerance:.0%} of the target"
            f" {spec.target_saturation:.0%}: keep {current}",
        )
    replicas = ceil_replicas(load.num_running / (load.max_num_seqs * spec.target_saturation))
    return Candidate(
        "saturation",
        replicas,
        "num_running",
        sat,
        f"{load.num_running:.0f} running requests are {sat:.1%} of {current} x"
        f" {load.max_num_seqs} batch slots vs target {spec.target_saturation:.0%}:"
        f" {replicas} replicas run them at target",
    )


def queue_drain(load: FleetLoad, ready: int, current: int, spec: AutoscalingSpec) -> Candidate:
    """Give a queue deeper than ``targetQueueDepth`` per ready pod enough replicas to run.

    Sources: Knative KPA / AIBrix sizing on in-flight requests (``ceil(demand / per-pod
    capacity)``) and llm-d WVA's queue saturation threshold. Ours: the size is the larger of
    (a) the replicas that run every queued request at today's per-pod concurrency and (b) the
    replicas whose KV holds today's usage plus the queued prompt tokens at the target usage.
    A raw count of waiting requests divided by a per-pod target over-scales badly when each
    pod runs a hundred requests, so the count is never used alone. The waiting count
    includes the requests held at the router (``router_queued``): a burst the router holds
    triggers this rule before any engine queues it; their prompt tokens are unknown, so
    (b) does not see them and the answer is at least one more replica.
    """
    if ready == 0:
        return Candidate("queue_drain", None, "num_waiting", None, "no ready pod")
    per_pod = load.num_waiting / ready
    if per_pod <= spec.target_queue_depth * (1.0 + spec.tolerance):
        return Candidate(
            "queue_drain",
            None,
            "num_waiting",
            per_pod,
            f"{per_pod:.1f} waiting per ready pod is within the target {spec.target_queue_depth:g}",
        )
    by_tokens = 0
    if load.capacity_known:
        by_tokens = ceil_replicas(load.demand_tokens / load.capacity_per_replica)
    replicas = max(by_tokens, ready + 1)
    held = f", {load.router_queued:.0f} held at the router" if load.router_queued else ""
    return Candidate(
        "queue_drain",
        replicas,
        "num_waiting",
        per_pod,
        f"{per_pod:.1f} waiting per ready pod > target {spec.target_queue_depth:g}"
        f" ({load.waiting_tokens:.0f} queued prompt tokens{held}): {replicas} replicas"
        " run them",
    )


def forecast(
    trend: Trend | None,
    latest_demand: float | None,
    current: int,
    spec: AutoscalingSpec,
    queue_deep: bool = False,
    still_rising: bool = True,
) -> Candidate:
    """Scale before the KV runs out, not after: ours (no other autoscaler does this).

    Fit a least-squares line to the fleet's KV demand (tokens held plus queued prompt
    tokens, in replica-equivalents; where a request waits does not change it) over
    ``forecast_window_seconds``. If, at that slope, demand reaches the capacity of the
    ``current`` replicas (pending ones included) sooner than a new pod can start
    (``startupSeconds`` + margin), ask now for the replicas that keep the demand forecast at
    that horizon under the target usage. A reactive rule asks only once the cache is full,
    one start-up too late.

    Noise guards: the exhaustion time uses the lower end of the slope's 95% confidence
    interval, so a trend must stand out from the scatter of its own samples before it
    triggers, and the rise must go on in the newest third of the window (``still_rising``),
    so a step that already happened is not extrapolated as a ramp; the size uses the
    fitted slope. The forecast is for the time *before*
    exhaustion: once demand exceeds the fleet, or the queue is deeper than its target
    (``queue_deep``), it steps aside, since extrapolating a growing backlog would size for
    a queue the new pods drain anyway; the queue-drain and starvation rules own that case.
    ``latest_demand`` is ``None`` when the newest observation was incomplete (no forecast).
    """
    horizon = spec.forecast_horizon_seconds
    if trend is None or latest_demand is None:
        return Candidate(
            "forecast",
            None,
            "kv_demand_trend",
            None,
            "not enough complete history for a trend yet",
        )
    level, slope = trend.level, trend.slope
    to_exhaustion = seconds_to_exhaustion(level, trend.cautious_slope, float(current))
    if queue_deep:
        return Candidate(
            "forecast",
            None,
            "kv_demand_trend",
            to_exhaustion,
            "the queue is deeper than its target: the queue-drain rule sizes the backlog",
        )
    if to_exhaustion == 0.0:
        return Candidate(
            "forecast",
            None,
            "kv_demand_trend",
            0.0,
            f"KV demand {level:.2f} replica-eq already fills {current} replicas:"
            " the queue-drain and starvation rules size the backlog",
        )
    if to_exhaustion < horizon and not still_rising:
        return Candidate(
            "forecast",
            None,
            "kv_demand_trend",
            to_exhaustion,
            f"KV demand {level:.2f} replica-eq rose, but is flat over the newest third of the"
            " window: a step, not a ramp",
        )
    if to_exhaustion >= horizon:
        when = (
            "never (no significant rise)" if math.isinf(to_exhaustion) else f"{to_exhaustion:.0f} s"
        )
        return Candidate(
            "forecast",
            None,
            "kv_demand_trend",
            to_exhaustion,
            f"KV demand {level:.2f} replica-eq, slope {slope * 60:+.3f}/min"
            f" (lower 95% bound {trend.cautious_slope * 60:+.3f}): exhaustion {when},"
            f" beyond the {horizon:.0f} s horizon",
        )
    ahead = trend.at(horizon)
    replicas = ceil_replicas(ahead / spec.target_cache_usage)
    return Candidate(
        "forecast",
        replicas,
        "kv_demand_trend",
        to_exhaustion,
        f"KV demand {level:.2f} replica-eq rising {slope * 60:+.3f}/min exhausts"
        f" {current} replicas in {to_exhaustion:.0f} s < start-up {spec.startup_seconds:.0f} s"
        f" + margin {spec.forecast_margin_seconds:.0f} s; {replicas} replicas keep the"
        f" {horizon:.0f} s forecast ({ahead:.2f}) under {spec.target_cache_usage:.0%}",
    )


def is_starving(load: FleetLoad, spec: AutoscalingSpec) -> bool:
    """Any pod preempting, or any pod at or above ``starvation_usage`` KV usage."""
    return bool(load.preempting_pods) or bool(
        load.usage_reported and load.max_usage >= spec.starvation_usage
    )


def starvation(
    load: FleetLoad, ready: int, current: int, spec: AutoscalingSpec, base: int | None = None
) -> Candidate:
    """Requests are being starved now: at least one more replica, now.

    Ours, after llm-d WVA's per-replica saturation test: any preemption, or any pod at or
    above ``starvation_usage`` (0.95) KV usage, means requests are losing work or about to.
    It asks for ``base + 1``, where ``base`` is the ready count when this starvation
    episode began (``ready`` if it begins now): a pod already pending answers it (no double
    scaling for one pressure), it never waits for a stabilization window, and it is one
    replica per episode. A hot spot that one more replica does not relieve (a Service
    routes at random, so one pod can stay full while the rest idle) must not ratchet the
    fleet to ``maxReplicas`` one start-up at a time; sustained fleet-wide pressure is the
    sizing rules' to answer (headroom, saturation, queue drain, forecast).
    """
    replicas = (ready if base is None else base) + 1
    if load.preempting_pods:
        return Candidate(
            "starvation",
            replicas,
            "preemption_rate",
            float(len(load.preempting_pods)),
            f"{len(load.preempting_pods)} pod(s) preempting"
            f" ({', '.join(load.preempting_pods[:3])}): at least {replicas} replicas now",
        )
    if load.usage_reported and load.max_usage >= spec.starvation_usage:
        return Candidate(
            "starvation",
            replicas,
            "kv_usage",
            load.max_usage,
            f"a pod is at {load.max_usage:.1%} KV usage (>= {spec.starvation_usage:.0%}):"
            f" at least {replicas} replicas now",
        )
    return Candidate(
        "starvation",
        None,
        "kv_usage",
        load.max_usage if load.usage_reported else None,
        "no preemptions and no pod near a full KV cache",
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _prefill_ask(view: LatencyView, current: int, tol: float
                 ) -> tuple[int, str, float, str] | None:
    """The replicas whose prefill capacity runs the fleet's computed prefill (grown by
    the forecast) at :data:`~kvpilot.autoscaler.latency.PREFILL_UTILIZATION_TARGET`, with
    HPA's tolerance band; None without the prefix-cache rates or a prefill capacity.
    Signal ``prefill_utilization``, value the utilization at ``current``."""
    rate, computed = view.prefill_rate, view.prefill_computed
    if rate is None or computed is None or current < 1:
        return None
    demand = computed * view.growth
    used = demand / (current * rate)
    n = max(1, ceil_replicas(demand / (rate * PREFILL_UTILIZATION_TARGET)))
    if abs(used / PREFILL_UTILIZATION_TARGET - 1.0) <= tol:
        n = current
    grown = f", x{view.growth:.2f} forecast growth" if view.growth > 1.0 else ""
    return (n, "prefill_utilization", used,
            f"prefill {demand:.0f} tokens/s computed (prefix-cache misses{grown}) is"
            f" {used:.0%} of {current} x {rate:.0f} tokens/s vs target"
            f" {PREFILL_UTILIZATION_TARGET:.0%}: {n} replicas")


def latency(view: LatencyView | None, current: int, spec: AutoscalingSpec) -> Candidate:
    """Size the fleet for ``spec.autoscaling.slo``: the fewest replicas whose predicted ITL
    and TTFT at the SLO's percentile are within their targets at the load the fleet has
    (running plus waiting requests, grown by the KV forecast when that rule triggers).

    Sources: NVIDIA Dynamo's SLA planner (replicas = predicted load / the largest
    per-replica load that meets the ITL target, from a profile) and llm-d's
    predicted-latency scaling (scale on the latency a model of live samples predicts);
    the model is :mod:`kvpilot.autoscaler.latency`. HPA's tolerance band: while the
    prediction at ``current`` is within ``tolerance`` of a target, that target asks for
    ``current``. A target that no replica count meets (ITL at one request per replica, or TTFT
    without its queue wait, already above it) gives no opinion and says so: more
    replicas would not help, so they are not bought. Signal ``itl_pNN`` or ``ttft_pNN``
    (whichever asks for more), value its prediction at ``current`` in seconds.

    No SLO: no opinion. An SLO but no pod exporting a latency histogram (an engine older
    than these metrics): no opinion, detail :data:`NO_HISTOGRAMS`; the fleet is sized on
    the saturation rules, never on a guess. Before the ITL fit is trusted the answer comes
    from the prior (:data:`kvpilot.autoscaler.latency.PRIORS`) and says so; it may scale
    up or hold, and the consolidation check never lets it scale down.
    """
    slo = spec.slo
    if slo is None:
        return Candidate("latency", None, "latency", None, "no SLO (spec.autoscaling.slo unset)")
    label = slo.quantile_label
    if view is None or not view.histograms:
        signal = f"itl_{label}" if slo.itl_seconds is not None else f"ttft_{label}"
        return Candidate("latency", None, signal, None, NO_HISTOGRAMS)
    asks: list[tuple[int, str, float, str]] = []
    notes: list[str] = []
    tol = spec.tolerance
    grown = f", x{view.growth:.2f} forecast growth" if view.growth > 1.0 else ""
    if slo.itl_seconds is not None and view.fit is not None:
        target, fit = slo.itl_seconds, view.fit
        predicted = fit.predict(view.batch(current))
        source = ("fitted" if fit.trusted else
                  f"prior ({fit.informed_reads} of {MIN_INFORMED_READS} informed reads)")
        line = (f"ITL {label} {_ms(fit.a)} + {fit.c * 1000:.2f} ms/request ({source}): "
                f"{_ms(predicted)} at {view.batch(current):.1f} requests per replica"
                f" ({view.requests:.0f} requests{grown})")
        n = view.itl_replicas(target)
        if n is None:
            notes.append(f"{line}; the target {_ms(target)} is below the"
                         f" {_ms(fit.predict(1.0))} of one request per replica: more replicas"
                         " do not help")
        else:
            if abs(predicted / target - 1.0) <= tol:
                n = current
            asks.append((n, f"itl_{label}", predicted,
                         f"{line} vs target {_ms(target)}: {n} replicas"))
    if slo.ttft_seconds is not None:
        target, t = slo.ttft_seconds, view.ttft
        if t is None:
            notes.append("TTFT: too few first tokens in the window to read")
        else:
            predicted = t.predict(current)
            rate = "unknown" if t.prefill_rate is None else f"{t.prefill_rate:.0f} tok/s"
            line = (f"TTFT {label} {_ms(t.observed)} observed ({_ms(t.base)} base +"
                    f" {t.waiting_tokens:.0f} queued tokens at {rate} per replica)")
            n = t.replicas_for(target)
            if n is None and t.prefill_rate is None:
                notes.append(f"{line}; no prefill rate (no ITL mean or token budget): the"
                             " queue wait cannot be sized")
            elif n is None:
                notes.append(f"{line}; the target {_ms(target)} is missed without a queue:"
                             " more replicas do not help")
            else:
                if abs(predicted / target - 1.0) <= tol:
                    n = current
                asks.append((n, f"ttft_{label}", predicted,
                             f"{line} vs target {_ms(target)}: {n} replicas"))
    if slo.ttft_seconds is not None:
        ask = _prefill_ask(view, current, tol)
        if ask is not None:
            asks.append(ask)
    if not asks:
        signal = f"itl_{label}" if slo.itl_seconds is not None else f"ttft_{label}"
        value = view.observed_itl if slo.itl_seconds is not None else (
            view.ttft.observed if view.ttft else None)
        return Candidate("latency", None, signal, value, "; ".join(notes) or "no latency data")
    replicas, signal, value, _ = max(asks, key=lambda a: a[0])
    detail = "; ".join([a[3] for a in asks] + notes)
    return Candidate("latency", replicas, signal, value, detail)
