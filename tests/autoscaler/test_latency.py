"""The SLO: the latency model (kvpilot.autoscaler.latency), the ``latency`` rule, its
part of the consolidation check, the fallback for engines without histograms, and the
spec's refusals."""

from __future__ import annotations

import math
import random

import pytest

from kvpilot.autoscaler import (
    AutoscalingSpec,
    FleetSignals,
    LatencyWindow,
    PodSignals,
    PolicyState,
    SloSpec,
    decide,
)
from kvpilot.autoscaler.latency import (
    MIN_INFORMED_READS,
    PRIORS,
    ItlFit,
    LatencyModel,
    LatencyView,
    TtftView,
    itl_samples,
    pooled,
    prefill_capacity,
    prefix_rates,
)
from kvpilot.autoscaler.rules import NO_HISTOGRAMS
from kvpilot.autoscaler.windows import closed_loop_itl, latency_blocker

INF = math.inf


def window_at(quantile_value: float, count: float = 100.0, q: float = 0.9) -> LatencyWindow:
    """A window whose ``q`` quantile is exactly ``quantile_value`` (q x count observations
    in the first bucket, bounded by it; the rest above)."""
    return LatencyWindow(((quantile_value, q * count), (quantile_value * 4, count), (INF, count)),
                         quantile_value * count)


def pod(name: str, running: float = 10, usage: float = 0.3, itl: LatencyWindow | None = None,
        ttft: LatencyWindow | None = None, waiting: float = 0, waiting_tokens: float = 0,
        step_tokens: float | None = None) -> PodSignals:
    return PodSignals(name, kv_usage=usage, num_waiting=waiting, waiting_tokens=waiting_tokens,
                      num_running=running, preemption_rate=0.0, kv_capacity_tokens=10000,
                      itl=itl, ttft=ttft, step_tokens=step_tokens)


def slo_spec(**slo) -> AutoscalingSpec:
    return AutoscalingSpec(max_replicas=20, scale_down_stabilization_seconds=30,
                           slo=SloSpec(**slo))


# ---------------------------------------------------------------- the spec
@pytest.mark.parametrize("kwargs,message", [
    ({"itl_seconds": 0}, "slo.itlSeconds must be a number in (0, 86400] seconds; got 0"),
    ({"itl_seconds": -0.1}, "slo.itlSeconds must be a number in (0, 86400] seconds; got -0.1"),
    ({"ttft_seconds": "fast"}, "slo.ttftSeconds must be a number in (0, 86400] seconds; got 'fast'"),
    ({"ttft_seconds": 86401}, "slo.ttftSeconds must be a number in (0, 86400] seconds; got 86401"),
    ({"ttft_seconds": float("nan")}, "slo.ttftSeconds must be a number"),
    ({"itl_seconds": True}, "slo.itlSeconds must be a number in (0, 86400] seconds; got True"),
    ({"itl_seconds": 0.1, "percentile": 0}, "slo.percentile must be a number in (0, 1), e.g. 0.9; got 0"),
    ({"itl_seconds": 0.1, "percentile": 1.0}, "slo.percentile must be a number in (0, 1)"),
    ({"itl_seconds": 0.1, "percentile": 99}, "slo.percentile must be a number in (0, 1)"),
    ({}, "slo needs ttftSeconds or itlSeconds (or both); got neither"),
    ({"itl_seconds": 0.1, "profile": "tpu"}, "slo profile must be one of cpu, gpu; got 'tpu'"),
])
def test_slo_spec_refuses_bad_values_by_name(kwargs, message):
    with pytest.raises(ValueError) as err:
        SloSpec(**kwargs)
    assert message in str(err.value)


def test_slo_spec_from_and_to_the_crd():
    spec = AutoscalingSpec.from_crd({"maxReplicas": 4, "slo": {"itlSeconds": 0.05}})
    assert spec.slo == SloSpec(itl_seconds=0.05, percentile=0.9)
    assert spec.slo.quantile_label == "p90"
    assert AutoscalingSpec.from_crd(spec.to_crd()) == spec
    assert "slo" not in AutoscalingSpec(max_replicas=4).to_crd()
    with pytest.raises(ValueError, match=r"slo\.ttftSeconds must be a number"):
        AutoscalingSpec.from_crd({"slo": {"ttftSeconds": -1}})
    with pytest.raises(ValueError, match="slo must be an object"):
        AutoscalingSpec.from_crd({"slo": 0.5})


# ---------------------------------------------------------------- the model
def test_the_model_converges_on_a_known_line():
    """Samples from itl = 0.040 + 0.003 b (+-5% noise) at batches 2..40: the fit finds
    a and c within a few percent, far from the CPU prior (0.027, 0.00625)."""
    a, c = 0.040, 0.003
    rng = random.Random(7)
    model = LatencyModel(0.9)
    for _ in range(40):
        samples = [(b, (a + c * b) * rng.uniform(0.95, 1.05)) for b in (2, 8, 16, 24, 40)]
        model = model.update(samples, observations=500)
    fit = model.fit(PRIORS["cpu"])
    assert fit.trusted and fit.informed_reads == 40
    assert fit.a == pytest.approx(a, rel=0.08)
    assert fit.c == pytest.approx(c, rel=0.05)
    assert fit.max_batch(0.100) == pytest.approx((0.100 - a) / c, rel=0.06)


