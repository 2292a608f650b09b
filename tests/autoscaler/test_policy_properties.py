"""Properties of decide() over arbitrary observation sequences (hypothesis)."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.autoscaler import AutoscalingSpec, FleetSignals, PodSignals, PolicyState, decide

from .plant import Plant, direction_changes


def maybe(strategy):
    return st.one_of(st.none(), strategy)


pods = st.builds(
    lambda usage, waiting, tokens, running, rate, cap: (usage, waiting, tokens, running, rate, cap),
    maybe(st.floats(0, 1)),
    maybe(st.integers(0, 60)),
    maybe(st.integers(0, 2_000_000)),
    maybe(st.integers(0, 300)),
    maybe(st.sampled_from([0.0, 0.0, 0.0, 0.2, 3.0])),
    maybe(st.sampled_from([16_384, 100_000, 464_688])),
)
observations = st.tuples(
    st.lists(pods, max_size=10), st.integers(0, 5), st.sampled_from([15.0, 15.0, 15.0, 60.0])
)


@st.composite
def specs(draw):
    low = draw(st.integers(1, 6))
    return AutoscalingSpec(
        min_replicas=low,
        max_replicas=draw(st.integers(low, low + 20)),
        target_cache_usage=draw(st.sampled_from([0.5, 0.7, 0.75, 0.85])),
        target_queue_depth=draw(st.sampled_from([1.0, 4.0, 16.0])),
        startup_seconds=draw(st.sampled_from([0.0, 60.0, 120.0, 600.0])),
        scale_up_stabilization_seconds=draw(st.sampled_from([0.0, 0.0, 60.0])),
        scale_down_stabilization_seconds=draw(st.sampled_from([0.0, 60.0, 300.0])),
    )


def fleet(pod_values, pending):
    return FleetSignals(tuple(PodSignals(f"p{i}", *v) for i, v in enumerate(pod_values)), pending)


def replay(spec, sequence):
    """Yield (signals, decision) along a sequence, threading the state and the clock."""
    state, now = PolicyState(), 0.0
    for pod_values, pending, gap in sequence:
        signals = fleet(pod_values, pending)
        d = decide(signals, state, spec, now)
        yield signals, d
        state, now = d.state, now + gap


@settings(max_examples=120, deadline=None)
@given(specs(), st.lists(observations, min_size=1, max_size=25))
def test_never_outside_min_max(spec, sequence):
    for _, d in replay(spec, sequence):
        assert spec.min_replicas <= d.desired_replicas <= spec.max_replicas


@settings(max_examples=120, deadline=None)
@given(specs(), st.lists(observations, min_size=1, max_size=25))
def test_never_down_on_missing_data(spec, sequence):
    """C15/C17: with any signal missing the count only goes down to honour maxReplicas."""
    for signals, d in replay(spec, sequence):
        if d.missing_pods or not d.metrics_available:
            assert d.desired_replicas >= min(signals.current_replicas, spec.max_replicas)


@settings(max_examples=120, deadline=None)
@given(specs(), st.lists(observations, min_size=1, max_size=25))
def test_a_scale_up_never_waits_for_a_window(spec, sequence):
    """Whatever the history, the forecast and the starvation alarm act at once, and with no
    scale-up window neither do the reactive rules: no scale-down window ever delays them."""
    for signals, d in replay(spec, sequence):
        urgent = [
            c.replicas
            for c in d.candidates
            if c.rule in {"forecast", "starvation"} and c.replicas is not None
        ]
        if spec.scale_up_stabilization_seconds == 0:
            urgent += [c.replicas for c in d.candidates if c.replicas is not None]
        wanted = max(urgent, default=0)
        if wanted > signals.current_replicas:
            assert d.direction == "up" or signals.current_replicas >= spec.max_replicas
            assert d.desired_replicas >= min(max(wanted, spec.min_replicas), spec.max_replicas)


@settings(max_examples=120, deadline=None)
@given(specs(), st.lists(observations, min_size=1, max_size=25))
def test_state_is_json_and_replays_identically(spec, sequence):
    state = PolicyState()
    for _, d in replay(spec, sequence):
        state = d.state
    assert PolicyState.from_dict(json.loads(json.dumps(state.to_dict()))) == state


@settings(max_examples=40, deadline=None)
@given(
    demand=st.floats(0.0, 30.0),
    ready=st.integers(1, 20),
    startup_steps=st.integers(0, 12),
    spec=specs(),
)
def test_no_oscillation_on_a_steady_load(demand, ready, startup_steps, spec):
    """A constant load: the count may move toward a level (and correct one overshoot), then
    stays put."""
    plant = Plant(spec, ready=max(ready, spec.min_replicas), startup_steps=startup_steps)
    counts = [d.desired_replicas for d in plant.run(lambda step: demand, 160)]
    assert direction_changes(counts) <= 1
    assert len(set(counts[-40:])) == 1
