"""Kopf handlers against the in-memory API: status written by the handlers (under a
resourceVersion precondition, owning only their condition types), Events,
retry intent of errors (PermanentError for bad specs, TemporaryError for 409s and
outages), the Deployment watch, metrics, registration and settings."""

from __future__ import annotations

import logging

import kopf
import pytest

from kvpilot.operator import constants as c
from kvpilot.operator.api import ConflictError, InvalidObjectError, TransientApiError
from kvpilot.operator.handlers.children import on_deployment_event
from kvpilot.operator.handlers.context import OperatorContext
from kvpilot.operator.handlers.lifecycle import (
    CONFLICT_RETRY_SECONDS,
    TRANSIENT_RETRY_SECONDS,
    on_delete,
    on_resync,
    on_spec,
    run_reconcile,
)
from kvpilot.operator.metrics import OperatorMetrics
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.reconcile import CONFLICT_ATTEMPTS
from kvpilot.operator.registration import (
    DAEMON_CANCELLATION_TIMEOUT_SECONDS,
    configure,
    register,
)

from .fakes import Clock, FakeKubeApi, inference

EMBEDDED = {"uri": "embedded://smollm2-135m-instruct"}
AUTO = {"model": EMBEDDED, "autoscaling": {"minReplicas": 2, "maxReplicas": 5}}


class Recorder:
    def __init__(self):
        self.events = []

    def __call__(self, body, type_, reason, message):
        self.events.append((body["metadata"]["name"], type_, reason, message))


@pytest.fixture
def ctx():
    return OperatorContext(api=FakeKubeApi(), options=OperatorOptions(engine_image="e:1"),
                           metrics=OperatorMetrics(), clock=Clock(), post_event=Recorder())


def metric(ctx, name, **labels) -> float | None:
    return ctx.metrics.registry.get_sample_value(name, labels)


def stored_status(ctx):
    return ctx.api.stored(c.KIND, "llm", "chat")["status"]


def test_on_spec_writes_status_and_posts_events(ctx):
    body = inference(spec=AUTO)
    ctx.api.put(body)
    patch = kopf.Patch()
    assert on_spec(body=body, patch=patch, memo=ctx, logger=logging.getLogger()) is None
    assert stored_status(ctx)["desiredReplicas"] == 2
    assert stored_status(ctx)["observedGeneration"] == 1
    assert [e[2] for e in ctx.post_event.events] == ["Created"]
    assert patch == {}  # nothing for Kopf to merge-patch: no spec, no stale status
    assert metric(ctx, "kvpilot_operator_reconcile_total", result="success") == 1
    keys = {"namespace": "llm", "inference_deployment": "chat"}
    assert metric(ctx, "kvpilot_operator_desired_replicas", **keys) == 2
    assert metric(ctx, "kvpilot_operator_max_replicas", **keys) == 5


def test_resync_repairs_a_manually_edited_deployment(ctx):
    body = inference(spec={"model": EMBEDDED, "replicas": 2})
    ctx.api.put(body)
    on_spec(body=body, patch=kopf.Patch(), memo=ctx)
    ctx.api.objects[("Deployment", "llm", "chat")]["spec"]["template"]["spec"]["containers"][0][
        "image"] = "hacked:1"
    ctx.api.objects[("Deployment", "llm", "chat")]["spec"]["replicas"] = 7
    on_resync(body=body, patch=kopf.Patch(), memo=ctx)
    stored = ctx.api.stored("Deployment", "llm", "chat")
    assert stored["spec"]["template"]["spec"]["containers"][0]["image"] == "e:1"
    assert stored["spec"]["replicas"] == 2
    assert stored_status(ctx)["lastScaleReason"] == "7 -> 2: spec.replicas is 2"
    keys = {"namespace": "llm", "inference_deployment": "chat", "direction": "down"}
    assert metric(ctx, "kvpilot_operator_scale_events_total", **keys) == 1


def test_invalid_spec_is_a_permanent_error_with_a_condition(ctx):
    body = inference(spec={"model": EMBEDDED, "autoscaling": {"minReplicas": 4, "maxReplicas": 2}},
                     generation=3)
    with pytest.raises(kopf.PermanentError, match=r"autoscaling\.minReplicas: got 4") as info:
        run_reconcile(ctx, body)
    status = info.value.status
    ready = status["conditions"][0]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "InvalidSpec")
    assert "must be <= autoscaling.maxReplicas (2)" in ready["message"]
    assert status["observedGeneration"] == 3
    assert ctx.post_event.events[0][1:3] == ("Warning", "InvalidSpec")
    assert metric(ctx, "kvpilot_operator_reconcile_total", result="invalid_spec") == 1
    assert ctx.api.writes() == []


