"""Each candidate rule on its own (table tests)."""

import pytest

from kvpilot.autoscaler import AutoscalingSpec, FleetSignals, aggregate
from kvpilot.autoscaler.forecast import Trend
from kvpilot.autoscaler.rules import forecast, headroom, queue_drain, starvation

from .plant import CAP, pods_for

SPEC = AutoscalingSpec(max_replicas=50)


def load(demand, ready, **kw):
    return aggregate(FleetSignals(pods_for(demand, ready, **kw)))


@pytest.mark.parametrize(
    ("demand", "ready", "pending", "want"),
    [
        (3.0, 4, 0, 4),  # usage 0.75 = target: hold
        (3.3, 4, 0, 4),  # 0.825: within 10% tolerance
        (3.4, 4, 0, 5),  # 0.85: ceil(3.4 / 0.75)
        (1.0, 4, 0, 2),  # 0.25: two hold it at target
        (0.0, 4, 0, 0),  # nothing held
        (3.4, 4, 1, 5),  # pending counts as supply (usage 0.68 over 5): hold
        (3.96, 4, 2, 6),  # 0.99 on 4 ready, 2 pending: 3.96/0.75 = 5.28 -> 6
    ],
)
def test_headroom_is_hpa_with_tolerance_and_pending_supply(demand, ready, pending, want):
    c = headroom(load(demand, ready), ready + pending, SPEC)
    assert c.replicas == want and c.signal == "kv_usage"


def test_headroom_without_usage_has_no_opinion():
    assert (
        headroom(aggregate(FleetSignals(pods_for(1.0, 2, frozenset({0, 1})))), 2, SPEC).replicas
        is None
    )


def test_queue_drain_sizes_held_plus_queued_tokens_at_full_capacity():
    # 6 replica-eq of demand on 4 pods: 4 x 0.99 held, the rest queued.
    c = queue_drain(load(6.0, 4), 4, 4, SPEC)
    assert c.replicas == 6 and c.signal == "num_waiting" and c.value > SPEC.target_queue_depth


def test_queue_drain_within_depth_has_no_opinion():
    c = queue_drain(load(4.0, 4), 4, 4, SPEC)  # 0.01 x 4 x CAP tokens queued = 2 requests
    assert c.replicas is None


def test_queue_drain_asks_at_least_one_more_than_ready():
    few_tokens = aggregate(FleetSignals(pods_for(1.0, 2)))
    deep = type(few_tokens)(**{**few_tokens.__dict__, "num_waiting": 40.0})
    assert queue_drain(deep, 2, 2, SPEC).replicas == 3


def trend(level, slope_per_min, stderr=0.0, samples=9):
    return Trend(slope_per_min / 60, stderr / 60, level, samples, 120.0)


@pytest.mark.parametrize(
    ("tr", "current", "want"),
    [
        (trend(3.0, 1.2), 4, 8),  # exhausts 4 in 50 s < 150 s; (3 + 0.02 x 150) / 0.75
        (trend(3.0, 0.2), 4, None),  # exhausts in 300 s: beyond the horizon
        (trend(3.0, -1.0), 4, None),  # falling
        (trend(3.0, 1.2, stderr=1.0), 4, None),  # not significant
        (trend(4.5, 1.0), 4, None),  # already exhausted: the reactive rules own it
    ],
)
def test_forecast_triggers_on_exhaustion_before_startup_plus_margin(tr, current, want):
    c = forecast(tr, tr.level, current, SPEC)
    if want is None:
        assert c.replicas is None
    else:
        assert c.replicas == want
        assert c.value == pytest.approx((current - tr.level) / tr.slope)  # seconds


def test_forecast_needs_history():
    assert forecast(None, 1.0, 3, SPEC).replicas is None
    assert forecast(trend(3.0, 1.2), None, 4, SPEC).replicas is None


@pytest.mark.parametrize(
    ("kw", "demand", "want", "signal"),
    [
        ({"preempting": True}, 1.0, 5, "preemption_rate"),
        ({}, 3.84, 5, "kv_usage"),  # 0.96 per pod
        ({}, 3.6, None, "kv_usage"),  # 0.90: no alarm
    ],
)
def test_starvation_alarm_asks_ready_plus_one(kw, demand, want, signal):
    c = starvation(load(demand, 4, **kw), 4, 6, SPEC)
    assert c.replicas == want and c.signal == signal


def test_capacity_constant_is_what_the_plant_reports():
    assert load(1.0, 1).capacity_per_replica == CAP
