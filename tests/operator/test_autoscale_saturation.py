"""The operator hands the engines' --max-num-seqs (spec.engine.maxNumSeqs) to the policy,
so a fleet whose batches are busy keeps its replicas at low KV usage."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from kvpilot.autoscaler import PodSignals, PolicyState
from kvpilot.operator.autoscaling.fleet import EnginePod, FleetObservation
from kvpilot.operator.autoscaling.metrics_source import MetricsReading
from kvpilot.operator.autoscaling.plan import plan_autoscale
from kvpilot.operator.spec import parse_spec

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=timezone.utc)


def _spec(max_num_seqs: int, target_saturation: float | None = None):
    autoscaling = {"minReplicas": 1, "maxReplicas": 4}
    if target_saturation is not None:
        autoscaling["targetSaturation"] = target_saturation
    return parse_spec({"model": {"uri": "embedded://smollm2-135m-instruct"},
                       "engine": {"maxNumSeqs": max_num_seqs}, "autoscaling": autoscaling})


def _plan(spec, running_per_pod: float, replicas: int = 1):
    pods = tuple(EnginePod(f"p{i}", f"10.0.0.{i + 1}") for i in range(replicas))
    reading = MetricsReading("pods", tuple(
        PodSignals(p.name, kv_usage=0.1, num_waiting=0.0, waiting_tokens=0.0,
                   num_running=running_per_pod, preemption_rate=0.0, kv_capacity_tokens=5000.0)
        for p in pods))
    return plan_autoscale(FleetObservation(replicas, pods, 0), reading, PolicyState(), spec, (), NOW)


def test_a_full_batch_at_low_kv_usage_scales_up_on_saturation():
    plan = _plan(_spec(max_num_seqs=8), running_per_pod=8.0)
    assert plan.decision.rule == "saturation"
    assert plan.requested == 2  # ceil(8 / (8 x 0.75))
    candidate = next(c for c in plan.decision.candidates if c.rule == "saturation")
    assert candidate.value == 1.0
    written = plan.status["autoscaler"]["lastDecision"]
    (in_status,) = [c for c in written["candidates"] if c["rule"] == "saturation"]
    assert in_status["replicas"] == 2 and in_status["value"] == 1.0
    assert "batch slots" in in_status["detail"]


def test_the_spec_target_is_the_one_the_policy_reads():
    # 8 running of 16 slots: 50%, within 10% of a 0.5 target; above nothing at 0.75.
    assert _spec(16, 0.5).autoscaling.target_saturation == 0.5
    at_half = _plan(_spec(16, 0.5), running_per_pod=8.0)
    candidate = next(c for c in at_half.decision.candidates if c.rule == "saturation")
    assert candidate.replicas == 1
    grown = _plan(_spec(16, 0.25), running_per_pod=8.0)
    assert grown.requested == 2 and grown.decision.rule == "saturation"


def test_the_default_target_is_the_crds():
    assert _spec(8).autoscaling.target_saturation == 0.75


def test_an_slo_reaches_the_policy_with_the_crs_token_budget():
    """spec.autoscaling.slo through the operator's plan: the TTFT model's prefill rate is
    one replica's prefill capacity at the CR's engine.maxNumBatchedTokens (the CPU
    prior's plane, 512 / (27 ms + 512 x 1.5 ms) = 644 tokens/s: a TTFT target alone
    fits nothing), and the latency view lands in status.autoscaler.lastDecision."""
    import math

    from kvpilot.autoscaler import LatencyWindow

    spec = parse_spec({"model": {"uri": "embedded://smollm2-135m-instruct"},
                       "engine": {"maxNumSeqs": 64, "maxNumBatchedTokens": 512},
                       "autoscaling": {"minReplicas": 1, "maxReplicas": 8,
                                       "slo": {"ttftSeconds": 2.0}}})
    itl = LatencyWindow(((0.25, 90), (1.0, 100), (math.inf, 100)), 25.0)  # mean 250 ms
    ttft = LatencyWindow(((6.0, 18), (24.0, 20), (math.inf, 20)), 100.0)  # p90 6 s
    pod = EnginePod("p0", "10.0.0.1")
    reading = MetricsReading("pods", (PodSignals(
        "p0", kv_usage=0.2, num_waiting=2.0, waiting_tokens=2576.1, num_running=4.0,
        preemption_rate=0.0, kv_capacity_tokens=50000.0, itl=itl, ttft=ttft),))
    plan = plan_autoscale(FleetObservation(1, (pod,), 0), reading, PolicyState(), spec, (), NOW)
    latency = plan.status["autoscaler"]["lastDecision"]["latency"]
    assert latency["prefillRate"] == pytest.approx(644.025, abs=1e-3)
    # 2,576 queued tokens are 4 s of the 6 s p90: base 2 s, so no count meets 2 s...
    assert latency["ttftBase"] == pytest.approx(2.0, abs=1e-3)
    candidate = next(c for c in plan.decision.candidates if c.rule == "latency")
    assert candidate.replicas is None and "more replicas do not help" in candidate.detail


def test_the_status_signals_carry_latency_and_the_prefix_cache():
    """status.signals: the pooled p90 ITL and TTFT over the window (once the windows hold
    20 ITL / 10 TTFT observations), the prefix caches' hit rate and the prefill the fleet
    computed; absent (None) when no pod reported them, never 0."""
    from kvpilot.autoscaler import LatencyWindow
    from kvpilot.operator.autoscaling.plan import observed_signals

    inf = float("inf")
    itl = LatencyWindow(((0.01, 50), (0.05, 90), (0.1, 100), (inf, 100)), 3.0)
    ttft = LatencyWindow(((0.5, 9), (2.0, 10), (inf, 10)), 4.0)
    pods = (PodSignals("a", itl=itl, ttft=ttft, prompt_token_rate=3000.0, cached_token_rate=2400.0),
            PodSignals("b", itl=itl, prompt_token_rate=1000.0, cached_token_rate=1200.0),
            PodSignals("c"))
    seen = observed_signals(MetricsReading("pods", pods)).to_status(NOW)["signals"]
    assert seen["itlP90Seconds"] == 0.05  # 180 of 200 observations at or under 50 ms
    assert seen["ttftP90Seconds"] == 0.5  # 9 of 10 at or under 0.5 s
    # Computed: 600 + 0 (b's hits clamp to its lookups) of 4,000 looked up.
    assert seen["prefillTokensPerSecond"] == 600.0 and seen["prefixCacheHitRate"] == 0.85
    thin = LatencyWindow(((0.05, 5), (inf, 5)), 0.1)  # too few observations to read
    bare = observed_signals(MetricsReading("pods", (PodSignals("a", itl=thin, ttft=thin),)))
    assert (bare.itl_p90, bare.ttft_p90, bare.prefix_cache_hit_rate,
            bare.prefill_tokens_per_second) == (None, None, None, None)
