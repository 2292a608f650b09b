"""Thin Kopf handlers over :func:`kvpilot.operator.reconcile.reconcile`, and the context
they share (``memo``). Which trigger calls which handler: the table in
:mod:`kvpilot.operator.registration`.

Errors carry retry intent: an invalid spec or an object the API refuses becomes a
:class:`ReconcileRefused` (a ``kopf.PermanentError``) carrying a ``Ready=False`` status
saying why (no crash loop, no retry until the spec changes); 409 conflicts and API
outages become a ``kopf.TemporaryError`` with a delay. Handlers return None and write
``status`` themselves (:mod:`kvpilot.operator.status.writer`: each writer owns its
condition types, under a resourceVersion precondition), so Kopf stores nothing there (its
progress lives in ``kvpilot.dev/`` annotations), and nothing here writes ``spec``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, cast

import kopf

from kvpilot.operator import constants as c
from kvpilot.operator.api import (
    ApiError,
    ConflictError,
    InvalidObjectError,
    KubeApi,
)
from kvpilot.operator.autoscaling.metrics_source import MetricsSource, SourceConfig, build_source
from kvpilot.operator.logs import object_ref
from kvpilot.operator.metrics import OperatorMetrics
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.reconcile import ReconcileResult, Resource, reconcile
from kvpilot.operator.repair import ChildFingerprints, RecordingApi, RepairBackoff
from kvpilot.operator.restarts import RestartTracker
from kvpilot.operator.spec import SpecError, parse_spec
from kvpilot.operator.status.conditions import set_conditions
from kvpilot.operator.status.router import router_condition
from kvpilot.operator.status.workload import failure_status, workload_status
from kvpilot.operator.status.writer import write_status

EventPoster = Callable[[Mapping[str, Any], str, str, str], None]
CONFLICT_RETRY_SECONDS = 2.0
TRANSIENT_RETRY_SECONDS = 20.0


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


def post_kopf_event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    """Post a Kubernetes Event through Kopf's queue (safe from sync handlers' threads)."""
    # kopf.event reads the object reference from any mapping; its annotation names Body.
    kopf.event(cast(kopf.Body, body), type=type_, reason=reason, message=message)


@dataclass(frozen=True)
class OperatorContext:
    """Everything handlers need, passed to Kopf as ``memo`` (copied per object).

    Attributes:
        api: the Kubernetes API (a fake in tests).
        options: operator-wide settings.
        metrics: the operator's Prometheus series.
        clock: returns the current time (timezone-aware).
        post_event: posts an Event on an object.
        source_factory: builds the autoscaler's metric source for a resource (a fake in
            tests).
        restarts: engine restart counts last seen per pod (shared by every copy of the
            memo: Kopf copies it shallowly per object).
        fingerprints, repairs: what each child last looked like and the per-owner repair
            back-off (:mod:`kvpilot.operator.repair`; shared likewise).
        monotonic: seconds for the back-off (a fake in tests).

    ``api`` is wrapped in a :class:`~kvpilot.operator.repair.RecordingApi`.
    """

    api: KubeApi
    options: OperatorOptions
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    clock: Callable[[], datetime] = _utc_now
    post_event: EventPoster = post_kopf_event
    source_factory: Callable[[SourceConfig], MetricsSource] = build_source
    restarts: RestartTracker = field(default_factory=RestartTracker)
    fingerprints: ChildFingerprints = field(default_factory=ChildFingerprints)
    repairs: RepairBackoff = field(default_factory=RepairBackoff)
    monotonic: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        # Every apply records what it stored, so our own writes' watch events are known
        # as ours (kvpilot.operator.repair).
        if not isinstance(self.api, RecordingApi):
            object.__setattr__(self, "api", RecordingApi(self.api, self.fingerprints))


class ReconcileRefused(kopf.PermanentError):
    """The spec is invalid or the API refused an object: no retry until the spec changes.

    Attributes:
        status: the status merge patch that says why (Ready and Progressing False with the
            reason, ``observedGeneration``); the caller writes it.
        reason: ``InvalidSpec`` or ``ApplyFailed``.
    """

    def __init__(self, message: str, reason: str, status: dict[str, Any]) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


def run_reconcile(ctx: OperatorContext, body: Mapping[str, Any], requested: int | None = None,
                  requested_reason: str = "") -> ReconcileResult:
    """Reconcile one InferenceDeployment; count it in the metrics and post its Events.

    Returns the result, whose ``status`` the caller writes. Writes no status itself.

    Raises:
        ReconcileRefused: invalid spec or refused object (a Warning Event is posted; the
            exception carries the failure status to write).
        kopf.TemporaryError: conflicts, API outages (no status to write).
    """
    resource = Resource.from_body(body)
    now = ctx.clock()
    started = time.monotonic()

    def refuse(result: str, reason: str, exc: Exception) -> ReconcileRefused:
        ctx.metrics.count_reconcile(result, time.monotonic() - started)
        message = str(exc)
        status = failure_status(reason, message, resource.status.get("conditions"),
                                resource.generation, now)
        ctx.post_event(body, "Warning", reason, message)
        return ReconcileRefused(message, reason, status)

    try:
        result = reconcile(ctx.api, resource, ctx.options, now, requested, requested_reason)
    except SpecError as exc:
        raise refuse("invalid_spec", "InvalidSpec", exc) from exc
    except InvalidObjectError as exc:
        raise refuse("apply_failed", "ApplyFailed", exc) from exc
    except ConflictError as exc:
        ctx.metrics.count_reconcile("conflict", time.monotonic() - started)
        raise kopf.TemporaryError(f"{exc}; retrying", delay=CONFLICT_RETRY_SECONDS) from exc
    except ApiError as exc:
        ctx.metrics.count_reconcile("transient", time.monotonic() - started)
        raise kopf.TemporaryError(str(exc), delay=TRANSIENT_RETRY_SECONDS) from exc

    ctx.metrics.count_reconcile("success", time.monotonic() - started)
    ctx.metrics.observe(resource.namespace, resource.name, result.status,
                        resource.spec.get("autoscaling"))
    if result.target.is_scale:
        ctx.metrics.count_scale(resource.namespace, resource.name,
                                result.target.current or 0, result.target.replicas)
    for event in result.events:
        ctx.post_event(body, event.type, event.reason, event.message)
    return result


def reconcile_and_write_status(ctx: OperatorContext, body: Mapping[str, Any]) -> None:
    """:func:`run_reconcile`, then its status (or the refusal's) written with
    :func:`~kvpilot.operator.status.writer.write_status`, owning only Ready, Progressing and
    RouterReady (a refusal only the first two: it knows nothing new about the router).

    Not through Kopf's patch: that is a merge patch of a list built from ``body``, which
    may predate the autoscaler's last write and would erase its conditions.

    Raises what run_reconcile raises (after writing a refusal's status); a failed status
    write is a kopf.TemporaryError.
    """
    try:
        result = run_reconcile(ctx, body)
    except ReconcileRefused as exc:
        _write_reconcile_status(ctx, body, exc.status, c.WORKLOAD_CONDITIONS)
        raise
    _write_reconcile_status(ctx, body, result.status, c.RECONCILE_CONDITIONS,
                            result.drop_conditions)


def _write_reconcile_status(ctx: OperatorContext, body: Mapping[str, Any],
                            status: Mapping[str, Any], owned: tuple[str, ...],
                            drop: tuple[str, ...] = ()) -> None:
    meta = body.get("metadata") or {}
    try:
        write_status(ctx.api, meta.get("namespace", ""), meta.get("name", ""), status,
                     owned, drop)
    except ApiError as exc:
        raise kopf.TemporaryError(f"status write failed: {exc}",
                                  delay=TRANSIENT_RETRY_SECONDS) from exc


def on_spec(body: kopf.Body, memo: OperatorContext, **_: Any) -> None:
    """create / update / resume of an InferenceDeployment."""
    reconcile_and_write_status(memo, body)


def on_resync(body: kopf.Body, memo: OperatorContext, **_: Any) -> None:
    """The slow periodic pass: re-applies the children (repairs manual edits and drift)."""
    reconcile_and_write_status(memo, body)


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


def on_engine_pod_event(body: kopf.Body, type: str | None, memo: OperatorContext,
                        **_: Any) -> None:
    """An engine pod changed: report each container restart seen since the last event as
    a Warning Event ``EngineRestarted`` on its InferenceDeployment, counted by reason in
    ``kvpilot_operator_engine_restarts_total`` (:mod:`kvpilot.operator.restarts`). A
    failed read of the owner is logged, not retried: the restart is still counted."""
    if type == "DELETED":
        memo.restarts.forget(body)
        return
    restarts = memo.restarts.observe(body)
    if not restarts:
        return
    meta = body.get("metadata", {})
    name, namespace = (meta.get("labels") or {}).get(c.LABEL_OWNER), meta.get("namespace")
    if not name or not namespace:
        return
    for restart in restarts:
        memo.metrics.count_restarts(namespace, name, restart.reason, restart.added)
    try:
        owner = memo.api.get(c.API_VERSION, c.KIND, namespace, name)
    except ApiError as exc:
        logging.getLogger(__name__).warning("engine restart on %s/%s not posted: %s",
                                            namespace, name, exc, extra=object_ref(namespace, name))
        return
    if owner is not None:
        for restart in restarts:
            memo.post_event(owner, "Warning", "EngineRestarted", restart.message())


def on_delete(body: kopf.Body, memo: OperatorContext, **_: Any) -> None:
    """Forget the resource's series. Optional: it never blocks deletion, and the children
    go with the owner through garbage collection."""
    meta = body.get("metadata", {})
    memo.metrics.forget(meta.get("namespace", ""), meta.get("name", ""))
