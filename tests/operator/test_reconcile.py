"""reconcile() against the in-memory API: what it applies, in which order, what status and
Events it reports, how it handles conflicts, foreign objects and the autoscaler's count."""

from __future__ import annotations

import pytest

from kvpilot.operator import constants as c
from kvpilot.operator.api import ConflictError, InvalidObjectError, TransientApiError
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.reconcile import CONFLICT_ATTEMPTS, Resource, reconcile
from kvpilot.operator.spec import SpecError

from .fakes import T0, FakeKubeApi, inference

OPTIONS = OperatorOptions(engine_image="kvpilot/engine:test")
EMBEDDED = {"uri": "embedded://smollm2-135m-instruct"}
AUTO = {"model": EMBEDDED, "autoscaling": {"minReplicas": 1, "maxReplicas": 5}}
PODMONITOR = "monitoring.coreos.com/v1/PodMonitor"


def run(api, spec=None, **kwargs):
    body = inference(spec=spec)
    if api.stored(c.KIND, "llm", "chat") is None:
        api.put(body)
    return reconcile(api, Resource.from_body(body), OPTIONS, T0, **kwargs)


def deployment_replicas(api) -> int:
    return api.stored("Deployment", "llm", "chat")["spec"]["replicas"]


def test_create_applies_children_in_order_and_reports():
    api = FakeKubeApi(apis=(PODMONITOR,))
    result = run(api)
    assert result.applied == ("Deployment/chat", "Service/chat", "PodDisruptionBudget/chat",
                              "PodMonitor/chat", "ServiceAccount/chat-router",
                              "RoleBinding/chat-router", "Deployment/chat-router",
                              "Service/chat-router", "PodMonitor/chat-router")
    assert [e.reason for e in result.events] == ["Created"]
    assert result.status["desiredReplicas"] == 1
    assert result.status["observedGeneration"] == 1
    ready = {c_["type"]: c_["status"] for c_ in result.status["conditions"]}
    assert ready == {"Ready": "False", "Progressing": "True", "RouterReady": "False"}
    assert "lastScaleTime" not in result.status  # creating is not scaling


def test_no_pod_monitor_without_the_prometheus_operator_api():
    api = FakeKubeApi()
    assert "PodMonitor/chat" not in run(api).applied
    always = OperatorOptions(engine_image="x", pod_monitor="always")
    body = inference()
    result = reconcile(FakeKubeApi(), Resource.from_body(body), always, T0)
    assert "PodMonitor/chat" in result.applied


def test_reconcile_is_idempotent():
    api = FakeKubeApi(apis=(PODMONITOR,))
    first = run(api)
    applied_first = [call[4] for call in api.calls if call[0] == "apply"]
    api.calls.clear()
    second = run(api)
    applied_second = [call[4] for call in api.calls if call[0] == "apply"]
    # Same configurations; the Deployment's second apply carries a resourceVersion precondition.
    applied_second[0]["metadata"].pop("resourceVersion")
    assert applied_first == applied_second
    assert first.status == second.status
    assert second.events == ()
    assert api.stored("Deployment", "llm", "chat")["metadata"]["generation"] == 1


def test_ready_status_follows_the_deployment():
    api = FakeKubeApi()
    run(api, {"model": EMBEDDED, "replicas": 2})
    api.set_deployment_status("llm", "chat", replicas=2, readyReplicas=2, updatedReplicas=2)
    status = run(api, {"model": EMBEDDED, "replicas": 2}).status
    assert (status["replicas"], status["readyReplicas"], status["desiredReplicas"]) == (2, 2, 2)
    assert status["conditions"][0]["status"] == "True"


def test_static_replicas_change_is_a_scale_with_event_and_status():
    api = FakeKubeApi()
    run(api, {"model": EMBEDDED, "replicas": 2})
    result = run(api, {"model": EMBEDDED, "replicas": 5})
    assert deployment_replicas(api) == 5
    assert [(e.type, e.reason) for e in result.events] == [("Normal", "ScaledUp")]
    assert result.status["lastScaleReason"] == "2 -> 5: spec.replicas is 5"
    assert result.status["lastScaleTime"] == "2026-11-29T12:00:00Z"


