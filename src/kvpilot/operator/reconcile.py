"""One level-based reconcile of an InferenceDeployment: read, choose the count, apply,
report.

::

    body --Resource.from_body--> Resource --parse_spec (and metadata.name)--> InferenceSpec
    GET Deployment --replica_target--> ReplicaTarget --build_children--> Children
        (once per attempt); first attempt: GET every other child (never write over one
        we do not control), then the Deployment's owner checked
    SSA ConfigMap NAME-adapters while LoRA is on (the engine pods mount it)
    SSA Deployment (resourceVersion precondition; 409 -> re-read, up to CONFLICT_ATTEMPTS)
    SSA Service, PodDisruptionBudget[, PodMonitor], spec.router's objects (router:
        ServiceAccount, RoleBinding, Deployment, Service[, PDB][, PodMonitor], all
        NAME-router; gateway: InferencePool NAME, where the cluster serves the kind)
    SSA ScaledObject NAME in KEDA mode (spec.autoscaling.engine: keda)
    DELETE router objects the spec no longer wants, the headroom placeholders when off, the
        ScaledObject outside KEDA mode, the adapters ConfigMap with LoRA off (only our own,
        uid precondition)
    -> ReconcileResult(status merge patch, events, condition types to drop)

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
  starts at minReplicas (at one with ``minReplicas: 0``: a new fleet serves first and goes
  to zero when idle). Only the autoscaler takes a fleet to zero, and a fleet at zero stays
  there until the autoscaler activates it (docs/autoscaling.md, "Scale to zero").

* KEDA mode (``autoscaling.engine: keda``): KEDA's HPA is the truth. The Deployment is
  applied without ``spec.replicas`` (a new one starts at the API's default, one, and KEDA
  raises it to minReplicaCount); :func:`replica_target` only reports the current count.
  Server-side apply resets a field its last owner stops sending, so before the first apply
  without it the count is handed over (:data:`HANDOVER_FIELD_MANAGER` applies the current
  count, with a resourceVersion precondition, as the Kubernetes docs' "Transferring
  ownership" does for an HPA): switching a live fleet to KEDA keeps its size.

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
from kvpilot.operator.builders.children import POD_MONITOR_API_VERSION, ChildRef
from kvpilot.operator.builders.keda import SCALED_OBJECT_API_VERSION, SCALED_OBJECT_KIND
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.spec import InferenceSpec, parse_spec
from kvpilot.operator.status.conditions import Condition, set_conditions, to_rfc3339
from kvpilot.operator.status.router import (
    endpoint_status,
    gateway_condition,
    missing_pool_condition,
    router_condition,
)
from kvpilot.operator.status.workload import workload_status

CONFLICT_ATTEMPTS = 5
# KEDA mode: the field manager that keeps the engine Deployment's spec.replicas while the
# operator's own manager stops sending it (docs/autoscaling.md, "KEDA mode").
HANDOVER_FIELD_MANAGER = "kvpilot-handover-to-keda"


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
        deleted: ``Kind/name`` of every object deleted (router objects no longer wanted).
        drop_conditions: condition types the writer removes (RouterReady when the router
            is disabled; the autoscaler's in KEDA mode).
    """

    status: dict[str, Any]
    events: tuple[Event, ...]
    target: ReplicaTarget
    applied: tuple[str, ...]
    deleted: tuple[str, ...] = ()
    drop_conditions: tuple[str, ...] = ()


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
    if spec.autoscaling is not None and spec.autoscaling.keda:
        # KEDA's HPA owns the count: nothing to choose, the current one is reported.
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
        return ReplicaTarget(bounds.floor, None, "")
    if base == 0 and bounds.scale_to_zero:
        # Scale to zero: only the autoscaler takes the fleet to zero, and a fleet at zero
        # stays there until the autoscaler activates it.
        return ReplicaTarget(0, current, why if current != 0 else "")
    replicas = bounds.clamp(base)
    if replicas > base:
        why = f"raised to autoscaling.minReplicas={bounds.floor}" + (f" ({why})" if why else "")
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


def _owned_by(existing: Mapping[str, Any], resource: Resource) -> bool:
    """True when ``resource`` is the controller of ``existing``."""
    refs = (existing.get("metadata") or {}).get("ownerReferences") or ()
    return any(ref.get("controller") and ref.get("uid") == resource.uid for ref in refs)