def test_the_model_converges_through_the_policy_from_histograms():
    """The same through decide(): per-pod ITL windows whose p90 is a + c x num_running."""
    a, c = 0.020, 0.004
    spec = slo_spec(itl_seconds=5.0)  # a loose target: only the fit is under test
    state = PolicyState()
    batches = (3, 9, 20, 31)
    for i in range(30):
        pods = tuple(pod(f"p{k}", running=b, itl=window_at(a + c * b)) for k, b in enumerate(batches))
        d = decide(FleetSignals(pods, max_num_seqs=64), state, spec, 1000.0 + 15 * i)
        state = d.state
    assert d.latency is not None and d.latency["trusted"] is True
    assert d.latency["itlA"] == pytest.approx(a, rel=0.03)
    assert d.latency["itlC"] == pytest.approx(c, rel=0.03)


def test_the_prior_holds_the_line_without_data_and_a_negative_slope_is_clamped():
    fit = LatencyModel(0.9).fit(PRIORS["gpu"])
    assert (fit.a, fit.c) == pytest.approx((PRIORS["gpu"].a, PRIORS["gpu"].c))
    assert not fit.trusted
    # Faster at bigger batches (noise): the slope is clamped at 0, the level is the mean.
    model = LatencyModel(0.9)
    for _ in range(30):
        model = model.update([(2, 0.09), (40, 0.05)], observations=100)
    fit = model.fit(PRIORS["cpu"])
    assert fit.c == 0.0 and 0.05 < fit.a < 0.09
    assert fit.max_batch(0.1) == math.inf and fit.max_batch(0.01) is None


def test_a_read_informs_the_model_only_with_enough_observations():
    model = LatencyModel(0.9).update([(4, 0.1)], observations=49)
    assert model.informed_reads == 0 and model.s0 == 1.0
    model = model.update([(4, 0.1)], observations=50)
    assert model.informed_reads == 1
    # No samples: the old ones are forgotten all the same.
    assert model.update([], 0).s0 == pytest.approx(0.9 * model.s0)


def test_itl_samples_skip_idle_pods_and_thin_windows():
    pods = [pod("busy", running=8, itl=window_at(0.08)),
            pod("idle", running=0, itl=window_at(0.02)),
            pod("thin", running=8, itl=window_at(0.08, count=10)),
            pod("old", running=8, itl=None)]
    samples, observations = itl_samples(pods, 0.9)
    assert samples == ((8.0, pytest.approx(0.08), 0.0),) and observations == 100


def test_pooled_windows_add_up_and_skip_other_bounds():
    one = LatencyWindow(((0.1, 5), (INF, 10)), 1.0)
    two = LatencyWindow(((0.1, 1), (INF, 2)), 0.5)
    odd = LatencyWindow(((0.2, 1), (INF, 2)), 0.5)
    total = pooled([one, two, odd])
    assert total.buckets == ((0.1, 6.0), (INF, 12.0)) and total.sum_seconds == 1.5
    assert pooled([]) is None


def test_model_state_survives_the_cr_status_and_refuses_garbage():
    model = LatencyModel(0.9).update([(4, 0.1), (8, 0.12)], observations=200)
    state = PolicyState(latency=model)
    assert PolicyState.from_dict(state.to_dict()) == state
    # A state an older operator wrote has no latency key: the prior again.
    old = state.to_dict()
    del old["latency"]
    assert PolicyState.from_dict(old).latency is None
    bad = state.to_dict()
    bad["latency"]["s0"] = "many"
    with pytest.raises(ValueError, match="malformed"):
        PolicyState.from_dict(bad)
    bad["latency"] = {**model.to_dict(), "percentile": 1.5}
    with pytest.raises(ValueError, match="percentile"):
        PolicyState.from_dict(bad)


def test_ttft_view_scales_only_the_queue_wait():
    # 2 replicas, 20,000 tokens queued, 1,000 tok/s each: 10 s of queue in a 12 s TTFT.
    view = TtftView(observed=12.0, waiting_tokens=20000, prefill_rate=1000.0, ready=2)
    assert view.base == pytest.approx(2.0)
    assert view.predict(4) == pytest.approx(2.0 + 5.0)
    assert view.replicas_for(4.0) == 10  # 2 + 20000 / (10 x 1000) = 4 s
    # No queue: the TTFT is the base; more replicas do not help.
    assert TtftView(8.0, 0.0, 1000.0, 2).replicas_for(4.0) is None
    assert TtftView(2.0, 0.0, 1000.0, 2).replicas_for(4.0) == 1


# ---------------------------------------------------------------- the policy
def run(spec, make_pods, reads, state=None, start=1000.0, max_num_seqs=64):
    """``reads`` decisions; ``make_pods(replicas)`` gives the pods of each. Returns the
    decisions (the fleet follows desired_replicas)."""
    state = state or PolicyState()
    replicas, out = None, []
    for i in range(reads):
        pods = make_pods(replicas)
        d = decide(FleetSignals(pods, max_num_seqs=max_num_seqs), state, spec, start + 15.0 * i)
        state, replicas = d.state, d.desired_replicas
        out.append(d)
    return out


