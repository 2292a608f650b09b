"""Inputs (PodSignals/FleetSignals/aggregate) and the serializable PolicyState."""

import json

import pytest

from kvpilot.autoscaler import (
    AutoscalingSpec,
    FleetSignals,
    PodSignals,
    PolicyState,
    Recommendation,
    aggregate,
    counter_rate,
    decide,
)


def pod(name, **kw):
    base = dict(
        kv_usage=0.5,
        num_waiting=0,
        waiting_tokens=0,
        num_running=10,
        preemption_rate=0.0,
        kv_capacity_tokens=1000,
    )
    return PodSignals(name, **{**base, **kw})


def test_aggregate_adds_tokens_using_each_pods_capacity():
    load = aggregate(
        FleetSignals(
            (
                pod("a", kv_usage=0.5, kv_capacity_tokens=1000),
                pod("b", kv_usage=0.25, kv_capacity_tokens=2000, num_waiting=3, waiting_tokens=600),
            )
        )
    )
    assert load.used_tokens == 1000.0 and load.waiting_tokens == 600.0
    assert load.capacity_per_replica == 1500.0 and load.capacity_known
    assert load.num_waiting == 3 and load.max_usage == 0.5 and load.complete


def test_missing_values_add_nothing_and_are_listed():
    load = aggregate(
        FleetSignals(
            (pod("a"), PodSignals("b"), pod("c", preemption_rate=None, kv_capacity_tokens=None))
        )
    )
    assert load.missing_pods == ("b", "c") and not load.complete
    assert load.usage_reported == 2
    # c has no capacity: the fleet median (1000) stands in for it.
    assert load.used_tokens == pytest.approx(1000.0)


def test_unknown_capacity_works_in_replica_units():
    load = aggregate(FleetSignals((pod("a", kv_capacity_tokens=None, waiting_tokens=5000),)))
    assert not load.capacity_known and load.capacity_per_replica == 1.0
    assert load.used_tokens == 0.5 and load.waiting_tokens == 0.0


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"kv_usage": 1.2}, "kv_usage must be [0, 1.0] or None; got 1.2"),
        ({"kv_usage": float("nan")}, "kv_usage must be a number or None"),
        ({"num_waiting": -1}, "num_waiting must be >= 0 and finite or None; got -1"),
        ({"kv_capacity_tokens": 0}, "kv_capacity_tokens must be > 0 or None; got 0"),
    ],
)
def test_bad_pod_values_are_refused(kw, message):
    with pytest.raises(ValueError) as err:
        pod("x", **kw)
    assert message in str(err.value) and "'x'" in str(err.value)


def test_fleet_refuses_negative_pending_and_duplicate_names():
    with pytest.raises(ValueError, match="pending_replicas must be >= 0; got -1"):
        FleetSignals((), -1)
    with pytest.raises(ValueError, match="pod names must be unique"):
        FleetSignals((pod("a"), pod("a")))


def test_counter_rate_handles_resets_and_missing_samples():
    assert counter_rate(10, 0.0, 40, 15.0) == 2.0
    assert counter_rate(100, 0.0, 30, 15.0) == 2.0  # reset: 30 since the restart
    assert counter_rate(None, None, 30, 15.0) is None
    assert counter_rate(10, 15.0, 40, 15.0) is None


def test_state_round_trips_through_json_and_survives_a_restart():
    spec = AutoscalingSpec(max_replicas=8)
    state = PolicyState()
    for i in range(12):
        pods = tuple(pod(f"p{j}", kv_usage=0.3 + 0.05 * i) for j in range(2))
        state = decide(FleetSignals(pods), state, spec, 15.0 * i).state
    restored = PolicyState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert restored == state
    # The restored state gives the same next decision as the one kept in memory.
    pods = tuple(pod(f"p{j}", kv_usage=0.9) for j in range(2))
    a = decide(FleetSignals(pods), state, spec, 180.0)
    b = decide(FleetSignals(pods), restored, spec, 180.0)
    assert a == b