def _check_owner(existing: Mapping[str, Any], resource: Resource, kind: str = "Deployment",
                 name: str | None = None) -> None:
    """Refuse to take over a child (``kind`` named ``name``, default the resource's) that
    this InferenceDeployment does not control: applying ours would re-point a user's Service
    or PDB, and our owner reference would let garbage collection delete it with us."""
    name = name or resource.name
    for ref in (existing.get("metadata") or {}).get("ownerReferences") or ():
        if not ref.get("controller"):
            continue
        if ref.get("uid") == resource.uid:
            return
        if ref.get("kind") == c.KIND and ref.get("name") == resource.name:
            raise TransientApiError(
                f"{kind} {name} still belongs to a deleted {c.KIND} of the same"
                " name; waiting for garbage collection"
            )
        raise InvalidObjectError(
            f"{kind} {resource.namespace}/{name} is controlled by"
            f" {ref.get('kind')}/{ref.get('name')}; rename the {c.KIND} or delete that {kind}"
        )
    raise InvalidObjectError(
        f"{kind} {resource.namespace}/{name} exists and is not managed by"
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


def serves_inference_pool(api: KubeApi) -> bool:
    """Whether the cluster serves InferencePool (the Gateway API Inference Extension CRD)."""
    return api.has_api(c.INFERENCE_POOL_API_VERSION, c.INFERENCE_POOL_KIND)


def serves_scaled_objects(api: KubeApi) -> bool:
    """Whether the cluster serves KEDA's ScaledObject (keda.sh/v1alpha1)."""
    return api.has_api(SCALED_OBJECT_API_VERSION, SCALED_OBJECT_KIND)


@dataclass(frozen=True)
class _Wants:
    """What this reconcile builds besides the engine Deployment, decided once."""

    pod_monitor: bool
    inference_pool: bool
    scaled_objects: bool = False


def _build(resource: Resource, spec: InferenceSpec, options: OperatorOptions, replicas: int,
           wants: _Wants) -> Children:
    return build_children(resource.owner, spec, replicas, options.engine_image,
                          wants.pod_monitor, options.pod_monitor_labels,
                          router_image=options.router_image,
                          inference_pool=wants.inference_pool,
                          scaled_objects=wants.scaled_objects)


@dataclass(frozen=True)
class _Applied:
    deployment: dict[str, Any]  # as stored after the apply
    target: ReplicaTarget
    children: Children
    created: bool


def _manages_replicas(deployment: Mapping[str, Any]) -> bool:
    """Whether our field manager's apply owns the Deployment's ``spec.replicas``, from its
    ``metadata.managedFields`` (True when the API did not return them: hand over to be
    safe, the hand-over writes the count it read)."""
    managed = (deployment.get("metadata") or {}).get("managedFields")
    if managed is None:
        return True
    for entry in managed:
        mine = entry.get("manager") == c.FIELD_MANAGER and entry.get("operation") == "Apply"
        if mine and "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {}):
            return True
    return False


def _hand_over_replicas(api: KubeApi, current: dict[str, Any]) -> dict[str, Any]:
    """KEDA mode: make :data:`HANDOVER_FIELD_MANAGER` a co-owner of ``spec.replicas`` at
    its current value, so our apply without the field keeps it. Returns the Deployment as
    stored. Raises ConflictError when it changed since ``current`` was read."""
    meta = current["metadata"]
    return api.apply({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                     "resourceVersion": meta["resourceVersion"]},
        "spec": {"replicas": _current_replicas(current)},
    }, force=False, field_manager=HANDOVER_FIELD_MANAGER)


def _check_children_owners(api: KubeApi, resource: Resource, children: Children) -> None:
    """Refuse before writing anything if a child other than the Deployment (checked on each
    read of it) exists under its name and is someone else's. Raises what
    :func:`_check_owner` raises."""
    for obj in children.all()[1:]:
        meta = obj["metadata"]
        existing = api.get(obj["apiVersion"], obj["kind"], resource.namespace, meta["name"])
        if existing is not None:
            _check_owner(existing, resource, obj["kind"], meta["name"])


def _apply_deployment(api: KubeApi, resource: Resource, spec: InferenceSpec,
                      options: OperatorOptions, wants: _Wants, requested: int | None,
                      requested_reason: str) -> _Applied:
    """Read, choose the count, build the children and apply the Deployment, retrying 409s
    against fresh state. Each attempt builds the children once, for the count it applies;
    the first also refuses, before any write, children whose names are someone else's (the
    other children's names do not change between attempts)."""
    for attempt in range(1, CONFLICT_ATTEMPTS + 1):
        current = api.get("apps/v1", "Deployment", resource.namespace, resource.name)
        target = replica_target(spec, _current_replicas(current), requested, requested_reason)
        children = _build(resource, spec, options, target.replicas, wants)
        if attempt == 1:
            _check_children_owners(api, resource, children)
            if children.adapters is not None:
                # Before the Deployment: a pod it creates mounts this ConfigMap.
                api.apply(children.adapters)
        if current is not None:
            _check_owner(current, resource)
            keda = spec.autoscaling is not None and spec.autoscaling.keda
            if keda and _manages_replicas(current):
                try:
                    current = _hand_over_replicas(api, current)
                except ConflictError:
                    if attempt == CONFLICT_ATTEMPTS:
                        raise
                    continue
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


