"""Node headroom: the placeholder-pod count (kvpilot.autoscaler.headroom) and the node
pool the simulator models them on (kvpilot.autoscaler.sim.nodes)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpilot.autoscaler.headroom import HeadroomState, headroom
from kvpilot.autoscaler.sim import Scenario, make_trace, simulate
from kvpilot.autoscaler.sim.controllers import HeadroomPolicy, KvPilotPolicy
from kvpilot.autoscaler.sim.model import ReplicaModel
from kvpilot.autoscaler.sim.nodes import NodeModel, NodePool
from kvpilot.autoscaler.spec import AutoscalingSpec
from kvpilot.autoscaler.state import PolicyState

SPEC = AutoscalingSpec(min_replicas=1, max_replicas=20, target_cache_usage=0.5, startup_seconds=120)


def demand(points):
    return PolicyState(demand=tuple(points))


def test_a_significant_rise_keeps_placeholders_for_a_node_then_a_pod():
    # 0.1 replica-eq per 15 s = 0.4/min, over 120 s: a clean ramp from 2.0 to 2.8.
    state = demand((t, 2.0 + t / 150) for t in range(0, 135, 15))
    got = headroom(state, SPEC, desired=6, now=120, node_startup_seconds=300, previous=HeadroomState())
    # horizon 300 + 150 s: 2.8 + 0.4/min x 7.5 min = 5.8 replica-eq, at 50% -> 12 replicas
    assert got.replicas == 12 - 6 and got.lower_since is None
    assert "in 450 s (a node, then a pod)" in got.reason
    capped = headroom(state, replace(SPEC, max_replicas=8), 6, 120, 300, HeadroomState())
    assert capped.replicas == 2  # never beyond maxReplicas


def test_placeholders_never_exceed_the_replicas_decided():
    # The same rise seen by a fleet of 3: 12 needed, but at most 3 placeholders (one node
    # start-up may at most double the fleet); a fleet of 0 or 1 may still get one.
    state = demand((t, 2.0 + t / 150) for t in range(0, 135, 15))
    got = headroom(state, SPEC, desired=3, now=120, node_startup_seconds=300, previous=HeadroomState())
    assert got.replicas == 3 and "(at most 1 x the replicas decided)" in got.reason
    assert headroom(state, SPEC, 1, 120, 300, HeadroomState()).replicas == 1
    assert headroom(state, SPEC, 0, 120, 300, HeadroomState()).replicas == 1


def test_flat_demand_keeps_none_and_placeholders_come_down_after_the_window():
    flat = demand((t, 2.0) for t in range(0, 135, 15))
    assert headroom(flat, SPEC, 4, 120, 300, HeadroomState()).replicas == 0
    held = headroom(flat, SPEC, 4, 120, 300, HeadroomState(3))
    assert held.replicas == 3 and held.lower_since == 120  # lower answer: wait
    later = headroom(flat, SPEC, 4, 120 + SPEC.scale_down_stabilization_seconds - 1, 300, held)
    assert later.replicas == 3
    done = headroom(flat, SPEC, 4, 120 + SPEC.scale_down_stabilization_seconds, 300, later)
    assert done.replicas == 0 and done.lower_since is None


def test_no_history_no_placeholders_and_bad_input_is_refused():
    assert headroom(PolicyState(), SPEC, 3, 0, 300, HeadroomState()).replicas == 0
    with pytest.raises(ValueError, match="node_startup_seconds must be > 0; got 0"):
        headroom(PolicyState(), SPEC, 3, 0, 0, HeadroomState())
    assert HeadroomState.from_dict({"replicas": 2, "lowerSince": 5.0, "reason": "x"}) == HeadroomState(2, 5.0, "x")
    assert HeadroomState.from_dict({"replicas": -1}) == HeadroomState()
    assert HeadroomState.from_dict("garbage") == HeadroomState()


class Events:
    def __init__(self):
        self.bound, self.requested = [], []


def pool(pods_per_node=1, start=300.0, scale_down=600.0):
    ev = Events()
    p = NodePool(NodeModel(start, pods_per_node, scale_down), lambda rid, t: ev.bound.append((rid, t)),
                 lambda node: ev.requested.append(node))
    return p, ev


def test_pods_bind_to_free_slots_then_wait_for_a_node():
    p, ev = pool(pods_per_node=2)
    p.add_ready_nodes(1, 0.0)
    assert p.schedule_engine(0, 0.0) and p.schedule_engine(1, 0.0)
    assert not p.schedule_engine(2, 10.0)  # full: pending, a node is asked for
    assert [n.ready_at for n in ev.requested] == [310.0]
    assert not p.schedule_engine(3, 20.0)  # the coming node has room for it: no second node
    assert len(ev.requested) == 1
    p.node_ready(ev.requested[0], 310.0)
    assert ev.bound[-2:] == [(2, 310.0), (3, 310.0)]


def test_an_engine_preempts_a_placeholder_which_asks_for_a_node():
    p, ev = pool()
    p.add_ready_nodes(1, 0.0)
    p.set_placeholders(1, 0.0)  # binds to the free node
    assert p.placeholders == 1 and not ev.requested
    assert p.schedule_engine(7, 5.0)  # takes the placeholder's slot at once
    assert ev.bound == [(7, 5.0)]
    assert p.pending_placeholders == 1 and len(ev.requested) == 1  # the placeholder wants a node
    p.set_placeholders(0, 6.0)  # no longer wanted: the pending one goes
    assert p.placeholders == 0


def test_empty_nodes_go_after_the_scale_down_time_and_are_billed_until_then():
    p, _ = pool(scale_down=600.0)
    p.add_ready_nodes(2, 0.0)
    p.schedule_engine(0, 0.0)
    p.release_engine(0, 100.0)
    p.scale_down(650.0)
    assert list(p.nodes) == [0]  # node 1, empty since 0, went; node 0 only since 100
    p.scale_down(700.0)
    assert len(p.nodes) == 0
    p.close(1000.0)
    assert p.node_seconds == pytest.approx(650.0 + 700.0)  # each billed until it went


def test_headroom_cuts_starvation_when_nodes_are_slow():
    model = ReplicaModel()
    scenario = Scenario(peak_replicas=6, duration_seconds=2400, seed=1)
    trace = make_trace("ramp", scenario.peak_replicas, scenario.duration_seconds, 1, model,
                       scenario.target_cache_usage)
    config = replace(scenario.config(trace), nodes=NodeModel(300.0, 1, 600.0))
    spec = scenario.spec(trace, model)
    pods_only = simulate(trace, KvPilotPolicy(spec), model, config)
    ahead = simulate(trace, HeadroomPolicy(spec, 300.0), model, config)
    assert pods_only.node_hours > 0 and ahead.placeholder_hours > 0
    # A small fleet and one seed (0.54x here); the goal is measured in benchmarks/.
    assert ahead.starvation_seconds < 0.75 * pods_only.starvation_seconds
    # Without a node model nothing changes: placeholders need nodes to mean anything.
    plain = simulate(trace, HeadroomPolicy(spec, 300.0), model, scenario.config(trace))
    assert plain.node_hours == 0 and plain.placeholder_hours == 0