def test_refused_object_is_a_permanent_error(ctx):
    ctx.api.fail_next("apply:Deployment", InvalidObjectError(
        "apply Deployment llm/chat: HTTP 422: spec.template.spec.containers[0].resources: bad", 422))
    with pytest.raises(kopf.PermanentError, match="HTTP 422") as info:
        run_reconcile(ctx, inference())
    assert info.value.status["conditions"][0]["reason"] == "ApplyFailed"
    assert metric(ctx, "kvpilot_operator_reconcile_total", result="apply_failed") == 1


def test_conflicts_are_temporary(ctx):
    ctx.api.fail_next("apply:Deployment", *[ConflictError("modified", 409)] * CONFLICT_ATTEMPTS)
    with pytest.raises(kopf.TemporaryError) as info:
        run_reconcile(ctx, inference())
    assert info.value.delay == CONFLICT_RETRY_SECONDS
    assert metric(ctx, "kvpilot_operator_reconcile_total", result="conflict") == 1
    # The retry that Kopf schedules then succeeds.
    assert run_reconcile(ctx, inference()).status["desiredReplicas"] == 1


def test_api_outage_is_temporary_and_leaves_status_alone(ctx):
    ctx.api.fail_next("get:Deployment", TransientApiError("connection refused"))
    with pytest.raises(kopf.TemporaryError) as info:
        run_reconcile(ctx, inference())
    assert info.value.delay == TRANSIENT_RETRY_SECONDS
    assert getattr(info.value, "status", None) is None  # nothing to write
    assert metric(ctx, "kvpilot_operator_reconcile_total", result="transient") == 1


def _engine_deployment(ctx, ready: int):
    ctx.api.set_deployment_status("llm", "chat", replicas=2, readyReplicas=ready,
                                  updatedReplicas=2)
    return ctx.api.stored("Deployment", "llm", "chat")


def test_deployment_event_refreshes_the_owner_status(ctx):
    body = inference(spec=AUTO)
    ctx.api.put(body)
    on_spec(body=body, memo=ctx)
    deployment = _engine_deployment(ctx, ready=2)
    on_deployment_event(body=deployment, type="MODIFIED", memo=ctx)
    status = ctx.api.stored(c.KIND, "llm", "chat")["status"]
    assert status["readyReplicas"] == 2
    assert status["conditions"][0]["status"] == "True"
    assert status["observedGeneration"] == 1  # untouched: no spec was reconciled
    writes = len(ctx.api.writes())
    ctx.post_event.events.clear()
    on_deployment_event(body=deployment, type="MODIFIED", memo=ctx)  # nothing changed
    assert len(ctx.api.writes()) == writes
    keys = {"namespace": "llm", "inference_deployment": "chat"}
    assert metric(ctx, "kvpilot_operator_ready_replicas", **keys) == 2


def test_deployment_events_that_need_nothing(ctx, caplog):
    on_deployment_event(body={"metadata": {"namespace": "llm", "labels": {}}}, type="ADDED",
                        memo=ctx)
    orphan = {"metadata": {"namespace": "llm", "labels": {c.LABEL_OWNER: "gone"}}}
    on_deployment_event(body=orphan, type="MODIFIED", memo=ctx)
    on_deployment_event(body=orphan, type="DELETED", memo=ctx)
    assert ctx.api.writes() == []
    ctx.api.fail_next(f"get:{c.KIND}", TransientApiError("timeout"))
    with caplog.at_level(logging.WARNING):
        on_deployment_event(body=orphan, type="MODIFIED", memo=ctx)
    assert "status refresh for llm/gone failed: timeout" in caplog.text


def test_delete_forgets_the_series(ctx):
    body = inference(spec=AUTO)
    on_spec(body=body, patch=kopf.Patch(), memo=ctx)
    keys = {"namespace": "llm", "inference_deployment": "chat"}
    assert metric(ctx, "kvpilot_operator_desired_replicas", **keys) == 2
    on_delete(body=body, memo=ctx)
    assert metric(ctx, "kvpilot_operator_desired_replicas", **keys) is None
    assert metric(ctx, "kvpilot_operator_max_replicas", **keys) is None


