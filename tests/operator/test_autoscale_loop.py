"""The autoscaler loop (kvpilot.operator.autoscaling.loop) as table tests: a fake metric
source, the in-memory API and a settable clock. Each test drives ticks and asserts what
reached the Deployment, the status, the conditions and the Events.

Cases: C15 (source unreachable or empty: hold, MetricsAvailable=False, resume), C16 (no
spec writes; a GitOps re-apply keeps the autoscaler's count), C17 (an empty answer is
missing data, not zero load), and a restart in the middle of a scale-up.
"""

from __future__ import annotations

import copy
import dataclasses

import kopf
import pytest

from kvpilot.operator import constants as c
from kvpilot.operator.api import TransientApiError
from kvpilot.operator.autoscaling.loop import RETRY_SECONDS
from kvpilot.operator.autoscaling.metrics_source import SourceConfig
from kvpilot.operator.handlers.lifecycle import on_spec

from .fake_sources import empty, loaded, unreachable
from .fleet_harness import AUTO, Fleet


def test_scale_up_applies_the_count_and_explains_it():
    fleet = Fleet(load=loaded(0.97, waiting=0), replicas=2)
    fleet.pods(ready=2)
    assert fleet.tick(0) == 15.0
    assert fleet.replicas == 3  # the starvation alarm: at least one more, now
    status = fleet.status
    assert status["desiredReplicas"] == 3
    decision = status["autoscaler"]["lastDecision"]
    assert decision["direction"] == "up" and decision["rule"] in ("starvation", "headroom")
    assert status["lastScaleReason"].startswith(f"2 -> 3: rule {decision['rule']}, ")
    assert "kv_usage=0.97" in status["lastScaleReason"]
    ((type_, reason, message),) = fleet.events.events
    assert (type_, reason) == ("Normal", "ScaledUp") and message == status["lastScaleReason"]
    assert status["signals"]["cacheUsage"] == 0.97 and status["signals"]["readyPods"] == 2
    assert fleet.condition("MetricsAvailable")["reason"] == "SignalsReported"
    assert fleet.condition("ScalingActive")["reason"] == "ScaledUp"
    assert fleet.condition("ScalingLimited")["status"] == "False"
    assert fleet.condition("Ready")["status"] == "False"  # the reconcile's view: 3 desired
    assert fleet.factory.configs == [SourceConfig("pods", None, "llm", "chat")]
    assert fleet.source.reads == [(("chat-0", "chat-1"), fleet.clock.now.timestamp())]