def test_c16_reconcile_keeps_the_autoscalers_count():
    """Autoscaling: a re-applied CR (GitOps) or a resync never resets the Deployment."""
    api = FakeKubeApi()
    run(api, AUTO)
    assert deployment_replicas(api) == 1
    scaled = run(api, AUTO, requested=4, requested_reason="queue depth 9 > 4 per pod")
    assert deployment_replicas(api) == 4
    assert scaled.events[0].reason == "ScaledUp"
    assert "queue depth 9 > 4 per pod" in scaled.events[0].message
    again = run(api, AUTO)  # the same CR applied again
    assert deployment_replicas(api) == 4 and again.events == ()
    # Nothing ever wrote the InferenceDeployment's spec.
    assert all(call[1] != c.KIND for call in api.writes())
    assert api.stored(c.KIND, "llm", "chat")["spec"] == AUTO


def test_lowering_max_replicas_clamps_the_deployment():
    api = FakeKubeApi()
    run(api, AUTO, requested=5)
    lowered = {"model": EMBEDDED, "autoscaling": {"minReplicas": 1, "maxReplicas": 3}}
    result = run(api, lowered)
    assert deployment_replicas(api) == 3
    assert result.events[0].reason == "ScaledDown"
    assert "capped at autoscaling.maxReplicas=3" in result.status["lastScaleReason"]


def test_conflict_is_retried_against_fresh_state():
    """Someone (the autoscaler timer) resized the Deployment between read and apply: the
    precondition fails, reconcile re-reads and keeps the newer count."""
    api = FakeKubeApi()
    run(api, AUTO)
    resized = []

    def concurrent_resize(obj):
        if obj["kind"] == "Deployment" and obj["metadata"]["name"] == "chat" and not resized:
            resized.append(True)
            stored = api.objects[("Deployment", "llm", "chat")]
            stored["spec"]["replicas"] = 3
            stored["metadata"]["resourceVersion"] = "999"

    api.before_apply = concurrent_resize
    result = run(api, AUTO)
    assert deployment_replicas(api) == 3
    assert result.target.replicas == 3
    deployment_applies = [call for call in api.calls
                          if call[:2] == ("apply", "Deployment") and call[3] == "chat"]
    assert len(deployment_applies) == 3  # create, conflicting apply, retried apply


def test_conflicts_exhausted_raise():
    api = FakeKubeApi()
    api.fail_next("apply:Deployment", *[ConflictError("busy", 409)] * CONFLICT_ATTEMPTS)
    with pytest.raises(ConflictError):
        run(api)
    api.fail_next("apply:Deployment", *[ConflictError("busy", 409)] * (CONFLICT_ATTEMPTS - 1))
    assert run(api).target.replicas == 1


def test_invalid_spec_raises_before_any_write():
    api = FakeKubeApi()
    with pytest.raises(SpecError, match=r"autoscaling\.minReplicas"):
        run(api, {"model": EMBEDDED, "autoscaling": {"minReplicas": 4, "maxReplicas": 2}})
    assert api.writes() == []


def test_foreign_deployment_is_not_taken_over():
    api = FakeKubeApi()
    api.put({"apiVersion": "apps/v1", "kind": "Deployment",
             "metadata": {"name": "chat", "namespace": "llm"}, "spec": {"replicas": 1}})
    with pytest.raises(InvalidObjectError, match="exists and is not managed by kvpilot"):
        run(api)
    api.objects[("Deployment", "llm", "chat")]["metadata"]["ownerReferences"] = [
        {"kind": "ReplicaSet", "name": "other", "uid": "u", "controller": True}]
    with pytest.raises(InvalidObjectError, match="controlled by ReplicaSet/other"):
        run(api)
    assert [call for call in api.writes() if call[0] == "apply"] == []


