"""Children restored from their own watch events (kvpilot.operator.repair): a Deployment
or Service deleted or edited by someone else is reconciled back at once; our own applies
and status updates trigger nothing; a fight with another writer is backed off; an owner
that is gone or going is left alone."""

from __future__ import annotations

import copy
import logging

import pytest

from kvpilot.operator import constants as c
from kvpilot.operator.api import TransientApiError
from kvpilot.operator.handlers.children import on_deployment_event, on_service_event
from kvpilot.operator.handlers.context import OperatorContext
from kvpilot.operator.handlers.lifecycle import on_spec
from kvpilot.operator.metrics import OperatorMetrics
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.repair import ChildFingerprints, RepairBackoff, fingerprint

from .fakes import Clock, FakeKubeApi, inference

SPEC = {"model": {"uri": "embedded://smollm2-135m-instruct"}, "replicas": 2}


class Seconds:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Events(list):
    def __call__(self, body, *event):
        self.append((body["metadata"]["name"], *event))


@pytest.fixture
def ctx():
    due = []
    ctx = OperatorContext(api=FakeKubeApi(), options=OperatorOptions(engine_image="e:1"),
                          metrics=OperatorMetrics(), clock=Clock(), post_event=Events(),
                          monotonic=Seconds(), repairs=RepairBackoff(schedule=lambda s, fn: due.append((s, fn))))
    ctx.repairs.due_now = due  # type: ignore[attr-defined]  # what the back-off deferred
    body = inference(spec=SPEC)
    ctx.api.put(body)
    on_spec(body=body, memo=ctx)
    return ctx


def repairs(ctx, kind, cause, result):
    return ctx.metrics.registry.get_sample_value(
        "kvpilot_operator_child_repairs_total", {"kind": kind, "cause": cause, "result": result}) or 0


def edited_by_someone(ctx, kind, name, edit):
    """Change a stored child as another writer would: spec edited, generation moved (a
    Deployment) or only the resourceVersion (a Service)."""
    obj = ctx.api.stored(kind, "llm", name)
    edit(obj)
    stored = ctx.api.put(obj)
    if kind == "Deployment":
        stored["metadata"]["generation"] += 1
        ctx.api.objects[(kind, "llm", name)] = copy.deepcopy(stored)
    return stored


def test_a_deleted_deployment_is_recreated_at_once(ctx):
    deployment = ctx.api.stored("Deployment", "llm", "chat")
    on_deployment_event(body=deployment, type="ADDED", memo=ctx)  # first sight: nothing
    assert ctx.api.delete("apps/v1", "Deployment", "llm", "chat")
    on_deployment_event(body=deployment, type="DELETED", memo=ctx)
    restored = ctx.api.stored("Deployment", "llm", "chat")
    assert restored is not None and restored["spec"]["replicas"] == 2
    assert repairs(ctx, "Deployment", "deleted", "repaired") == 1
    assert ctx.post_event[-1] == ("chat", "Warning", "ChildRestored", "Deployment chat was deleted by someone "
                              "else; restored from the spec (edit the InferenceDeployment instead)")


def test_an_edited_deployment_is_put_back_and_a_manual_scale_reverted(ctx):
    deployment = ctx.api.stored("Deployment", "llm", "chat")
    on_deployment_event(body=deployment, type="ADDED", memo=ctx)
    want = deployment["spec"]
    edited = edited_by_someone(ctx, "Deployment", "chat", lambda d: d["spec"].update(replicas=7))
    on_deployment_event(body=edited, type="MODIFIED", memo=ctx)
    assert ctx.api.stored("Deployment", "llm", "chat")["spec"] == want
    assert repairs(ctx, "Deployment", "changed", "repaired") == 1


def test_our_own_apply_and_status_updates_trigger_nothing(ctx):
    deployment = ctx.api.stored("Deployment", "llm", "chat")
    on_deployment_event(body=deployment, type="ADDED", memo=ctx)
    # A spec change of ours (the InferenceDeployment now asks for 3): the apply records
    # what it stored, so its watch event is known as ours.
    body = ctx.api.stored(c.KIND, "llm", "chat")
    body["spec"]["replicas"] = 3
    ctx.api.put(body)
    on_spec(body=body, memo=ctx)
    ours = ctx.api.stored("Deployment", "llm", "chat")
    assert ours["metadata"]["generation"] == deployment["metadata"]["generation"] + 1
    writes = len(ctx.api.writes())
    on_deployment_event(body=ours, type="MODIFIED", memo=ctx)
    # The kube-controller-manager's status writes move neither generation nor spec.
    ctx.api.set_deployment_status("llm", "chat", replicas=3, readyReplicas=1, updatedReplicas=3)
    on_deployment_event(body=ctx.api.stored("Deployment", "llm", "chat"), type="MODIFIED", memo=ctx)
    assert [w for w in ctx.api.writes()[writes:] if w[0] == "apply"] == []
    assert repairs(ctx, "Deployment", "changed", "repaired") == 0


def test_a_service_deleted_or_edited_is_restored(ctx):
    service = ctx.api.stored("Service", "llm", "chat")
    on_service_event(body=service, type="ADDED", memo=ctx)
    want = service["spec"]
    edited = edited_by_someone(ctx, "Service", "chat",
                               lambda s: s["spec"]["ports"][0].update(port=9999))
    on_service_event(body=edited, type="MODIFIED", memo=ctx)
    assert ctx.api.stored("Service", "llm", "chat")["spec"] == want
    ctx.monotonic.now += 60  # past the back-off
    assert ctx.api.delete("v1", "Service", "llm", "chat")
    on_service_event(body=edited, type="DELETED", memo=ctx)
    assert ctx.api.stored("Service", "llm", "chat")["spec"] == want
    assert repairs(ctx, "Service", "changed", "repaired") == 1
    assert repairs(ctx, "Service", "deleted", "repaired") == 1


