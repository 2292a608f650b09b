"""The objects one InferenceDeployment owns: a Deployment, a Service, a
PodDisruptionBudget and, where the Prometheus operator is installed, a PodMonitor; plus
what ``spec.router`` asks for in front of them (:mod:`kvpilot.operator.builders.router`):
the router's ServiceAccount, RoleBinding, Deployment, Service, PDB (two or more replicas)
and PodMonitor, all named NAME-router, or in gateway mode an InferencePool named NAME; and
in KEDA mode (``spec.autoscaling.engine: keda``) a KEDA ScaledObject named NAME
(:mod:`kvpilot.operator.builders.keda`), whose HPA owns the engine Deployment's replica
count: the Deployment is then applied without ``spec.replicas``. While LoRA is on
(``spec.adapters`` or ``spec.engine.lora``), a ConfigMap NAME-adapters holds the adapter
list (``adapters.json``) the engine pods load at start-up; it is applied before the
Deployment, so a new pod never starts without it.

Engine objects share the InferenceDeployment's name (names are unique per kind); all carry
an owner reference with ``controller: true`` so deletion cascades, and are complete apply
configurations: server-side apply with the ``kvpilot-operator`` field manager removes any
field the operator applied before and no longer sends, so nothing is ever sent partially.
Router objects the spec no longer wants are listed in ``Children.unwanted`` for the
reconcile to delete (server-side apply never removes an object).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvpilot.operator import constants as c
from kvpilot.operator.builders import router as r
from kvpilot.operator.builders.keda import (
    SCALED_OBJECT_API_VERSION,
    SCALED_OBJECT_KIND,
    build_scaled_object,
)
from kvpilot.operator.builders.labels import (
    adapters_name,
    headroom_name,
    object_labels,
    router_name,
    selector_labels,
)
from kvpilot.operator.builders.pod import build_pod_template, startup_budget_seconds
from kvpilot.operator.spec import InferenceSpec

POD_MONITOR_API_VERSION = "monitoring.coreos.com/v1"
SCRAPE_INTERVAL = "15s"


@dataclass(frozen=True)
class Owner:
    """The InferenceDeployment the children belong to."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        """An ownerReference: garbage collection deletes the child with its owner."""
        return {
            "apiVersion": c.API_VERSION,
            "kind": c.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclass(frozen=True)
class ChildRef:
    """A child object by apiVersion, kind and name (in the owner's namespace)."""

    api_version: str
    kind: str
    name: str


@dataclass(frozen=True)
class Children:
    """Apply configurations, in apply order. ``pod_monitor`` None = not wanted.

    Attributes:
        router: the router's objects in apply order (ServiceAccount and RoleBinding before
            the Deployment whose pods use them), or the InferencePool; () when disabled.
        unwanted: router objects this spec does not want (mode switched, router disabled,
            PDB below two replicas), the node-headroom placeholder Deployment when
            node headroom is off, and the ScaledObject outside KEDA mode (where the kind
            is served): the reconcile deletes them if they are its own.
        scaled_object: the KEDA ScaledObject in KEDA mode, else None.
        adapters: the adapters ConfigMap while LoRA is on, else None (then listed in
            ``unwanted``).
    """

    deployment: dict[str, Any]
    service: dict[str, Any]
    pod_disruption_budget: dict[str, Any]
    pod_monitor: dict[str, Any] | None
    router: tuple[dict[str, Any], ...] = ()
    unwanted: tuple[ChildRef, ...] = ()
    scaled_object: dict[str, Any] | None = None
    adapters: dict[str, Any] | None = None

    def all(self) -> list[dict[str, Any]]:
        """Every object, the Deployment first (the adapters ConfigMap, when wanted, right
        after it: the reconcile applies that one before the Deployment)."""
        objs = [self.deployment] + ([self.adapters] if self.adapters else [])
        objs += [self.service, self.pod_disruption_budget]
        objs += ([self.pod_monitor] if self.pod_monitor else []) + list(self.router)
        return objs + ([self.scaled_object] if self.scaled_object else [])

    def router_deployment(self) -> dict[str, Any] | None:
        """The router Deployment among ``router`` (None unless router mode)."""
        return next((o for o in self.router if o["kind"] == "Deployment"), None)


def _metadata(owner: Owner) -> dict[str, Any]:
    return {
        "name": owner.name,
        "namespace": owner.namespace,
        "labels": object_labels(owner.name),
        "ownerReferences": [owner.reference()],
    }


def build_deployment(owner: Owner, spec: InferenceSpec, replicas: int | None,
                     default_image: str) -> dict[str, Any]:
    """The engine Deployment with ``replicas`` pods (None, KEDA mode: no ``spec.replicas``
    in the apply configuration, so KEDA's HPA, which owns the field, keeps it; the
    annotation ``kvpilot.dev/replicas-owner: keda`` tells repairs to leave its changes).

    Rolling updates add one pod before removing one (``maxUnavailable: 0``): capacity never
    drops during a rollout, at the price of one spare pod's worth of resources (a GPU).
    """
    count: dict[str, Any] = {} if replicas is None else {"replicas": replicas}
    metadata = _metadata(owner)
    if replicas is None:
        metadata["annotations"] = {c.ANNOTATION_REPLICAS_OWNER: c.REPLICAS_OWNER_KEDA}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            **count,
            "selector": {"matchLabels": selector_labels(owner.name)},
            "revisionHistoryLimit": 5,
            "progressDeadlineSeconds": startup_budget_seconds(spec) + 300,
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": build_pod_template(owner.name, spec, default_image),
        },
    }


