"""Scale to zero in the policy (kvpilot.autoscaler.zero): to zero only after a full idle
run, back to one when the router holds a request, never on missing data."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpilot.autoscaler import AutoscalingSpec, FleetSignals, PodSignals, PolicyState, decide

ZERO = AutoscalingSpec(min_replicas=0, max_replicas=4, interval_seconds=15,
                       scale_down_stabilization_seconds=60, scale_to_zero_after_seconds=60)


def idle_pod(name: str = "chat-0", **kw) -> PodSignals:
    values = dict(kv_usage=0.0, num_waiting=0.0, waiting_tokens=0.0, num_running=0.0,
                  preemption_rate=0.0, kv_capacity_tokens=16384.0)
    values.update(kw)
    return PodSignals(name, **values)


def run(spec, signals_at, start=0.0, steps=10, state=None):
    """Decide every 15 s from ``start``; ``signals_at(t)`` gives the observation while the
    fleet has pods (after a decision for zero, it has none). Returns the decisions."""
    state = state or PolicyState()
    out = []
    for i in range(steps):
        now = start + 15.0 * i
        at_zero = bool(out) and out[-1].desired_replicas == 0
        decision = decide(FleetSignals(()) if at_zero else signals_at(now), state, spec, now)
        state = decision.state
        out.append(decision)
    return out


def test_an_idle_fleet_goes_to_zero_after_the_idle_run_and_not_before():
    decisions = run(ZERO, lambda t: FleetSignals((idle_pod(),), requests_finished=7.0), steps=7)
    # t=0: no previous count (not idle yet); idle from t=15; 60 s later, at t=75: zero.
    assert [d.desired_replicas for d in decisions] == [1, 1, 1, 1, 1, 0, 0]
    zero = decisions[5]
    assert (zero.direction, zero.rule, zero.signal) == ("down", "scale_to_zero", "idle_seconds")
    assert zero.value == 60.0 and "no request for 60 s" in zero.reason
    assert zero.state.idle_since is None and zero.state.last_scale_down_time == 75.0


def test_a_finished_request_between_two_reads_restarts_the_idle_run():
    # Nothing is running at any read, but the finished count moves at t=45.
    def signals(t):
        return FleetSignals((idle_pod(),), requests_finished=7.0 if t < 45 else 8.0)
    decisions = run(ZERO, signals, steps=10)
    assert [d.desired_replicas for d in decisions] == [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]
    assert decisions[3].state.idle_since is None  # t=45: traffic
    assert decisions[8].rule == "scale_to_zero"  # idle from t=60, zero at t=120


@pytest.mark.parametrize("busy", [
    {"pods": (idle_pod(num_running=1.0),)},
    {"pods": (idle_pod(num_waiting=2.0),)},
    {"pods": (idle_pod(num_running=None),)},  # missing is not idle
    {"pods": (idle_pod(),), "router_queued": 1.0},
    {"pods": (idle_pod(),), "requests_without_engine": 3.0},
    {"pods": (idle_pod(),), "pending_replicas": 1},
    {"pods": (idle_pod(),), "requests_finished": None},
], ids=["running", "waiting", "missing-running", "router-held", "no-engine", "pending",
        "finished-unknown"])
def test_traffic_or_missing_data_never_goes_to_zero(busy):
    fields = {"requests_finished": 7.0, **busy}
    decisions = run(ZERO, lambda t: FleetSignals(**fields), steps=12)
    assert min(d.desired_replicas for d in decisions) >= 1
    assert all(d.state.idle_since is None for d in decisions)


def test_without_min_replicas_zero_an_idle_fleet_stays_at_one():
    spec = replace(ZERO, min_replicas=1)
    decisions = run(spec, lambda t: FleetSignals((idle_pod(),), requests_finished=7.0), steps=12)
    assert {d.desired_replicas for d in decisions} == {1}
    assert all(d.state.idle_since is None for d in decisions)  # not tracked


def test_an_idle_fleet_of_several_goes_to_zero_at_once():
    pods = (idle_pod("chat-0"), idle_pod("chat-1"), idle_pod("chat-2"))
    spec = replace(ZERO, scale_down_stabilization_seconds=3600)  # the ordinary path holds
    decisions = run(spec, lambda t: FleetSignals(pods, requests_finished=3.0), steps=7)
    assert [d.desired_replicas for d in decisions] == [3, 3, 3, 3, 3, 0, 0]


def test_the_ordinary_policy_never_goes_below_one_with_min_replicas_zero():
    # Low but real traffic (a request running): the scale-down stops at one.
    pods = (idle_pod("chat-0", num_running=1.0, kv_usage=0.01), idle_pod("chat-1"))
    decisions = run(ZERO, lambda t: FleetSignals(pods, requests_finished=1.0), steps=20)
    assert min(d.desired_replicas for d in decisions) == 1
    assert decisions[-1].rule != "scale_to_zero"


def test_at_zero_the_fleet_stays_until_the_router_holds_a_request():
    state = PolicyState(idle_since=10.0, requests_finished=5.0)
    quiet = decide(FleetSignals(()), state, ZERO, 100.0)
    assert (quiet.desired_replicas, quiet.direction, quiet.rule) == (0, "hold", "scaled_to_zero")
    assert quiet.metrics_available and quiet.limited is None
    assert quiet.state.idle_since is None and quiet.state.requests_finished is None
    held = decide(FleetSignals((), requests_without_engine=4.0), quiet.state, ZERO, 101.0)
    assert (held.desired_replicas, held.direction, held.rule) == (1, "up", "activation")
    assert (held.signal, held.value) == ("requests_without_engine", 4.0)
    assert held.state.last_scale_time == 101.0


def test_activation_asks_for_min_replicas_when_above_one():
    # minReplicas 0 is the only way to zero; the floor otherwise is max(1, minReplicas).
    spec = replace(ZERO, min_replicas=0, max_replicas=4)
    assert spec.floor == 1
    assert AutoscalingSpec(min_replicas=2, max_replicas=4).floor == 2


def test_a_starting_pod_after_activation_is_not_idle_and_holds():
    # Deployment at 1, the pod still loading: current 1, nothing ready, no metrics.
    decision = decide(FleetSignals((), pending_replicas=1), PolicyState(), ZERO, 0.0)
    assert (decision.desired_replicas, decision.rule) == (1, "missing_metrics")
    assert decision.state.idle_since is None


def test_state_round_trips_the_idle_run():
    state = PolicyState(idle_since=12.5, requests_finished=40.0)
    assert PolicyState.from_dict(state.to_dict()) == state
    # A state written before scale to zero existed reads as not idle.
    old = {k: v for k, v in state.to_dict().items() if k not in ("idleSince", "requestsFinished")}
    assert PolicyState.from_dict(old) == PolicyState()


def test_bad_signals_name_the_field():
    with pytest.raises(ValueError, match="requests_without_engine must be >= 0"):
        FleetSignals((), requests_without_engine=-1.0)
    with pytest.raises(ValueError, match="requests_finished must be >= 0"):
        FleetSignals((), requests_finished=float("inf"))
