"""spec.router: the vllm-router Deployment (and its Service, ServiceAccount, RoleBinding,
PDB, PodMonitor) or the gateway mode's InferencePool, as built, validated (Kubernetes
schemas, the pinned vllm-router's own argument parser, the vendored InferencePool CRD),
reconciled (applied, deleted when no longer wanted, never over someone else's object) and
reported (status.endpoint, status.inferencePool, the RouterReady condition)."""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import kopf
import kubernetes_validate
import pytest

from kvpilot.operator import constants as c
from kvpilot.operator.api import InvalidObjectError
from kvpilot.operator.builders import Owner, build_children
from kvpilot.operator.builders.labels import object_labels, router_object_labels
from kvpilot.operator.builders.router import router_args
from kvpilot.operator.handlers.children import on_deployment_event
from kvpilot.operator.handlers.context import OperatorContext
from kvpilot.operator.handlers.lifecycle import on_spec
from kvpilot.operator.metrics import OperatorMetrics
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.reconcile import Resource, reconcile
from kvpilot.operator.spec import SpecError, parse_spec
from kvpilot.operator.spec.router import ROUTER_POLICIES, SESSION_HEADERS

from .crdschema import admit, load_crd, prune, root_schema, sub_schema
from .fakes import T0, Clock, FakeKubeApi, inference

OWNER = Owner("chat", "llm", "uid-chat")
EMBEDDED = {"uri": "embedded://smollm2-135m-instruct"}
ENGINE_IMAGE, ROUTER_IMAGE = "kvpilot/engine:test", "kvpilot/router:test"
OPTIONS = OperatorOptions(engine_image=ENGINE_IMAGE, router_image=ROUTER_IMAGE)
PODMONITOR = "monitoring.coreos.com/v1/PodMonitor"
INFERENCE_POOL = f"{c.INFERENCE_POOL_API_VERSION}/{c.INFERENCE_POOL_KIND}"
GATEWAY = {"mode": "gateway", "gateway": {"endpointPickerRef": {"name": "chat-epp"}}}
POOL_CRD = Path(__file__).parent / "fixtures" / "inference.networking.k8s.io_inferencepools.yaml"
K8S_VERSION = "1.36.0"


def spec_with(router: dict | None = None, **more) -> dict:
    spec = {"model": EMBEDDED, **more}
    if router is not None:
        spec["router"] = router
    return spec


def build(spec: dict, pod_monitor: bool = True, inference_pool: bool = True):
    return build_children(OWNER, parse_spec(spec), 2, ENGINE_IMAGE, pod_monitor,
                          router_image=ROUTER_IMAGE, inference_pool=inference_pool)


def by_kind(objs, kind: str) -> dict:
    (found,) = [o for o in objs if o["kind"] == kind]
    return found


