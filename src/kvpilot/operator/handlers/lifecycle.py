"""The InferenceDeployment's own lifecycle: create, update and resume reconcile it
(:func:`on_spec`), the resync timer re-applies its children (:func:`on_resync`), delete
forgets its series (:func:`on_delete`). Thin over
:func:`kvpilot.operator.reconcile.reconcile`.

Errors carry retry intent: an invalid spec or an object the API refuses becomes a
:class:`ReconcileRefused` (a ``kopf.PermanentError``) carrying a ``Ready=False`` status
saying why (no crash loop, no retry until the spec changes); 409 conflicts and API
outages become a ``kopf.TemporaryError`` with a delay.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import kopf

from kvpilot.operator import constants as c
from kvpilot.operator.api import ApiError, ConflictError, InvalidObjectError
from kvpilot.operator.handlers.context import OperatorContext
from kvpilot.operator.reconcile import ReconcileResult, Resource, reconcile
from kvpilot.operator.spec import SpecError
from kvpilot.operator.status.workload import failure_status
from kvpilot.operator.status.writer import write_status

CONFLICT_RETRY_SECONDS = 2.0
TRANSIENT_RETRY_SECONDS = 20.0


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


def on_delete(body: kopf.Body, memo: OperatorContext, **_: Any) -> None:
    """Forget the resource's series. Optional: it never blocks deletion, and the children
    go with the owner through garbage collection."""
    meta = body.get("metadata", {})
    memo.metrics.forget(meta.get("namespace", ""), meta.get("name", ""))
