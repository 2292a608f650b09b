"""A small in-process Kubernetes API server on 127.0.0.1, just enough for Kopf and the
operator's client to run for real: discovery, list, watch (streamed JSON lines), get,
JSON merge patch, JSON patch, server-side apply (simplified: the applied object replaces what the
field manager sent before), the status subresource, Events, and deletion with finalizers.

It is a test double, not a conformance implementation: no admission, no managed fields,
no field selectors, one storage version per kind. The real API server is exercised by the
e2e suite (`make e2e`, docs/e2e.md).
"""

from __future__ import annotations

import copy
import itertools
import json
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .crdschema import merge_patch


def send_json(handler: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
    """Answer ``payload`` as JSON with ``status`` (the test servers' one response shape)."""
    data = json.dumps(payload).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


# (group, version) -> [(plural, kind, namespaced, subresources)]
RESOURCES = {
    ("", "v1"): [("services", "Service", True, ()), ("events", "Event", True, ()),
                 ("pods", "Pod", True, ()), ("namespaces", "Namespace", False, ()),
                 ("serviceaccounts", "ServiceAccount", True, ())],
    ("rbac.authorization.k8s.io", "v1"): [("rolebindings", "RoleBinding", True, ())],
    ("apiextensions.k8s.io", "v1"): [("customresourcedefinitions", "CustomResourceDefinition",
                                      False, ())],
    ("apps", "v1"): [("deployments", "Deployment", True, ("status", "scale"))],
    ("policy", "v1"): [("poddisruptionbudgets", "PodDisruptionBudget", True, ("status",))],
    ("kvpilot.dev", "v1alpha1"): [("inferencedeployments", "InferenceDeployment", True,
                                   ("status", "scale"))],
}
VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
WATCH_SLICE_SECONDS = 2.0


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Conflict(Exception):
    """A merge patch's resourceVersion precondition failed."""


class Store:
    """Objects by (group, plural, namespace, name), a global resourceVersion, an event log."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.log: list[tuple[int, tuple[str, str], str, dict[str, Any]]] = []
        self.requests: list[tuple[str, str, str | None]] = []
        self._rv = itertools.count(1000)

    def _commit(self, key, obj, kind_of_change) -> dict[str, Any]:
        rv = next(self._rv)
        obj["metadata"]["resourceVersion"] = str(rv)
        if kind_of_change == "DELETED":
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        self.log.append((rv, key[:2], kind_of_change, copy.deepcopy(obj)))
        self.lock.notify_all()
        return copy.deepcopy(obj)

    def create(self, group: str, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            obj = copy.deepcopy(obj)
            meta = obj["metadata"]
            meta.setdefault("uid", f"uid-{plural}-{meta['name']}")
            meta.setdefault("generation", 1)
            meta.setdefault("creationTimestamp", _now())
            key = (group, plural, meta.get("namespace", ""), meta["name"])
            return self._commit(key, obj, "ADDED")

    def get(self, group, plural, namespace, name) -> dict[str, Any] | None:
        with self.lock:
            obj = self.objects.get((group, plural, namespace, name))
            return copy.deepcopy(obj)

    def update(self, group, plural, namespace, name, change) -> dict[str, Any] | None:
        """Apply ``change(obj) -> obj`` atomically; bumps generation on spec changes and
        completes a deletion once no finalizer is left."""
        with self.lock:
            key = (group, plural, namespace, name)
            current = self.objects.get(key)
            if current is None:
                return None
            new = change(copy.deepcopy(current))
            if new.get("spec") != current.get("spec"):
                new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
            if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
                return self._commit(key, new, "DELETED")
            return self._commit(key, new, "MODIFIED")

    def delete(self, group, plural, namespace, name) -> None:
        def mark(obj):
            obj["metadata"]["deletionTimestamp"] = _now()
            return obj
        self.update(group, plural, namespace, name, mark)

    def list(self, group, plural, namespace=None, selector=None):
        with self.lock:
            items = [copy.deepcopy(o) for (g, p, ns, _), o in self.objects.items()
                     if (g, p) == (group, plural) and namespace in (None, ns)
                     and _selected(o, selector)]
            return items, str(self.log[-1][0] if self.log else 1)

    def events_after(self, group, plural, rv, namespace, selector, deadline):
        """Watch events with resourceVersion > rv, waiting until ``deadline`` for one."""
        with self.lock:
            while True:
                found = [(r, t, o) for r, k, t, o in self.log
                         if k == (group, plural) and r > rv
                         and namespace in (None, o["metadata"].get("namespace"))
                         and _selected(o, selector)]
                if found or time.monotonic() >= deadline:
                    return found
                self.lock.wait(timeout=max(0.0, deadline - time.monotonic()))


def _selected(obj, selector: str | None) -> bool:
    if not selector:
        return True
    labels = obj["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in (p.split("=", 1) for p in selector.split(",")))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    server: FakeApiServer

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, payload: Any) -> None:
        send_json(self, status, payload)

    def _not_found(self, what: str) -> None:
        self._send(404, {"kind": "Status", "status": "Failure", "reason": "NotFound",
                         "message": f"{what} not found", "code": 404})

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length)) if length else None

    def _route(self):
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        parts = [p for p in url.path.split("/") if p]
        store = self.server.store
        store.requests.append((self.command, url.path, self.headers.get("Content-Type")))
        fault = self.server.faults.get((self.command, url.path))
        if fault is not None:
            self._body()
            return self._send(fault, {"kind": "Status", "code": fault, "message": "injected"})
        if url.path == "/version":
            return self._send(200, {"major": "1", "minor": "36", "gitVersion": "v1.36.0"})
        if url.path == "/api":
            return self._send(200, {"kind": "APIVersions", "versions": ["v1"]})
        if url.path == "/apis":
            return self._send(200, {"kind": "APIGroupList", "groups": [
                {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
                 "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v}}
                for g, v in RESOURCES if g]})
        if parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        else:
            group, version, rest = parts[1], parts[2] if len(parts) > 2 else "", parts[3:]
        if (group, version) not in RESOURCES:
            return self._not_found(url.path)
        if not rest:
            return self._send(200, {"kind": "APIResourceList",
                                    "groupVersion": f"{group}/{version}".lstrip("/"),
                                    "resources": _discovery(group, version)})
        namespace = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        plural, name, sub = rest[0], rest[1] if len(rest) > 1 else None, rest[2:]
        if name is None and self.command == "GET":
            selector = query.get("labelSelector")
            if query.get("watch") in ("true", "1"):
                return self._watch(group, plural, namespace, selector, query)
            items, rv = store.list(group, plural, namespace, selector)
            return self._send(200, {"kind": "List", "metadata": {"resourceVersion": rv},
                                    "items": items})
        if name is None and self.command == "POST":
            obj = self._body()
            obj.setdefault("metadata", {}).setdefault("namespace", namespace)
            obj["metadata"].setdefault("name", f"{plural}-{len(store.log)}")
            return self._send(201, store.create(group, plural, obj))
        if self.command == "GET":
            obj = store.get(group, plural, namespace or "", name)
            return self._send(200, obj) if obj else self._not_found(f"{plural} {name}")
        if self.command == "PATCH":
            return self._patch(group, plural, namespace or "", name, sub, query)
        return self._send(405, {"message": f"{self.command} not supported"})

    def _patch(self, group, plural, namespace, name, sub, query):
        store, body = self.server.store, self._body()
        content_type = self.headers.get("Content-Type", "")
        if content_type.startswith("application/apply-patch"):
            precondition = body.get("metadata", {}).pop("resourceVersion", None)
            current = store.get(group, plural, namespace, name)
            if precondition and (current is None or
                                 current["metadata"]["resourceVersion"] != precondition):
                return self._send(409, {"kind": "Status", "code": 409, "reason": "Conflict",
                                        "message": "the object has been modified"})
            if current is None:
                return self._send(201, store.create(group, plural, body))

            def apply(obj):
                meta = {**obj["metadata"], **body["metadata"]}
                return {**obj, **{k: v for k, v in body.items() if k != "metadata"},
                        "metadata": meta, "status": obj.get("status", {})}
            return self._send(200, store.update(group, plural, namespace, name, apply))
        if content_type.startswith("application/json-patch"):
            try:
                if sub == ["status"]:
                    body = [op for op in body if op["path"].startswith("/status")]
                else:
                    body = [op for op in body if not op["path"].startswith("/status")]
                updated = store.update(group, plural, namespace, name,
                                       lambda obj: json_patch(obj, body))
            except JsonPatchError as exc:
                return self._send(422, {"kind": "Status", "code": 422, "message": str(exc)})
            return self._send(200, updated) if updated else self._not_found(f"{plural} {name}")
        precondition = (body.get("metadata") or {}).pop("resourceVersion", None)
        if sub == ["status"]:
            change = lambda obj: {**obj, "status": merge_patch(obj.get("status") or {},  # noqa: E731
                                                                body.get("status") or {})}
        else:
            patch = {k: v for k, v in body.items() if k != "status"}
            change = lambda obj: merge_patch(obj, patch)  # noqa: E731

        def guarded(obj):  # runs under the store's lock: check and write are one step
            if precondition and obj["metadata"]["resourceVersion"] != precondition:
                raise _Conflict
            return change(obj)
        try:
            updated = store.update(group, plural, namespace, name, guarded)
        except _Conflict:
            return self._send(409, {"kind": "Status", "code": 409, "reason": "Conflict",
                                    "message": "the object has been modified"})
        return self._send(200, updated) if updated else self._not_found(f"{plural} {name}")

    def _watch(self, group, plural, namespace, selector, query):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        rv = int(query.get("resourceVersion") or 0)
        timeout = min(float(query.get("timeoutSeconds") or WATCH_SLICE_SECONDS),
                      WATCH_SLICE_SECONDS)
        deadline = time.monotonic() + timeout
        while not self.server.stopping.is_set() and time.monotonic() < deadline:
            events = self.server.store.events_after(group, plural, rv, namespace, selector,
                                                    min(deadline, time.monotonic() + 0.2))
            for event_rv, change, obj in events:
                line = json.dumps({"type": change, "object": obj}) + "\n"
                self.wfile.write(line.encode())
                self.wfile.flush()
                rv = event_rv

    do_GET = do_POST = do_PATCH = _route


class JsonPatchError(ValueError):
    pass


def json_patch(obj: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 ``add``/``replace``/``remove``/``test`` (what Kopf sends)."""
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = obj
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent.setdefault(part, {})
        last = parts[-1]
        kind = op["op"]
        if isinstance(parent, list):
            index = len(parent) if last == "-" else int(last)
            if kind == "add":
                parent.insert(index, copy.deepcopy(op["value"]))
            elif kind == "replace":
                parent[index] = copy.deepcopy(op["value"])
            elif kind == "remove":
                del parent[index]
            elif kind == "test" and parent[index] != op["value"]:
                raise JsonPatchError(f"test failed at {op['path']}")
        elif kind in ("add", "replace"):
            parent[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            if last not in parent:
                raise JsonPatchError(f"nothing to remove at {op['path']}")
            del parent[last]
        elif kind == "test" and parent.get(last) != op.get("value"):
            raise JsonPatchError(f"test failed at {op['path']}")
    return obj


def _discovery(group: str, version: str) -> list[dict[str, Any]]:
    out = []
    for plural, kind, namespaced, subs in RESOURCES[(group, version)]:
        out.append({"name": plural, "singularName": kind.lower(), "namespaced": namespaced,
                    "kind": kind, "verbs": VERBS})
        out += [{"name": f"{plural}/{s}", "singularName": "", "namespaced": namespaced,
                 "kind": kind, "verbs": ["get", "patch", "update"]} for s in subs]
    return out


class FakeApiServer(ThreadingHTTPServer):
    """Start with ``with FakeApiServer() as api:``; ``api.url``, ``api.store``."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.store = Store()
        # (method, path) -> HTTP status to answer instead (fault injection)
        self.faults: dict[tuple[str, str], int] = {}
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> FakeApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        with self.store.lock:
            self.store.lock.notify_all()
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=10)
