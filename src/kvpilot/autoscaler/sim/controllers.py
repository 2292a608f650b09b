"""The scaling policies the simulator compares, behind one small interface.

Each policy has ``name``, ``interval_seconds`` and ``decide(now, ready, pending) -> int``
(the desired total), where ``ready`` are the serving replicas (read-only) and ``pending``
the ones still starting. Each keeps its own history, as a real controller would.

- :class:`KvPilotPolicy`: ours, :func:`kvpilot.autoscaler.decide` fed the same signals our
  engine exports.
- :class:`HpaStylePolicy`: Kubernetes HPA on the mean KV usage per pod, with HPA's default
  behaviour (``replica_calculator.go`` and ``horizontal.go``): target 0.75, tolerance 0.1,
  pods without metrics count as 0 on a scale-up and as at-target on a scale-down (holding
  if that flips the direction), scale-down stabilization 300 s (highest recommendation in
  the window), scale-up immediate, at most max(+100%, +4 pods) per 15 s.
- :class:`KpaStylePolicy`: Knative KPA (``pkg/autoscaler/scaling/autoscaler.go``) on the
  queue depth (waiting requests): 2 s tick, stable window 60 s, panic window 6 s, panic
  when the panic-window want is >= 2x the ready pods, no scale-down while panicking,
  at most /2 per tick down and x1000 up.
- :class:`SaturationPolicy`: llm-d's Workload Variant Autoscaler, saturation analyzer V1
  (``deploy/configmap-saturation-scaling.yaml`` of llm-d/llm-d-workload-variant-autoscaler,
  v0.7.0 defaults): a replica is saturated at KV usage >= 0.80 or queue >= 5; over the
  non-saturated replicas, scale up by one when the mean spare KV (0.80 - usage) < 0.1 or
  the mean spare queue (5 - queue) < 3 (or when every replica is saturated); scale down
  by one when the same load spread over one replica fewer still leaves both spares at or
  above their triggers. Our reading of it: one replica per 15 s interval, and no change
  while a replica is still starting (so a start-up is not answered twice).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from kvpilot.autoscaler.headroom import HeadroomState, headroom
from kvpilot.autoscaler.policy import Decision, decide
from kvpilot.autoscaler.signals import FleetSignals, LatencyWindow, PodSignals
from kvpilot.autoscaler.sim.fleet import ScalingPolicy
from kvpilot.autoscaler.sim.replica import Histogram, Replica
from kvpilot.autoscaler.spec import AutoscalingSpec
from kvpilot.autoscaler.state import PolicyState


def latency_window(hist: Histogram, previous: tuple[list[float], float] | None) -> LatencyWindow:
    """The increase of a replica's simulated histogram since ``previous`` (a
    :meth:`Histogram.snapshot`; None: since the start), as the policy reads an engine's
    (cumulative ``(upper bound, count)`` pairs, the last ``+Inf``)."""
    counts, total = hist.snapshot()
    if previous is not None:
        counts = [max(0.0, a - b) for a, b in zip(counts, previous[0])]
        total = max(0.0, total - previous[1])
    buckets, running = [], 0.0
    for bound, count in zip((*hist.bounds, math.inf), counts):
        running += count
        buckets.append((bound, running))
    return LatencyWindow(tuple(buckets), total)


class KvPilotPolicy:
    """Ours: builds :class:`PodSignals` per ready replica and calls :func:`decide`.

    Besides the saturation signals, each pod carries what the engine's histograms grew by
    since the last decision: ``itl`` and ``ttft`` (:func:`latency_window` of the replica's
    simulated histograms, filled from the simulated step timings, never from a latency
    model of the policy's) and ``step_tokens`` (tokens scheduled per step over the
    window); the fleet carries ``max_num_batched_tokens``.
    """

    name = "kvpilot"

    def __init__(self, spec: AutoscalingSpec) -> None:
        self.spec = spec
        self.interval_seconds = spec.interval_seconds
        self.state = PolicyState()
        self._last_preempt: dict[int, tuple[float, int]] = {}
        self._last_hist: dict[int, tuple[tuple[list[float], float], tuple[list[float], float],
                                         float, float]] = {}
        # Per replica: its prefix-cache counters (queried, hit tokens) at the last read.
        self._last_prefix: dict[int, tuple[float, float, float]] = {}
        self.rules: dict[str, int] = {}
        self.last: Decision | None = None
        self.last_signals: FleetSignals | None = None

    def pod_signals(self, now: float, r: Replica) -> PodSignals:
        """One replica's signals at ``now`` (and remember its counters for the next)."""
        prev_time, prev = self._last_preempt.get(r.rid, (now, r.preemptions))
        rate = (r.preemptions - prev) / (now - prev_time) if now > prev_time else 0.0
        self._last_preempt[r.rid] = (now, r.preemptions)
        r.observe(now)
        last = self._last_hist.get(r.rid)
        itl = latency_window(r.itl, last[0] if last else None)
        ttft = latency_window(r.ttft, last[1] if last else None)
        steps = r.steps - (last[2] if last else 0.0)
        tokens = r.step_tokens - (last[3] if last else 0.0)
        self._last_hist[r.rid] = (r.itl.snapshot(), r.ttft.snapshot(), r.steps, r.step_tokens)
        q0, h0, t0 = self._last_prefix.get(r.rid, (0.0, 0.0, r.ready_at))
        self._last_prefix[r.rid] = (r.queried_tokens, r.hit_tokens, now)
        span = now - t0
        return PodSignals(
            f"r{r.rid}",
            r.kv_usage(now),
            float(len(r.waiting)),
            r.waiting_tokens,
            float(r.num_running),
            rate,
            float(r.model.kv_capacity_tokens),
            itl=itl,
            ttft=ttft,
            step_tokens=max(0.0, tokens / steps) if steps > 1e-9 else None,
            prompt_token_rate=(r.queried_tokens - q0) / span if span > 0 else None,
            cached_token_rate=(r.hit_tokens - h0) / span if span > 0 else None,
        )

    def decide(self, now: float, ready: Sequence[Replica], pending: int) -> int:
        pods = [self.pod_signals(now, r) for r in ready]
        # Every replica runs the same engine model: its --max-num-seqs is the fleet's.
        max_num_seqs = ready[0].model.max_num_seqs if ready else None
        budget = ready[0].model.max_num_batched_tokens if ready else None
        signals = FleetSignals(tuple(pods), pending, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=budget)
        self.last_signals = signals
        d = decide(signals, self.state, self.spec, now)
        self.state = d.state
        self.last = d
        if d.direction != "hold":
            self.rules[d.rule] = self.rules.get(d.rule, 0) + 1
        return d.desired_replicas


