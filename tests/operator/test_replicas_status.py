"""Replica decisions (C16: the operator never fights the autoscaler), conditions and the
status derived from the engine Deployment."""

from __future__ import annotations

from datetime import timedelta

import pytest

from kvpilot.operator.reconcile import ReplicaTarget, replica_target, scale_status
from kvpilot.operator.spec import parse_spec
from kvpilot.operator.status.conditions import Condition, set_conditions, to_rfc3339
from kvpilot.operator.status.workload import failure_status, workload_status

from .fakes import T0

EMBEDDED = {"uri": "embedded://smollm2-135m-instruct"}
STATIC = parse_spec({"model": EMBEDDED, "replicas": 3})
DEFAULT = parse_spec({"model": EMBEDDED})
AUTO = parse_spec({"model": EMBEDDED, "autoscaling": {"minReplicas": 2, "maxReplicas": 6}})

DECISIONS = [
    # spec, current, requested, -> replicas, reason contains
    (STATIC, None, None, 3, ""),
    (STATIC, 3, None, 3, ""),
    (STATIC, 5, None, 3, "spec.replicas is 3"),
    (STATIC, 1, 7, 3, "spec.replicas is 3"),  # the autoscaler has no say on static specs
    (DEFAULT, None, None, 1, ""),
    (AUTO, None, None, 2, ""),              # a new fleet starts at minReplicas
    (AUTO, 4, None, 4, ""),                 # a reconcile keeps the autoscaler's count
    (AUTO, 9, None, 6, "capped at autoscaling.maxReplicas=6"),  # bounds changed
    (AUTO, 1, None, 2, "raised to autoscaling.minReplicas=2"),
    (AUTO, 4, 5, 5, "queue"),               # the autoscaler's recommendation applies
    (AUTO, 4, 10, 6, "capped at autoscaling.maxReplicas=6 (queue"),
    (AUTO, 4, 4, 4, ""),
]


@pytest.mark.parametrize("spec,current,requested,replicas,reason", DECISIONS)
def test_replica_target(spec, current, requested, replicas, reason):
    decision = replica_target(spec, current, requested, "queue depth 9 > 4" if requested else "")
    assert decision.replicas == replicas and decision.current == current
    assert reason in decision.reason
    assert (decision.reason == "") == (current in (None, replicas))
    assert decision.is_scale == (current is not None and current != replicas)


def test_conditions_keep_transition_time_until_status_changes():
    first = set_conditions(None, [Condition("Ready", "False", "ReplicasNotReady", "0/1")], T0, 1)
    later = T0 + timedelta(minutes=5)
    same = set_conditions(first, [Condition("Ready", "False", "ReplicasNotReady", "0/2")], later, 2)
    assert same[0]["lastTransitionTime"] == to_rfc3339(T0)
    assert same[0]["message"] == "0/2" and same[0]["observedGeneration"] == 2
    flipped = set_conditions(same, [Condition("Ready", "True", "AllReplicasReady", "2/2")], later, 2)
    assert flipped[0]["lastTransitionTime"] == to_rfc3339(later)
    assert first[0]["message"] == "0/1"  # inputs are not mutated


def test_conditions_of_other_owners_are_kept_in_order():
    autoscaler = set_conditions(None, [Condition("MetricsAvailable", "False", "NoData", "x")], T0, 1)
    merged = set_conditions(autoscaler, [Condition("Ready", "True", "AllReplicasReady", "1/1")],
                            T0, 1)
    assert [c["type"] for c in merged] == ["Ready", "MetricsAvailable"]


def test_condition_validation():
    with pytest.raises(ValueError, match="condition type must be one of"):
        Condition("Healthy", "True", "Fine", "")
    with pytest.raises(ValueError, match="condition status must be one of"):
        Condition("Ready", "yes", "Fine", "")
    with pytest.raises(ValueError, match="CamelCase"):
        Condition("Ready", "True", "all good", "")
    with pytest.raises(ValueError, match="timezone-aware"):
        to_rfc3339(T0.replace(tzinfo=None))


def deployment(desired, replicas=0, ready=0, updated=0, generation=1, observed=1, stalled=False):
    conds = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
              "message": "ReplicaSet chat-5d has timed out progressing."}] if stalled else []
    return {"metadata": {"generation": generation}, "spec": {"replicas": desired},
            "status": {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated,
                       "observedGeneration": observed, "conditions": conds}}


WORKLOAD = [
    # deployment, Ready (status, reason), Progressing (status, reason)
    (deployment(2), ("False", "ReplicasNotReady"), ("True", "RollingOut")),
    (deployment(2, 2, 1, 2), ("False", "ReplicasNotReady"), ("True", "ReplicasStarting")),
    (deployment(2, 2, 2, 2), ("True", "AllReplicasReady"), ("False", "Complete")),
    (deployment(2, 3, 2, 1, generation=2, observed=2), ("True", "AllReplicasReady"),
     ("True", "RollingOut")),
    (deployment(2, 2, 2, 2, generation=3, observed=2), ("True", "AllReplicasReady"),
     ("True", "RollingOut")),
    (deployment(0), ("False", "ScaledToZero"), ("False", "Complete")),
    (deployment(2, 3, 2, 1, stalled=True), ("True", "AllReplicasReady"),
     ("False", "ProgressDeadlineExceeded")),
]


@pytest.mark.parametrize("dep,ready,progressing", WORKLOAD)
def test_workload_status(dep, ready, progressing):
    status = workload_status("chat", dep, 4, None, T0)
    conds = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert conds == {"Ready": ready, "Progressing": progressing}
    assert status["desiredReplicas"] == dep["spec"]["replicas"]
    assert status["readyReplicas"] == dep["status"]["readyReplicas"]
    assert status["replicas"] == dep["status"]["replicas"]
    assert status["observedGeneration"] == 4
    assert status["selector"] == (
        "app.kubernetes.io/component=engine,kvpilot.dev/inference-deployment=chat")


def test_workload_status_from_the_deployment_watch_leaves_generation_alone():
    status = workload_status("chat", deployment(1, 1, 1, 1), None, None, T0)
    assert "observedGeneration" not in status
    assert all("observedGeneration" not in c for c in status["conditions"])


def test_scale_and_failure_status():
    assert scale_status(ReplicaTarget(3, None, ""), T0) == {}
    assert scale_status(ReplicaTarget(3, 3, ""), T0) == {}
    assert scale_status(ReplicaTarget(4, 3, "queue depth 9 > 4"), T0) == {
        "lastScaleTime": "2026-11-29T12:00:00Z", "lastScaleReason": "3 -> 4: queue depth 9 > 4"}
    failed = failure_status("InvalidSpec", "spec.x: got 1", None, 7, T0)
    assert failed["observedGeneration"] == 7
    assert [(c["type"], c["status"], c["reason"]) for c in failed["conditions"]] == [
        ("Ready", "False", "InvalidSpec"), ("Progressing", "False", "InvalidSpec")]


def test_conditions_keep_observed_generation_when_no_spec_was_reconciled():
    first = set_conditions(None, [Condition("Ready", "False", "ReplicasNotReady", "0/1")], T0, 3)
    later = set_conditions(first, [Condition("Ready", "True", "AllReplicasReady", "1/1")], T0, None)
    assert later[0]["observedGeneration"] == 3