def test_the_prior_scales_up_on_the_first_read():
    """40 requests on 2 replicas, CPU prior: ITL 27 + 6.25 x 20 = 152 ms > the 100 ms target;
    the prior asks for ceil(40 / ((100 - 27) / 6.25)) = 4 replicas at once."""
    spec = slo_spec(itl_seconds=0.1)
    pods = tuple(pod(f"p{k}", running=20, itl=window_at(0.15)) for k in range(2))
    d = decide(FleetSignals(pods, max_num_seqs=64), PolicyState(), spec, 0.0)
    assert (d.direction, d.desired_replicas, d.rule) == ("up", 4, "latency")
    assert d.signal == "itl_p90" and d.value == pytest.approx(0.027 + 0.00625 * 20, rel=0.05)
    assert "prior (1 of 4 informed reads)" in d.reason


def test_the_prior_never_scales_down():
    """An idle-looking fleet (KV 10%, batch 3 of 64) with an SLO and real traffic: the
    other rules would let a replica go, but until the fit is trusted the step is held;
    once it is, and the fit says 3 replicas stay well within the SLO, it goes."""
    spec = slo_spec(itl_seconds=0.5)

    def pods(replicas):
        n = replicas or 4
        return tuple(pod(f"p{k}", running=12 / n, usage=0.1, itl=window_at(0.03 + 0.002 * 12 / n))
                     for k in range(n))

    decisions = run(spec, pods, 10)
    untrusted = [d for d in decisions if d.latency["informedReads"] < MIN_INFORMED_READS]
    assert untrusted and all(d.direction != "down" for d in untrusted)
    assert any("the prior never scales down" in d.reason for d in untrusted)
    assert any(d.direction == "down" for d in decisions), [d.reason for d in decisions]
    first_down = next(d for d in decisions if d.direction == "down")
    assert first_down.latency["trusted"] is True


def trusted(a: float, c: float, batches=(5, 15, 30)) -> LatencyModel:
    """A model fitted on 30 reads of exact samples of ``a + c x b``."""
    model = LatencyModel(0.9)
    for _ in range(30):
        model = model.update([(b, a + c * b) for b in batches], observations=300)
    return model


def test_the_trusted_model_holds_a_scale_down_that_would_miss_the_slo():
    """Fitted itl = 40 + 4 ms x b, 44 requests on 4 replicas (11 each: 84 ms). The open
    loop would need ceil(44 / 15) = 3 replicas for 100 ms, but 3 replicas would run 14.7
    each and, with the requests staying longer at the slower ITL (closed loop: x = 4 x 44
    / (3 x 84) = 0.698, 40 / (1 - x) = 132-134 ms), miss it: the rule asks
    ceil(4 x 44 / (84 x 0.6)) = 4 and the consolidation check would hold 3 (> 90 ms, the
    SLO less the 10% band). With a 200 ms target the same step goes."""
    pods = tuple(pod(f"p{k}", running=11, usage=0.1, itl=window_at(0.084)) for k in range(4))
    state = PolicyState(latency=trusted(0.04, 0.004))
    spec = AutoscalingSpec(max_replicas=20, scale_down_stabilization_seconds=0,
                           slo=SloSpec(itl_seconds=0.1))
    d = decide(FleetSignals(pods, max_num_seqs=64), state, spec, 0.0)
    latency = next(c for c in d.candidates if c.rule == "latency")
    assert latency.replicas == 4
    assert d.direction == "hold"
    fit = ItlFit(0.04, 0.004, 10.0, 10, True)
    lv = LatencyView("p90", True, fit, 0.084, None, requests=44.0, growth=1.0,
                     max_num_seqs=64, ready=4)
    blocker = latency_blocker(lv, 3, spec)
    assert blocker and "3 replicas would run 14.7 requests each at a predicted ITL p90 of 133 ms > 90 ms" in blocker
    loose = AutoscalingSpec(max_replicas=20, scale_down_stabilization_seconds=0,
                            slo=SloSpec(itl_seconds=0.2))
    d = decide(FleetSignals(pods, max_num_seqs=64), state, loose, 0.0)
    assert (d.direction, d.desired_replicas) == ("down", 3)


def test_the_scale_down_check_counts_the_requests_a_slower_itl_keeps_in_flight():
    """The SLO simulation's burst: a fit of about 2 + 0.7 ms x b, 43 requests on 4
    replicas (10.75 each, 9.5 ms), target 50 ms. The open-loop prediction for 3 replicas
    (14.3 each: 12 ms) passes, and the simulated fleet then ran at 60-180 ms. By Little's
    law the requests in flight grow with the ITL: x = 0.7 x 43 / (3 x 9.5) > 1, so 3
    replicas cannot keep up and the step is held; at 8 replicas' worth of the same
    requests on 12 (x = 0.7 x 43 / (11 x 4.5) = 0.6) it goes."""
    spec = AutoscalingSpec(max_replicas=20, scale_down_stabilization_seconds=0,
                           slo=SloSpec(itl_seconds=0.05))
    state = PolicyState(latency=trusted(0.002, 0.0007, batches=(5, 10, 20)))
    pods = tuple(pod(f"p{k}", running=10.75, usage=0.1, itl=window_at(0.0095)) for k in range(4))
    d = decide(FleetSignals(pods, max_num_seqs=256), state, spec, 0.0)
    assert d.direction == "hold", d.reason
    latency = next(c for c in d.candidates if c.rule == "latency")
    assert latency.replicas == 4, latency.detail
    assert d.latency["itlA"] + d.latency["itlC"] * 43 / 3 < 0.045  # what the open loop let go
    fit = ItlFit(0.002, 0.0007, 10.0, 10, True)
    lv = LatencyView("p90", True, fit, 0.0095, None, requests=43.0, growth=1.0,
                     max_num_seqs=256, ready=4)
    assert "predicted ITL p90 of inf ms" in (latency_blocker(lv, 3, spec) or "")
    spread = tuple(pod(f"p{k}", running=43 / 12, usage=0.1, itl=window_at(0.0045))
                   for k in range(12))
    d = decide(FleetSignals(spread, max_num_seqs=256), state, spec, 0.0)
    assert (d.direction, d.desired_replicas) == ("down", 11), d.reason


