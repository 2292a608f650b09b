"""One level-based reconcile of an InferenceDeployment: read, decide, apply, report.

::

    body --Resource.from_body--> Resource --parse_spec--> InferenceSpec
    GET Deployment --decide_replicas--> ReplicaDecision --build_children--> Children
    SSA Deployment (resourceVersion precondition; 409 -> re-read, up to CONFLICT_ATTEMPTS)
    GET + SSA Service, PodDisruptionBudget[, PodMonitor] (never one we do not control)
    -> ReconcileResult(status merge patch, events)

Idempotent: running it twice on an unchanged object applies identical configurations and
returns the same status. It writes only the children; the caller writes the status and
posts the events, and nothing ever writes the InferenceDeployment's spec (case C16).

The autoscaler timer calls :func:`reconcile` with ``requested`` (its recommendation):
the same code path then applies the new count, so the two never fight over
``Deployment.spec.replicas`` and a concurrent change surfaces as a 409 that is retried
against fresh state.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kvpilot.operator import constants as c
from kvpilot.operator.api import ConflictError, InvalidObjectError, KubeApi, TransientApiError
from kvpilot.operator.builders import Owner, build_children
from kvpilot.operator.builders.children import POD_MONITOR_API_VERSION
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.replicas import ReplicaDecision, decide_replicas
from kvpilot.operator.spec import check_name, parse_spec
from kvpilot.operator.status import scale_status, workload_status

CONFLICT_ATTEMPTS = 5


@dataclass(frozen=True)
class Resource:
    """The InferenceDeployment being reconciled, as read from the API."""

    name: str
    namespace: str
    uid: str
    generation: int | None
    spec: Mapping[str, Any]
    status: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Resource:
        meta = body.get("metadata") or {}
        return cls(
            name=meta.get("name", ""),
            namespace=meta.get("namespace", ""),
            uid=meta.get("uid", ""),
            generation=meta.get("generation"),
            spec=copy.deepcopy(dict(body.get("spec") or {})),
            status=copy.deepcopy(dict(body.get("status") or {})),
        )

    @property
    def owner(self) -> Owner:
        return Owner(self.name, self.namespace, self.uid)


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to post on the InferenceDeployment."""

    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class ReconcileResult:
    """Attributes:
        status: merge patch for ``status`` (every key declared in the CRD).
        events: to post, in order.
        decision: the replica decision that was applied.
        applied: ``Kind/name`` of every object applied, in order.
    """

    status: dict[str, Any]
    events: tuple[Event, ...]
    decision: ReplicaDecision
    applied: tuple[str, ...]


def _check_owner(existing: Mapping[str, Any], resource: Resource, kind: str = "Deployment") -> None:
    """Refuse to take over a child (``kind`` of the resource's name) that this
    InferenceDeployment does not control: applying ours would re-point a user's Service or
    PDB, and our owner reference would let garbage collection delete it with us."""
    for ref in (existing.get("metadata") or {}).get("ownerReferences") or ():
        if not ref.get("controller"):
            continue
        if ref.get("uid") == resource.uid:
            return
        if ref.get("kind") == c.KIND and ref.get("name") == resource.name:
            raise TransientApiError(
                f"{kind} {resource.name} still belongs to a deleted {c.KIND} of the same"
                " name; waiting for garbage collection"
            )
        raise InvalidObjectError(
            f"{kind} {resource.namespace}/{resource.name} is controlled by"
            f" {ref.get('kind')}/{ref.get('name')}; rename the {c.KIND} or delete that {kind}"
        )
    raise InvalidObjectError(
        f"{kind} {resource.namespace}/{resource.name} exists and is not managed by"
        f" kvpilot; rename the {c.KIND} or delete that {kind}"
    )


def _current_replicas(deployment: Mapping[str, Any] | None) -> int | None:
    if deployment is None:
        return None
    replicas = (deployment.get("spec") or {}).get("replicas")
    return replicas if isinstance(replicas, int) else 1  # the API's default


def want_pod_monitor(api: KubeApi, options: OperatorOptions) -> bool:
    """Whether to apply a PodMonitor under ``options.pod_monitor``."""
    if options.pod_monitor == "auto":
        return api.has_api(POD_MONITOR_API_VERSION, "PodMonitor")
    return options.pod_monitor == "always"


def _apply_deployment(api: KubeApi, resource: Resource, options: OperatorOptions,
                      pod_monitor: bool, requested: int | None, requested_reason: str):
    """Read-decide-apply the Deployment, retrying 409s against fresh state."""
    spec = parse_spec(resource.spec)
    for attempt in range(1, CONFLICT_ATTEMPTS + 1):
        current = api.get("apps/v1", "Deployment", resource.namespace, resource.name)
        if current is not None:
            _check_owner(current, resource)
        decision = decide_replicas(spec, _current_replicas(current), requested, requested_reason)
        children = build_children(resource.owner, spec, decision.replicas, options.engine_image,
                                  pod_monitor, options.pod_monitor_labels)
        config = children.deployment
        if current is not None:
            # A precondition: if anyone resized or changed it since the read, 409.
            config = {**config, "metadata": {
                **config["metadata"],
                "resourceVersion": current["metadata"]["resourceVersion"],
            }}
        try:
            return api.apply(config), decision, children, current is None
        except ConflictError:
            if attempt == CONFLICT_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def reconcile(api: KubeApi, resource: Resource, options: OperatorOptions, now: datetime,
              requested: int | None = None, requested_reason: str = "") -> ReconcileResult:
    """Bring the children of ``resource`` to its spec and report the status.

    Args:
        api: the Kubernetes API (real or fake).
        resource: the InferenceDeployment as read.
        options: operator-wide settings.
        now: the clock, passed in (timezone-aware).
        requested: the autoscaler's recommended replica count (None from plain
            reconciles, which keep the current count when autoscaling).
        requested_reason: why, for the Event and ``status.lastScaleReason``.

    Raises:
        SpecError: the spec is invalid (permanent until the spec changes).
        InvalidObjectError: the API refused an object, or the name is taken.
        ConflictError: still conflicting after CONFLICT_ATTEMPTS tries.
        TransientApiError: the API is unreachable or overloaded.
    """
    check_name(resource.name)
    pod_monitor = want_pod_monitor(api, options)
    # Every child's name is the resource's: refuse before writing anything if one of them
    # exists and is someone else's (the Deployment is checked inside its apply loop).
    others = [("v1", "Service"), ("policy/v1", "PodDisruptionBudget")]
    for api_version, kind in others + ([(POD_MONITOR_API_VERSION, "PodMonitor")] if pod_monitor else []):
        existing = api.get(api_version, kind, resource.namespace, resource.name)
        if existing is not None:
            _check_owner(existing, resource, kind)
    deployment, decision, children, created = _apply_deployment(
        api, resource, options, pod_monitor, requested, requested_reason
    )
    applied = [f"Deployment/{resource.name}"]
    for obj in children.all()[1:]:
        api.apply(obj)
        applied.append(f"{obj['kind']}/{resource.name}")

    status = workload_status(resource.name, deployment, resource.generation,
                             resource.status.get("conditions"), now)
    status.update(scale_status(decision, now))
    events: list[Event] = []
    if created:
        events.append(Event("Normal", "Created",
                            f"created engine Deployment with {decision.replicas} replicas"))
    if decision.is_scale:
        direction = "ScaledUp" if decision.replicas > (decision.current or 0) else "ScaledDown"
        events.append(Event("Normal", direction, status["lastScaleReason"]))
    return ReconcileResult(status, tuple(events), decision, tuple(applied))
