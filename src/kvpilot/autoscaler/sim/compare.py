"""Run several policies on the same traces, under the same bounds, behind one or several
routings: what ``kvpilot simulate`` and ``benchmarks/autoscaler_bench.py`` call."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpilot.autoscaler.sim.controllers import POLICIES, make_policy
from kvpilot.autoscaler.sim.fleet import simulate
from kvpilot.autoscaler.sim.model import DEFAULT_ROUTING, ReplicaModel, SimConfig
from kvpilot.autoscaler.sim.report import SimResult
from kvpilot.autoscaler.sim.traces import TRACES, Trace, make_trace
from kvpilot.autoscaler.spec import DEFAULTS, AutoscalingSpec, SloSpec


@dataclass(frozen=True)
class Scenario:
    """What every policy shares in one comparison.

    Attributes:
        peak_replicas: replicas the trace's peak needs at the target usage (sizes the load).
        duration_seconds / seed / warmup_seconds / slo_wait_seconds / slo_ttft_seconds /
            slo_itl_seconds: see SimConfig.
        max_factor: maxReplicas = ceil(max_factor x peak_replicas) + 1 (room to overshoot).
        target_cache_usage / target_queue_depth: shared targets (HPA uses the first, KPA
            the second, ours both).
        slo_profile: ``cpu`` or ``gpu``: our policy is given ``spec.autoscaling.slo``
            with the scenario's targets (its latency model starting from that profile's
            prior), as a user who states an SLO would; None (the default) runs it without
            one, as the starvation comparisons do. The baselines never read it.
    """

    peak_replicas: float = 8.0
    duration_seconds: float = 3600.0
    seed: int = 0
    warmup_seconds: float = 300.0
    slo_wait_seconds: float = 2.0
    slo_ttft_seconds: float = 1.0
    slo_itl_seconds: float = 0.05
    max_factor: float = 1.5
    target_cache_usage: float = float(DEFAULTS["targetCacheUsage"])
    target_queue_depth: float = float(DEFAULTS["targetQueueDepth"])
    slo_profile: str | None = None

    def __post_init__(self) -> None:
        checks = (
            ("peak_replicas", self.peak_replicas, 0 < self.peak_replicas <= 100_000, "in (0, 100000]"),
            ("max_factor", self.max_factor, 1 <= self.max_factor <= 100, "in [1, 100]"),
            ("slo_wait_seconds", self.slo_wait_seconds, self.slo_wait_seconds > 0, "> 0"),
            ("slo_ttft_seconds", self.slo_ttft_seconds, self.slo_ttft_seconds > 0, "> 0"),
            ("slo_itl_seconds", self.slo_itl_seconds, self.slo_itl_seconds > 0, "> 0"),
            ("duration_seconds", self.duration_seconds, self.duration_seconds > 0, "> 0"),
            ("warmup_seconds", self.warmup_seconds,
             0 <= self.warmup_seconds < self.duration_seconds, "in [0, duration)"),
        )
        for name, value, ok, allowed in checks:
            # NaN fails every comparison, so it is refused here too; so is inf by the bounds.
            if not (ok and math.isfinite(value)):
                raise ValueError(f"{name} must be finite and {allowed}; got {value!r}")

    def bounds(self, trace: Trace) -> tuple[int, int]:
        """(minReplicas, maxReplicas): the trough's need, and headroom above the peak."""
        low = max(1, math.floor(trace.base_replicas))
        high = max(low + 1, math.ceil(self.max_factor * self.peak_replicas) + 1)
        return low, high

    def spec(self, trace: Trace, model: ReplicaModel) -> AutoscalingSpec:
        low, high = self.bounds(trace)
        return AutoscalingSpec(
            min_replicas=low,
            max_replicas=high,
            target_cache_usage=self.target_cache_usage,
            target_queue_depth=self.target_queue_depth,
            startup_seconds=model.startup_seconds,
            slo=None if self.slo_profile is None else SloSpec(
                ttft_seconds=self.slo_ttft_seconds, itl_seconds=self.slo_itl_seconds, profile=self.slo_profile),
        )

    def config(self, trace: Trace, routing: str = DEFAULT_ROUTING) -> SimConfig:
        low, high = self.bounds(trace)
        initial = trace.base_replicas if trace.initial_replicas is None else trace.initial_replicas
        start = min(high, max(low, round(initial)))
        return SimConfig(
            duration_seconds=self.duration_seconds,
            slo_wait_seconds=self.slo_wait_seconds,
            slo_ttft_seconds=self.slo_ttft_seconds,
            slo_itl_seconds=self.slo_itl_seconds,
            min_replicas=low,
            max_replicas=high,
            initial_replicas=start,
            seed=self.seed,
            warmup_seconds=self.warmup_seconds,
            routing=routing,
        )


def compare(
    traces: Sequence[str] = TRACES,
    policies: Sequence[str] = POLICIES,
    scenario: Scenario = Scenario(),
    model: ReplicaModel | None = None,
    progress: Callable[[SimResult], None] | None = None,
    routings: Sequence[str] = (DEFAULT_ROUTING,),
) -> list[SimResult]:
    """Every policy on every trace behind every routing (the same requests for each
    policy and routing of a trace)."""
    model = model or ReplicaModel()
    if not routings:
        raise ValueError("routings must name at least one routing")
    results = []
    for name in traces:
        trace = make_trace(
            name,
            scenario.peak_replicas,
            scenario.duration_seconds,
            scenario.seed,
            model,
            scenario.target_cache_usage,
        )
        for routing in routings:
            config = scenario.config(trace, routing)  # refuses an unknown routing
            for policy in policies:
                result = simulate(
                    trace,
                    make_policy(policy, scenario.spec(trace, model)),
                    model,
                    config,
                )
                results.append(result)
                if progress:
                    progress(result)
    return results