def test_closed_loop_itl_is_the_fit_at_the_current_count_and_grows_faster_below():
    """a = 10 ms, c = 1 ms, 40 requests on 4 replicas (20 ms now). 3 replicas: x = 40 /
    (3 x 20) = 2/3, 10 / (1/3) = 30 ms (the open loop says 23.3 ms); 2 replicas: x = 1,
    unbounded; 5 replicas: 16.7 ms, below the open loop's 18 ms, which is the floor."""
    view = LatencyView("p90", True, ItlFit(0.01, 0.001, 10.0, 10, True), 0.02, None,
                       requests=40.0, growth=1.0, max_num_seqs=256, ready=4)
    assert closed_loop_itl(view, 4) == pytest.approx(0.02)
    assert closed_loop_itl(view, 3) == pytest.approx(0.03)
    assert closed_loop_itl(view, 2) == INF
    assert closed_loop_itl(view, 5) == pytest.approx(0.018)
    assert closed_loop_itl(view, 0) == INF


def test_the_in_flight_growth_follows_the_mean_itl_when_it_is_below_the_quantile():
    """The SLO simulation's steady_high_concurrency: fit 9.3 + 0.139 ms x b, 285 requests
    on 4 replicas (p90 19.2 ms, window mean 11.4 ms). On the quantile alone 3 replicas
    settle at 9.3 / (1 - 0.69) = 30 ms and the rule asks ceil(2.53) = 3; the requests'
    duration follows the mean, which grows faster (k = 0.0396 / (3 x 0.0114) > 1): 3
    replicas cannot keep up (the simulated fleet filled max_num_seqs and queued), the
    rule asks ceil(0.0396 / (0.0114 x (1 - 2.52 / 50))) = 4. A mean so low that the
    slope alone exceeds it (k at the current count >= 1) falls back to the quantile."""
    fit = ItlFit(0.0093, 0.000139, 10.0, 10, True)

    def view(mean):
        return LatencyView("p90", True, fit, 0.0192, None, requests=285.0, growth=1.0,
                           max_num_seqs=256, ready=4, itl_mean=mean)

    assert closed_loop_itl(view(None), 3) == pytest.approx(0.0093 / (1 - 0.0396 / (3 * 0.019204)),
                                                           rel=1e-3)
    assert view(None).itl_replicas(0.05) == 3
    assert closed_loop_itl(view(0.0114), 3) == INF
    assert closed_loop_itl(view(0.0114), 4) == pytest.approx(0.019204, rel=1e-3)
    assert view(0.0114).itl_replicas(0.05) == 4
    assert closed_loop_itl(view(0.005), 3) == closed_loop_itl(view(None), 3)
    assert closed_loop_itl(view(0.05), 3) == closed_loop_itl(view(None), 3)  # above: the fit


def test_the_latency_rule_sizes_with_the_closed_loop_below_the_current_count():
    """Same fit and load: for a 50 ms target the open loop needs one replica (40 per
    replica fit), the closed loop ceil(1 x 40 / (20 x (1 - 10 / 50))) = 3; for a 15 ms
    target (missed now) the open loop's ceil(40 / 5) = 8 decides, as before."""
    view = LatencyView("p90", True, ItlFit(0.01, 0.001, 10.0, 10, True), 0.02, None,
                       requests=40.0, growth=1.0, max_num_seqs=256, ready=4)
    assert view.itl_replicas(0.05) == 3
    assert view.itl_replicas(0.015) == 8


def test_the_latency_rule_sizes_for_the_target_with_a_trusted_fit():
    """Fitted a = 20 ms, c = 5 ms/request; 120 requests on 4 replicas (30 each: 170 ms);
    a 100 ms target allows 16 per replica: 8 replicas."""
    spec = slo_spec(itl_seconds=0.1)
    model = trusted(0.02, 0.005)
    pods = tuple(pod(f"p{k}", running=30, itl=window_at(0.17)) for k in range(4))
    d = decide(FleetSignals(pods, max_num_seqs=64), PolicyState(latency=model), spec, 0.0)
    assert (d.direction, d.desired_replicas, d.rule) == ("up", 8, "latency")
    assert "(fitted)" in d.reason


def test_within_the_tolerance_band_the_latency_rule_keeps_the_count():
    spec = slo_spec(itl_seconds=0.1)
    model = trusted(0.02, 0.005)
    pods = tuple(pod(f"p{k}", running=17, itl=window_at(0.105)) for k in range(4))  # 105 ms
    d = decide(FleetSignals(pods, max_num_seqs=64), PolicyState(latency=model), spec, 0.0)
    latency = next(c for c in d.candidates if c.rule == "latency")
    assert latency.replicas == 4 and d.direction == "hold"