def router_container(children) -> dict:
    (container,) = by_kind(children.router, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def engine_container(children) -> dict:
    (container,) = children.deployment["spec"]["template"]["spec"]["containers"]
    return container


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# ------------------------------------------------------------------------- builders
@pytest.mark.parametrize("policy", ROUTER_POLICIES)
def test_router_objects_for_each_policy(policy):
    router = {"policy": policy}
    if policy == "consistent_hash":
        router["sessionHeader"] = "x-session-id"
    children = build(spec_with(router))
    assert [(o["kind"], o["metadata"]["name"]) for o in children.router] == [
        ("ServiceAccount", "chat-router"), ("RoleBinding", "chat-router"),
        ("Deployment", "chat-router"), ("Service", "chat-router"),
        ("PodMonitor", "chat-router")]
    args = router_container(children)["args"]
    assert args == [
        "--host", "0.0.0.0", "--port", "8000", "--policy", policy,
        "--service-discovery", "--selector",
        "app.kubernetes.io/component=engine", "kvpilot.dev/inference-deployment=chat",
        "--service-discovery-port", "8000", "--service-discovery-namespace", "llm",
        "--prometheus-host", "0.0.0.0", "--prometheus-port", "29000",
        "--health-check-endpoint", "/ready", "--health-check-interval-secs", "5",
        "--health-check-timeout-secs", "3", "--health-failure-threshold", "2",
        "--health-success-threshold", "2",
        "--retry-max-retries", "2", "--retry-initial-backoff-ms", "50",
        "--retry-max-backoff-ms", "500",
    ]
    # The engines publish KV events (and declare the ports) only for kv_aware.
    engine = engine_container(children)
    kv = policy == "kv_aware"
    assert ("--kv-events-config" in engine["args"]) is kv
    ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
    assert ports == ({"http": 8000, "kv-events": 5557, "kv-replay": 5558} if kv else {"http": 8000})
    if kv:
        assert json.loads(flag(engine["args"], "--kv-events-config")) == {
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
            "topic": "kv-events"}
    for obj in children.all():
        if obj["kind"] != "PodMonitor":
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("policy", ROUTER_POLICIES)
def test_router_args_parse_with_the_pinned_vllm_router(policy):
    """The flags exist in vllm-router 0.1.17 and mean what the operator wants: parsed by
    the release's own argument parser (no process, no cluster)."""
    try:
        from vllm_router.launch_router import parse_router_args
    except ImportError:
        pytest.fail("vllm-router is not installed: pip install -e '.[router]'", pytrace=False)
    router = {"policy": policy}
    if policy == "consistent_hash":
        router["sessionHeader"] = "x-user-id"
    spec = parse_spec(spec_with(router, env=[{"name": "KVPILOT_API_KEY", "value": "k"}]))
    parsed = parse_router_args(router_args("chat", "llm", spec))
    assert parsed.policy == policy
    assert parsed.service_discovery is True
    assert parsed.selector == {"app.kubernetes.io/component": "engine",
                               "kvpilot.dev/inference-deployment": "chat"}
    assert parsed.service_discovery_namespace == "llm"
    assert (parsed.host, parsed.port) == ("0.0.0.0", c.ROUTER_PORT)
    assert parsed.service_discovery_port == c.ENGINE_PORT
    assert (parsed.prometheus_host, parsed.prometheus_port) == ("0.0.0.0", c.ROUTER_METRICS_PORT)
    assert parsed.health_check_endpoint == c.READY_PATH
    assert parsed.health_check_interval_secs == 5 and parsed.health_failure_threshold == 2
    # Attempts, the first included: one retry, on a freshly picked engine.
    assert parsed.retry_max_retries == 2 and parsed.disable_retries is False
    assert parsed.api_key == "$(KVPILOT_API_KEY)"  # expanded by the kubelet
    assert parsed.worker_urls == []  # no static workers: all come from discovery


def test_router_pod_security_probes_and_identity():
    children = build(spec_with(None, terminationGracePeriodSeconds=120))
    deployment = by_kind(children.router, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = router_container(children)
    assert container["image"] == ROUTER_IMAGE and container["command"] == ["vllm-router"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["securityContext"]["runAsUser"] == 10001
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "http": 8000, "metrics": 29000}
    assert container["livenessProbe"]["httpGet"] == {"path": "/liveness", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    assert container["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "5"]}}
    # It watches pods, so it mounts its own ServiceAccount's token; the engine does not.
    assert pod["serviceAccountName"] == "chat-router"
    assert pod["automountServiceAccountToken"] is True
    assert children.deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert pod["terminationGracePeriodSeconds"] == 120  # streams through it may finish
    assert container["resources"] == {"requests": {"cpu": "100m", "memory": "128Mi"},
                                      "limits": {"memory": "512Mi"}}
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp", "/cache"}
    binding = by_kind(children.router, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole", "name": "kvpilot-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-router",
                                    "namespace": "llm"}]
    service = by_kind(children.router, "Service")
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http",
                                         "protocol": "TCP"}]
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1,
                                                               "maxUnavailable": 0}
    # The engine pods keep their drain: preStop sleep, then --drain-timeout.
    engine = engine_container(children)
    assert engine["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "10"]}}
    assert flag(engine["args"], "--drain-timeout") == "105"


def test_router_spec_settings_reach_the_router():
    children = build(spec_with({"replicas": 3, "image": "my/router:9",
                                "resources": {"requests": {"cpu": "1"}}},
                               imagePullSecrets=[{"name": "regcred"}]))
    deployment = by_kind(children.router, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    container = router_container(children)
    assert container["image"] == "my/router:9"
    assert container["resources"] == {"requests": {"cpu": "1"}}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["topologySpreadConstraints"][0]["labelSelector"] == {
        "matchLabels": {c.LABEL_COMPONENT: "router", c.LABEL_OWNER: "chat"}}


def test_router_pdb_only_from_two_replicas():
    one = build(spec_with(None))
    assert "PodDisruptionBudget" not in [o["kind"] for o in one.router]
    assert ("PodDisruptionBudget", "chat-router") in [(r.kind, r.name) for r in one.unwanted]
    two = build(spec_with({"replicas": 2}))
    pdb = by_kind(two.router, "PodDisruptionBudget")
    assert pdb["metadata"]["name"] == "chat-router"
    assert pdb["spec"] == {"maxUnavailable": 1, "unhealthyPodEvictionPolicy": "AlwaysAllow",
                           "selector": {"matchLabels": {c.LABEL_COMPONENT: "router",
                                                        c.LABEL_OWNER: "chat"}}}
    assert not [r for r in two.unwanted if r.kind == "PodDisruptionBudget"]


def test_router_pod_monitor_scrapes_the_metrics_port():
    children = build_children(OWNER, parse_spec(spec_with(None)), 1, ENGINE_IMAGE, True,
                              (("release", "kps"),), router_image=ROUTER_IMAGE)
    monitor = by_kind(children.router, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["selector"] == {"matchLabels": {c.LABEL_COMPONENT: "router",
                                                           c.LABEL_OWNER: "chat"}}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    assert endpoint["relabelings"][0]["targetLabel"] == "inference_deployment"
    assert "PodMonitor" not in [o["kind"] for o in build(spec_with(None), pod_monitor=False).router]


def test_selectors_keep_engines_and_routers_apart():
    """The engine Service and the router's discovery select engine pods only; the router
    Service selects router pods only (a router must never route to itself)."""
    children = build(spec_with(None))
    engine_pod = children.deployment["spec"]["template"]["metadata"]["labels"]
    router_pod = by_kind(children.router, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert engine_pod == object_labels("chat") and router_pod == router_object_labels("chat")

    def matches(selector, labels):
        return selector.items() <= labels.items()

    discovery = dict(s.split("=", 1) for s in router_container(children)["args"][
        router_container(children)["args"].index("--selector") + 1:][:2])
    assert matches(discovery, engine_pod) and not matches(discovery, router_pod)
    assert matches(children.service["spec"]["selector"], engine_pod)
    assert not matches(children.service["spec"]["selector"], router_pod)
    router_service = by_kind(children.router, "Service")["spec"]["selector"]
    assert matches(router_service, router_pod) and not matches(router_service, engine_pod)


@pytest.mark.parametrize(("spec", "expected"), [
    (spec_with(None, env=[{"name": "KVPILOT_API_KEY",
                           "valueFrom": {"secretKeyRef": {"name": "llm-key", "key": "key"}}}]),
     ["--api-key", "$(KVPILOT_API_KEY)"]),
    (spec_with(None, engine={"extraArgs": ["--api-key=s3cret"]}), ["--api-key", "s3cret"]),
    (spec_with(None, engine={"extraArgs": ["--api-key", "s3cret"]}), ["--api-key", "s3cret"]),
    (spec_with(None), []),
], ids=["env-secret", "extra-args-equals", "extra-args-separate", "none"])
def test_the_engines_api_key_is_passed_through(spec, expected):
    children = build(spec)
    args = router_container(children)["args"]
    assert args[len(args) - len(expected):] == expected if expected else "--api-key" not in args
    env = {e["name"]: e for e in router_container(children)["env"]}
    if expected == ["--api-key", "$(KVPILOT_API_KEY)"]:
        # The same reference as the engine's: the key never appears in the pod spec.
        assert env["KVPILOT_API_KEY"] == spec["env"][0]
    else:
        assert "KVPILOT_API_KEY" not in env


def test_disabled_router_builds_nothing_and_lists_what_to_delete():
    children = build(spec_with({"enabled": False}))
    assert children.router == ()
    assert "--kv-events-config" not in engine_container(children)["args"]
    assert {(r.kind, r.name) for r in children.unwanted} == {
        ("ServiceAccount", "chat-router"), ("RoleBinding", "chat-router"),
        ("Deployment", "chat-router"), ("Service", "chat-router"),
        ("PodDisruptionBudget", "chat-router"), ("PodMonitor", "chat-router"),
        ("InferencePool", "chat"),
        ("Deployment", "chat-headroom"),  # no node headroom asked for either
        ("ConfigMap", "chat-adapters")}  # nor LoRA adapters


def test_gateway_mode_builds_an_inference_pool_valid_against_its_crd():
    crd = load_crd(POOL_CRD)
    children = build(spec_with(GATEWAY))
    assert [o["kind"] for o in children.router] == ["InferencePool"]
    assert not [o for o in children.all() if o["metadata"]["name"] == "chat-router"]
    assert "--kv-events-config" not in engine_container(children)["args"]
    pool = by_kind(children.router, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["name"] == "chat"
    stored, errors = admit(crd, pool)
    assert errors == []
    assert prune(root_schema(crd), pool)[1] == []  # every field we send is declared
    assert stored["spec"]["selector"]["matchLabels"] == children.service["spec"]["selector"]
    assert stored["spec"]["targetPorts"] == [{"number": 8000}]
    assert stored["spec"]["endpointPickerRef"] == {
        "group": "", "kind": "Service", "name": "chat-epp", "port": {"number": 9002},
        "failureMode": "FailClose"}
    assert {(r.kind, r.name) for r in children.unwanted} >= {("Deployment", "chat-router")}
    # The check itself works: the CRD refuses a pool with no target port.
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPorts"] = []
    assert admit(crd, broken)[1]


def test_gateway_mode_settings_and_missing_crd():
    gateway = {"mode": "gateway", "gateway": {"endpointPickerRef": {
        "name": "epp", "port": 9443, "failureMode": "FailOpen"}}}
    pool = by_kind(build(spec_with(gateway)).router, "InferencePool")
    assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "epp",
                                                 "port": {"number": 9443},
                                                 "failureMode": "FailOpen"}
    assert build(spec_with(gateway), inference_pool=False).router == ()


# ------------------------------------------------------------------------- spec and CRD
@pytest.fixture(scope="module")
def crd():
    return load_crd()


def cr(spec: dict, name: str = "chat") -> dict:
    return {"apiVersion": c.API_VERSION, "kind": c.KIND,
            "metadata": {"name": name, "namespace": "llm"}, "spec": spec}


def test_router_defaults_in_the_crd_and_the_operator(crd):
    stored, errors = admit(crd, cr(spec_with(None)))
    assert errors == []
    assert stored["spec"]["router"] == {
        "enabled": True, "mode": "router", "policy": "kv_aware", "replicas": 1,
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                      "limits": {"memory": "512Mi"}}}
    assert parse_spec(stored["spec"]).router == parse_spec(spec_with(None)).router
    schema = sub_schema(sub_schema(load_crd()["spec"]["versions"][0]["schema"]
                                   ["openAPIV3Schema"], "spec"), "router")
    assert tuple(schema["properties"]["policy"]["enum"]) == ROUTER_POLICIES
    assert tuple(schema["properties"]["sessionHeader"]["enum"]) == SESSION_HEADERS


# (case, spec, a piece of the API server's message, the operator's field, a piece of its
# message). Both must refuse; both name the field and what is allowed.
REFUSED = [
    ("policy-not-offered", spec_with({"policy": "round_robin"}),
     ".spec.router.policy: 'round_robin' not in", "router.policy",
     "got 'round_robin'; one of kv_aware, cache_aware, power_of_two, consistent_hash"),
    ("consistent-hash-without-header", spec_with({"policy": "consistent_hash"}),
     "router.sessionHeader is required when router.policy is consistent_hash",
     "router.sessionHeader", "required when router.policy is consistent_hash"),
    ("header-vllm-router-ignores", spec_with({"policy": "consistent_hash",
                                             "sessionHeader": "x-conversation-id"}),
     ".spec.router.sessionHeader: 'x-conversation-id' not in", "router.sessionHeader",
     "got 'x-conversation-id'; one of x-session-id"),
    ("header-without-consistent-hash", spec_with({"sessionHeader": "x-session-id"}),
     "router.sessionHeader applies only to router.policy consistent_hash",
     "router.sessionHeader", "only with router.policy consistent_hash"),
    ("gateway-without-picker", spec_with({"mode": "gateway"}),
     "router.gateway.endpointPickerRef is required when router.mode is gateway",
     "router.gateway.endpointPickerRef", "required when router.mode is gateway"),
    ("unknown-mode", spec_with({"mode": "mesh"}), ".spec.router.mode: 'mesh' not in",
     "router.mode", "got 'mesh'; one of router, gateway"),
    ("zero-router-replicas", spec_with({"replicas": 0}),
     ".spec.router.replicas: 0 below minimum 1", "router.replicas",
     "got 0; an integer in [1, 100] is required"),
    ("picker-not-a-service-name", spec_with({"mode": "gateway", "gateway": {
        "endpointPickerRef": {"name": "EPP_1"}}}),
     ".spec.router.gateway.endpointPickerRef.name: 'EPP_1' does not match",
     "router.gateway.endpointPickerRef.name", "got 'EPP_1'; a Service name"),
    ("picker-port-out-of-range", spec_with({"mode": "gateway", "gateway": {
        "endpointPickerRef": {"name": "epp", "port": 70000}}}),
     "endpointPickerRef.port: 70000 above maximum 65535",
     "router.gateway.endpointPickerRef.port", "got 70000; an integer in [1, 65535]"),
    ("kv-events-flag-while-kv-aware", spec_with(None, engine={
        "extraArgs": ["--kv-events-config={}"]}),
     "engine.extraArgs must not set --kv-events-config while spec.router routes with policy"
     " kv_aware", "engine.extraArgs", "--kv-events-config is set by the operator"),
]


@pytest.mark.parametrize("case,spec,crd_message,field,message", REFUSED,
                         ids=[r[0] for r in REFUSED])
def test_bad_router_specs_are_refused_naming_the_field(crd, case, spec, crd_message, field,
                                                       message):
    _, errors = admit(crd, cr(spec))
    assert any(crd_message in e for e in errors), errors
    with pytest.raises(SpecError) as info:
        parse_spec(copy.deepcopy(spec))
    assert info.value.field == field
    assert message in str(info.value) and f"spec.{field}" in str(info.value)


@pytest.mark.parametrize("router", [
    {"policy": "power_of_two"}, {"enabled": False}, GATEWAY,
], ids=["other-policy", "disabled", "gateway"])
def test_kv_events_flag_is_the_users_without_kv_aware(crd, router):
    spec = spec_with(router, engine={"extraArgs": ["--kv-events-config={}"]})
    assert admit(crd, cr(spec))[1] == []
    args = engine_container(build(spec))["args"]
    assert args.count("--kv-events-config={}") == 1 and "--kv-events-config" not in args


def test_every_session_header_is_accepted(crd):
    for header in SESSION_HEADERS:
        spec = spec_with({"policy": "consistent_hash", "sessionHeader": header})
        assert admit(crd, cr(spec))[1] == []
        assert parse_spec(spec).router.session_header == header


# ------------------------------------------------------------------------- reconcile
def run(api, spec, name="chat", **kwargs):
    body = inference(name=name, spec=spec)
    if api.stored(c.KIND, "llm", name) is None:
        api.put(body)
    else:
        api.objects[(c.KIND, "llm", name)]["spec"] = spec
    return reconcile(api, Resource.from_body(body), OPTIONS, T0, **kwargs)


def conditions(status) -> dict:
    return {x["type"]: (x["status"], x["reason"], x["message"]) for x in status["conditions"]}


def test_reconcile_runs_the_router_and_reports_its_endpoint():
    api = FakeKubeApi(apis=(PODMONITOR,))
    result = run(api, spec_with(None))
    assert {"ServiceAccount/chat-router", "RoleBinding/chat-router", "Deployment/chat-router",
            "Service/chat-router", "PodMonitor/chat-router"} <= set(result.applied)
    assert result.status["endpoint"] == "http://chat-router.llm.svc:8000"
    assert result.status["inferencePool"] is None
    assert conditions(result.status)["RouterReady"] == (
        "False", "RouterUnavailable",
        "0/1 router pods available: no engine pod is ready yet, and a router pod turns ready"
        " once it has found one")
    # The engine Service stays, under its old name, for whoever used it.
    assert api.stored("Service", "llm", "chat")["spec"]["selector"] == {
        c.LABEL_COMPONENT: "engine", c.LABEL_OWNER: "chat"}
    api.set_deployment_status("llm", "chat-router", replicas=1, readyReplicas=1,
                              availableReplicas=1)
    ready = run(api, spec_with(None))
    assert conditions(ready.status)["RouterReady"] == (
        "True", "RouterAvailable", "1/1 router pods available")


def test_disabling_the_router_deletes_its_objects_and_points_at_the_engines():
    api = FakeKubeApi(apis=(PODMONITOR,))
    ctx = OperatorContext(api=api, options=OPTIONS, metrics=OperatorMetrics(), clock=Clock(),
                          post_event=lambda *a: None)
    body = inference(spec=spec_with({"replicas": 2}))
    api.put(body)
    on_spec(body=body, patch=kopf.Patch(), memo=ctx)
    assert api.stored("PodDisruptionBudget", "llm", "chat-router") is not None
    assert "RouterReady" in conditions(api.stored(c.KIND, "llm", "chat")["status"])
    disabled = inference(spec=spec_with({"enabled": False}), generation=2)
    api.objects[(c.KIND, "llm", "chat")]["spec"] = disabled["spec"]
    on_spec(body=disabled, patch=kopf.Patch(), memo=ctx)
    for kind in ("ServiceAccount", "RoleBinding", "Deployment", "Service",
                 "PodDisruptionBudget", "PodMonitor"):
        assert api.stored(kind, "llm", "chat-router") is None, kind
    assert api.stored("Deployment", "llm", "chat") is not None  # the engines stay
    status = api.stored(c.KIND, "llm", "chat")["status"]
    assert status["endpoint"] == "http://chat.llm.svc:8000"
    assert "RouterReady" not in conditions(status)  # removed, not left stale
    assert "--kv-events-config" not in api.stored("Deployment", "llm", "chat")["spec"][
        "template"]["spec"]["containers"][0]["args"]


def test_going_to_one_router_replica_deletes_its_pdb():
    api = FakeKubeApi()
    run(api, spec_with({"replicas": 2}))
    assert api.stored("PodDisruptionBudget", "llm", "chat-router") is not None
    result = run(api, spec_with({"replicas": 1}))
    assert result.deleted == ("PodDisruptionBudget/chat-router",)
    assert api.stored("PodDisruptionBudget", "llm", "chat-router") is None
    assert [e.reason for e in result.events] == ["RouterObjectsDeleted"]


def test_objects_of_the_router_names_that_are_not_ours_are_never_touched():
    api = FakeKubeApi()
    foreign = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "chat-router", "namespace": "llm"},
               "spec": {"selector": {"app": "web"}}}
    api.put(foreign)
    with pytest.raises(InvalidObjectError, match="Service llm/chat-router exists and is not"
                                                 " managed by kvpilot"):
        run(api, spec_with(None))
    assert [call for call in api.writes() if call[0] == "apply"] == []
    # With the router disabled it is not ours to delete either.
    result = run(api, spec_with({"enabled": False}))
    assert result.deleted == () and api.stored("Service", "llm", "chat-router")["spec"] == (
        foreign["spec"])


def test_a_name_too_long_for_the_router_service_is_refused_before_any_write():
    api = FakeKubeApi()
    with pytest.raises(SpecError, match="at most 56 characters"):
        run(api, spec_with(None), name="a" * 57)
    assert api.writes() == []
    assert run(api, spec_with({"enabled": False}), name="b" * 63).status["endpoint"] == (
        f"http://{'b' * 63}.llm.svc:8000")


def test_gateway_mode_applies_an_inference_pool_and_reports_acceptance():
    api = FakeKubeApi(apis=(INFERENCE_POOL,))
    result = run(api, spec_with(GATEWAY))
    assert "InferencePool/chat" in result.applied
    assert api.stored("Deployment", "llm", "chat-router") is None
    assert result.status["endpoint"] is None and result.status["inferencePool"] == "chat"
    status, reason, message = conditions(result.status)["RouterReady"]
    assert (status, reason) == ("False", "InferencePoolNotAccepted")
    assert "HTTPRoute" in message
    api.objects[("InferencePool", "llm", "chat")]["status"] = {"parents": [{
        "parentRef": {"kind": "Gateway", "namespace": "infra", "name": "inference-gw"},
        "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted"}]}]}
    accepted = run(api, spec_with(GATEWAY))
    assert conditions(accepted.status)["RouterReady"] == (
        "True", "InferencePoolAccepted", "InferencePool chat accepted by Gateway infra/inference-gw")