class HeadroomPolicy:
    """Ours plus node headroom: :class:`KvPilotPolicy` decides the engine replicas, then
    :func:`kvpilot.autoscaler.headroom.headroom` sizes the placeholder pods that make the
    cluster autoscaler add nodes ahead of them (read by the simulator as
    ``placeholders`` after each decision; it matters only with ``SimConfig.nodes``)."""

    name = "kvpilot+headroom"

    def __init__(self, spec: AutoscalingSpec, node_startup_seconds: float) -> None:
        self.inner = KvPilotPolicy(spec)
        self.spec = spec
        self.interval_seconds = spec.interval_seconds
        self.node_startup_seconds = node_startup_seconds
        self.headroom = HeadroomState()
        self.placeholders = 0

    @property
    def rules(self) -> dict[str, int]:
        return self.inner.rules

    def decide(self, now: float, ready: Sequence[Replica], pending: int) -> int:
        desired = self.inner.decide(now, ready, pending)
        self.headroom = headroom(self.inner.state, self.spec, desired, now, self.node_startup_seconds,
                                 self.headroom)
        self.placeholders = self.headroom.replicas
        return desired


class HpaStylePolicy:
    """Kubernetes HPA's algorithm and default behaviour on mean KV usage."""

    name = "hpa"

    def __init__(
        self,
        min_replicas: int,
        max_replicas: int,
        target: float = 0.75,
        tolerance: float = 0.1,
        down_window_seconds: float = 300.0,
        interval_seconds: float = 15.0,
    ) -> None:
        self.min, self.max = min_replicas, max_replicas
        self.target, self.tolerance = target, tolerance
        self.down_window = down_window_seconds
        self.interval_seconds = interval_seconds
        self.history: deque[tuple[float, int]] = deque()

    def _recommend(self, now: float, ready: Sequence[Replica], pending: int) -> int:
        current = len(ready) + pending
        if not ready:
            return current
        usages = [r.kv_usage(now) for r in ready]
        total = sum(usages)
        ratio = total / len(usages) / self.target
        if pending:  # pods without metrics: 0 on the way up, at target on the way down
            if ratio > 1.0:
                new_ratio = total / (current * self.target)
            else:
                new_ratio = (total + pending * self.target) / (current * self.target)
            if abs(new_ratio - 1.0) <= self.tolerance or (ratio > 1.0) != (new_ratio > 1.0):
                return current
            return math.ceil(new_ratio * current)
        if abs(ratio - 1.0) <= self.tolerance:
            return current
        return math.ceil(ratio * len(usages))

    def decide(self, now: float, ready: Sequence[Replica], pending: int) -> int:
        current = len(ready) + pending
        rec = self._recommend(now, ready, pending)
        self.history.append((now, rec))
        while self.history and self.history[0][0] < now - self.down_window:
            self.history.popleft()
        if rec < current:  # scale-down stabilization: highest recommendation in the window
            rec = min(current, max(r for _, r in self.history))
        else:  # scale-up policies: +100% or +4 pods per 15 s, whichever is more
            rec = min(rec, max(2 * current, current + 4))
        return min(max(rec, self.min), self.max)