def test_an_itl_target_below_an_empty_batch_buys_nothing():
    spec = slo_spec(itl_seconds=0.01)  # the CPU prior's a is 27 ms
    pods = tuple(pod(f"p{k}", running=20, itl=window_at(0.15)) for k in range(2))
    d = decide(FleetSignals(pods, max_num_seqs=64), PolicyState(), spec, 0.0)
    latency = next(c for c in d.candidates if c.rule == "latency")
    assert latency.replicas is None and "more replicas do not help" in latency.detail
    assert d.rule != "latency"


def test_ttft_queue_wait_scales_the_fleet_up():
    """p90 TTFT 16 s on 2 replicas. One replica prefills 2,048 / (27 ms + 2,048 x 1.5 ms)
    = 660.86 tok/s (the CPU prior's plane at a full budget; without an ITL target nothing is
    fitted). With 400 prompt tokens queued the queue is 0.3 s of it and the base 15.7 s >
    5 s: no count helps. With 20,000 queued the queue is 15.1 s of a 16 s TTFT."""
    spec = slo_spec(ttft_seconds=5.0)
    itl = LatencyWindow(((0.1, 90), (0.4, 100), (INF, 100)), 10.0)  # mean 100 ms
    ttft = LatencyWindow(((16.0, 90), (64.0, 100), (INF, 100)), 1600.0)  # p90 16 s

    def fleet(waiting_tokens):
        pods = tuple(pod(f"p{k}", running=8, itl=itl, ttft=ttft, waiting=10,
                         waiting_tokens=waiting_tokens) for k in range(2))
        return FleetSignals(pods, max_num_seqs=64, max_num_batched_tokens=2048)

    short = decide(fleet(200), PolicyState(), spec, 0.0)
    latency = next(c for c in short.candidates if c.rule == "latency")
    assert latency.replicas is None and "missed without a queue" in latency.detail
    assert short.latency is not None and short.latency["prefillRate"] == pytest.approx(660.86, abs=0.01)
    long = decide(fleet(10000), PolicyState(), spec, 0.0)
    latency = next(c for c in long.candidates if c.rule == "latency")
    # base = 16 - 20000 / (2 x 660.86) = 0.868 s; n = ceil(20000 / (660.86 x 4.132)) = 8
    assert latency.replicas == 8 and latency.signal == "ttft_p90"
    assert long.desired_replicas == 8 and long.rule == "latency"


def test_ttft_consolidation_check_holds_when_fewer_would_queue_too_long():
    """Light KV and batches, 4 replicas, TTFT 3 s of which 2 s queue (4,520 tokens at
    565 tok/s per replica: the CPU prior's plane at a 100-token budget, 100 / (27 ms +
    100 x 1.5 ms)): 3 replicas would wait 2.67 s, TTFT 3.67 s > 3.6 s."""
    spec = AutoscalingSpec(max_replicas=20, scale_down_stabilization_seconds=0,
                           slo=SloSpec(ttft_seconds=4.0))
    itl = LatencyWindow(((0.1, 90), (0.4, 100), (INF, 100)), 10.0)
    ttft = LatencyWindow(((3.0, 90), (12.0, 100), (INF, 100)), 300.0)
    pods = tuple(pod(f"p{k}", running=2, usage=0.1, itl=itl, ttft=ttft, waiting_tokens=1130)
                 for k in range(4))
    d = decide(FleetSignals(pods, max_num_seqs=64, max_num_batched_tokens=100), PolicyState(),
               spec, 0.0)
    assert d.direction == "hold" and "predicted TTFT p90 of 3667 ms > 3600 ms" in d.reason


def test_a_fleet_without_latency_histograms_sizes_on_saturation_and_says_so():
    """An older engine: no ITL or TTFT windows. The latency rule has no opinion, the
    saturation rule sizes the fleet, and the reason names the fallback."""
    spec = slo_spec(itl_seconds=0.05, ttft_seconds=1.0)
    pods = tuple(pod(f"p{k}", running=60, usage=0.2) for k in range(2))
    d = decide(FleetSignals(pods, max_num_seqs=64), PolicyState(), spec, 0.0)
    latency = next(c for c in d.candidates if c.rule == "latency")
    assert latency.replicas is None and latency.detail == NO_HISTOGRAMS
    assert d.rule == "saturation" and d.desired_replicas == 3  # ceil(120 / 48)
    assert d.reason.endswith(f"({NO_HISTOGRAMS})")
    assert d.latency["histograms"] is False
    assert d.state.latency is not None and d.state.latency.s0 == 0  # nothing learnt
    # Without an SLO nothing changes: no suffix, no latency view, no model state.
    plain = decide(FleetSignals(pods, max_num_seqs=64), PolicyState(),
                   AutoscalingSpec(max_replicas=20), 0.0)
    assert NO_HISTOGRAMS not in plain.reason and plain.latency is None
    assert plain.state.latency is None and "latency" not in plain.to_dict()


def test_latency_windows_are_not_load_signals():
    """A pod without histograms is not missing data (scale-down is not held for it)."""
    assert pod("old").missing == ()