def build_service(owner: Owner) -> dict[str, Any]:
    """A ClusterIP Service on port 8000 in front of the ready engine pods."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner.name),
            "ports": [{
                "name": c.ENGINE_PORT_NAME,
                "port": c.ENGINE_PORT,
                "targetPort": c.ENGINE_PORT_NAME,
                "protocol": "TCP",
            }],
        },
    }


def build_pod_disruption_budget(owner: Owner) -> dict[str, Any]:
    """At most one engine pod evicted at a time (node drains, cluster upgrades). Pods that
    are not ready may always be evicted, so a broken pod never blocks a drain."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(owner.name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def build_pod_monitor(owner: Owner,
                      extra_labels: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    """A Prometheus-operator PodMonitor scraping every engine pod's /metrics, with the
    owner's name copied into the ``inference_deployment`` series label. ``extra_labels``
    go on the PodMonitor itself (what a Prometheus's podMonitorSelector matches); ours win
    on a clash."""
    owner_label = "__meta_kubernetes_pod_label_" + "".join(
        ch if ch.isalnum() else "_" for ch in c.LABEL_OWNER
    )
    metadata = _metadata(owner)
    metadata["labels"] = {**dict(extra_labels), **metadata["labels"]}
    return {
        "apiVersion": POD_MONITOR_API_VERSION,
        "kind": "PodMonitor",
        "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": selector_labels(owner.name)},
            "podMetricsEndpoints": [{
                "port": c.ENGINE_PORT_NAME,
                "path": c.METRICS_PATH,
                "interval": SCRAPE_INTERVAL,
                "relabelings": [{
                    "sourceLabels": [owner_label],
                    "targetLabel": c.SERIES_LABEL,
                    "action": "replace",
                }],
            }],
        },
    }


def build_adapters_config_map(owner: Owner, spec: InferenceSpec) -> dict[str, Any]:
    """The ConfigMap NAME-adapters: ``adapters.json``, the JSON list ``[{"name", "uri"}]``
    of ``spec.adapters`` the engine loads before it reports ready
    (``--lora-adapters-file``). Only its name is in the pod template: a new list changes
    no pod (the operator loads and unloads adapters in running pods through their API)."""
    metadata = _metadata(owner)
    metadata["name"] = adapters_name(owner.name)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata,
        "data": {c.ADAPTERS_FILE_KEY: json.dumps([a.to_json() for a in spec.adapters], indent=1)},
    }


