"""The part of ``status`` the reconcile owns: replica counts, selector, observedGeneration
and the Ready/Progressing conditions, read from the engine Deployment as observed (the
scale fields of a resize, ``lastScaleTime``/``lastScaleReason``, come with the replica
target in :mod:`kvpilot.operator.reconcile`).

Every key produced here is declared in the CRD's status schema; the API server would
silently prune any other (``tests/operator/test_status_schema.py`` applies every patch
to the schema). All functions are pure: they take the observed objects and the time, and
return the status merge patch (a dict) without mutating their inputs.

Conditions owned here:

=============  ==================================================================
Ready          True when every desired engine pod is ready, and at zero replicas with
               autoscaling.minReplicas 0 (reason ScaledToZero) (False: ScaledToZero,
               ReplicasNotReady, InvalidSpec, ApplyFailed)
Progressing    True while the Deployment rolls out or new pods start; False with
               Complete when steady, ProgressDeadlineExceeded when stuck
=============  ==================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from kvpilot.operator.builders.labels import selector_string
from kvpilot.operator.status.conditions import Condition, set_conditions


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _deployment_counts(deployment: Mapping[str, Any]) -> dict[str, int]:
    status = deployment.get("status") or {}
    return {
        "desired": _int((deployment.get("spec") or {}).get("replicas")),
        "replicas": _int(status.get("replicas")),
        "ready": _int(status.get("readyReplicas")),
        "updated": _int(status.get("updatedReplicas")),
    }


def _stalled_message(deployment: Mapping[str, Any]) -> str | None:
    for cond in (deployment.get("status") or {}).get("conditions") or ():
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return cond.get("message") or "the Deployment exceeded its progress deadline"
    return None


def _rollout_pending(deployment: Mapping[str, Any], n: dict[str, int]) -> bool:
    generation = (deployment.get("metadata") or {}).get("generation")
    observed = (deployment.get("status") or {}).get("observedGeneration")
    unobserved = generation is not None and (observed is None or observed < generation)
    return unobserved or n["updated"] < n["desired"] or n["replicas"] > n["desired"]


def workload_conditions(deployment: Mapping[str, Any],
                        scale_to_zero: bool = False) -> tuple[Condition, Condition]:
    """(Ready, Progressing) derived from the engine Deployment as observed. With
    ``scale_to_zero`` (``autoscaling.minReplicas: 0``) a fleet at zero is Ready: it serves,
    the router holding each request while an engine starts."""
    n = _deployment_counts(deployment)
    counts = f"{n['ready']}/{n['desired']} engine pods ready"
    if n["desired"] == 0 and scale_to_zero:
        ready = Condition("Ready", "True", "ScaledToZero",
                          "scaled to zero while idle: the router holds the next request"
                          " (up to autoscaling.activationTimeoutSeconds) while an engine starts")
    elif n["desired"] == 0:
        ready = Condition("Ready", "False", "ScaledToZero", "no engine pods are requested")
    elif n["ready"] >= n["desired"]:
        ready = Condition("Ready", "True", "AllReplicasReady", counts)
    else:
        ready = Condition("Ready", "False", "ReplicasNotReady", counts)
    stalled = _stalled_message(deployment)
    if stalled is not None:
        progressing = Condition("Progressing", "False", "ProgressDeadlineExceeded", stalled)
    elif _rollout_pending(deployment, n):
        progressing = Condition(
            "Progressing", "True", "RollingOut",
            f"{n['updated']}/{n['desired']} engine pods updated, {counts}",
        )
    elif n["ready"] < n["desired"]:
        progressing = Condition("Progressing", "True", "ReplicasStarting", counts)
    else:
        progressing = Condition("Progressing", "False", "Complete", counts)
    return ready, progressing


def workload_status(name: str, deployment: Mapping[str, Any], generation: int | None,
                    conditions: list[Mapping[str, Any]] | None, now: datetime,
                    scale_to_zero: bool = False) -> dict[str, Any]:
    """Replica counts, selector, observedGeneration and the Ready/Progressing conditions.

    Args:
        name: the InferenceDeployment's name (for the selector).
        deployment: the engine Deployment as the API returned it (spec and status).
        generation: the InferenceDeployment's metadata.generation that was reconciled
            (None from the Deployment watch, which reconciles no spec: left unchanged).
        conditions: the current status.conditions (others' types are kept).
        now: the time of observation (timezone-aware).
        scale_to_zero: ``autoscaling.minReplicas`` is 0 (Ready at zero replicas).
    """
    n = _deployment_counts(deployment)
    status: dict[str, Any] = {
        "replicas": n["replicas"],
        "readyReplicas": n["ready"],
        "desiredReplicas": n["desired"],
        "selector": selector_string(name),
        "conditions": set_conditions(conditions, workload_conditions(deployment, scale_to_zero), now,
                                     generation),
    }
    if generation is not None:
        status["observedGeneration"] = generation
    return status


def failure_status(reason: str, message: str, conditions: list[Mapping[str, Any]] | None,
                   generation: int | None, now: datetime) -> dict[str, Any]:
    """Status for a generation the operator cannot apply (``reason`` e.g. InvalidSpec):
    Ready and Progressing False with the message, so ``kubectl get``/``describe`` shows why."""
    updates = (
        Condition("Ready", "False", reason, message),
        Condition("Progressing", "False", reason, message),
    )
    status: dict[str, Any] = {"conditions": set_conditions(conditions, updates, now, generation)}
    if generation is not None:
        status["observedGeneration"] = generation
    return status
