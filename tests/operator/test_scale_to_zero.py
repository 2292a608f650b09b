"""Scale to zero in the operator: the router's hold (arguments, readiness), the activation
probe on the router's error counter, the replica target, the Ready condition, and the
autoscaler loop going to zero when idle and back to one within a second of a held request."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from kvpilot.operator import constants as c
from kvpilot.operator.autoscaling.activation import POLL_SECONDS, ActivationProbe
from kvpilot.operator.autoscaling.metrics_source import EnginePod, RouterMetricNames
from kvpilot.operator.autoscaling.metrics_source.exposition import (
    ExpositionError,
    parse_router_no_engine,
)
from kvpilot.operator.autoscaling.metrics_source.reading import fleet_requests_finished
from kvpilot.operator.builders.router import (
    HOLD_BACKOFF_MULTIPLIER,
    RETRY_INITIAL_BACKOFF_MS,
    RETRY_MAX_BACKOFF_MS,
    hold_attempts,
    router_args,
)
from kvpilot.operator.reconcile import replica_target
from kvpilot.operator.spec import parse_spec
from kvpilot.operator.status.workload import workload_conditions

from .fake_sources import loaded
from .fleet_harness import EMBEDDED, Fleet

ZERO = {"model": EMBEDDED,
        "autoscaling": {"minReplicas": 0, "maxReplicas": 3, "intervalSeconds": 15,
                        "scaleToZeroAfterSeconds": 60, "activationTimeoutSeconds": 120}}

# What vllm-router 0.1.17 exported after holding one request with no worker for 10 attempts
# (captured from the pinned release, trimmed).
ROUTER_PAGE = """\
# TYPE vllm_router_retries_total counter
vllm_router_retries_total{route="/v1/completions"} 9
# TYPE vllm_router_request_errors_total counter
vllm_router_request_errors_total{route="/v1/completions",error_type="no_available_workers"} 10
vllm_router_request_errors_total{route="/v1/chat/completions",error_type="no_available_workers"} 2
vllm_router_request_errors_total{route="/v1/completions",error_type="upstream_5xx"} 4
# TYPE vllm_router_active_workers gauge
vllm_router_active_workers 0
"""


def _args(spec: dict) -> list[str]:
    return router_args("chat", "llm", parse_spec(spec))


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("hold", [1, 3, 30, 120, 300, 3600])
def test_the_hold_schedule_adds_up_to_the_activation_timeout_and_no_more(hold):
    attempts = hold_attempts(hold)
    waits, backoff = [], float(RETRY_INITIAL_BACKOFF_MS)
    for _ in range(attempts - 1):  # one wait between two attempts
        waits.append(min(backoff, RETRY_MAX_BACKOFF_MS))
        backoff *= HOLD_BACKOFF_MULTIPLIER
    assert sum(waits) >= hold * 1000
    assert sum(waits[:-1]) < hold * 1000  # one attempt fewer would not hold long enough
    with pytest.raises(ValueError, match="hold_seconds must be > 0"):
        hold_attempts(0)


def test_the_router_holds_requests_and_is_ready_without_engines_only_with_min_replicas_zero():
    from kvpilot.operator.builders.router import build_router_pod_template

    args = _args(ZERO)
    assert _flag(args, "--retry-max-retries") == str(hold_attempts(120))
    assert _flag(args, "--retry-backoff-multiplier") == "1.5"
    assert _flag(args, "--retry-jitter-factor") == "0"
    assert int(_flag(args, "--request-timeout-secs")) >= 120 + 1800
    probe = build_router_pod_template("chat", "llm", parse_spec(ZERO), "r:1")
    container = probe["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/liveness"
    # minReplicas 1: one retry, and ready only once an engine is.
    plain = {**ZERO, "autoscaling": {**ZERO["autoscaling"], "minReplicas": 1}}
    assert _flag(_args(plain), "--retry-max-retries") == "2"
    assert "--retry-jitter-factor" not in _args(plain)
    container = build_router_pod_template("chat", "llm", parse_spec(plain), "r:1")["spec"][
        "containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readiness"


def test_the_hold_arguments_parse_with_the_pinned_vllm_router():
    try:
        from vllm_router.launch_router import parse_router_args
    except ImportError:
        pytest.fail("vllm-router is not installed: pip install -e '.[router]'", pytrace=False)
    parsed = parse_router_args(_args(ZERO))
    assert parsed.retry_max_retries == hold_attempts(120)
    assert parsed.retry_backoff_multiplier == 1.5 and parsed.retry_jitter_factor == 0.0
    assert parsed.retry_initial_backoff_ms == 50 and parsed.retry_max_backoff_ms == 500


def test_the_no_engine_counter_is_summed_over_routes_and_absent_is_zero():
    assert parse_router_no_engine(ROUTER_PAGE, RouterMetricNames()) == 12.0
    assert parse_router_no_engine("# TYPE x gauge\nx 1\n", RouterMetricNames()) == 0.0
    bad = ('vllm_router_request_errors_total{route="/v1/completions",'
           'error_type="no_available_workers"} NaN\n')
    with pytest.raises(ExpositionError, match="not a counter value"):
        parse_router_no_engine(bad, RouterMetricNames())
    with pytest.raises(ExpositionError):
        parse_router_no_engine("{{{ not metrics", RouterMetricNames())


def _probe(pages: dict[str, list]) -> ActivationProbe:
    """A probe whose router pods answer from ``pages``: per IP, a list of counter values
    (an Exception to fail that poll), consumed one per poll."""
    def handler(request: httpx.Request) -> httpx.Response:
        value = pages[request.url.host].pop(0)
        if isinstance(value, Exception):
            raise httpx.ConnectError(str(value), request=request)
        body = ('vllm_router_request_errors_total{route="/v1/completions",'
                f'error_type="no_available_workers"}} {value}\n')
        return httpx.Response(200, text=body)
    return ActivationProbe("llm/chat", client=httpx.Client(transport=httpx.MockTransport(handler)))


def test_the_probe_counts_growth_between_polls_with_baselines_resets_and_failures():
    routers = (EnginePod("chat-router-a", "10.0.1.1", 29000),
               EnginePod("chat-router-b", "10.0.1.2", 29000))
    probe = _probe({"10.0.1.1": [5, 7, 7, 2, OSError("refused"), 4],
                    "10.0.1.2": [0, 0, 3, 3, 3, 3]})
    assert probe.poll(routers, 0.0) == 0.0  # first sight: baselines only
    assert probe.poll(routers, 1.0) == 2.0  # a: 5 -> 7
    assert probe.poll(routers, 2.0) == 3.0  # b: 0 -> 3
    assert probe.poll(routers, 3.0) == 2.0  # a restarted: 2 is its increase
    assert probe.poll(routers, 4.0) == 0.0  # a unreadable: adds nothing, keeps its baseline
    assert probe.poll(routers, 5.0) == 2.0  # a: 2 -> 4
    assert probe.poll((), 6.0) is None  # no router: no answer
    only_a = _probe({"10.0.1.1": [OSError("refused")]})
    assert only_a.poll(routers[:1], 0.0) is None  # none readable


def test_fleet_requests_finished_needs_every_pod():
    assert fleet_requests_finished([3.0, 4.0]) == 7.0
    assert fleet_requests_finished([3.0, None]) is None
    assert fleet_requests_finished([]) is None
    assert fleet_requests_finished([float("nan")]) is None


@pytest.mark.parametrize(("current", "requested", "replicas"), [
    (None, None, 1),  # a new fleet serves first
    (1, 0, 0),  # the autoscaler takes it to zero
    (0, None, 0),  # a reconcile of a fleet at zero keeps zero
    (0, 1, 1),  # activation
    (2, None, 2),
])
def test_replica_target_with_min_replicas_zero(current, requested, replicas):
    assert replica_target(parse_spec(ZERO), current, requested).replicas == replicas


def test_raising_min_replicas_brings_a_fleet_at_zero_back():
    spec = parse_spec({**ZERO, "autoscaling": {**ZERO["autoscaling"], "minReplicas": 2}})
    target = replica_target(spec, 0)
    assert target.replicas == 2 and "raised to autoscaling.minReplicas=2" in target.reason


def test_a_fleet_at_zero_by_design_is_ready():
    deployment = {"metadata": {"generation": 3},
                  "spec": {"replicas": 0},
                  "status": {"observedGeneration": 3, "replicas": 0}}
    ready, _ = workload_conditions(deployment, scale_to_zero=True)
    assert (ready.status, ready.reason) == ("True", "ScaledToZero")
    assert "activationTimeoutSeconds" in ready.message
    ready, _ = workload_conditions(deployment)  # spec.replicas 0 by hand: not serving
    assert (ready.status, ready.reason) == ("False", "ScaledToZero")


def _router_pod(fleet: Fleet) -> None:
    fleet.api.put({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "chat-router-0", "namespace": "llm",
        "labels": {c.LABEL_COMPONENT: "router", c.LABEL_OWNER: "chat"}},
        "spec": {"containers": [{"name": "router", "ports": [
            {"name": "metrics", "containerPort": 29000}]}]},
        "status": {"podIP": "10.0.1.1", "conditions": [{"type": "Ready", "status": "True"}]}})


def test_the_loop_goes_to_zero_when_idle_and_back_within_a_poll_of_a_held_request():
    def idle(pods, now):
        reading = loaded(0.0, waiting=0, running=0.0)(pods, now)
        return dataclasses.replace(reading, requests_finished=12.0)

    fleet = Fleet(spec=ZERO, load=idle)
    assert fleet.replicas == 1  # a new fleet starts at one
    fleet.pods(ready=1)
    _router_pod(fleet)
    errors = {"n": 0.0}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=(
            'vllm_router_request_errors_total{route="/v1/chat/completions",'
            f'error_type="no_available_workers"}} {errors["n"]}\n'))
    fleet.loop.activation = ActivationProbe(
        "llm/chat", client=httpx.Client(transport=httpx.MockTransport(handler)))

    fleet.tick(0)
    for _ in range(5):  # idle from the second decision; 60 s later: zero
        assert fleet.replicas == 1
        fleet.tick(15)
    assert fleet.replicas == 0
    decision = fleet.status["autoscaler"]["lastDecision"]
    assert (decision["direction"], decision["rule"]) == ("down", "scale_to_zero")
    assert fleet.status["lastScaleReason"].startswith("1 -> 0: rule scale_to_zero")
    assert fleet.events.reasons()[-1] == "ScaledDown"
    assert fleet.condition("Ready")["reason"] == "ScaledToZero"
    assert fleet.condition("Ready")["status"] == "True"
    fleet.pods(ready=0)  # the engine pod is gone (and the harness removed every pod)
    _router_pod(fleet)

    # At zero: polled every second between intervals, nothing held -> stays at zero.
    assert fleet.tick(0.5) == POLL_SECONDS
    assert fleet.replicas == 0
    reads = len(fleet.source.reads)
    assert fleet.tick(1.0) == POLL_SECONDS  # a poll reads no engine metrics
    assert len(fleet.source.reads) == reads
    errors["n"] = 6.0  # a request arrives; the router retries it
    fleet.tick(1.0)
    assert fleet.replicas == 1
    decision = fleet.status["autoscaler"]["lastDecision"]
    assert (decision["direction"], decision["rule"]) == ("up", "activation")
    assert fleet.condition("MetricsAvailable")["status"] == "True"
    assert fleet.events.reasons()[-1] == "ScaledUp"


def test_a_fleet_at_zero_reports_metrics_as_available_not_missing():
    fleet = Fleet(spec=ZERO, load=loaded(0.0, running=0.0))
    fleet.api.objects[("Deployment", "llm", "chat")]["spec"]["replicas"] = 0
    fleet.tick(0)
    assert fleet.replicas == 0
    cond = fleet.condition("MetricsAvailable")
    assert (cond["status"], cond["reason"]) == ("True", "ScaledToZero")
    assert "MetricsUnavailable" not in fleet.events.reasons()


def test_an_unreadable_router_keeps_the_fleet_from_going_to_zero():
    """Found in review: a failed router scrape counted as "nothing held", so a fleet whose
    router could not be read went to zero and could then never be activated."""
    def idle(pods, now):
        reading = loaded(0.0, waiting=0, running=0.0)(pods, now)
        return dataclasses.replace(reading, requests_finished=12.0)

    fleet = Fleet(spec=ZERO, load=idle)
    fleet.pods(ready=1)
    _router_pod(fleet)

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)
    fleet.loop.activation = ActivationProbe(
        "llm/chat", client=httpx.Client(transport=httpx.MockTransport(refuse)))
    fleet.tick(0)
    for _ in range(10):
        fleet.tick(15)
    assert fleet.replicas == 1
    assert fleet.status["autoscaler"]["policyState"].get("idleSince") is None