def test_a_pod_that_reports_nothing_holds_the_scale_down_but_not_the_model():
    spec = slo_spec(itl_seconds=0.5)
    pods = (pod("a", running=2, usage=0.05, itl=window_at(0.03)),
            pod("b", running=2, usage=0.05, itl=window_at(0.03)),
            PodSignals("silent"))
    d = decide(FleetSignals(pods, max_num_seqs=64), PolicyState(), spec, 0.0)
    assert d.direction == "hold" and d.missing_pods == ("silent",)
    assert d.state.latency.s0 == 2.0  # both reporting pods were learnt from


def test_a_new_percentile_starts_the_model_over_and_no_slo_drops_it():
    model = LatencyModel(0.9).update([(4, 0.1)], observations=100)
    pods = (pod("a", running=4, itl=window_at(0.1, q=0.99)),)
    spec = slo_spec(itl_seconds=0.5, percentile=0.99)
    d = decide(FleetSignals(pods, max_num_seqs=64), PolicyState(latency=model), spec, 0.0)
    assert d.state.latency.percentile == 0.99 and d.state.latency.s0 == 1.0
    assert d.latency["percentile"] == "p99"
    d = decide(FleetSignals(pods, max_num_seqs=64), d.state, AutoscalingSpec(max_replicas=5), 15.0)
    assert d.state.latency is None


def test_before_the_fit_is_trusted_an_itl_observed_over_the_band_holds():
    """Thin traffic (30 ITL observations: not enough to inform the fit) but the ITL the
    fleet gives now, 190 ms p90, is over 180 ms: one replica fewer is not faster."""
    spec = AutoscalingSpec(max_replicas=20, scale_down_stabilization_seconds=0,
                           slo=SloSpec(itl_seconds=0.2))
    pods = tuple(pod(f"p{k}", running=1, usage=0.05, itl=window_at(0.19, count=10))
                 for k in range(3))
    d = decide(FleetSignals(pods, max_num_seqs=64), PolicyState(), spec, 0.0)
    assert d.direction == "hold"
    assert "the ITL p90 observed with 3 replicas, 190 ms, is already over 180 ms" in d.reason


def test_with_too_little_traffic_to_measure_the_other_checks_decide():
    """A nearly idle fleet (5 ITL observations in the window): no latency to protect, so
    the untrusted prior does not hold the step the KV and batch checks allow."""
    spec = AutoscalingSpec(max_replicas=20, scale_down_stabilization_seconds=0,
                           slo=SloSpec(itl_seconds=0.2))
    pods = tuple(pod(f"p{k}", running=1, usage=0.05, itl=window_at(0.05, count=5))
                 for k in range(3))
    d = decide(FleetSignals(pods, max_num_seqs=64), PolicyState(), spec, 0.0)
    assert (d.direction, d.desired_replicas) == ("down", 2)
    assert d.latency["trusted"] is False


# ---------------------------------------------------------------- the prefill term
def test_the_three_term_fit_converges_on_a_known_plane():
    """Samples from itl = 0.030 + 0.002 b + 0.0004 p (+-3% noise) over batches and prefill
    tokens per step that vary independently: the fit finds a, c and d."""
    a, c, d = 0.030, 0.002, 0.0004
    rng = random.Random(11)
    model = LatencyModel(0.9)
    for _ in range(40):
        samples = [(b, (a + c * b + d * p) * rng.uniform(0.97, 1.03), p)
                   for b, p in ((2, 300), (8, 0), (16, 150), (24, 400), (40, 50))]
        model = model.update(samples, observations=500)
    fit = model.fit(PRIORS["cpu"])
    assert fit.trusted
    assert fit.a == pytest.approx(a, rel=0.15)
    assert fit.c == pytest.approx(c, rel=0.1)
    assert fit.d == pytest.approx(d, rel=0.1)
    assert fit.predict(10, 100) == pytest.approx(a + c * 10 + d * 100, rel=0.05)


def test_without_prefill_in_the_data_the_fit_is_the_two_term_line():
    """p always 0 (or constant): d is not identifiable; the fit is the 2-parameter one
    with d = 0, as before the prefill term."""
    a, c = 0.040, 0.003
    for p in (0.0, 120.0):
        model = LatencyModel(0.9)
        for _ in range(30):
            model = model.update([(b, a + c * b + 0.0001 * p, p) for b in (2, 8, 16, 40)],
                                 observations=500)
        fit = model.fit(PRIORS["cpu"])
        assert fit.d == 0.0
        assert fit.c == pytest.approx(c, rel=0.05)
        assert fit.a == pytest.approx(a + 0.0001 * p, rel=0.08)
        two = LatencyModel(0.9, s0=model.s0, sb=model.sb, sy=model.sy, sbb=model.sbb,
                           sby=model.sby, informed_reads=model.informed_reads)
        assert (fit.a, fit.c) == pytest.approx((two.fit(PRIORS["cpu"]).a,
                                                two.fit(PRIORS["cpu"]).c))


def test_an_old_two_parameter_state_loads_with_no_prefill_sums():
    old = {"percentile": 0.9, "s0": 9.0, "sb": 90.0, "sy": 0.9, "sbb": 1200.0, "sby": 10.0,
           "informedReads": 12}
    model = LatencyModel.from_dict(old)
    assert (model.sp, model.spp, model.sbp, model.spy) == (0.0, 0.0, 0.0, 0.0)
    fit = model.fit(PRIORS["gpu"])
    assert fit.d == 0.0 and math.isfinite(fit.a) and math.isfinite(fit.c)
    # The new sums round-trip.
    grown = model.update([(4.0, 0.2, 300.0)], observations=100)
    again = LatencyModel.from_dict(grown.to_dict())
    assert again == grown and again.spp == pytest.approx(90000.0)


