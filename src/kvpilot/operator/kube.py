"""The real :class:`~kvpilot.operator.api.KubeApi`, over the official ``kubernetes``
client's ApiClient (which owns authentication: in-cluster token, kubeconfig, exec plugins).

Requests are generic (any kind, by apiVersion and kind) and bodies stay plain dicts:

* ``apply``:        PATCH ``application/apply-patch+yaml`` (JSON is YAML), fieldManager
                    ``kvpilot-operator`` (another to hand a field over), force=true (we own
                    what we apply)
* ``delete``:       DELETE with propagationPolicy Background and an optional uid precondition
* ``patch_status``: PATCH ``application/merge-patch+json`` on ``.../status`` (optionally with
                    a ``metadata.resourceVersion`` precondition)
* ``has_api``:      GET ``/apis/GROUP/VERSION`` (discovery), cached for DISCOVERY_TTL_SECONDS
* ``list_pods``:    GET ``/api/v1/namespaces/NS/pods?labelSelector=k=v,...``

HTTP errors become :mod:`kvpilot.operator.api` errors: 409 ConflictError; 400/404/415/422
on writes InvalidObjectError; 401/403, 429, 5xx and connection failures TransientApiError
(a missing RBAC rule heals by itself once the chart is fixed).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

import urllib3
from kubernetes import client as k8s

from kvpilot.operator import constants as c
from kvpilot.operator.api import (
    ApiError,
    ConflictError,
    InvalidObjectError,
    TransientApiError,
)

PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "PodMonitor": "podmonitors",
    "ServiceAccount": "serviceaccounts",
    "RoleBinding": "rolebindings",
    c.INFERENCE_POOL_KIND: "inferencepools",
    "ScaledObject": "scaledobjects",
    "ConfigMap": "configmaps",
    c.KIND: c.PLURAL,
}
REQUEST_TIMEOUT_SECONDS = 30
DISCOVERY_TTL_SECONDS = 300.0


def resource_path(api_version: str, kind: str, namespace: str, name: str) -> str:
    """REST path of a namespaced object: ``/api/v1/...`` for the core group."""
    if kind not in PLURALS:
        raise ValueError(f"kind {kind!r} is not one the operator writes; known: {sorted(PLURALS)}")
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{PLURALS[kind]}/{name}"


def selector_string(labels: Mapping[str, str]) -> str:
    """An equality label selector, ``k1=v1,k2=v2`` (sorted, so requests are stable)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _json_object(data: bytes) -> dict[str, Any]:
    """The JSON object of a response body (the API server answers objects; a body that is
    not JSON raises ValueError, as json.loads does)."""
    return cast("dict[str, Any]", json.loads(data))


def _message(status: int, body: bytes, what: str) -> str:
    try:
        detail = json.loads(body).get("message") or body.decode(errors="replace")
    except (ValueError, AttributeError):
        detail = body.decode(errors="replace") if body else ""
    return f"{what}: HTTP {status}: {detail}".strip()


def raise_for_status(status: int, body: bytes, what: str, write: bool) -> None:
    """Translate an HTTP status into the api module's errors (2xx returns)."""
    if 200 <= status < 300:
        return
    message = _message(status, body, what)
    if status == 409:
        raise ConflictError(message, status)
    if status in (401, 403):
        raise TransientApiError(f"{message} (check the operator's RBAC rules)", status)
    if status == 429 or status >= 500:
        raise TransientApiError(message, status)
    if write or status != 404:
        raise InvalidObjectError(message, status)
    raise ApiError(message, status)


class KubernetesApi:
    """KubeApi over a ``kubernetes.client.ApiClient``. Thread-safe as the client is."""

    def __init__(self, api_client: k8s.ApiClient,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client = api_client
        self._clock = clock
        self._discovery: dict[str, tuple[float, bool]] = {}

    def _request(self, method: str, path: str, what: str, *, body: Any = None,
                 query: list[tuple[str, str]] | None = None,
                 content_type: str | None = None) -> tuple[int, bytes]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            serialized = self._client.param_serialize(
                method=method, resource_path=path, query_params=query or [],
                header_params=headers, body=body, auth_settings=["BearerToken"],
            )
            response = self._client.call_api(
                *serialized, _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
            data = response.read() or b""
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise TransientApiError(f"{what}: {type(exc).__name__}: {exc}") from exc
        except k8s.exceptions.ApiException as exc:
            raise_for_status(exc.status or 0, (exc.body or "").encode(), what, method != "GET")
            raise
        return response.status, data

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        what = f"get {kind} {namespace}/{name}"
        status, data = self._request("GET", resource_path(api_version, kind, namespace, name), what)
        if status == 404:
            return None
        raise_for_status(status, data, what, write=False)
        return _json_object(data)

    def apply(self, obj: Mapping[str, Any], force: bool = True,
              field_manager: str = c.FIELD_MANAGER) -> dict[str, Any]:
        meta = obj["metadata"]
        what = f"apply {obj['kind']} {meta['namespace']}/{meta['name']}"
        path = resource_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        query = [("fieldManager", field_manager)] + ([("force", "true")] if force else [])
        status, data = self._request("PATCH", path, what, body=dict(obj), query=query,
                                     content_type="application/apply-patch+yaml")
        raise_for_status(status, data, what, write=True)
        return _json_object(data)

    def delete(self, api_version: str, kind: str, namespace: str, name: str,
               uid: str | None = None) -> bool:
        what = f"delete {kind} {namespace}/{name}"
        body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1",
                                "propagationPolicy": "Background"}
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        status, data = self._request("DELETE", resource_path(api_version, kind, namespace, name),
                                     what, body=body, content_type="application/json")
        if status == 404:
            return False
        raise_for_status(status, data, what, write=True)
        return True

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any],
                     resource_version: str | None = None) -> None:
        what = f"patch status of {c.KIND} {namespace}/{name}"
        path = resource_path(c.API_VERSION, c.KIND, namespace, name) + "/status"
        body: dict[str, Any] = {"status": dict(status)}
        if resource_version is not None:
            # The API server checks a resourceVersion in a merge patch (409 on mismatch).
            body["metadata"] = {"resourceVersion": resource_version}
        code, data = self._request("PATCH", path, what, body=body,
                                   query=[("fieldManager", c.FIELD_MANAGER)],
                                   content_type="application/merge-patch+json")
        raise_for_status(code, data, what, write=True)

    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        what = f"list pods in {namespace} ({selector_string(labels)})"
        status, data = self._request("GET", f"/api/v1/namespaces/{namespace}/pods", what,
                                     query=[("labelSelector", selector_string(labels))])
        raise_for_status(status, data, what, write=False)
        return list(json.loads(data).get("items") or ())

    def has_api(self, group_version: str, kind: str) -> bool:
        key = f"{group_version}/{kind}"
        cached = self._discovery.get(key)
        if cached is not None and self._clock() - cached[0] < DISCOVERY_TTL_SECONDS:
            return cached[1]
        path = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
        status, data = self._request("GET", path, f"discover {group_version}")
        if status == 404:
            found = False
        else:
            raise_for_status(status, data, f"discover {group_version}", write=False)
            found = any(r.get("kind") == kind for r in json.loads(data).get("resources", ()))
        self._discovery[key] = (self._clock(), found)
        return found
