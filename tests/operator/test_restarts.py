"""Engine container restarts are reported on the InferenceDeployment: a Warning Event
``EngineRestarted`` per restart seen happening, counted by termination reason."""

from __future__ import annotations

import copy

import pytest

from kvpilot.operator import constants as c
from kvpilot.operator.handlers.context import OperatorContext
from kvpilot.operator.handlers.pods import on_engine_pod_event
from kvpilot.operator.metrics import OperatorMetrics
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.restarts import RestartTracker, restart_counts, restarts_between

from .fakes import Clock, FakeKubeApi, inference


def pod(restarts: int = 0, reason: str | None = None, exit_code: int | None = None,
        uid: str = "u1", name: str = "chat-abc") -> dict:
    status = {"name": "engine", "restartCount": restarts, "ready": True}
    if reason is not None:
        status["lastState"] = {"terminated": {"reason": reason, "exitCode": exit_code}}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "llm", "uid": uid,
                         "labels": {c.LABEL_COMPONENT: c.ENGINE_COMPONENT,
                                    c.LABEL_OWNER: "chat"}},
            "status": {"containerStatuses": [status]}}


def test_counts_read_containers_and_init_containers_and_skip_malformed():
    body = pod(2)
    body["status"]["initContainerStatuses"] = [{"name": "model-download", "restartCount": 1},
                                               {"name": "bad", "restartCount": True},
                                               {"restartCount": 3}]
    assert restart_counts(body) == {"engine": 2, "model-download": 1}
    assert restart_counts({}) == {}


def test_a_restart_names_the_reason_the_exit_code_and_what_to_do():
    (restart,) = restarts_between({"engine": 0}, pod(1, "OOMKilled", 137))
    assert (restart.added, restart.restart_count, restart.reason, restart.exit_code) == \
        (1, 1, "OOMKilled", 137)
    message = restart.message()
    assert "chat-abc" in message and "OOMKilled" in message and "exit code 137" in message
    assert "limits.memory" in message
    assert restarts_between({"engine": 1}, pod(1, "OOMKilled", 137)) == []
    (unknown,) = restarts_between({}, pod(2))
    assert (unknown.added, unknown.reason, unknown.exit_code) == (2, "Unknown", None)


def test_the_first_sight_of_a_pod_is_the_baseline_and_a_deleted_pod_is_forgotten():
    tracker = RestartTracker()
    assert tracker.observe(pod(3, "Error", 1)) == []          # restarts from before: unknown when
    assert tracker.observe(pod(3, "Error", 1)) == []          # nothing new
    (restart,) = tracker.observe(pod(5, "OOMKilled", 137))    # two more since
    assert restart.added == 2
    assert tracker.observe({"metadata": {}}) == []            # no uid: nothing to track
    tracker.forget(pod())
    assert len(tracker) == 0


@pytest.fixture
def ctx():
    events = []
    context = OperatorContext(api=FakeKubeApi(), options=OperatorOptions(engine_image="e:1"),
                              metrics=OperatorMetrics(), clock=Clock(),
                              post_event=lambda body, type_, reason, message: events.append(
                                  (body["metadata"]["name"], type_, reason, message)))
    context.api.put(inference())
    return context, events


def test_the_handler_posts_one_warning_per_restart_and_counts_it(ctx):
    context, events = ctx
    memo = copy.copy(context)  # Kopf copies the memo per object: the tracker is shared
    on_engine_pod_event(body=pod(0), type="ADDED", memo=memo)
    on_engine_pod_event(body=pod(1, "OOMKilled", 137), type="MODIFIED", memo=copy.copy(context))
    assert [(e[0], e[1], e[2]) for e in events] == [("chat", "Warning", "EngineRestarted")]
    assert "OOMKilled" in events[0][3]
    sample = context.metrics.registry.get_sample_value(
        "kvpilot_operator_engine_restarts_total",
        {"namespace": "llm", "inference_deployment": "chat", "reason": "OOMKilled"})
    assert sample == 1
    on_engine_pod_event(body=pod(1, "OOMKilled", 137), type="MODIFIED", memo=context)
    assert len(events) == 1  # the same count again: nothing new
    on_engine_pod_event(body=pod(1), type="DELETED", memo=context)
    assert len(context.restarts) == 0
    context.metrics.forget("llm", "chat")
    assert context.metrics.registry.get_sample_value(
        "kvpilot_operator_engine_restarts_total",
        {"namespace": "llm", "inference_deployment": "chat", "reason": "OOMKilled"}) is None


def test_a_restart_of_a_pod_whose_owner_is_gone_is_counted_not_posted(ctx):
    context, events = ctx
    orphan = pod(0, uid="u2")
    orphan["metadata"]["labels"][c.LABEL_OWNER] = "gone"
    on_engine_pod_event(body=orphan, type="ADDED", memo=context)
    orphan = copy.deepcopy(orphan)
    orphan["status"]["containerStatuses"][0]["restartCount"] = 1
    on_engine_pod_event(body=orphan, type="MODIFIED", memo=context)
    assert events == []
    assert context.metrics.registry.get_sample_value(
        "kvpilot_operator_engine_restarts_total",
        {"namespace": "llm", "inference_deployment": "gone", "reason": "Unknown"}) == 1