def test_gateway_mode_without_the_crd_reports_it_instead_of_failing():
    api = FakeKubeApi()  # the cluster serves no InferencePool
    result = run(api, spec_with(GATEWAY))
    assert not [a for a in result.applied if a.startswith("InferencePool")]
    assert ("get", "InferencePool", "llm", "chat") not in api.calls
    assert conditions(result.status)["RouterReady"] == (
        "False", "InferencePoolCRDMissing",
        "the inferencepools.inference.networking.k8s.io CRD (inference.networking.k8s.io/v1)"
        " is not installed: install the Gateway API Inference Extension CRDs; no"
        " InferencePool was applied")
    assert conditions(result.status)["Ready"][0] == "False"  # the engines are reported as usual


def test_switching_from_router_to_gateway_removes_the_router():
    api = FakeKubeApi(apis=(INFERENCE_POOL,))
    run(api, spec_with(None))
    result = run(api, spec_with(GATEWAY))
    assert set(result.deleted) == {"ServiceAccount/chat-router", "RoleBinding/chat-router",
                                   "Deployment/chat-router", "Service/chat-router"}
    back = run(api, spec_with(None))
    assert back.deleted == ("InferencePool/chat",)


def test_router_deployment_watch_moves_router_ready():
    api = FakeKubeApi()
    ctx = OperatorContext(api=api, options=OPTIONS, metrics=OperatorMetrics(), clock=Clock(),
                          post_event=lambda *a: None)
    body = inference(spec=spec_with(None))
    api.put(body)
    on_spec(body=body, patch=kopf.Patch(), memo=ctx)
    before = api.stored(c.KIND, "llm", "chat")["status"]
    assert conditions(before)["RouterReady"][:2] == ("False", "RouterUnavailable")
    api.set_deployment_status("llm", "chat-router", replicas=1, availableReplicas=1)
    ctx.clock.advance(30)
    on_deployment_event(body=api.stored("Deployment", "llm", "chat-router"), type="MODIFIED",
                        memo=ctx)
    after = api.stored(c.KIND, "llm", "chat")["status"]
    assert conditions(after)["RouterReady"] == ("True", "RouterAvailable",
                                                "1/1 router pods available")
    router_ready = next(x for x in after["conditions"] if x["type"] == "RouterReady")
    assert router_ready["lastTransitionTime"] == "2026-11-29T12:00:30Z"
    # The engine counts are the engine Deployment's, untouched by a router event.
    assert {k: after[k] for k in ("replicas", "readyReplicas", "desiredReplicas")} == {
        k: before[k] for k in ("replicas", "readyReplicas", "desiredReplicas")}
    assert conditions(after)["Ready"] == conditions(before)["Ready"]
    writes = len(api.writes())
    on_deployment_event(body=api.stored("Deployment", "llm", "chat-router"), type="MODIFIED",
                        memo=ctx)
    assert len(api.writes()) == writes  # unchanged: nothing written
    api.set_deployment_status("llm", "chat-router", replicas=1, availableReplicas=0)
    on_deployment_event(body=api.stored("Deployment", "llm", "chat-router"), type="MODIFIED",
                        memo=ctx)
    assert conditions(api.stored(c.KIND, "llm", "chat")["status"])["RouterReady"][:2] == (
        "False", "RouterUnavailable")


