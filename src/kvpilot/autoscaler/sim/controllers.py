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
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from kvpilot.autoscaler.headroom import HeadroomState, headroom
from kvpilot.autoscaler.policy import Decision, decide
from kvpilot.autoscaler.signals import FleetSignals, PodSignals
from kvpilot.autoscaler.sim.fleet import ScalingPolicy
from kvpilot.autoscaler.sim.replica import Replica
from kvpilot.autoscaler.spec import AutoscalingSpec
from kvpilot.autoscaler.state import PolicyState


class KvPilotPolicy:
    """Ours: builds :class:`PodSignals` per ready replica and calls :func:`decide`."""

    name = "kvpilot"

    def __init__(self, spec: AutoscalingSpec) -> None:
        self.spec = spec
        self.interval_seconds = spec.interval_seconds
        self.state = PolicyState()
        self._last_preempt: dict[int, tuple[float, int]] = {}
        self.rules: dict[str, int] = {}
        self.last: Decision | None = None

    def decide(self, now: float, ready: Sequence[Replica], pending: int) -> int:
        pods = []
        for r in ready:
            prev_time, prev = self._last_preempt.get(r.rid, (now, r.preemptions))
            rate = (r.preemptions - prev) / (now - prev_time) if now > prev_time else 0.0
            self._last_preempt[r.rid] = (now, r.preemptions)
            pods.append(
                PodSignals(
                    f"r{r.rid}",
                    r.kv_usage(now),
                    float(len(r.waiting)),
                    r.waiting_tokens,
                    float(r.num_running),
                    rate,
                    float(r.model.kv_capacity_tokens),
                )
            )
        # Every replica runs the same engine model: its --max-num-seqs is the fleet's.
        max_num_seqs = ready[0].model.max_num_seqs if ready else None
        d = decide(FleetSignals(tuple(pods), pending, max_num_seqs=max_num_seqs), self.state,
                   self.spec, now)
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
    """Knative KPA's stable/panic algorithm on the fleet's queue depth."""

    name = "kpa"

    def __init__(
        self,
        min_replicas: int,
        max_replicas: int,
        target_per_pod: float = 4.0,
        stable_seconds: float = 60.0,
        panic_seconds: float = 6.0,
        panic_threshold: float = 2.0,
        max_up_rate: float = 1000.0,
        max_down_rate: float = 2.0,
        interval_seconds: float = 2.0,
    ) -> None:
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
        self.samples.append((now, float(sum(len(r.waiting) for r in ready))))
        while self.samples and self.samples[0][0] <= now - self.stable:
            self.samples.popleft()
        n = len(ready)
        lo, hi = math.floor(n / self.down_rate), math.ceil(n * self.up_rate)
        stable_want = self._average(now, self.stable) / self.target
        panic_want = self._average(now, self.panic) / self.target
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


POLICIES = ("kvpilot", "hpa", "kpa")


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
    raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {name!r}")
