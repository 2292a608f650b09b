"""One level-based reconcile of an InferenceDeployment: read, choose the count, apply,
report.

::

    body --Resource.from_body--> Resource --parse_spec--> InferenceSpec
    GET Deployment --replica_target--> ReplicaTarget --build_children--> Children
    SSA Deployment (resourceVersion precondition; 409 -> re-read, up to CONFLICT_ATTEMPTS)
    GET + SSA Service, PodDisruptionBudget[, PodMonitor] (never one we do not control)
    -> ReconcileResult(status merge patch, events)

Idempotent: running it twice on an unchanged object applies identical configurations and
returns the same status. It writes only the children; the caller writes the status and
posts the events, and nothing ever writes the InferenceDeployment's spec (so GitOps tools
see no drift).

The replica count (:func:`replica_target`). Two controllers must never fight over
``Deployment.spec.replicas``:

* static (``spec.replicas``): the spec is the truth.
* neither field: the Deployment keeps its current count (1 when it is created). So removing
  ``autoscaling`` without writing ``replicas`` leaves the fleet as the autoscaler left it,
  as removing an HPA leaves its Deployment, instead of dropping it to one pod at once.
* autoscaling: the autoscaler is the truth. A reconcile keeps the Deployment's current
  count (clamped to [minReplicas, maxReplicas], e.g. after the bounds changed) and only an
  explicit ``requested`` count from the autoscaler loop moves it. A new Deployment
  starts at minReplicas.

The autoscaler loop calls :func:`reconcile` with ``requested`` (its recommendation):
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
from kvpilot.operator.builders import Children, Owner, build_children
from kvpilot.operator.builders.children import POD_MONITOR_API_VERSION
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.spec import InferenceSpec, check_name, parse_spec
from kvpilot.operator.status.conditions import to_rfc3339
from kvpilot.operator.status.workload import workload_status

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
        target: the replica count that was applied.
        applied: ``Kind/name`` of every object applied, in order.
    """

    status: dict[str, Any]
    events: tuple[Event, ...]
    target: ReplicaTarget
    applied: tuple[str, ...]


@dataclass(frozen=True)
class ReplicaTarget:
    """The replica count one reconcile applies to the engine Deployment.

    Attributes:
        replicas: the count to apply.
        current: the Deployment's count before (None = no Deployment yet).
        reason: why ``replicas`` differs from ``current`` ("" when it does not).
    """

    replicas: int
    current: int | None
    reason: str

    @property
    def is_scale(self) -> bool:
        """True when an existing Deployment changes size (an Event and lastScaleTime)."""
        return self.current is not None and self.current != self.replicas


def replica_target(spec: InferenceSpec, current: int | None, requested: int | None = None,
                   requested_reason: str = "") -> ReplicaTarget:
    """The replica count this reconcile applies (pure; the policy in the module docstring).

    Args:
        spec: the validated spec.
        current: the Deployment's ``spec.replicas`` now (None = it does not exist).
        requested: the autoscaler's recommendation (ignored for static specs, whose
            count comes from the spec alone).
        requested_reason: the autoscaler's explanation, kept in the decision's reason.
    """
    if spec.autoscaling is None and spec.replicas is None:
        return ReplicaTarget(1 if current is None else current, current, "")
    static = spec.static_replicas
    if static is not None:
        reason = f"spec.replicas is {static}" if current is not None and current != static else ""
        return ReplicaTarget(static, current, reason)
    bounds = spec.autoscaling
    if bounds is None:  # static_replicas is None only when autoscaling is set
        raise AssertionError("unreachable: neither replicas nor autoscaling")
    if requested is not None:
        base, why = requested, requested_reason or f"autoscaler recommends {requested}"
    elif current is not None:
        base, why = current, ""
    else:
        return ReplicaTarget(bounds.min_replicas, None, "")
    replicas = bounds.clamp(base)
    if replicas > base:
        why = f"raised to autoscaling.minReplicas={bounds.min_replicas}" + (f" ({why})" if why else "")
    elif replicas < base:
        why = f"capped at autoscaling.maxReplicas={bounds.max_replicas}" + (f" ({why})" if why else "")
    return ReplicaTarget(replicas, current, why if replicas != current else "")

def scale_status(target: ReplicaTarget, now: datetime) -> dict[str, Any]:
    """``lastScaleTime``/``lastScaleReason`` when the target resized the fleet, else {}."""
    if not target.is_scale:
        return {}
    return {
        "lastScaleTime": to_rfc3339(now),
        "lastScaleReason": f"{target.current} -> {target.replicas}: {target.reason}",
    }


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


@dataclass(frozen=True)
class _Applied:
    deployment: dict[str, Any]  # as stored after the apply
    target: ReplicaTarget
    children: Children
    created: bool


def _apply_deployment(api: KubeApi, resource: Resource, options: OperatorOptions,
                      pod_monitor: bool, requested: int | None,
                      requested_reason: str) -> _Applied:
    """Read, choose the count and apply the Deployment, retrying 409s against fresh state."""
    spec = parse_spec(resource.spec)
    for attempt in range(1, CONFLICT_ATTEMPTS + 1):
        current = api.get("apps/v1", "Deployment", resource.namespace, resource.name)
        if current is not None:
            _check_owner(current, resource)
        target = replica_target(spec, _current_replicas(current), requested, requested_reason)
        children = build_children(resource.owner, spec, target.replicas, options.engine_image,
                                  pod_monitor, options.pod_monitor_labels)
        config = children.deployment
        if current is not None:
            # A precondition: if anyone resized or changed it since the read, 409.
            config = {**config, "metadata": {
                **config["metadata"],
                "resourceVersion": current["metadata"]["resourceVersion"],
            }}
        try:
            return _Applied(api.apply(config), target, children, current is None)
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
    done = _apply_deployment(api, resource, options, pod_monitor, requested, requested_reason)
    target = done.target
    applied = [f"Deployment/{resource.name}"]
    for obj in done.children.all()[1:]:
        api.apply(obj)
        applied.append(f"{obj['kind']}/{resource.name}")

    status = workload_status(resource.name, done.deployment, resource.generation,
                             resource.status.get("conditions"), now)
    status.update(scale_status(target, now))
    events: list[Event] = []
    if done.created:
        events.append(Event("Normal", "Created",
                            f"created engine Deployment with {target.replicas} replicas"))
    if target.is_scale:
        direction = "ScaledUp" if target.replicas > (target.current or 0) else "ScaledDown"
        events.append(Event("Normal", direction, status["lastScaleReason"]))
    return ReconcileResult(status, tuple(events), target, tuple(applied))