def test_itl_samples_read_the_prefill_from_step_tokens():
    pods = [pod("prefilling", running=8, itl=window_at(0.15), step_tokens=520.0),
            pod("decoding", running=8, itl=window_at(0.05), step_tokens=6.0)]
    samples, _ = itl_samples(pods, 0.9)
    assert samples == ((8.0, pytest.approx(0.15), 512.0), (8.0, pytest.approx(0.05), 0.0))


def test_prefill_heavy_steps_make_more_replicas_help():
    """Steps carrying a prefill chunk are slow (itl = 20 ms + 1 ms/request + 0.2 ms per
    prefill token, 64 to 104 ms). A 2-parameter line puts that into the level (above the
    50 ms target: "more replicas do not help"); with the prefill term the level is 20 ms
    and, as both the batch and the prefill per step fall as 1 / n, the rule scales up."""
    a, c, d = 0.020, 0.001, 0.0002
    spec = slo_spec(itl_seconds=0.05)
    shape = ((2, 400), (4, 200), (6, 350), (8, 250))
    state = PolicyState()
    for i in range(30):
        pods = tuple(pod(f"p{k}", running=b, itl=window_at(a + c * b + d * p),
                         step_tokens=b + p) for k, (b, p) in enumerate(shape))
        dec = decide(FleetSignals(pods, max_num_seqs=64, max_num_batched_tokens=512),
                     state, spec, 1000.0 + 15 * i)
        state = dec.state
    latency = next(x for x in dec.candidates if x.rule == "latency")
    assert "more replicas do not help" not in latency.detail
    assert latency.replicas is not None and latency.replicas > 4
    assert dec.direction == "up"


def test_a_minor_prefill_share_keeps_the_two_term_line():
    """The prefill term is folded into the per-request slope only where prefill
    dominates it (d P/R > c): here decode rows carry the cost (c = 4 ms/request) and the
    prefill is a few tokens a step, so the view's line is the two-parameter fit, not
    c + d P/R; with prefill-heavy steps (the test above) it is folded."""
    a, c, d = 0.020, 0.004, 0.0002
    spec = slo_spec(itl_seconds=0.05)
    shape = ((2, 4), (4, 10), (6, 2), (8, 6))
    state = PolicyState()
    signals = None
    for i in range(30):
        pods = tuple(pod(f"p{k}", running=b, itl=window_at(a + c * b + d * p),
                         step_tokens=b + p) for k, (b, p) in enumerate(shape))
        signals = FleetSignals(pods, max_num_seqs=64, max_num_batched_tokens=512)
        state = decide(signals, state, spec, 1000.0 + 15 * i).state
    from kvpilot.autoscaler.policy import observe_latency
    from kvpilot.autoscaler.rules import Candidate
    from kvpilot.autoscaler.signals import aggregate

    no_forecast = Candidate("forecast", None, "kv_usage", None, "")
    view, after = observe_latency(signals, aggregate(signals), state, spec, no_forecast, None, None)
    two_term = after.latency.fit(PRIORS["cpu"], prefill=False)
    assert after.latency.fit(PRIORS["cpu"]).d > 0  # the plane was fitted, then not folded
    assert view.fit.c == pytest.approx(two_term.c)
    assert view.fit.c == pytest.approx(c, rel=0.25)


# ------------------------------------------------- prefill capacity and the prefix cache
def warm_pod(name: str, prompt: float, cached: float, running: float = 4) -> PodSignals:
    """A pod with little KV in use, a short TTFT, and its prefix cache's rates (tokens/s)."""
    return PodSignals(name, kv_usage=0.05, num_waiting=0, waiting_tokens=0, num_running=running,
                      preemption_rate=0.0, kv_capacity_tokens=10000,
                      ttft=LatencyWindow(((0.2, 90), (1.0, 100), (INF, 100)), 12.0),
                      prompt_token_rate=prompt, cached_token_rate=cached)


# The GPU prior's plane at a 2,048-token budget: 2048 / (10 ms + 2048 x 69.5 us).
GPU_PREFILL = 2048 / (0.010 + 2048 * 0.0000695)


def test_prefill_capacity_and_prefix_rates():
    assert prefill_capacity(0.010, 0.0000695, 2048) == pytest.approx(GPU_PREFILL)
    assert prefill_capacity(0.010, 0.0000695, None) == pytest.approx(1 / 0.0000695)
    assert prefill_capacity(0.010, 0.0, 2048) is None
    pods = [warm_pod("a", 20000, 18000), warm_pod("b", 5000, 6000),  # counters read apart
            pod("c")]  # an engine without the counters
    computed, handover = prefix_rates(pods)
    assert computed == pytest.approx(2000.0) and handover == pytest.approx(18000.0)
    assert prefix_rates([pod("c")]) is None
    with pytest.raises(ValueError, match="pod 'x': cached_token_rate must be >= 0"):
        warm_pod("x", 10.0, -1.0)


