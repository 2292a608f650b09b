"""Demand held at the request router (``FleetSignals.router_queued``) joins the engines'
waiting count: a burst the router holds scales the fleet before any engine queues."""

import math

import pytest

from kvpilot.autoscaler import (
    AutoscalingSpec,
    FleetSignals,
    PodSignals,
    PolicyState,
    aggregate,
    decide,
)

SPEC = AutoscalingSpec(min_replicas=1, max_replicas=10, scale_down_stabilization_seconds=60)


def calm(name):
    """A pod at the target usage with nothing waiting: no rule wants more or fewer."""
    return PodSignals(name, kv_usage=0.75, num_waiting=0.0, waiting_tokens=0.0, num_running=8.0,
                      preemption_rate=0.0, kv_capacity_tokens=100_000.0)


PODS = (calm("a"), calm("b"), calm("c"))


def test_router_held_requests_join_the_waiting_count():
    load = aggregate(FleetSignals(PODS, 0, router_queued=20.0))
    assert load.num_waiting == 20.0 and load.router_queued == 20.0
    # Their prompt tokens are unknown: no queued tokens are invented for them.
    assert load.waiting_tokens == 0.0 and load.demand_tokens == load.used_tokens
    assert aggregate(FleetSignals(PODS)).num_waiting == 0.0


def test_engines_idle_in_queue_but_router_holding_requests_scales_up():
    quiet = decide(FleetSignals(PODS), PolicyState(), SPEC, 0.0)
    assert quiet.direction == "hold" and quiet.desired_replicas == 3
    held = decide(FleetSignals(PODS, 0, router_queued=30.0), PolicyState(), SPEC, 0.0)
    assert held.direction == "up" and held.rule == "queue_drain"
    assert held.desired_replicas == 4  # at least one more; the held prompts' size is unknown
    assert held.signal == "num_waiting" and held.value == pytest.approx(10.0)
    assert "30 held at the router" in held.reason


def test_a_router_queue_within_the_target_depth_changes_nothing():
    # 3 ready pods x targetQueueDepth 4 (x 1.1 tolerance): 12 held requests are no backlog.
    d = decide(FleetSignals(PODS, 0, router_queued=12.0), PolicyState(), SPEC, 0.0)
    assert d.direction == "hold" and d.desired_replicas == 3


def test_requests_held_at_the_router_block_a_scale_down():
    light = tuple(PodSignals(p.name, 0.2, 0.0, 0.0, 2.0, 0.0, 100_000.0) for p in PODS)
    state = PolicyState()
    for i in range(8):  # a full, continuous scale-down window below the current count
        d = decide(FleetSignals(light), state, SPEC, 15.0 * i)
        state = d.state
    assert d.direction == "down"
    blocked = decide(FleetSignals(light, 0, router_queued=10.0), state, SPEC, 15.0 * 8)
    assert blocked.direction == "hold"
    assert "would queue 5.0 each" in blocked.reason


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, True, None, "3"])
def test_router_queued_must_be_a_finite_non_negative_number(bad):
    with pytest.raises(ValueError, match="router_queued"):
        FleetSignals(PODS, 0, router_queued=bad)