def test_a_fight_with_another_writer_is_backed_off(ctx, caplog):
    deployment = ctx.api.stored("Deployment", "llm", "chat")
    on_deployment_event(body=deployment, type="ADDED", memo=ctx)

    def fight():
        edited = edited_by_someone(ctx, "Deployment", "chat", lambda d: d["spec"].update(replicas=9))
        on_deployment_event(body=edited, type="MODIFIED", memo=ctx)
        return ctx.api.stored("Deployment", "llm", "chat")["spec"]["replicas"]

    due = ctx.repairs.due_now
    assert fight() == 2  # the first repair is immediate
    ctx.monotonic.now += 0.5
    with caplog.at_level(logging.WARNING):
        assert fight() == 9  # within the 1 s back-off: deferred, not dropped
    assert "Deployment chat was changed again; repair in 0.5 s" in caplog.text
    assert repairs(ctx, "Deployment", "changed", "deferred") == 1
    assert [round(s, 3) for s, _ in due] == [0.5]
    assert fight() == 9  # a repair is already due: no second timer
    assert len(due) == 1
    ctx.monotonic.now += 0.5
    due.pop()[1]()  # the timer fires: 1 s after the first repair, allowed; the next waits 2 s
    assert ctx.api.stored("Deployment", "llm", "chat")["spec"]["replicas"] == 2
    ctx.monotonic.now += 1.5
    assert fight() == 9 and [round(s, 3) for s, _ in due] == [0.5]
    ctx.monotonic.now += 0.5
    due.pop()[1]()
    assert ctx.api.stored("Deployment", "llm", "chat")["spec"]["replicas"] == 2
    assert repairs(ctx, "Deployment", "changed", "repaired") == 3


def test_nothing_is_restored_for_an_owner_gone_or_going(ctx):
    deployment = ctx.api.stored("Deployment", "llm", "chat")
    on_deployment_event(body=deployment, type="ADDED", memo=ctx)
    owner = ctx.api.stored(c.KIND, "llm", "chat")
    owner["metadata"]["deletionTimestamp"] = "2026-12-04T15:00:00Z"
    ctx.api.put(owner)
    ctx.api.delete("apps/v1", "Deployment", "llm", "chat")
    on_deployment_event(body=deployment, type="DELETED", memo=ctx)
    assert ctx.api.stored("Deployment", "llm", "chat") is None
    ctx.api.delete("kvpilot.dev/v1alpha1", c.KIND, "llm", "chat")
    on_deployment_event(body=deployment, type="DELETED", memo=ctx)
    assert ctx.api.stored("Deployment", "llm", "chat") is None
    assert repairs(ctx, "Deployment", "deleted", "repaired") == 0


def test_an_unreadable_owner_is_logged_and_left_to_the_resync(ctx, caplog):
    deployment = ctx.api.stored("Deployment", "llm", "chat")
    ctx.api.delete("apps/v1", "Deployment", "llm", "chat")
    ctx.api.fail_next(f"get:{c.KIND}", TransientApiError("timeout"))
    with caplog.at_level(logging.WARNING):
        on_deployment_event(body=deployment, type="DELETED", memo=ctx)
    assert "Deployment chat was deleted; its owner could not be read: timeout" in caplog.text
    assert ctx.api.stored("Deployment", "llm", "chat") is None


def test_fingerprints_and_backoff_units():
    assert fingerprint({"metadata": {"generation": 3, "resourceVersion": "9"}}) == ("g", 3)
    assert fingerprint({"metadata": {"resourceVersion": "9"}}) == ("rv", "9")
    assert fingerprint({"metadata": {}}) is None
    seen = ChildFingerprints()
    a = {"metadata": {"uid": "u", "generation": 1}}
    assert not seen.changed(a)  # first sight
    assert not seen.changed(a)
    assert seen.changed({"metadata": {"uid": "u", "generation": 2}})
    seen.record({"metadata": {"uid": "u", "generation": 3}})
    assert not seen.changed({"metadata": {"uid": "u", "generation": 3}})
    # The watch lags behind our apply: an event of an older generation is no change.
    assert not seen.changed({"metadata": {"uid": "u", "generation": 2}})
    assert seen.changed({"metadata": {"uid": "u", "generation": 4}})
    assert not seen.changed({"metadata": {"generation": 3}})  # no uid: cannot tell
    svc = ChildFingerprints()
    assert not svc.changed({"metadata": {"uid": "s", "resourceVersion": "10"}})
    assert svc.changed({"metadata": {"uid": "s", "resourceVersion": "11"}})
    backoff = RepairBackoff(initial=1, maximum=4, reset_after=30)
    times = [0, 0.5, 1, 2, 3, 5, 6, 9, 13, 50]
    assert [backoff.allow("ns", "x", t)[0] for t in times] == [
        True, False, True, False, True, False, False, True, True, True]
    # waits: 1 (0->1), 2 (1->3), 4 (3->7: 5 and 6 refused, 9 ok), capped at 4 (9->13),
    # and 37 s of quiet reset it