@pytest.mark.parametrize(("api_version", "kind"), [
    ("v1", "Service"), ("policy/v1", "PodDisruptionBudget"),
    ("monitoring.coreos.com/v1", "PodMonitor")])
def test_a_foreign_child_of_the_same_name_is_not_taken_over(api_version, kind):
    """Found in review: only the Deployment was checked, so a user's Service ``chat``
    (selecting their web pods) got our selector and our controller owner reference, and
    deleting the InferenceDeployment would have garbage-collected it. Nothing is written."""
    api = FakeKubeApi(apis=(PODMONITOR,))
    api.put({"apiVersion": api_version, "kind": kind,
             "metadata": {"name": "chat", "namespace": "llm"}, "spec": {"selector": {"app": "web"}}})
    with pytest.raises(InvalidObjectError, match=f"{kind} llm/chat exists and is not managed"):
        run(api)
    assert [call for call in api.writes() if call[0] == "apply"] == []
    assert api.stored(kind, "llm", "chat")["spec"] == {"selector": {"app": "web"}}


def test_deployment_of_a_deleted_namesake_waits_for_garbage_collection():
    api = FakeKubeApi()
    api.put({"apiVersion": "apps/v1", "kind": "Deployment",
             "metadata": {"name": "chat", "namespace": "llm", "ownerReferences": [
                 {"kind": c.KIND, "name": "chat", "uid": "old-uid", "controller": True}]},
             "spec": {"replicas": 1}})
    with pytest.raises(TransientApiError, match="waiting for garbage collection"):
        run(api)


def test_refused_child_surfaces_as_invalid_object():
    api = FakeKubeApi()
    api.fail_next("apply:Service", InvalidObjectError("Service is invalid: ports", 422))
    with pytest.raises(InvalidObjectError, match="Service is invalid"):
        run(api)


def test_removing_autoscaling_without_replicas_keeps_the_fleet():
    """Found in review: the fleet dropped from 8 pods to 1 at once when autoscaling was
    removed and replicas not written (cutting generations on 7 pods)."""
    api = FakeKubeApi()
    run(api, AUTO, requested=5)
    assert deployment_replicas(api) == 5
    result = run(api, {"model": EMBEDDED})
    assert deployment_replicas(api) == 5 and not result.target.is_scale
    run(api, {"model": EMBEDDED, "replicas": 2})
    assert deployment_replicas(api) == 2
    assert run(FakeKubeApi(), {"model": EMBEDDED}).target.replicas == 1  # a new one


def test_children_are_built_once_per_attempt_and_the_name_checked_once(monkeypatch):
    """A reconcile used to build every child twice (once to check that no
    child's name is someone else's, once to apply) and checked the name twice. One build
    per attempt now: a 409 on the Deployment rebuilds against the fresh count, nothing
    else does; the name is checked once, with the spec."""
    import kvpilot.operator.reconcile as reconcile_module
    import kvpilot.operator.spec.inference as inference_module

    builds: list[int] = []
    names: list[str] = []
    build, label = reconcile_module.build_children, inference_module._check_label

    def counting_build(owner, spec, replicas, *args, **kwargs):
        builds.append(replicas)
        return build(owner, spec, replicas, *args, **kwargs)

    def counting_label(name):
        names.append(name)
        label(name)

    monkeypatch.setattr(reconcile_module, "build_children", counting_build)
    monkeypatch.setattr(inference_module, "_check_label", counting_label)
    api = FakeKubeApi(apis=(PODMONITOR,))
    run(api, AUTO)
    assert (builds, names) == ([1], ["chat"])

    builds.clear()
    names.clear()
    api.fail_next("apply:Deployment", ConflictError("busy", 409))
    run(api, AUTO, requested=3)
    assert (builds, names) == ([3, 3], ["chat"])  # one build per attempt