def _delete_unwanted(api: KubeApi, resource: Resource,
                     unwanted: tuple[ChildRef, ...]) -> list[str]:
    """Delete the router objects the spec no longer wants, when they are this resource's
    (anything else of that name is left alone). Returns ``Kind/name`` of each deleted."""
    deleted = []
    for ref in unwanted:
        existing = api.get(ref.api_version, ref.kind, resource.namespace, ref.name)
        if existing is None or not _owned_by(existing, resource):
            continue
        uid = (existing.get("metadata") or {}).get("uid")
        if api.delete(ref.api_version, ref.kind, resource.namespace, ref.name, uid=uid):
            deleted.append(f"{ref.kind}/{ref.name}")
    return deleted


def _router_condition(spec: InferenceSpec, stored: Mapping[str, dict[str, Any]],
                      engines_ready: int, wants: _Wants) -> Condition | None:
    """RouterReady from the router objects as applied (None = the router is disabled)."""
    if spec.router.runs_router:
        return router_condition(stored.get("Deployment"), engines_ready)
    if spec.router.uses_gateway:
        if not wants.inference_pool:
            return missing_pool_condition()
        return gateway_condition(stored.get(c.INFERENCE_POOL_KIND))
    return None


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
        InvalidObjectError: the API refused an object, or the name is taken, or KEDA mode
            on a cluster without KEDA's ScaledObject kind.
        ConflictError: still conflicting after CONFLICT_ATTEMPTS tries.
        TransientApiError: the API is unreachable or overloaded.
    """
    spec = parse_spec(resource.spec, resource.name)
    wants = _Wants(
        pod_monitor=want_pod_monitor(api, options),
        # Asked in every mode: a pool left from gateway mode is deleted in the others.
        inference_pool=serves_inference_pool(api),
        # Likewise: a ScaledObject left from KEDA mode is deleted in kvpilot mode.
        scaled_objects=serves_scaled_objects(api),
    )
    if spec.autoscaling is not None and spec.autoscaling.keda and not wants.scaled_objects:
        raise InvalidObjectError(
            f"spec.autoscaling.engine is keda but the cluster does not serve"
            f" {SCALED_OBJECT_API_VERSION} {SCALED_OBJECT_KIND}: install KEDA, or set"
            " spec.autoscaling.engine to kvpilot")
    done = _apply_deployment(api, resource, spec, options, wants, requested, requested_reason)
    target = done.target
    applied = [f"Deployment/{resource.name}"]
    stored_router: dict[str, dict[str, Any]] = {}
    if done.children.adapters is not None:
        applied.insert(0, f"ConfigMap/{done.children.adapters['metadata']['name']}")
    for obj in done.children.all()[1:]:
        if obj is done.children.adapters:
            continue  # applied before the Deployment
        stored = api.apply(obj)
        applied.append(f"{obj['kind']}/{obj['metadata']['name']}")
        if any(obj is r for r in done.children.router):
            stored_router[obj["kind"]] = stored
    deleted = _delete_unwanted(api, resource, done.children.unwanted)

    status = workload_status(resource.name, done.deployment, resource.generation,
                             resource.status.get("conditions"), now,
                             spec.autoscaling is not None and spec.autoscaling.scale_to_zero)
    status.update(scale_status(target, now))
    status.update(endpoint_status(resource.name, resource.namespace, spec.router))
    router = _router_condition(spec, stored_router, status["readyReplicas"], wants)
    drop: tuple[str, ...] = ()
    if router is not None:
        status["conditions"] = set_conditions(status["conditions"], [router], now,
                                              resource.generation)
    else:
        drop = (c.ROUTER_CONDITION,)
        status["conditions"] = [cond for cond in status["conditions"]
                                if cond.get("type") != c.ROUTER_CONDITION]
    if spec.autoscaling is not None and spec.autoscaling.keda:
        # KEDA decides: the operator's autoscaler conditions (left from kvpilot mode) go;
        # the ScaledObject's own conditions say how KEDA is doing.
        drop += c.AUTOSCALER_CONDITIONS
        status["conditions"] = [cond for cond in status["conditions"]
                                if cond.get("type") not in c.AUTOSCALER_CONDITIONS]
    if not spec.lora_enabled:
        # LoRA off: the adapter sync stops, and what it last reported goes.
        drop += (c.ADAPTERS_CONDITION,)
        status["conditions"] = [cond for cond in status["conditions"]
                                if cond.get("type") != c.ADAPTERS_CONDITION]
        for key in ("adapters", "adaptersReady"):
            if key in resource.status:
                status[key] = None
    events: list[Event] = []
    if done.created:
        events.append(Event("Normal", "Created",
                            f"created engine Deployment with {target.replicas} replicas"))
    if target.is_scale:
        direction = "ScaledUp" if target.replicas > (target.current or 0) else "ScaledDown"
        events.append(Event("Normal", direction, status["lastScaleReason"]))
    if deleted:
        events.append(Event("Normal", "RouterObjectsDeleted",
                            f"deleted what spec.router no longer asks for: {', '.join(deleted)}"))
    return ReconcileResult(status, tuple(events), target, tuple(applied), tuple(deleted), drop)