def test_register_wires_every_trigger():
    registry = kopf.OperatorRegistry()
    register(registry, OperatorOptions(resync_seconds=120))
    # Kopf has no public listing of registered handlers; these private registries are
    # stable across the 1.3x/1.4x releases.
    changing = {h.id: h for h in registry._changing.get_all_handlers()}
    assert set(changing) == {"reconcile-create", "reconcile-update", "reconcile-resume", "forget"}
    assert changing["forget"].requires_finalizer is False  # optional: never blocks deletion
    spawning = {h.id: h for h in registry._spawning.get_all_handlers()}
    assert set(spawning) == {"resync", "autoscaler", "adapters"}
    timer = spawning["resync"]
    assert (timer.interval, timer.initial_delay) == (120, 120)
    # The autoscaler: a daemon per resource, only where spec.autoscaling is set.
    daemon = spawning["autoscaler"]
    assert daemon.cancellation_timeout == DAEMON_CANCELLATION_TIMEOUT_SECONDS
    assert daemon.when(spec={"autoscaling": {"maxReplicas": 3}}) is True
    assert daemon.when(spec={"replicas": 2}) is False
    # The adapter sync: a daemon per resource with LoRA on.
    adapters = spawning["adapters"]
    assert adapters.when(spec={"adapters": [{"name": "a", "uri": "hf://o/a"}]}) is True
    assert adapters.when(spec={"replicas": 2}) is False
    watching = {h.id: h for h in registry._watching.get_all_handlers()}
    assert set(watching) == {"child-deployment", "child-service", "engine-restarts"}
    watch = watching["child-deployment"]  # engine and router Deployments
    assert (watch.selector.group, watch.selector.any_name) == ("apps", "deployments")
    assert watch.labels == {c.LABEL_MANAGED_BY: c.FIELD_MANAGER}
    services = watching["child-service"]  # engine and router Services: restored when edited
    assert (services.selector.group, services.selector.any_name) == ("", "services")
    assert services.labels == {c.LABEL_MANAGED_BY: c.FIELD_MANAGER}
    pods = watching["engine-restarts"]  # engine pods only: restarts reported on the owner
    assert (pods.selector.group, pods.selector.any_name) == ("", "pods")
    assert pods.labels == {c.LABEL_MANAGED_BY: c.FIELD_MANAGER,
                           c.LABEL_COMPONENT: c.ENGINE_COMPONENT}
    activities = {h.id: h.activity.value for h in registry._activities.get_all_handlers()}
    assert activities == {"configure": "startup", "login-via-client": "authentication"}


def test_settings_keep_kopf_state_out_of_status():
    """Kopf's default progress storage writes status.kopf, which the structural schema
    prunes (C14): progress and diff-base go to kvpilot.dev annotations instead."""
    settings = kopf.OperatorSettings()
    configure(settings)
    assert settings.persistence.finalizer == "kvpilot.dev/finalizer"
    storage = settings.persistence.progress_storage
    assert isinstance(storage, kopf.AnnotationsProgressStorage)
    assert storage.prefix == "kvpilot.dev"
    diffbase = settings.persistence.diffbase_storage
    assert isinstance(diffbase, kopf.AnnotationsDiffBaseStorage)
    assert diffbase.prefix == "kvpilot.dev"
    assert settings.peering.standalone is True
    body = kopf.Body(inference())
    patch = kopf.Patch()
    storage.store(key=kopf.HandlerId("reconcile-create"), record={"success": True},
                  body=body, patch=patch)
    storage.touch(body=body, patch=patch, value="x")
    assert "status" not in patch
    assert all(k.startswith("kvpilot.dev/") for k in patch["metadata"]["annotations"])


def test_resize_counters_exist_at_zero_before_the_first_resize(ctx):
    body = inference(spec=AUTO)
    on_spec(body=body, patch=kopf.Patch(), memo=ctx)
    for direction in ("up", "down"):
        keys = {"namespace": "llm", "inference_deployment": "chat", "direction": direction}
        assert metric(ctx, "kvpilot_operator_scale_events_total", **keys) == 0


def test_metrics_refuse_unknown_results():
    with pytest.raises(ValueError, match="result must be one of"):
        OperatorMetrics().count_reconcile("weird", 0.1)
