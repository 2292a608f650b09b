"""decide() over time on a closed-loop plant: ramp, spike, sawtooth, zero traffic, missing
metrics (C15, C17) and steady load."""

from kvpilot.autoscaler import AutoscalingSpec, FleetSignals, PodSignals, PolicyState, decide

from .plant import Plant, direction_changes, pods_for

SPEC = AutoscalingSpec(min_replicas=1, max_replicas=40)


def counts(decisions):
    return [d.desired_replicas for d in decisions]


def test_ramp_forecast_scales_before_any_pod_is_full():
    """Demand rises 0.6 replica-eq per minute; a pod takes 8 intervals (120 s) to start.
    The forecast asks for pods while the fleet still has headroom; nobody ever queues."""
    plant = Plant(SPEC, ready=4, startup_steps=8)
    decisions = plant.run(lambda step: 2.0 + 0.01 * 15 * step, 120)
    first_up = next(d for d in decisions if d.direction == "up")
    assert first_up.rule == "forecast"
    max_usage_then = max(c.value or 0 for c in first_up.candidates if c.rule == "starvation")
    assert max_usage_then < SPEC.starvation_usage
    assert all(d.rule != "starvation" and d.rule != "queue_drain" for d in decisions)
    assert all(d.direction != "down" for d in decisions)


def test_spike_scales_up_at_once_and_counts_pending_as_supply():
    plant = Plant(SPEC, ready=4, startup_steps=8)
    plant.run(lambda step: 3.0, 30)
    spike = plant.tick(12.0)
    assert spike.direction == "up" and spike.desired_replicas >= 12
    assert spike.rule in {"queue_drain", "starvation"}
    # While those pods start, the same pressure does not ask again.
    during = [plant.tick(12.0) for _ in range(6)]
    assert all(d.direction == "hold" for d in during)
    assert len({d.desired_replicas for d in during}) == 1