class KpaStylePolicy:
    """Knative KPA's stable/panic algorithm on the fleet's queue depth (``metric``
    "waiting", target ``target_per_pod`` requests) or on its concurrency (``metric``
    "concurrency": requests in flight, running + waiting, per pod; target
    ``target_per_pod``, or when None Knative's container-concurrency-target-percentage,
    70%, of the engines' ``--max-num-seqs`` as the containerConcurrency)."""

    name = "kpa"

    def __init__(
        self,
        min_replicas: int,
        max_replicas: int,
        target_per_pod: float | None = 4.0,
        stable_seconds: float = 60.0,
        panic_seconds: float = 6.0,
        panic_threshold: float = 2.0,
        max_up_rate: float = 1000.0,
        max_down_rate: float = 2.0,
        interval_seconds: float = 2.0,
        metric: str = "waiting",
    ) -> None:
        if metric not in ("waiting", "concurrency"):
            raise ValueError(f"metric must be waiting or concurrency; got {metric!r}")
        self.metric = metric
        if metric == "concurrency":
            self.name = "kpa_concurrency"
        self.min, self.max = min_replicas, max_replicas
        self.target = target_per_pod
        self.stable, self.panic = stable_seconds, panic_seconds
        self.threshold = panic_threshold
        self.up_rate, self.down_rate = max_up_rate, max_down_rate
        self.interval_seconds = interval_seconds
        self.samples: deque[tuple[float, float]] = deque()
        self.panic_time: float | None = None
        self.max_panic_pods = 0

    def _average(self, now: float, window: float) -> float:
        values = [v for t, v in self.samples if t > now - window]
        return sum(values) / len(values) if values else 0.0

    def decide(self, now: float, ready: Sequence[Replica], pending: int) -> int:
        current = len(ready) + pending
        if not ready:
            return min(max(current, self.min), self.max)
        if self.metric == "waiting":
            value = float(sum(len(r.waiting) for r in ready))
        else:
            value = float(sum(len(r.waiting) + r.num_running for r in ready))
        self.samples.append((now, value))
        target = self.target if self.target is not None else 0.7 * ready[0].model.max_num_seqs
        while self.samples and self.samples[0][0] <= now - self.stable:
            self.samples.popleft()
        n = len(ready)
        lo, hi = math.floor(n / self.down_rate), math.ceil(n * self.up_rate)
        stable_want = self._average(now, self.stable) / target
        panic_want = self._average(now, self.panic) / target
        stable = min(max(math.ceil(stable_want), lo), hi)
        panic = min(max(math.ceil(panic_want), lo), hi)
        if panic_want / n >= self.threshold:
            self.panic_time = now
        elif self.panic_time is not None and now - self.panic_time >= self.stable:
            self.panic_time, self.max_panic_pods = None, 0
        desired = stable
        if self.panic_time is not None:  # panicking: take the larger, never go down
            desired = max(stable, panic, self.max_panic_pods)
            self.max_panic_pods = desired
        return min(max(desired, self.min), self.max)