def test_a_router_event_after_disabling_writes_nothing():
    api = FakeKubeApi()
    ctx = OperatorContext(api=api, options=OPTIONS, metrics=OperatorMetrics(), clock=Clock(),
                          post_event=lambda *a: None)
    body = inference(spec=spec_with(None))
    api.put(body)
    on_spec(body=body, patch=kopf.Patch(), memo=ctx)
    router = api.stored("Deployment", "llm", "chat-router")
    api.objects[(c.KIND, "llm", "chat")]["spec"] = spec_with({"enabled": False})
    writes = len(api.writes())
    on_deployment_event(body=router, type="MODIFIED", memo=ctx)
    assert len(api.writes()) == writes


# ------------------------------------------------------------------------- the real router
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.slow
def test_the_pinned_router_answers_the_probes_the_deployment_declares(tmp_path):
    """vllm-router 0.1.17 started with the operator's own arguments (ports moved to free
    ones, bound to 127.0.0.1, no cluster so discovery finds nobody): /liveness answers 200,
    /readiness 503 until an engine is found (so a router pod without engines takes no
    traffic), and the metrics port serves Prometheus text."""
    vllm_router = Path(sys.executable).parent / "vllm-router"
    if not vllm_router.exists():
        pytest.fail("vllm-router is not installed: pip install -e '.[router]'", pytrace=False)
    container = router_container(build(spec_with(None)))
    args = list(container["args"])
    port, metrics = _free_port(), _free_port()
    args[args.index("--port") + 1] = str(port)
    args[args.index("--prometheus-port") + 1] = str(metrics)
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--prometheus-host") + 1] = "127.0.0.1"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none")}
    proc = subprocess.Popen([str(vllm_router), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    liveness = container["livenessProbe"]["httpGet"]["path"]
    readiness = container["readinessProbe"]["httpGet"]["path"]
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                live = _get(f"http://127.0.0.1:{port}{liveness}")
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, "the router never listened"
                time.sleep(0.5)
        assert live == (200, "OK")
        status, text = _get(f"http://127.0.0.1:{port}{readiness}")
        assert status == 503 and json.loads(text)["status"] == "not_ready"
        status, text = _get(f"http://127.0.0.1:{metrics}/metrics")
        assert status == 200 and "vllm_router_" in text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