def test_sawtooth_shorter_than_the_window_never_scales_down():
    """Load swings between 2 and 6 replica-eq every 2 minutes: scale up for the peaks and
    keep them, since the low phases never last a full scale-down window."""
    plant = Plant(SPEC, ready=6, startup_steps=8)
    decisions = plant.run(lambda step: 6.0 if (step // 8) % 2 == 0 else 2.0, 200)
    assert all(d.direction != "down" for d in decisions[20:])
    assert direction_changes(counts(decisions)) == 0


def test_zero_traffic_steps_down_one_at_a_time_after_a_full_window_to_min():
    spec = AutoscalingSpec(min_replicas=2, max_replicas=10)
    plant = Plant(spec, ready=8)
    decisions = plant.run(lambda step: 0.0, 200)
    downs = [(i, d) for i, d in enumerate(decisions) if d.direction == "down"]
    first_step = downs[0][0]
    assert first_step * spec.interval_seconds >= spec.scale_down_stabilization_seconds
    assert all(d.current_replicas - d.desired_replicas == 1 for _, d in downs)
    assert decisions[-1].desired_replicas == spec.min_replicas
    assert plant.decisions[-1].rule in {"hold"}  # at min: nothing further to do
    assert all(d.desired_replicas >= spec.min_replicas for d in decisions)


def test_steady_load_settles_and_never_moves_again():
    plant = Plant(SPEC, ready=2, startup_steps=8)
    decisions = plant.run(lambda step: 4.5, 300)
    tail = counts(decisions[60:])
    assert len(set(tail)) == 1
    assert 0.9 * SPEC.target_cache_usage <= 4.5 / tail[0] <= SPEC.target_cache_usage * 1.1


def test_c15_metrics_missing_for_several_intervals_hold_replicas_then_resume():
    """The source is unreachable (no pod reports anything) for 10 intervals while the load
    is low: replicas are held, MetricsAvailable is false; scaling resumes after."""
    plant = Plant(SPEC, ready=6)
    plant.run(lambda step: 1.0, 15)  # low load, inside the 300 s window: holding anyway
    everyone = lambda ready: frozenset(range(ready))  # noqa: E731
    blind = [plant.tick(1.0, missing=everyone) for _ in range(10)]
    assert all(d.direction == "hold" and d.desired_replicas == 6 for d in blind)
    assert all(not d.metrics_available and d.rule == "missing_metrics" for d in blind)
    assert "metrics missing" in blind[0].reason
    resumed = [plant.tick(1.0) for _ in range(60)]
    assert all(d.metrics_available for d in resumed)
    # The missing stretch broke the window: the first step down needs a new full window.
    first_down = next(i for i, d in enumerate(resumed) if d.direction == "down")
    assert first_down * SPEC.interval_seconds >= SPEC.scale_down_stabilization_seconds
    assert resumed[-1].desired_replicas < 6


def test_c15_no_ready_pod_at_all_holds():
    d = decide(FleetSignals((), 3), PolicyState(), SPEC, 0.0)
    assert d.direction == "hold" and d.desired_replicas == 3 and not d.metrics_available


def test_c17_an_empty_vector_for_one_pod_is_missing_not_zero():
    """A wrong metric name or label leaves one pod's series empty: the metric source passes
    None. The policy must not read that pod as idle (which would invite a scale-down)."""
    plant = Plant(SPEC, ready=6)
    one_blind = lambda ready: frozenset({0})  # noqa: E731
    decisions = [plant.tick(1.0, missing=one_blind) for _ in range(60)]
    assert all(d.direction != "down" for d in decisions)
    assert decisions[-1].missing_pods == ("p0",)
    assert "never scale down on missing data" in decisions[-1].reason


def test_c17_partial_data_can_still_scale_up():
    """Missing pods count as zero load (HPA's rule for a scale-up), so pressure seen on the
    pods that do report still adds replicas."""
    pods = pods_for(8.0, 4, missing=frozenset({3}))
    d = decide(FleetSignals(pods), PolicyState(), SPEC, 0.0)
    assert d.direction == "up" and d.metrics_available


def test_bounds_are_reported_for_scaling_limited():
    spec = AutoscalingSpec(min_replicas=1, max_replicas=5)
    d = decide(FleetSignals(pods_for(20.0, 4)), PolicyState(), spec, 0.0)
    assert d.desired_replicas == 5 and d.limited == "max" and d.unclamped_replicas > 5
    assert "limited to maxReplicas=5" in d.reason
    below = decide(
        FleetSignals(pods_for(0.0, 1)),
        PolicyState(),
        AutoscalingSpec(min_replicas=3, max_replicas=5),
        0.0,
    )
    assert below.desired_replicas == 3 and below.rule == "bounds" and below.limited == "min"


def test_above_max_after_a_spec_change_goes_straight_to_max():
    d = decide(FleetSignals(pods_for(1.0, 8)), PolicyState(), AutoscalingSpec(max_replicas=5), 0.0)
    assert d.desired_replicas == 5 and d.direction == "down" and d.rule == "bounds"


def test_consolidation_blocks_a_step_that_would_overload_the_rest():
    """The window says lower, but one replica fewer would run above target less tolerance."""
    plant = Plant(SPEC, ready=5)
    decisions = plant.run(lambda step: 3.0, 60)  # 0.6 per pod; 4 pods would run 0.75
    assert all(d.desired_replicas == 5 for d in decisions)
    assert any("consolidation check" in d.reason for d in decisions)


def test_decision_to_dict_is_plain_json():
    import json

    d = decide(FleetSignals(pods_for(2.0, 2)), PolicyState(), SPEC, 0.0)
    data = json.loads(json.dumps(d.to_dict()))
    assert {c["rule"] for c in data["candidates"]} == {
        "headroom",
        "saturation",
        "queue_drain",
        "forecast",
        "starvation",
        "latency",  # no opinion without an SLO, listed all the same
    }
    assert data["desiredReplicas"] == d.desired_replicas


def test_pod_signals_are_what_a_metric_source_builds():
    pod = PodSignals(
        "chat-0",
        kv_usage=0.4,
        num_waiting=0,
        waiting_tokens=0,
        num_running=3,
        preemption_rate=0.0,
        kv_capacity_tokens=16384,
    )
    assert pod.missing == ()
    assert PodSignals("chat-1").missing == (
        "kv_usage",
        "num_waiting",
        "waiting_tokens",
        "num_running",
        "preemption_rate",
    )


def _hot_spot(ready: int, pending: int, hot: float = 0.96) -> FleetSignals:
    """One pod full (0.96), every other nearly idle: a Service routed long requests there."""
    def pod(name, usage):
        return PodSignals(name, kv_usage=usage, num_waiting=0, waiting_tokens=0, num_running=1,
                          preemption_rate=0.0, kv_capacity_tokens=100_000)
    return FleetSignals((pod("hot", hot), *(pod(f"p{i}", 0.05) for i in range(ready - 1))),
                        pending)


def test_a_hot_spot_gets_one_replica_per_episode_not_a_ratchet_to_max():
    """Found in review: the alarm asked for ready + 1 at every decision, so each pod it
    added, once ready, raised the ask again: 2 -> 20 in 18 minutes while the fleet idled
    at 10% usage, and never back down. Now: +1 when the episode begins, then it holds."""
    spec = AutoscalingSpec(min_replicas=2, max_replicas=20, startup_seconds=60)
    state, ready, pending, t = PolicyState(), 2, 0, 0.0
    started: list[float] = []
    for _ in range(120):  # 30 minutes at the 15 s interval
        ready += sum(1 for s in started if t - s >= 60)
        started = [s for s in started if t - s < 60]
        pending = len(started)
        d = decide(_hot_spot(ready, pending), state, spec, t)
        state = d.state
        started += [t] * max(0, d.desired_replicas - ready - pending)
        t += spec.interval_seconds
    assert ready + pending == 3
    assert state.starvation_base_replicas == 2
    # The episode ends when no pod starves; the next one may add one again.
    calm = decide(_hot_spot(3, 0, hot=0.5), state, spec, t)
    assert calm.state.starvation_base_replicas is None
    again = decide(_hot_spot(3, 0), calm.state, spec, t + 15)
    assert (again.direction, again.desired_replicas, again.rule) == ("up", 4, "starvation")


def test_the_starvation_episode_survives_a_restart_through_the_state_dict():
    spec = AutoscalingSpec(min_replicas=2, max_replicas=20)
    first = decide(_hot_spot(2, 0), PolicyState(), spec, 0.0)
    assert (first.direction, first.desired_replicas) == ("up", 3)
    restored = PolicyState.from_dict(first.state.to_dict())
    assert restored.starvation_base_replicas == 2
    later = decide(_hot_spot(3, 0), restored, spec, 120.0)  # the new pod is ready, still hot
    assert later.desired_replicas == 3
