"""Watches of the engine's and the router's Deployments and Services (label
``app.kubernetes.io/managed-by=kvpilot-operator``): a child someone else deleted or edited
is restored (:func:`repair_child`, :mod:`kvpilot.operator.repair`); otherwise an engine
Deployment's counts and conditions, or a router Deployment's RouterReady, are copied to
its owner at once (the resync timer would catch up anyway; this keeps ``kubectl get``
current)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from kvpilot.operator import constants as c
from kvpilot.operator.api import ApiError
from kvpilot.operator.handlers.context import OperatorContext
from kvpilot.operator.handlers.lifecycle import reconcile_and_write_status
from kvpilot.operator.logs import object_ref
from kvpilot.operator.spec import SpecError, parse_spec
from kvpilot.operator.status.conditions import set_conditions
from kvpilot.operator.status.router import router_condition
from kvpilot.operator.status.workload import workload_status
from kvpilot.operator.status.writer import write_status


def repair_child(memo: OperatorContext, body: Mapping[str, Any], type: str | None) -> bool:
    """Reconcile the owner of a child that someone else deleted or edited
    (:mod:`kvpilot.operator.repair`), unless the owner is gone or going; when the back-off
    says wait, the repair runs when the wait is over. Returns True when a reconcile ran
    now. Logs, never raises: the resync is the fallback."""
    meta = body.get("metadata") or {}
    if type == "DELETED":
        memo.fingerprints.forget(body)
        cause = "deleted"
    elif memo.fingerprints.changed(body):
        cause = "changed"
    else:
        return False
    name, namespace = (meta.get("labels") or {}).get(c.LABEL_OWNER), meta.get("namespace")
    if not name or not namespace:
        return False
    return _repair_owner(memo, namespace, name, body.get("kind") or "child", meta.get("name", ""), cause)


def _repair_owner(memo: OperatorContext, namespace: str, name: str, kind: str, child: str, cause: str) -> bool:
    log = logging.getLogger(__name__)
    extra = object_ref(namespace, name)
    try:
        owner = memo.api.get(c.API_VERSION, c.KIND, namespace, name)
    except ApiError as exc:
        log.warning("%s %s was %s; its owner could not be read: %s", kind, child, cause, exc, extra=extra)
        return False
    if owner is None or (owner.get("metadata") or {}).get("deletionTimestamp"):
        return False  # garbage collection or our own delete of a child the spec dropped
    allowed, remaining = memo.repairs.allow(namespace, name, memo.monotonic())
    if not allowed:
        if memo.repairs.later(namespace, name, remaining,
                              lambda: _repair_owner(memo, namespace, name, kind, child, cause)):
            memo.metrics.count_repair(kind, cause, "deferred")
            log.warning("%s %s was %s again; repair in %.1f s (back-off: is another controller writing it?)",
                        kind, child, cause, remaining, extra=extra)
        return False
    memo.metrics.count_repair(kind, cause, "repaired")
    log.info("%s %s was %s by someone else: reconciling to restore it", kind, child, cause, extra=extra)
    try:
        reconcile_and_write_status(memo, owner)
    except (kopf.PermanentError, kopf.TemporaryError) as exc:
        log.warning("restoring %s %s failed: %s; the resync retries", kind, child, exc, extra=extra)
        return True
    try:
        memo.post_event(owner, "Warning", "ChildRestored",
                        f"{kind} {child} was {cause} by someone else; restored from the spec "
                        "(edit the InferenceDeployment instead)")
    except Exception as exc:  # an Event is a courtesy: the child is restored either way
        log.warning("ChildRestored Event for %s %s not posted: %s", kind, child, exc, extra=extra)
    return True


def on_service_event(body: kopf.Body, type: str | None, memo: OperatorContext, **_: Any) -> None:
    """An engine or router Service changed or went: restore it (:func:`repair_child`)."""
    repair_child(memo, body, type)


def on_deployment_event(body: kopf.Body, type: str | None, memo: OperatorContext,
                        **_: Any) -> None:
    """An engine or router Deployment changed: restore it when someone else deleted or
    edited it (:func:`repair_child`); else refresh its owner's counts and conditions
    (engine) or its RouterReady condition (router) at once (the resync timer would catch
    up anyway; this keeps ``kubectl get`` current)."""
    if repair_child(memo, body, type) or type == "DELETED":
        return
    labels = body.get("metadata", {}).get("labels") or {}
    if labels.get(c.LABEL_COMPONENT) == c.HEADROOM_COMPONENT:
        return  # placeholders: nothing of theirs goes into the owner's status
    name, namespace = labels.get(c.LABEL_OWNER), body.get("metadata", {}).get("namespace")
    if not name or not namespace:
        return
    try:
        owner = memo.api.get(c.API_VERSION, c.KIND, namespace, name)
        if owner is None:
            return
        if labels.get(c.LABEL_COMPONENT) == c.ROUTER_COMPONENT:
            _refresh_router_condition(memo, owner, body)
            return
        current = owner.get("status") or {}
        autoscaling = (owner.get("spec") or {}).get("autoscaling") or {}
        status = workload_status(name, body, None, current.get("conditions"), memo.clock(),
                                 autoscaling.get("minReplicas") == 0)
        changed = {k: v for k, v in status.items() if current.get(k) != v}
        if changed and not _only_times_differ(changed, current):
            write_status(memo.api, namespace, name, status, c.WORKLOAD_CONDITIONS)
        memo.metrics.observe(namespace, name, status, (owner.get("spec") or {}).get("autoscaling"))
    except ApiError as exc:
        # Not worth a retry loop: the resync timer and the next event repair it.
        logging.getLogger(__name__).warning("status refresh for %s/%s failed: %s",
                                            namespace, name, exc, extra=object_ref(namespace, name))


def _refresh_router_condition(memo: OperatorContext, owner: Mapping[str, Any],
                              deployment: Mapping[str, Any]) -> None:
    """Write RouterReady from a router Deployment event, owning only that type; nothing
    when the owner's spec no longer runs a router (the reconcile is deleting it) or when
    the condition is unchanged. Raises ApiError from the status write."""
    meta = owner.get("metadata") or {}
    try:
        router = parse_spec(owner.get("spec") or {}).router
    except SpecError:
        return  # the reconcile reports InvalidSpec; nothing to say about the router
    if not router.runs_router or (deployment.get("metadata") or {}).get("deletionTimestamp"):
        return
    current = owner.get("status") or {}
    ready = current.get("readyReplicas")
    condition = router_condition(deployment, ready if isinstance(ready, int) else None)
    conditions = set_conditions(current.get("conditions"), [condition], memo.clock(), None)
    before = [x for x in current.get("conditions") or () if x.get("type") == c.ROUTER_CONDITION]
    after = [x for x in conditions if x.get("type") == c.ROUTER_CONDITION]
    if before != after:
        write_status(memo.api, meta.get("namespace", ""), meta.get("name", ""),
                     {"conditions": conditions}, (c.ROUTER_CONDITION,))


def _only_times_differ(changed: Mapping[str, Any], current: Mapping[str, Any]) -> bool:
    """True when the only change is in conditions and only in their timestamps."""
    if set(changed) != {"conditions"}:
        return False

    def strip(conds: Any) -> list[dict[str, Any]]:
        return [{k: v for k, v in cond.items() if k != "lastTransitionTime"}
                for cond in conds or ()]

    return strip(changed["conditions"]) == strip(current.get("conditions"))
