"""The real operator (Kopf, its login, watches and patches, our handlers and our
kubernetes-client edge) against the in-process fake API server on 127.0.0.1.

One scenario, in order: create an InferenceDeployment -> children applied, finalizer and
status written, an Event posted; the engine Deployment becomes ready -> Ready=True through
the Deployment watch; the autoscaler's count survives a GitOps re-apply (C16); the spec
changes -> a new pod template; a bad spec slips past the
(absent) schema -> Ready=False/InvalidSpec, no crash loop; delete -> the finalizer is
removed and the object goes. Every wait is bounded; the operator and the server are
always stopped.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes.config import kube_config

from kvpilot.operator import constants as c
from kvpilot.operator.cli import operate
from kvpilot.operator.handlers.context import OperatorContext
from kvpilot.operator.kube import KubernetesApi
from kvpilot.operator.metrics import OperatorMetrics
from kvpilot.operator.options import OperatorOptions

from .crdschema import REPO
from .fake_apiserver import FakeApiServer
from .fake_sources import FakeSource, SourceFactory, loaded

CR = ("kvpilot.dev", "inferencedeployments")
DEPLOYMENTS = ("apps", "deployments")
WAIT_SECONDS = 30

pytestmark = pytest.mark.server  # a fake API server and a real Kopf loop, in threads


def wait_for(what: str, check: Callable[[], object]) -> object:
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {WAIT_SECONDS}s waiting for {what}")


def condition(obj, type_: str) -> dict:
    for cond in (obj or {}).get("status", {}).get("conditions", ()):
        if cond["type"] == type_:
            return cond
    return {}


@pytest.fixture
def operator(tmp_path, monkeypatch, request):
    """A running operator against a fresh fake API server; yields the server and the
    context. An indirect parameter replaces the autoscaler's metric source factory."""
    with FakeApiServer() as server:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": server.url}}],
            "users": [{"name": "op", "user": {"token": "test-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "op"}}],
        }))
        # The kubernetes client reads KUBECONFIG once, at import: point its default there.
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        config = k8s.Configuration(host=server.url)
        config.api_key = {"authorization": "Bearer test-token"}
        context = OperatorContext(
            api=KubernetesApi(k8s.ApiClient(config)),
            options=OperatorOptions(engine_image="kvpilot/engine:test", resync_seconds=60),
            metrics=OperatorMetrics(),
            **({"source_factory": request.param} if hasattr(request, "param") else {}),
        )
        stop, ready = threading.Event(), threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                asyncio.run(operate(context, stop_flag=stop, ready_flag=ready))
            except BaseException as exc:  # reported by the test, not lost in the thread
                errors.append(exc)

        thread = threading.Thread(target=run, name="kopf", daemon=True)
        thread.start()
        try:
            assert ready.wait(WAIT_SECONDS), f"operator not ready: {errors}"
            yield server, context
        finally:
            stop.set()
            thread.join(timeout=60)
            assert not thread.is_alive(), "the operator did not stop"
            assert not errors, errors


