"""Saturation: running requests against the engines' --max-num-seqs keep a busy fleet.

The case from `make demo`: 4 replicas, 48 requests running, none waiting, KV usage
0.1-0.2. On KV alone the policy stepped 4 -> 1 and the one replica queued all 48 again;
with ``max_num_seqs`` known it never goes below ceil(48 / (32 x 0.75)) = 2 and steps down
only once the load is gone.
"""

from __future__ import annotations

import math

import pytest

from kvpilot.autoscaler import AutoscalingSpec, FleetSignals, PodSignals, PolicyState, decide
from kvpilot.autoscaler.rules import saturation
from kvpilot.autoscaler.signals import aggregate
from kvpilot.autoscaler.windows import consolidation_blocker

SPEC = AutoscalingSpec(min_replicas=1, max_replicas=8, scale_down_stabilization_seconds=60)
MAX_NUM_SEQS = 32
CAP = 100_000.0


def busy_pods(replicas: int, running: float, kv_usage: float = 0.15,
              missing_running: frozenset[int] = frozenset()) -> tuple[PodSignals, ...]:
    """``running`` requests spread evenly, nothing waiting, low KV usage."""
    return tuple(
        PodSignals(f"p{i}", kv_usage=kv_usage, num_waiting=0.0, waiting_tokens=0.0,
                   num_running=None if i in missing_running else running / replicas,
                   preemption_rate=0.0, kv_capacity_tokens=CAP)
        for i in range(replicas)
    )


def run(replicas: int, running: float, steps: int, max_num_seqs: int | None = MAX_NUM_SEQS,
        spec: AutoscalingSpec = SPEC) -> list[int]:
    """Closed loop: every interval the policy's answer becomes the ready count at once."""
    state, counts = PolicyState(), []
    for step in range(steps):
        signals = FleetSignals(busy_pods(replicas, running), max_num_seqs=max_num_seqs)
        d = decide(signals, state, spec, step * spec.interval_seconds)
        state, replicas = d.state, d.desired_replicas
        counts.append(replicas)
    return counts


def load(replicas: int, running: float, max_num_seqs: int | None = MAX_NUM_SEQS,
         missing_running: frozenset[int] = frozenset()):
    return aggregate(FleetSignals(busy_pods(replicas, running, missing_running=missing_running),
                                  max_num_seqs=max_num_seqs))


def test_the_demo_load_keeps_the_replicas_it_needs_for_many_windows():
    windows = 5
    steps = int(windows * SPEC.scale_down_stabilization_seconds / SPEC.interval_seconds)
    counts = run(4, 48.0, steps)
    floor = math.ceil(48 / (MAX_NUM_SEQS * SPEC.target_saturation))
    assert floor == 2
    assert min(counts) >= floor, counts
    # It settles where one replica fewer would run above the target less the tolerance
    # band (the consolidation check, as for KV usage): 3, since 2 would run at 75%.
    settled = counts[len(counts) // 2:]
    assert set(settled) == {3}, counts


def test_on_kv_alone_the_same_load_shrinks_to_one():
    """Today's behaviour without max_num_seqs, kept as the contrast the rule fixes."""
    counts = run(4, 48.0, 40, max_num_seqs=None)
    assert counts[-1] == 1


def test_after_the_load_stops_the_fleet_steps_down():
    counts = run(2, 0.0, 40)
    assert counts[-1] == SPEC.floor


def test_saturation_above_target_scales_up_now():
    # 2 replicas x 32 slots, 60 running: 94% > 75%: ceil(60 / 24) = 3.
    d = decide(FleetSignals(busy_pods(2, 60.0), max_num_seqs=MAX_NUM_SEQS), PolicyState(), SPEC, 0.0)
    assert d.direction == "up" and d.desired_replicas == 3
    assert d.rule == "saturation" and d.signal == "num_running"
    assert d.value == pytest.approx(60 / 2 / 32)


def test_rule_within_the_tolerance_keeps_current():
    c = saturation(load(2, 48.0), 2, SPEC)  # 75% exactly
    assert c.replicas == 2 and "keep 2" in c.detail


def test_rule_below_target_asks_for_fewer():
    c = saturation(load(4, 20.0), 4, SPEC)
    assert c.replicas == 1  # ceil(20 / 24)
    assert c.value == pytest.approx(20 / 4 / 32)


def test_rule_has_no_opinion_without_max_num_seqs_or_running_counts():
    assert saturation(load(2, 48.0, max_num_seqs=None), 2, SPEC).replicas is None
    everyone_missing = load(2, 48.0, missing_running=frozenset({0, 1}))
    c = saturation(everyone_missing, 2, SPEC)
    assert c.replicas is None and "no pod reported" in c.detail


def test_a_pod_missing_its_running_count_holds_a_scale_down():
    state = PolicyState()
    for step in range(20):
        pods = busy_pods(4, 8.0, missing_running=frozenset({3}))
        d = decide(FleetSignals(pods, max_num_seqs=MAX_NUM_SEQS), state, SPEC, step * 15.0)
        state = d.state
        assert d.desired_replicas == 4
    assert "missing data" in d.reason


def test_consolidation_refuses_a_step_that_would_saturate_the_rest():
    # 3 replicas, 60 running: 2 replicas would run 94% of their slots.
    why = consolidation_blocker(load(3, 60.0), None, None, 2, SPEC)
    assert why is not None and "batch slots" in why
    assert consolidation_blocker(load(3, 30.0), None, None, 2, SPEC) is None


def test_step_down_reports_the_saturation_it_leaves():
    counts_and_reasons = []
    state = PolicyState()
    replicas = 3
    for step in range(20):
        d = decide(FleetSignals(busy_pods(replicas, 10.0), max_num_seqs=MAX_NUM_SEQS), state, SPEC,
                   step * 15.0)
        state, replicas = d.state, d.desired_replicas
        counts_and_reasons.append((d.direction, d.reason))
    downs = [r for direction, r in counts_and_reasons if direction == "down"]
    assert downs and "batch slots" in downs[0]


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.5, float("nan"), "0.7", True])
def test_target_saturation_is_refused_outside_its_range(value):
    with pytest.raises(ValueError, match="targetSaturation"):
        AutoscalingSpec(target_saturation=value)


def test_target_saturation_comes_from_the_crd_name():
    assert AutoscalingSpec.from_crd({"targetSaturation": 0.5}).target_saturation == 0.5
    assert AutoscalingSpec(target_saturation=1.0).to_crd()["targetSaturation"] == 1.0


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "32"])
def test_max_num_seqs_is_refused_unless_a_positive_int(value):
    with pytest.raises(ValueError, match="max_num_seqs"):
        FleetSignals((), max_num_seqs=value)