def test_state_stays_small():
    spec = AutoscalingSpec(max_replicas=8)
    state = PolicyState()
    for i in range(500):
        state = decide(FleetSignals((pod("a"),)), state, spec, 15.0 * i).state
    assert len(state.demand) <= spec.forecast_window_seconds / spec.interval_seconds + 1
    assert len(state.recommendations) <= spec.scale_down_stabilization_seconds / 15 + 2
    assert len(json.dumps(state.to_dict())) < 2000


def test_from_dict_fresh_and_malformed():
    assert PolicyState.from_dict(None) == PolicyState() == PolicyState.from_dict({})
    with pytest.raises(ValueError, match="version must be 1; got 7"):
        PolicyState.from_dict({"version": 7})
    with pytest.raises(ValueError, match="malformed policy state"):
        PolicyState.from_dict({"demand": [["x", 1]]})


def test_pruning_keeps_one_recommendation_at_the_window_start():
    recs = tuple(Recommendation(t, 3, 3) for t in (0.0, 100.0, 200.0, 300.0, 400.0))
    pruned = PolicyState((), recs).pruned(now=400.0, demand_window=120.0, rec_window=250.0)
    assert [r.time for r in pruned.recommendations] == [100.0, 200.0, 300.0, 400.0]
    # A clock that went backwards drops the entries "from the future".
    assert PolicyState((), recs).pruned(250.0, 120.0, 1000.0).recommendations[-1].time == 200.0


# ------------------------------------------------------------- latency windows
def test_latency_window_quantile_interpolates_like_histogram_quantile():
    from kvpilot.autoscaler import LatencyWindow

    inf = float("inf")
    # 10 observations: 4 in (0, 0.1], 4 in (0.1, 0.2], 2 in (0.2, 0.5]
    w = LatencyWindow(((0.1, 4), (0.2, 8), (0.5, 10), (inf, 10)), sum_seconds=1.5)
    assert w.count == 10
    assert w.mean == pytest.approx(0.15)
    assert w.quantile(0.5) == pytest.approx(0.125)  # rank 5: 1/4 into (0.1, 0.2]
    assert w.quantile(0.9) == pytest.approx(0.35)  # rank 9: half into (0.2, 0.5]
    assert w.quantile(0.2) == pytest.approx(0.05)


def test_latency_window_top_bucket_and_empty():
    from kvpilot.autoscaler import LatencyWindow

    inf = float("inf")
    w = LatencyWindow(((0.1, 1), (1.0, 1), (inf, 5)), sum_seconds=50.0)
    assert w.quantile(0.9) == 1.0  # in +Inf: the highest finite bound (PromQL)
    empty = LatencyWindow(((0.1, 0), (inf, 0)), sum_seconds=0.0)
    assert empty.quantile(0.9) is None and empty.mean is None


@pytest.mark.parametrize("buckets, total, match", [
    (((0.1, 1), (1.0, 2)), 1.0, "Inf"),
    (((0.5, 1), (0.1, 2), (float("inf"), 2)), 1.0, "increase"),
    (((0.1, 3), (float("inf"), 2)), 1.0, "cumulative"),
    (((0.1, 1), (float("inf"), 2)), -1.0, "sum_seconds"),
])
def test_latency_window_refuses_malformed(buckets, total, match):
    from kvpilot.autoscaler import LatencyWindow

    with pytest.raises(ValueError, match=match):
        LatencyWindow(buckets, sum_seconds=total)


def test_pod_latency_fields_are_not_load_signals():
    from kvpilot.autoscaler import LatencyWindow

    p = pod("a")
    assert p.itl is None and p.ttft is None and p.step_tokens is None and p.missing == ()
    with pytest.raises(ValueError, match="itl"):
        pod("a", itl=(0.1, 3))
    w = LatencyWindow(((0.1, 1), (float("inf"), 1)), 0.05)
    assert pod("a", itl=w, step_tokens=12.0).itl is w
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        FleetSignals((p,), max_num_batched_tokens=0)