def _router_children(owner: Owner, spec: InferenceSpec, router_image: str, pod_monitor: bool,
                     pod_monitor_labels: tuple[tuple[str, str], ...],
                     inference_pool: bool) -> tuple[list[dict[str, Any]], list[ChildRef]]:
    """(router objects to apply, router objects not wanted), from ``spec.router``."""
    name, ns, ref = owner.name, owner.namespace, owner.reference()
    wanted: list[dict[str, Any]] = []
    if spec.router.runs_router:
        wanted += [
            r.build_router_service_account(name, ns, ref),
            r.build_router_role_binding(name, ns, ref),
            r.build_router_deployment(name, ns, ref, spec, router_image),
            r.build_router_service(name, ns, ref),
        ]
        if spec.router.replicas >= 2:
            wanted.append(r.build_router_pod_disruption_budget(name, ns, ref))
        if pod_monitor:
            wanted.append(r.build_router_pod_monitor(name, ns, ref, pod_monitor_labels))
    elif spec.router.uses_gateway and inference_pool:
        wanted.append(r.build_inference_pool(name, ns, ref, spec, object_labels(name)))
    rname = router_name(name)
    candidates = [
        ChildRef("v1", "ServiceAccount", rname),
        ChildRef("rbac.authorization.k8s.io/v1", "RoleBinding", rname),
        ChildRef("apps/v1", "Deployment", rname),
        ChildRef("v1", "Service", rname),
        ChildRef("policy/v1", "PodDisruptionBudget", rname),
    ]
    if pod_monitor:  # only where the kind is served
        candidates.append(ChildRef(r.POD_MONITOR_API_VERSION, "PodMonitor", rname))
    if inference_pool:
        candidates.append(ChildRef(c.INFERENCE_POOL_API_VERSION, c.INFERENCE_POOL_KIND, name))
    kept = {(o["kind"], o["metadata"]["name"]) for o in wanted}
    return wanted, [ref_ for ref_ in candidates if (ref_.kind, ref_.name) not in kept]


def build_children(owner: Owner, spec: InferenceSpec, replicas: int, default_image: str,
                   pod_monitor: bool,
                   pod_monitor_labels: tuple[tuple[str, str], ...] = (),
                   router_image: str = "kvpilot/router:0.1.0",
                   inference_pool: bool = False,
                   scaled_objects: bool = False) -> Children:
    """Everything one InferenceDeployment owns, for ``replicas`` engine pods.

    Args:
        replicas: the engine Deployment's count; ignored in KEDA mode
            (``spec.autoscaling.engine: keda``), where the Deployment is built without
            ``spec.replicas`` and a ScaledObject is added.
        pod_monitor: the monitoring.coreos.com PodMonitor kind is wanted (and served).
        router_image: the router image when ``spec.router.image`` is unset.
        inference_pool: the InferencePool kind is served (gateway mode applies one only
            then; where it is not, the reconcile reports RouterReady False instead).
        scaled_objects: the KEDA ScaledObject kind is served: outside KEDA mode one of
            ours is then listed in ``unwanted`` (switching back to ``engine: kvpilot``
            deletes it).

    Raises ValueError on a negative replica count.
    """
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0; got {replicas}")
    keda = spec.autoscaling is not None and spec.autoscaling.keda
    router, unwanted = _router_children(owner, spec, router_image, pod_monitor,
                                        pod_monitor_labels, inference_pool)
    if spec.autoscaling is None or not spec.autoscaling.node_startup_seconds:
        # Node headroom off: its placeholder Deployment (the autoscaler loop applies it
        # while on) goes.
        unwanted = [*unwanted, ChildRef("apps/v1", "Deployment", headroom_name(owner.name))]
    if not keda and scaled_objects:
        unwanted = [*unwanted, ChildRef(SCALED_OBJECT_API_VERSION, SCALED_OBJECT_KIND, owner.name)]
    if not spec.lora_enabled:
        unwanted = [*unwanted, ChildRef("v1", "ConfigMap", adapters_name(owner.name))]
    return Children(
        deployment=build_deployment(owner, spec, None if keda else replicas, default_image),
        service=build_service(owner),
        pod_disruption_budget=build_pod_disruption_budget(owner),
        pod_monitor=build_pod_monitor(owner, pod_monitor_labels) if pod_monitor else None,
        router=tuple(router),
        unwanted=tuple(unwanted),
        scaled_object=(build_scaled_object(owner.reference(), owner.namespace, owner.name, spec)
                       if keda else None),
        adapters=build_adapters_config_map(owner, spec) if spec.lora_enabled else None,
    )