def test_finops_status_from_capacity_context_and_counters():
    fleet = Fleet(load=loaded(0.5), replicas=2)
    fleet.pods(ready=2)
    fleet.tick(0)
    status = fleet.status
    # 16,384 tokens per replica; 1,000-token requests take 63 blocks of 16 = 1,008 tokens.
    assert status["capacity"] == {"kvCapacityTokensPerReplica": 16384,
                                  "meanContextTokens": 1000.0,
                                  "maxConcurrentRequestsEstimate": 16384 // 1008}
    # 2 replicas x 2.0 per hour; 200 generated tokens/s -> 4.0 / 720,000 tokens.
    assert status["cost"]["costPerHour"] == 4.0
    assert status["cost"]["costPerMillionTokens"] == round(4.0 / (200 * 3600) * 1e6, 4)


def test_finops_concurrency_counts_a_request_up_to_the_kv_window():
    """Every layer slides with a 512-token window: a request holds at most
    (cdiv(512, 16) + 1) x 16 = 528 tokens, not the 1,008 its 1,000-token context takes."""
    def read(pods, now):
        return dataclasses.replace(loaded(0.5)(pods, now), kv_window_tokens=512)
    fleet = Fleet(load=read, replicas=2)
    fleet.pods(ready=2)
    fleet.tick(0)
    assert fleet.status["capacity"] == {"kvCapacityTokensPerReplica": 16384,
                                        "meanContextTokens": 1000.0,
                                        "maxConcurrentRequestsEstimate": 31}  # 16,384 // 528


@pytest.mark.parametrize("window", [None, 0, -512, True, "512", 512.0])
def test_no_window_or_a_garbage_one_estimates_whole_contexts(window):
    """An estimate never raises: a window that is no positive integer is no window."""
    from kvpilot.operator.autoscaling.metrics_source import EnginePod
    from kvpilot.operator.autoscaling.plan import finops_estimates

    reading = dataclasses.replace(loaded(0.5)([EnginePod("chat-0")], 0.0), kv_window_tokens=window)
    capacity, _ = finops_estimates(reading, 1, None, 16)
    assert capacity.max_concurrent_requests_estimate == 16384 // 1008


@pytest.mark.parametrize("garbage", [float("inf"), -5.0, float("nan")])
def test_garbage_finops_inputs_leave_estimates_out_and_scaling_goes_on(garbage):
    """A source that reports a nonsense token rate or context (a buggy exporter) must not
    stop the decision: the estimates it feeds are left out, the scale-up still happens."""
    def read(pods, now):
        return dataclasses.replace(loaded(0.97, waiting=8)(pods, now),
                                   generated_tokens_per_second=garbage,
                                   mean_context_tokens=garbage)
    fleet = Fleet(load=read, replicas=2)
    fleet.pods(ready=2)
    fleet.tick(0)
    assert fleet.replicas > 2
    status = fleet.status
    assert status["cost"].get("costPerMillionTokens") is None
    assert status["cost"]["costPerHour"] > 0
    assert status["capacity"].get("maxConcurrentRequestsEstimate") is None


def test_c15_unreachable_source_holds_then_scaling_resumes_when_data_returns():
    fleet = Fleet(load=unreachable, replicas=3)
    fleet.pods(ready=3)
    for i in range(6):  # 90 s, longer than the 60 s scale-down window
        fleet.tick(0 if i == 0 else 15)
        assert fleet.replicas == 3
        metrics = fleet.condition("MetricsAvailable")
        assert (metrics["status"], metrics["reason"]) == ("False", "SourceUnreachable")
        assert "ConnectionError" in metrics["message"]
        assert "holding 3 replicas" in metrics["message"]
        assert fleet.condition("ScalingActive")["reason"] == "MissingMetrics"
        assert "cacheUsage" not in fleet.status["signals"]  # absent, never 0
        assert fleet.status["autoscaler"]["lastDecision"]["rule"] == "missing_metrics"
    # One Warning for the outage, not one per interval.
    assert fleet.events.reasons() == ["MetricsUnavailable"]
    fleet.source.load = loaded(0.95, waiting=20)
    fleet.tick()
    assert fleet.replicas > 3
    assert fleet.condition("MetricsAvailable")["status"] == "True"
    assert fleet.events.reasons() == ["MetricsUnavailable", "ScaledUp", "MetricsRestored"]


def test_c15_c17_empty_answer_is_missing_data_not_zero_load():
    """Low real load would scale 3 -> 2 after the window; an empty vector must not."""
    fleet = Fleet(load=empty, replicas=3)
    fleet.pods(ready=3)
    for i in range(8):
        fleet.tick(0 if i == 0 else 15)
    assert fleet.replicas == 3
    metrics = fleet.condition("MetricsAvailable")
    assert (metrics["status"], metrics["reason"]) == ("False", "NoData")
    assert "returned no series for kv_usage" in metrics["message"]
    # The same fleet with real, low numbers does scale down: the hold was the data.
    fleet.source.load = loaded(0.05)
    for _ in range(6):
        fleet.tick()
    assert fleet.replicas < 3
    assert "ScaledDown" in fleet.events.reasons()


def test_partial_data_never_scales_down():
    def one_pod_missing(pods, now):
        reading = loaded(0.05)(pods, now)
        first = reading.pods[0]
        broken = type(first)(first.name, first.kv_usage, first.num_waiting, first.waiting_tokens,
                             first.num_running, None, first.kv_capacity_tokens)
        return type(reading)(reading.source, (broken, *reading.pods[1:]))

    fleet = Fleet(load=one_pod_missing, replicas=3)
    fleet.pods(ready=3)
    for i in range(10):
        fleet.tick(0 if i == 0 else 15)
    assert fleet.replicas == 3
    metrics = fleet.condition("MetricsAvailable")
    assert (metrics["status"], metrics["reason"]) == ("True", "PartialData")
    assert "chat-0 (preemption_rate)" in metrics["message"]


def test_no_ready_pods_holds_with_its_own_reason():
    fleet = Fleet(load=loaded(0.9), replicas=2)
    fleet.pods(ready=0, pending=2)
    fleet.tick(0)
    assert fleet.replicas == 2
    metrics = fleet.condition("MetricsAvailable")
    assert (metrics["reason"], metrics["message"]) == (
        "NoReadyPods", "no ready engine pod to read (2 starting); holding 2 replicas")
    assert fleet.source.reads == [((), fleet.clock.now.timestamp())]
    # Pods that are starting are not a metrics outage: no Warning, and no "restored" once
    # they serve (a real apiserver showed one pair for every new resource).
    assert fleet.events.reasons() == []
    fleet.pods(ready=2)
    fleet.tick()
    assert fleet.condition("MetricsAvailable")["status"] == "True"
    assert "MetricsUnavailable" not in fleet.events.reasons()
    assert "MetricsRestored" not in fleet.events.reasons()


def test_an_outage_after_starting_pods_is_still_reported():
    fleet = Fleet(load=unreachable, replicas=2)
    fleet.pods(ready=0, pending=2)
    fleet.tick(0)
    fleet.pods(ready=2)
    fleet.tick()
    assert fleet.condition("MetricsAvailable")["reason"] == "SourceUnreachable"
    assert fleet.events.reasons() == ["MetricsUnavailable"]


def test_clamped_at_max_sets_scaling_limited():
    spec = copy.deepcopy(AUTO)
    spec["autoscaling"]["maxReplicas"] = 3
    fleet = Fleet(spec=spec, load=loaded(0.97, waiting=40), replicas=2)
    fleet.pods(ready=2)
    fleet.tick(0)
    assert fleet.replicas == 3
    limited = fleet.condition("ScalingLimited")
    assert (limited["status"], limited["reason"]) == ("True", "TooManyReplicas")
    assert "capped at maxReplicas=3" in limited["message"]
    asked = fleet.status["autoscaler"]["lastDecision"]
    assert asked["limited"] == "max" and asked["desiredReplicas"] == 3
    fleet.pods(ready=3)
    fleet.tick()
    assert fleet.replicas == 3
    assert fleet.condition("ScalingLimited")["status"] == "True"
    fleet.source.load = loaded(0.6)
    fleet.tick()
    assert fleet.condition("ScalingLimited")["reason"] == "DesiredWithinRange"


def test_c16_decisions_never_touch_the_spec_and_a_reapply_keeps_the_count():
    fleet = Fleet(load=loaded(0.95, waiting=20), replicas=2)
    fleet.pods(ready=2)
    fleet.tick(0)
    scaled = fleet.replicas
    assert scaled > 2
    # A GitOps tool re-applies the same manifest: a reconcile without a recommendation.
    body = fleet.body()
    patch = kopf.Patch()
    on_spec(body=body, patch=patch, memo=fleet.ctx)
    assert fleet.replicas == scaled
    assert "spec" not in patch
    assert fleet.body()["spec"] == AUTO  # byte for byte what the user applied
    written = [call for call in fleet.api.writes() if call[1] == c.KIND]
    assert written and all(call[0] == "patch_status" for call in written)


def test_restart_in_the_middle_of_a_scale_up_does_not_scale_twice():
    fleet = Fleet(load=loaded(0.97, waiting=10), replicas=2)
    fleet.pods(ready=2)
    fleet.tick(0)
    after_first = fleet.replicas
    assert after_first > 2
    state = fleet.loop.state
    # The new pods are still starting when the operator restarts.
    fleet.pods(ready=2, pending=after_first - 2)
    fleet.restart()
    assert fleet.loop.state == state  # read back from status.autoscaler.policyState
    reads = len(fleet.source.reads)
    assert fleet.tick(5) == pytest.approx(10.0)  # not due: the interval is kept across restarts
    assert len(fleet.source.reads) == reads
    fleet.source.load = loaded(0.97, waiting=0)
    fleet.tick(10)
    assert fleet.replicas == after_first  # pending pods are supply: no second scale-up
    assert fleet.events.reasons().count("ScaledUp") == 1
    assert fleet.status["autoscaler"]["lastDecision"]["currentReplicas"] == after_first


def test_restart_without_pods_created_yet_reads_the_deployment_count():
    """Right after a scale-up the ReplicaSet may not have created the pods: the
    Deployment's count minus the ready pods is pending all the same."""
    fleet = Fleet(load=loaded(0.97), replicas=2)
    fleet.pods(ready=2)
    fleet.tick(0)
    assert fleet.replicas == 3
    fleet.restart()
    fleet.tick()
    assert fleet.replicas == 3
    assert fleet.status["autoscaler"]["lastDecision"]["currentReplicas"] == 3


def test_not_due_before_the_interval_and_nothing_read():
    fleet = Fleet(load=loaded(0.5), replicas=1)
    fleet.pods(ready=1)
    fleet.tick(0)
    assert fleet.tick(4) == pytest.approx(11.0)
    assert len(fleet.source.reads) == 1
    assert fleet.tick(11) == 15.0
    assert len(fleet.source.reads) == 2


def test_invalid_spec_or_missing_deployment_decides_nothing():
    fleet = Fleet(load=loaded(0.97), replicas=2)
    broken = fleet.body()
    broken["spec"]["autoscaling"]["minReplicas"] = 9
    assert fleet.loop.tick(broken) == RETRY_SECONDS
    del fleet.api.objects[("Deployment", "llm", "chat")]
    assert fleet.tick(0) == RETRY_SECONDS
    assert fleet.source.reads == []


def test_api_outage_is_retried_and_logged_once(caplog):
    fleet = Fleet(load=loaded(0.97), replicas=2)
    fleet.pods(ready=2)
    fleet.api.fail_next("list_pods", TransientApiError("api down"), TransientApiError("api down"))
    assert fleet.loop.tick_safely(fleet.body()) == RETRY_SECONDS
    assert fleet.loop.tick_safely(fleet.body()) == RETRY_SECONDS
    assert fleet.replicas == 2
    warnings = [r for r in caplog.records if "api down" in r.getMessage()
                and r.levelname == "WARNING"]
    assert len(warnings) == 1
    # The line names its InferenceDeployment (Kopf's formatters print it as [llm/chat]).
    assert warnings[0].k8s_ref["namespace"] == "llm" and warnings[0].k8s_ref["name"] == "chat"
    assert fleet.loop.tick_safely(fleet.body()) == 15.0
    assert fleet.replicas == 3


def test_a_failed_deployment_write_does_not_advance_the_policy_state():
    fleet = Fleet(load=loaded(0.97), replicas=2)
    fleet.pods(ready=2)
    before = fleet.loop.state
    fleet.api.fail_next("apply:Deployment", TransientApiError("etcd timeout"))
    assert fleet.loop.tick_safely(fleet.body()) == RETRY_SECONDS
    assert fleet.loop.state == before and fleet.loop.decided_at is None
    fleet.clock.advance(RETRY_SECONDS)
    fleet.loop.tick_safely(fleet.body())
    assert fleet.replicas == 3


def test_source_is_rebuilt_when_the_spec_names_another_one_and_closed():
    fleet = Fleet(load=loaded(0.5), replicas=1)
    fleet.pods(ready=1)
    fleet.tick(0)
    stored = fleet.api.objects[(c.KIND, "llm", "chat")]
    stored["spec"]["autoscaling"]["metrics"] = {"source": "prometheus", "url": "http://prom:9090"}
    fleet.tick()
    assert fleet.factory.configs[-1] == SourceConfig("prometheus", "http://prom:9090", "llm",
                                                     "chat")
    assert len(fleet.factory.configs) == 2
    fleet.loop.close()
    assert fleet.source.closed


def test_a_lagging_body_does_not_repeat_the_metrics_event():
    """Kopf's body may not show the loop's own last status write yet: the transition is
    judged against what the loop wrote, so the outage still gets one Warning."""
    fleet = Fleet(load=unreachable, replicas=2)
    fleet.pods(ready=2)
    stale = fleet.body()  # before any autoscaler condition was written
    fleet.tick(0)
    for _ in range(3):
        fleet.clock.advance(15)
        fleet.loop.tick(stale)
    assert fleet.events.reasons() == ["MetricsUnavailable"]
    fleet.source.load = loaded(0.5)
    fleet.clock.advance(15)
    fleet.loop.tick(stale)
    assert fleet.events.reasons() == ["MetricsUnavailable", "MetricsRestored"]


def test_a_refused_deployment_is_reported_once_not_retried_every_few_seconds():
    """Found in review: a Deployment the API refuses (422) while the policy wants to
    resize gave one ApplyFailed Warning every 5 s, no lastDecision and stale conditions."""
    from kvpilot.operator.api import InvalidObjectError

    fleet = Fleet(load=loaded(0.97), replicas=2)
    fleet.pods(ready=2)
    refused = InvalidObjectError("apply Deployment llm/chat: HTTP 422: bad resources", 422)
    fleet.api.fail_next("apply:Deployment", *[refused] * 50)
    delays = []
    for _ in range(20):
        delays.append(fleet.loop.tick_safely(fleet.body()))
        fleet.clock.advance(5)
    assert fleet.events.reasons().count("ApplyFailed") == 1
    assert fleet.replicas == 2
    status = fleet.status
    assert status["autoscaler"]["lastDecision"]["desiredReplicas"] > 2
    ready = next(x for x in status["conditions"] if x["type"] == "Ready")
    assert ready["reason"] == "ApplyFailed" and "HTTP 422" in ready["message"]
    assert max(delays) == AUTO["autoscaling"]["intervalSeconds"]


def test_requests_held_at_the_router_scale_the_fleet_before_any_engine_queues():
    """The engines run at the target usage with nothing waiting; the router pods hold a
    burst. The loop hands the ready router pods to the source and the held requests join
    the waiting count: one more replica now. Without them the same fleet holds."""
    held = {"n": 0.0}

    def read(pods, now):
        reading = loaded(0.75, waiting=0)(pods, now)
        return dataclasses.replace(reading, router_queued=held["n"] or None)

    fleet = Fleet(load=read, replicas=2)
    fleet.pods(ready=2)
    for i, ready in enumerate((True, False)):
        fleet.api.put({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": f"chat-router-{i}", "namespace": "llm",
            "labels": {c.LABEL_COMPONENT: "router", c.LABEL_OWNER: "chat"}},
            "spec": {"containers": [{"name": "router", "ports": [
                {"name": "metrics", "containerPort": 29000}]}]},
            "status": {"podIP": f"10.0.1.{i + 1}", "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]}})
    fleet.tick(0)
    assert fleet.replicas == 2
    assert fleet.source.routers == [("chat-router-0",)]  # ready routers only; not engines
    assert fleet.source.reads[-1][0] == ("chat-0", "chat-1")
    held["n"] = 20.0
    fleet.tick()
    assert fleet.replicas == 3
    decision = fleet.status["autoscaler"]["lastDecision"]
    assert (decision["direction"], decision["rule"]) == ("up", "queue_drain")
    assert "20 held at the router" in fleet.status["lastScaleReason"]


def test_node_headroom_keeps_placeholder_pods_ahead_of_a_rising_demand_and_removes_them_when_off():
    """autoscaling.nodeStartupSeconds > 0: after each decision the loop applies NAME-headroom
    with the placeholder count of kvpilot.autoscaler.headroom (engine-sized, low priority,
    engine scheduling constraints) and reports it in status.autoscaler.headroom; with node
    headroom off again the reconcile deletes that Deployment."""
    from kvpilot.operator.spec import parse_spec

    spec = copy.deepcopy(AUTO)
    spec["autoscaling"].update(nodeStartupSeconds=300, maxReplicas=20)
    spec["resources"] = {"requests": {"cpu": "4", "nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}
    spec["nodeSelector"] = {"pool": "h100"}
    fleet = Fleet(spec=spec, load=loaded(0.2), replicas=2)
    fleet.pods(ready=2)
    for step in range(12):  # KV usage climbing 4 points a tick: a ramp
        fleet.source.load = loaded(0.2 + 0.04 * step)
        fleet.tick()
        fleet.pods(ready=fleet.replicas)
    placeholder = fleet.api.stored("Deployment", "llm", "chat-headroom")
    headroom = fleet.status["autoscaler"]["headroom"]
    assert placeholder["spec"]["replicas"] == headroom["replicas"] > 0, headroom
    assert "a node, then a pod" in headroom["reason"]
    pod = placeholder["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "kvpilot-headroom"
    assert pod["nodeSelector"] == {"pool": "h100"}
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "4", "nvidia.com/gpu": 1},
                                                 "limits": {"nvidia.com/gpu": 1}}
    assert pod["containers"][0]["command"] == ["sleep", "infinity"]
    assert pod["terminationGracePeriodSeconds"] == 0
    labels = placeholder["spec"]["selector"]["matchLabels"]
    engine = fleet.api.stored("Deployment", "llm", "chat")["spec"]["selector"]["matchLabels"]
    assert labels != engine and not labels.items() <= engine.items()  # never an engine pod
    parse_spec(fleet.body()["spec"])
    # Node headroom off: the reconcile deletes the placeholders.
    body = fleet.body()
    body["spec"]["autoscaling"]["nodeStartupSeconds"] = 0
    fleet.api.put(body)
    on_spec(body=fleet.body(), memo=fleet.ctx)
    assert fleet.api.stored("Deployment", "llm", "chat-headroom") is None
