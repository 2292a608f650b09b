"""An in-memory Kubernetes API for reconcile and handler tests.

It keeps what a real API server keeps for our purposes: objects by (kind, namespace,
name), a resourceVersion bumped on every write and honoured as a precondition (409),
``metadata.generation`` bumped when ``spec`` changes, and the status subresource
separate from the spec. Every call is recorded, so tests assert what was written.

Server-side apply is modelled for one field, a Deployment's ``spec.replicas``: the field
managers that own it are kept; an apply that leaves it out drops its manager's ownership,
and when no manager owns it any more it goes back to the API's default (1). An apply with
another field manager may set only that field (the hand-over of docs/autoscaling.md, "KEDA
mode"), and :meth:`FakeKubeApi.scale` writes it as another controller's update would
(taking the field from every other manager).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

from kvpilot.operator import constants as c
from kvpilot.operator.api import ConflictError

from .crdschema import merge_patch

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=timezone.utc)


class Clock:
    """A settable, timezone-aware clock."""

    def __init__(self, start: datetime = T0) -> None:
        self.now = start

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


# Kinds whose objects the API server gives no metadata.generation (it moves only for
# kinds with a spec/status split that count spec changes).
NO_GENERATION = frozenset({"Service", "ServiceAccount", "ConfigMap"})


class FakeKubeApi:
    def __init__(self, apis: tuple[str, ...] = ()) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.calls: list[tuple[Any, ...]] = []
        self.apis = set(apis)
        self.errors: dict[str, list[Exception]] = {}  # "apply:Deployment" -> errors to raise
        self.before_apply: Callable[[Mapping[str, Any]], None] | None = None
        self._rv = itertools.count(100)
        # (kind, ns, name) of a Deployment -> the field managers owning spec.replicas.
        self.replica_managers: dict[tuple[str, str, str], set[str]] = {}

    # --------------------------------------------------------------- helpers for tests
    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Store an object as if someone else had created it."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(next(self._rv))
        if obj["kind"] not in NO_GENERATION:
            meta.setdefault("generation", 1)
        self.objects[(obj["kind"], meta["namespace"], meta["name"])] = obj
        return obj

    def stored(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get((kind, namespace, name)))

    def set_deployment_status(self, namespace: str, name: str, **status: Any) -> None:
        obj = self.objects[("Deployment", namespace, name)]
        obj["status"] = {"observedGeneration": obj["metadata"]["generation"], **status}
        obj["metadata"]["resourceVersion"] = str(next(self._rv))

    def scale(self, namespace: str, name: str, replicas: int,
              manager: str = "keda-operator") -> None:
        """Resize a Deployment as another controller does (an update through the scale
        subresource): the new count, owned by ``manager`` alone, generation bumped."""
        obj = self.objects[("Deployment", namespace, name)]
        obj["spec"]["replicas"] = replicas
        obj["metadata"]["generation"] += 1
        obj["metadata"]["resourceVersion"] = str(next(self._rv))
        self.replica_managers[("Deployment", namespace, name)] = {manager}

    def fail_next(self, call: str, *errors: Exception) -> None:
        self.errors.setdefault(call, []).extend(errors)

    def writes(self) -> list[tuple[Any, ...]]:
        return [call for call in self.calls if call[0] in ("apply", "patch_status", "delete")]

    def _maybe_fail(self, call: str) -> None:
        if self.errors.get(call):
            raise self.errors[call].pop(0)

    # --------------------------------------------------------------- KubeApi
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append(("get", kind, namespace, name))
        self._maybe_fail(f"get:{kind}")
        return self.stored(kind, namespace, name)

    def apply(self, obj: Mapping[str, Any], force: bool = True,
              field_manager: str = c.FIELD_MANAGER) -> dict[str, Any]:
        obj = copy.deepcopy(dict(obj))
        meta = obj["metadata"]
        key = (obj["kind"], meta["namespace"], meta["name"])
        self.calls.append(("apply", obj["kind"], meta["namespace"], meta["name"],
                           copy.deepcopy(obj), field_manager))
        if self.before_apply is not None:
            self.before_apply(obj)
        self._maybe_fail(f"apply:{obj['kind']}")
        current = self.objects.get(key)
        precondition = meta.pop("resourceVersion", None)
        if precondition is not None and (
            current is None or current["metadata"]["resourceVersion"] != precondition
        ):
            raise ConflictError(f"the object {key} has been modified", 409)
        if field_manager != c.FIELD_MANAGER:
            return self._hand_over(key, obj, current, field_manager)
        if obj["kind"] == "Deployment":
            self._own_replicas(key, obj, current)
        generation = 1
        if current is not None:
            generation = current["metadata"].get("generation", 0)
            if current.get("spec") != obj.get("spec"):
                generation += 1
        if obj["kind"] not in NO_GENERATION:
            meta["generation"] = generation
        meta["resourceVersion"] = str(next(self._rv))
        meta.setdefault("uid", f"uid-{key[0].lower()}-{key[2]}")
        if current is not None and "status" in current:
            obj["status"] = current["status"]
        self.objects[key] = obj
        return copy.deepcopy(obj)

    def _own_replicas(self, key: tuple[str, str, str], obj: dict[str, Any],
                      current: dict[str, Any] | None) -> None:
        owners = self.replica_managers.setdefault(key, set())
        spec = obj.setdefault("spec", {})
        if "replicas" in spec:
            owners.add(c.FIELD_MANAGER)
            return
        owners.discard(c.FIELD_MANAGER)
        kept = (current or {}).get("spec", {}).get("replicas")
        spec["replicas"] = kept if owners and kept is not None else 1  # the API's default

    def _hand_over(self, key: tuple[str, str, str], obj: dict[str, Any],
                   current: dict[str, Any] | None, manager: str) -> dict[str, Any]:
        """An apply by another field manager: only a Deployment's spec.replicas."""
        if key[0] != "Deployment" or current is None or set(obj.get("spec") or {}) != {"replicas"}:
            raise AssertionError(f"the fake applies only spec.replicas of a Deployment as {manager}")
        replicas = obj["spec"]["replicas"]
        if current["spec"].get("replicas") != replicas:
            current["spec"]["replicas"] = replicas
            current["metadata"]["generation"] += 1
        self.replica_managers.setdefault(key, set()).add(manager)
        current["metadata"]["resourceVersion"] = str(next(self._rv))
        return copy.deepcopy(current)

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any],
                     resource_version: str | None = None) -> None:
        self.calls.append(("patch_status", c.KIND, namespace, name, copy.deepcopy(dict(status))))
        self._maybe_fail(f"patch_status:{c.KIND}")
        obj = self.objects[(c.KIND, namespace, name)]
        if resource_version is not None and obj["metadata"]["resourceVersion"] != resource_version:
            raise ConflictError(f"{c.KIND} {namespace}/{name} has been modified", 409)
        obj["status"] = merge_patch(obj.get("status") or {}, dict(status))
        obj["metadata"]["resourceVersion"] = str(next(self._rv))

    def delete(self, api_version: str, kind: str, namespace: str, name: str,
               uid: str | None = None) -> bool:
        self.calls.append(("delete", kind, namespace, name))
        self._maybe_fail(f"delete:{kind}")
        current = self.objects.get((kind, namespace, name))
        if current is None:
            return False
        if uid is not None and current["metadata"].get("uid") != uid:
            raise ConflictError(f"{kind} {namespace}/{name}: uid precondition failed", 409)
        del self.objects[(kind, namespace, name)]
        return True

    def has_api(self, group_version: str, kind: str) -> bool:
        self.calls.append(("has_api", group_version, kind))
        return f"{group_version}/{kind}" in self.apis

    def list_pods(self, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        self.calls.append(("list_pods", namespace, dict(labels)))
        self._maybe_fail("list_pods")
        return [copy.deepcopy(obj) for (kind, ns, _), obj in sorted(self.objects.items())
                if kind == "Pod" and ns == namespace
                and all((obj["metadata"].get("labels") or {}).get(k) == v
                        for k, v in labels.items())]

    # --------------------------------------------------------------- pods for the autoscaler
    def add_pod(self, owner: str, name: str, ready: bool = True, namespace: str = "llm",
                ip: str = "10.0.0.1", deleting: bool = False) -> None:
        """An engine pod of InferenceDeployment ``owner``, ready or still starting."""
        from kvpilot.operator.builders.labels import object_labels

        meta: dict[str, Any] = {"name": name, "namespace": namespace,
                                "labels": object_labels(owner)}
        if deleting:
            meta["deletionTimestamp"] = "2026-11-29T12:00:00Z"
        status: dict[str, Any] = {"phase": "Running" if ready else "Pending",
                                  "conditions": [{"type": "Ready",
                                                  "status": "True" if ready else "False"}]}
        if ready:
            status["podIP"] = ip
        self.put({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status})

    def remove_pod(self, name: str, namespace: str = "llm") -> None:
        self.objects.pop(("Pod", namespace, name), None)


def inference(name: str = "chat", namespace: str = "llm", spec: dict[str, Any] | None = None,
              status: dict[str, Any] | None = None, generation: int = 1) -> dict[str, Any]:
    """An InferenceDeployment body as Kopf hands it to handlers."""
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                     "generation": generation, "resourceVersion": "1"},
        "spec": spec if spec is not None else {"model": {"uri": "embedded://smollm2-135m-instruct"}},
        "status": status or {},
    }