def test_operator_loop_end_to_end(operator):
    server, context = operator
    store = server.store
    sample = yaml.safe_load((REPO / "crds" / "samples" / "smollm2-cpu.yaml").read_text())
    sample["metadata"]["namespace"] = "llm"
    store.create(*CR, sample)

    # Created: children applied, finalizer added, status written, an Event posted. Kopf
    # writes the status after the handler applied every child.
    # Kopf's own state (the last handled configuration) may land in a patch after the
    # status one: wait for both.
    cr = wait_for("status.observedGeneration and Kopf's annotations",
                  lambda: (o := store.get(*CR, "llm", "smollm2"))
                  and o.get("status", {}).get("observedGeneration") == 1
                  and any(k.startswith("kvpilot.dev/") for k in o["metadata"].get("annotations", {}))
                  and o)
    assert cr["status"]["desiredReplicas"] == 1
    deployment = store.get(*DEPLOYMENTS, "llm", "smollm2")
    assert deployment["spec"]["replicas"] == 1
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--max-num-seqs" in args and args[args.index("--max-num-seqs") + 1] == "32"
    assert store.get("", "services", "llm", "smollm2")
    assert store.get("policy", "poddisruptionbudgets", "llm", "smollm2")
    assert c.FINALIZER in cr["metadata"]["finalizers"]
    assert cr["status"]["observedGeneration"] == 1
    assert "kopf" not in cr["status"]  # Kopf's state went to annotations (C14)
    assert any(k.startswith("kvpilot.dev/") for k in cr["metadata"].get("annotations", {}))
    assert cr["spec"] == sample["spec"]  # the spec is never written (C16)
    wait_for("a Created event", lambda: any(
        o.get("reason") == "Created" for (g, p, *_), o in list(store.objects.items())
        if p == "events"))
    ssa = [r for r in store.requests if r[0] == "PATCH" and r[1].endswith("/deployments/smollm2")]
    assert ssa and ssa[0][2] == "application/apply-patch+yaml"

    # The Deployment controller reports the pod ready: the watch copies it into status.
    def ready(obj):
        obj["status"] = {"observedGeneration": obj["metadata"]["generation"], "replicas": 1,
                         "readyReplicas": 1, "updatedReplicas": 1}
        return obj

    store.update(*DEPLOYMENTS, "llm", "smollm2", ready)
    wait_for("Ready=True", lambda: condition(store.get(*CR, "llm", "smollm2"), "Ready")
             .get("status") == "True")

    # C16: the autoscaler resized the Deployment to 3; a GitOps re-apply (a new label, the
    # same spec) is reconciled without resetting that count and without writing the spec.
    def autoscaled(obj):
        obj["spec"]["replicas"] = 3
        return obj

    def relabelled(obj):
        obj["metadata"].setdefault("labels", {})["gitops/revision"] = "2"
        return obj

    applies = len([r for r in store.requests if r[0] == "PATCH" and r[1].endswith(
        "/deployments/smollm2")])
    store.update(*DEPLOYMENTS, "llm", "smollm2", autoscaled)
    store.update(*CR, "llm", "smollm2", relabelled)
    wait_for("a reconcile of the re-applied object", lambda: len([
        r for r in store.requests if r[0] == "PATCH" and r[1].endswith("/deployments/smollm2")
    ]) > applies)
    assert store.get(*DEPLOYMENTS, "llm", "smollm2")["spec"]["replicas"] == 3
    assert store.get(*CR, "llm", "smollm2")["spec"] == sample["spec"]

    # A spec change rolls a new pod template.
    def more_seqs(obj):
        obj["spec"]["engine"]["maxNumSeqs"] = 64
        return obj

    store.update(*CR, "llm", "smollm2", more_seqs)

    def new_args():
        dep = store.get(*DEPLOYMENTS, "llm", "smollm2")
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        return args[args.index("--max-num-seqs") + 1] == "64"

    wait_for("the new pod template", new_args)
    wait_for("observedGeneration 2", lambda: store.get(*CR, "llm", "smollm2")["status"]
             .get("observedGeneration") == 2)

    # An invalid spec (no CRD validation in the fake): a condition, not a crash loop.
    def broken(obj):
        obj["spec"]["autoscaling"]["minReplicas"] = 9
        return obj

    store.update(*CR, "llm", "smollm2", broken)
    ready_cond = wait_for("InvalidSpec", lambda: (cond := condition(
        store.get(*CR, "llm", "smollm2"), "Ready")).get("reason") == "InvalidSpec" and cond)
    assert "autoscaling.minReplicas" in ready_cond["message"]
    patches_before = len(store.requests)
    time.sleep(1.0)
    assert len(store.requests) - patches_before < 20, "retrying a permanent error"

    # Delete: the operator removes its finalizer and the object goes.
    store.delete(*CR, "llm", "smollm2")
    wait_for("the object to be gone", lambda: store.get(*CR, "llm", "smollm2") is None)
    keys = {"namespace": "llm", "inference_deployment": "smollm2"}
    assert context.metrics.registry.get_sample_value(
        "kvpilot_operator_desired_replicas", keys) is None


def test_delete_during_retry_backoff_removes_the_finalizer(operator):
    """Where other operators looped forever: the object is deleted while its handler waits
    to retry a temporary error. The deletion wins and the finalizer goes."""
    server, context = operator
    store = server.store
    path = "/apis/apps/v1/namespaces/llm/deployments/stuck"
    server.faults[("PATCH", path)] = 503
    store.create(*CR, {"apiVersion": c.API_VERSION, "kind": c.KIND,
                       "metadata": {"name": "stuck", "namespace": "llm"},
                       "spec": {"model": {"uri": "embedded://smollm2-135m-instruct"}}})
    wait_for("a failed apply", lambda: any(r[:2] == ("PATCH", path) for r in store.requests))
    cr = wait_for("the finalizer", lambda: (o := store.get(*CR, "llm", "stuck"))
                  and c.FINALIZER in o["metadata"].get("finalizers", ()) and o)
    assert "status" not in cr or cr["status"].get("desiredReplicas") is None
    assert context.metrics.registry.get_sample_value(
        "kvpilot_operator_reconcile_total", {"result": "transient"}) >= 1
    store.delete(*CR, "llm", "stuck")
    wait_for("the object to be gone", lambda: store.get(*CR, "llm", "stuck") is None)
    assert store.get(*DEPLOYMENTS, "llm", "stuck") is None