def test_the_prefix_cache_handover_holds_a_warm_fleet():
    """Two replicas at 5% KV usage and a 0.2 s TTFT, each computing 2,000 prompt tokens/s
    and taking 18,000 from its prefix cache. One replica would prefill 4,000 + 18,000
    tokens/s (the sessions of the replica that goes prefill their context again): 164% of
    its 13,444 tokens/s > 50%. The same fleet with cold caches steps down."""
    spec = AutoscalingSpec(max_replicas=20, scale_down_stabilization_seconds=0,
                           slo=SloSpec(ttft_seconds=1.0, profile="gpu"))
    warm = FleetSignals(tuple(warm_pod(f"p{k}", 20000, 18000) for k in range(2)),
                        max_num_seqs=256, max_num_batched_tokens=2048)
    d = decide(warm, PolicyState(), spec, 0.0)
    assert d.direction == "hold" and d.desired_replicas == 2
    assert "one pod's prefix cache saves, 164% of their prefill capacity" in d.reason
    assert d.latency["prefixHandover"] == 18000.0 and d.latency["prefillComputed"] == 4000.0
    cold = FleetSignals(tuple(warm_pod(f"p{k}", 2500, 500) for k in range(2)),
                        max_num_seqs=256, max_num_batched_tokens=2048)
    d = decide(cold, PolicyState(), spec, 0.0)
    assert d.direction == "down" and d.desired_replicas == 1
    # An engine without the counters: no handover check, the fleet steps down as before.
    bare = FleetSignals(tuple(pod(f"p{k}", running=4, usage=0.05,
                                  ttft=LatencyWindow(((0.2, 90), (INF, 100)), 12.0))
                              for k in range(2)), max_num_seqs=256, max_num_batched_tokens=2048)
    assert decide(bare, PolicyState(), spec, 0.0).direction == "down"


def test_prefill_utilization_scales_the_fleet_up():
    """One replica computing 8,000 prompt tokens/s (no cache hits) runs at 60% of its
    13,444 tokens/s; at the 40% target that is ceil(8000 / 5378) = 2 replicas, though its
    TTFT (0.2 s), KV and batch are all under target."""
    spec = slo_spec(ttft_seconds=1.0, profile="gpu")
    d = decide(FleetSignals((warm_pod("p0", 8000, 0),), max_num_seqs=256,
                            max_num_batched_tokens=2048), PolicyState(), spec, 0.0)
    latency = next(c for c in d.candidates if c.rule == "latency")
    assert latency.replicas == 2 and latency.signal == "prefill_utilization"
    assert latency.value == pytest.approx(8000 / GPU_PREFILL)
    assert d.desired_replicas == 2 and d.rule == "latency" and d.direction == "up"
    # Without a TTFT target the prefill is the ITL plane's concern: no prefill ask.
    itl_only = decide(FleetSignals((warm_pod("p0", 8000, 0),), max_num_seqs=256,
                                   max_num_batched_tokens=2048), PolicyState(),
                      slo_spec(itl_seconds=0.05, profile="gpu"), 0.0)
    assert all(c.signal != "prefill_utilization" for c in itl_only.candidates)


def test_a_pod_without_the_counters_beside_ones_with_them_holds_the_step_down():
    """Found in review: pod a reports an empty cache, pod b (an older image mid-rollout)
    no counters. Summing only a, the fleet stepped down and b's cache was lost unseen.
    Now the step waits and says why; with both reporting, the check sizes it."""
    spec = AutoscalingSpec(max_replicas=20, scale_down_stabilization_seconds=0,
                           slo=SloSpec(ttft_seconds=1.0, profile="gpu"))
    silent = PodSignals("b", kv_usage=0.05, num_waiting=0, waiting_tokens=0, num_running=4,
                        preemption_rate=0.0, kv_capacity_tokens=10000,
                        ttft=LatencyWindow(((0.2, 90), (1.0, 100), (INF, 100)), 12.0))
    mixed = FleetSignals((warm_pod("a", 500, 0), silent), max_num_seqs=256,
                         max_num_batched_tokens=2048)
    d = decide(mixed, PolicyState(), spec, 0.0)
    assert d.direction == "hold"
    assert "1 of 2 ready pods report no prefix-cache rates" in d.reason
    both = FleetSignals((warm_pod("a", 500, 0), warm_pod("b", 500, 0)), max_num_seqs=256,
                        max_num_batched_tokens=2048)
    assert decide(both, PolicyState(), spec, 0.0).direction == "down"


def test_huge_but_finite_rates_never_raise():
    """Found in review: two pods at 1.7e308 tokens/s summed to inf and ceil(inf) raised
    OverflowError out of decide(). Now the ask is unbounded and the bounds clamp it."""
    spec = AutoscalingSpec(max_replicas=7, slo=SloSpec(ttft_seconds=1.0, profile="gpu"))
    pods = tuple(warm_pod(f"p{k}", 1.7e308, 0.0) for k in range(2))
    d = decide(FleetSignals(pods, max_num_seqs=256, max_num_batched_tokens=2048),
               PolicyState(), spec, 0.0)
    assert d.desired_replicas == 7 and d.limited == "max"


def test_keda_and_an_slo_are_refused_together_by_the_policy_spec_too():
    with pytest.raises(ValueError, match="slo is not allowed when engine is keda"):
        AutoscalingSpec.from_crd({"engine": "keda", "maxReplicas": 3,
                                  "slo": {"ttftSeconds": 2.0}})
