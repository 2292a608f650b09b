"""The slice of the Kubernetes API the reconcile loop uses, as a Protocol, and the
errors it raises. The real implementation is :class:`kvpilot.operator.kube.KubernetesApi`;
tests pass an in-memory fake. Objects are plain dicts in the API's JSON form (camelCase).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from kvpilot.operator.constants import FIELD_MANAGER


class ApiError(Exception):
    """Base of the errors below; ``status`` is the HTTP status (0 = no response)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class ConflictError(ApiError):
    """409: the object changed since it was read (a resourceVersion precondition failed).
    Retried by re-reading; never a reason to give up on the resource."""


class InvalidObjectError(ApiError):
    """400/422 (or 403/404 on a write): the API refused the object itself. Retrying the
    same object cannot help; the spec must change (or RBAC/CRDs be fixed)."""


class TransientApiError(ApiError):
    """Timeouts, connection errors, 429 and 5xx: retry later with back-off."""


class KubeApi(Protocol):
    """What reconcile needs. Every method may raise the errors above."""

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist (404)."""
        ...

    def apply(self, obj: Mapping[str, Any], force: bool = True,
              field_manager: str = FIELD_MANAGER) -> dict[str, Any]:
        """Server-side apply ``obj`` with ``field_manager`` (``kvpilot-operator``; another
        only to hand a field over, see ``reconcile``); returns the object as stored (spec
        and status). A ``metadata.resourceVersion`` in ``obj`` is a precondition:
        ConflictError when the stored object has moved on."""
        ...

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any],
                     resource_version: str | None = None) -> None:
        """JSON-merge-patch an InferenceDeployment's ``status`` subresource. With
        ``resource_version``, a precondition: ConflictError when the object has moved on
        (use :func:`kvpilot.operator.status.writer.write_status`, which retries)."""
        ...

    def delete(self, api_version: str, kind: str, namespace: str, name: str,
               uid: str | None = None) -> bool:
        """Delete the object (its dependents in the background); with ``uid``, only that
        incarnation (ConflictError when the stored object has another uid). False when it
        does not exist (404)."""
        ...

    def has_api(self, group_version: str, kind: str) -> bool:
        """True when the cluster serves ``kind`` in ``group_version`` (discovery)."""
        ...

    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """Pods in ``namespace`` carrying every label in ``labels`` (equality selector),
        as the API returns them (metadata, spec, status)."""
        ...
