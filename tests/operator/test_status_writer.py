"""Status writes by several writers: each owns its condition types, writes them into the
freshly read list under a resourceVersion precondition, and never erases another's
(the race that made MetricsAvailable vanish right after the autoscaler wrote it)."""

from __future__ import annotations

import kopf
import pytest

from kvpilot.operator import constants as c
from kvpilot.operator.api import ConflictError
from kvpilot.operator.handlers.children import on_deployment_event
from kvpilot.operator.handlers.context import OperatorContext
from kvpilot.operator.handlers.lifecycle import on_spec
from kvpilot.operator.metrics import OperatorMetrics
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.status.conditions import merge_conditions
from kvpilot.operator.status.writer import STATUS_CONFLICT_ATTEMPTS, write_status

from .fake_sources import loaded
from .fakes import Clock, FakeKubeApi, inference
from .fleet_harness import Fleet

EMBEDDED = {"uri": "embedded://smollm2-135m-instruct"}
AUTO = {"model": EMBEDDED, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}}


def cond(type_, status="True", reason="R"):
    return {"type": type_, "status": status, "reason": reason, "message": "",
            "lastTransitionTime": "2026-11-29T12:00:00Z"}


def types(conditions):
    return [(x["type"], x["status"], x["reason"]) for x in conditions]


def test_merge_keeps_types_the_writer_does_not_own():
    stored = [cond("Ready", "False", "ReplicasNotReady"), cond("MetricsAvailable")]
    written = [cond("Ready", "True", "AllReplicasReady"),
               cond("MetricsAvailable", "False", "Stale")]  # an echo of an old read
    assert types(merge_conditions(stored, written, c.RECONCILE_CONDITIONS)) == [
        ("Ready", "True", "AllReplicasReady"), ("MetricsAvailable", "True", "R")]
    assert stored[0]["status"] == "False"  # inputs untouched


@pytest.fixture
def ctx():
    return OperatorContext(api=FakeKubeApi(), options=OperatorOptions(engine_image="e:1"),
                           metrics=OperatorMetrics(), clock=Clock(),
                           post_event=lambda *a: None)


def test_a_reconcile_from_a_stale_body_keeps_the_autoscalers_conditions(ctx):
    stale = inference(spec=AUTO)
    ctx.api.put(stale)
    ctx.api.patch_status("llm", "chat", {"conditions": [cond("MetricsAvailable", reason="SignalsReported")]})
    on_spec(body=stale, patch=kopf.Patch(), memo=ctx)  # its body has no conditions at all
    stored = ctx.api.stored(c.KIND, "llm", "chat")["status"]["conditions"]
    assert [x["type"] for x in stored] == ["Ready", "Progressing", "RouterReady",
                                           "MetricsAvailable"]
    assert stored[3]["reason"] == "SignalsReported"


def test_a_conflict_is_retried_against_the_fresh_object(ctx):
    ctx.api.put(inference(spec=AUTO))
    ctx.api.fail_next(f"patch_status:{c.KIND}", ConflictError("modified", 409))
    assert write_status(ctx.api, "llm", "chat", {"desiredReplicas": 3}, ()) is True
    assert ctx.api.stored(c.KIND, "llm", "chat")["status"]["desiredReplicas"] == 3
    patches = [call for call in ctx.api.calls if call[0] == "patch_status"]
    gets = [call for call in ctx.api.calls if call[:2] == ("get", c.KIND)]
    assert len(patches) == 2 and len(gets) == 2


def test_a_write_between_read_and_patch_is_a_conflict_not_a_lost_update(ctx):
    """Another writer lands after write_status read the object: the precondition fails,
    and the second round merges into what that writer stored."""
    ctx.api.put(inference(spec=AUTO))
    real_get = ctx.api.get
    raced = []

    def get_then_race(*args):
        obj = real_get(*args)
        if not raced:
            raced.append(True)
            ctx.api.patch_status("llm", "chat", {"conditions": [cond("ScalingActive")]})
        return obj

    ctx.api.get = get_then_race
    write_status(ctx.api, "llm", "chat", {"conditions": [cond("Ready")]}, c.RECONCILE_CONDITIONS)
    stored = ctx.api.stored(c.KIND, "llm", "chat")["status"]["conditions"]
    assert [x["type"] for x in stored] == ["Ready", "ScalingActive"]


def test_conflicts_that_never_end_are_reported(ctx):
    ctx.api.put(inference(spec=AUTO))
    ctx.api.fail_next(f"patch_status:{c.KIND}",
                      *[ConflictError("modified", 409)] * STATUS_CONFLICT_ATTEMPTS)
    with pytest.raises(ConflictError):
        write_status(ctx.api, "llm", "chat", {"desiredReplicas": 3}, ())


def test_a_gone_object_is_not_written(ctx):
    assert write_status(ctx.api, "llm", "gone", {"desiredReplicas": 3}, ()) is False
    assert not [call for call in ctx.api.calls if call[0] == "patch_status"]


def test_the_deployment_watch_keeps_the_autoscalers_conditions(ctx):
    body = inference(spec=AUTO)
    ctx.api.put(body)
    on_spec(body=body, memo=ctx)
    ctx.api.patch_status("llm", "chat", {"conditions": [
        *ctx.api.stored(c.KIND, "llm", "chat")["status"]["conditions"], cond("ScalingActive")]})
    ctx.api.set_deployment_status("llm", "chat", replicas=1, readyReplicas=1, updatedReplicas=1)
    on_deployment_event(body=ctx.api.stored("Deployment", "llm", "chat"), type="MODIFIED",
                        memo=ctx)
    stored = ctx.api.stored(c.KIND, "llm", "chat")["status"]["conditions"]
    assert types(stored) == [("Ready", "True", "AllReplicasReady"),
                             ("Progressing", "False", "Complete"),
                             ("RouterReady", "False", "RouterUnavailable"),  # the reconcile's
                             ("ScalingActive", "True", "R")]


def test_the_loop_does_not_write_a_stale_ready_from_its_snapshot():
    """A holding tick (no resize, so no reconcile) must not copy the snapshot's Ready over
    the one the Deployment watch has written since."""
    fleet = Fleet(load=loaded(0.5), replicas=1)
    fleet.pods(ready=1)
    snapshot = fleet.body()  # Ready=False here: no pod was ready at the reconcile
    assert types(snapshot["status"]["conditions"])[0][:2] == ("Ready", "False")
    fleet.api.set_deployment_status("llm", "chat", replicas=1, readyReplicas=1, updatedReplicas=1)
    on_deployment_event(body=fleet.api.stored("Deployment", "llm", "chat"), type="MODIFIED",
                        memo=fleet.ctx)
    step = fleet.loop.run_interval(snapshot, *_resource_and_spec(snapshot), fleet.clock())
    assert step is not None and step.requested is None  # a hold: the reconcile did not run
    stored = types(fleet.status["conditions"])
    assert stored[0] == ("Ready", "True", "AllReplicasReady")
    assert "MetricsAvailable" in [t for t, _, _ in stored]


def _resource_and_spec(body):
    from kvpilot.operator.reconcile import Resource
    from kvpilot.operator.spec import parse_spec

    resource = Resource.from_body(body)
    return resource, parse_spec(resource.spec)