class SaturationPolicy:
    """llm-d WVA's saturation analyzer (V1) on per-replica KV usage and queue length.

    Attributes (the WVA ConfigMap's keys): ``kv_threshold`` (kvCacheThreshold, 0.80),
    ``queue_threshold`` (queueLengthThreshold, 5 requests), ``kv_spare_trigger``
    (kvSpareTrigger, 0.1), ``queue_spare_trigger`` (queueSpareTrigger, 3 requests).
    """

    name = "saturation"

    def __init__(
        self,
        min_replicas: int,
        max_replicas: int,
        kv_threshold: float = 0.80,
        queue_threshold: float = 5.0,
        kv_spare_trigger: float = 0.1,
        queue_spare_trigger: float = 3.0,
        interval_seconds: float = 15.0,
    ) -> None:
        self.min, self.max = min_replicas, max_replicas
        self.kv_threshold, self.queue_threshold = kv_threshold, queue_threshold
        self.kv_spare, self.queue_spare = kv_spare_trigger, queue_spare_trigger
        self.interval_seconds = interval_seconds

    def recommend(self, usages: Sequence[float], queues: Sequence[float]) -> int:
        """+1, -1 or 0 for replicas with these KV usages (0..1) and queue lengths."""
        free = [(u, q) for u, q in zip(usages, queues)
                if u < self.kv_threshold and q < self.queue_threshold]
        if not free:
            return 1 if usages else 0
        n = len(free)
        kv_load = sum(u for u, _ in free)
        queue_load = sum(q for _, q in free)
        if (self.kv_threshold - kv_load / n < self.kv_spare
                or self.queue_threshold - queue_load / n < self.queue_spare):
            return 1
        if (len(usages) > 1 and n > 1
                and self.kv_threshold - kv_load / (n - 1) >= self.kv_spare
                and self.queue_threshold - queue_load / (n - 1) >= self.queue_spare):
            return -1
        return 0

    def decide(self, now: float, ready: Sequence[Replica], pending: int) -> int:
        current = len(ready) + pending
        if pending or not ready:
            return min(max(current, self.min), self.max)
        step = self.recommend([r.kv_usage(now) for r in ready],
                              [float(len(r.waiting)) for r in ready])
        return min(max(current + step, self.min), self.max)


POLICIES = ("kvpilot", "hpa", "kpa", "kpa_concurrency", "saturation")


def make_policy(name: str, spec: AutoscalingSpec) -> ScalingPolicy:
    """A fresh policy by name, sharing the spec's bounds and targets."""
    if name == "kvpilot":
        return KvPilotPolicy(spec)
    if name == "hpa":
        return HpaStylePolicy(
            spec.min_replicas,
            spec.max_replicas,
            spec.target_cache_usage,
            down_window_seconds=spec.scale_down_stabilization_seconds,
            interval_seconds=spec.interval_seconds,
        )
    if name == "kpa":
        return KpaStylePolicy(spec.min_replicas, spec.max_replicas, spec.target_queue_depth)
    if name == "kpa_concurrency":
        return KpaStylePolicy(spec.min_replicas, spec.max_replicas, None, metric="concurrency")
    if name == "saturation":
        return SaturationPolicy(spec.min_replicas, spec.max_replicas,
                                interval_seconds=spec.interval_seconds)
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {name!r}")