HOT = SourceFactory(FakeSource(loaded(0.97, waiting=12)))


def engine_pod(name: str, owner: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "llm",
                         "labels": {"app.kubernetes.io/component": "engine",
                                    c.LABEL_OWNER: owner}},
            "status": {"phase": "Running", "podIP": "10.1.0.7",
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def events(store, reason: str) -> list[dict]:
    return [o for (g, p, *_), o in list(store.objects.items())
            if p == "events" and o.get("reason") == reason]


@pytest.mark.parametrize("operator", [HOT], indirect=True)
def test_autoscaler_daemon_scales_from_metrics_and_stops_with_autoscaling(operator):
    """The Kopf daemon runs the loop per autoscaled resource: it reads the ready pods'
    signals, scales the Deployment (an Event, status, no spec write) and goes away when
    spec.autoscaling is removed."""
    server, _ = operator
    store = server.store
    spec = {"model": {"uri": "embedded://smollm2-135m-instruct"},
            "autoscaling": {"minReplicas": 1, "maxReplicas": 3, "intervalSeconds": 1}}
    store.create("", "pods", engine_pod("hot-abc", "hot"))
    store.create(*CR, {"apiVersion": c.API_VERSION, "kind": c.KIND,
                       "metadata": {"name": "hot", "namespace": "llm"}, "spec": spec})
    wait_for("a scale-up", lambda: (d := store.get(*DEPLOYMENTS, "llm", "hot"))
             and d["spec"]["replicas"] > 1)
    wait_for("a ScaledUp event", lambda: events(store, "ScaledUp"))
    cr = wait_for("the decision in status", lambda: (o := store.get(*CR, "llm", "hot"))
                  and o.get("status", {}).get("autoscaler") and o)
    assert cr["spec"] == spec  # C16
    assert condition(cr, "MetricsAvailable")["reason"] == "SignalsReported"
    assert HOT.source.reads and HOT.source.reads[0][0] == ("hot-abc",)

    def static(obj):
        obj["spec"].pop("autoscaling")
        obj["spec"]["replicas"] = 2
        return obj

    store.update(*CR, "llm", "hot", static)
    wait_for("the daemon to stop and close its source", lambda: HOT.source.closed)
    reads = len(HOT.source.reads)
    time.sleep(1.5)
    assert len(HOT.source.reads) == reads
    wait_for("the static count", lambda: store.get(*DEPLOYMENTS, "llm", "hot")["spec"]
             ["replicas"] == 2)


def test_an_engine_restart_is_an_event_on_the_owner(operator):
    """The operator watches engine pods through Kopf: a container whose restartCount goes
    up (the kubelet restarted it after an OOM kill) becomes a Warning Event
    EngineRestarted on the InferenceDeployment, and nothing is written to the pod."""
    server, context = operator
    store = server.store
    store.create(*CR, {"apiVersion": c.API_VERSION, "kind": c.KIND,
                       "metadata": {"name": "chat", "namespace": "llm"},
                       "spec": {"model": {"uri": "embedded://smollm2-135m-instruct"}}})
    body = engine_pod("chat-abc", "chat")
    body["metadata"]["labels"][c.LABEL_MANAGED_BY] = c.FIELD_MANAGER
    body["status"]["containerStatuses"] = [{"name": "engine", "restartCount": 0}]
    store.create("", "pods", body)
    wait_for("the pod's baseline", lambda: len(context.restarts) == 1)

    def oom(obj):
        obj["status"]["containerStatuses"] = [{
            "name": "engine", "restartCount": 1,
            "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}]
        return obj

    store.update("", "pods", "llm", "chat-abc", oom)
    (event,) = wait_for("the EngineRestarted event", lambda: events(store, "EngineRestarted"))
    assert event["type"] == "Warning"
    assert event["involvedObject"]["name"] == "chat" and "OOMKilled" in event["message"]
    stored = store.get("", "pods", "llm", "chat-abc")
    assert not any(k.startswith(c.ANNOTATION_PREFIX)
                   for k in stored["metadata"].get("annotations") or {})
