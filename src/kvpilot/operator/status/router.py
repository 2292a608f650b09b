"""The part of ``status`` that says where clients connect and whether the router in front of
the engines works: ``endpoint``, ``inferencePool`` and the ``RouterReady`` condition.

=====================  ======  ========================  =====================================
``spec.router``        status  reason                    when
=====================  ======  ========================  =====================================
router mode            True    RouterAvailable           the router Deployment has >= 1
                                                         available pod
                       False   RouterUnavailable         none (a router pod is ready once its
                                                         discovery found a ready engine pod)
gateway mode           True    InferencePoolAccepted     a Gateway accepted the InferencePool
                       False   InferencePoolNotAccepted  none has (yet): no HTTPRoute uses it
                       False   InferencePoolCRDMissing   the cluster does not serve the kind;
                                                         nothing was applied
disabled               -       -                         the condition is removed
=====================  ======  ========================  =====================================

``endpoint`` is the in-cluster URL clients use: the router Service in router mode, the
engine Service when the router is disabled, and absent in gateway mode, where clients go
through the Gateway (whose address the operator does not know). Pure functions; a
``None`` value in a patch removes the key (JSON merge patch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpilot.operator import constants as c
from kvpilot.operator.builders.labels import router_name
from kvpilot.operator.spec import RouterSpec
from kvpilot.operator.status.conditions import Condition


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def service_url(service: str, namespace: str, port: int) -> str:
    """``http://SERVICE.NAMESPACE.svc:PORT``: resolvable from any namespace of the cluster."""
    return f"http://{service}.{namespace}.svc:{port}"


def endpoint_status(name: str, namespace: str, router: RouterSpec) -> dict[str, Any]:
    """``url`` and ``endpoint`` (the same URL: ``url`` is KServe's name for it) and
    ``inferencePool`` for this router setting (None = remove)."""
    if router.runs_router:
        url = service_url(router_name(name), namespace, c.ROUTER_PORT)
        return {"url": url, "endpoint": url, "inferencePool": None}
    if router.uses_gateway:
        return {"url": None, "endpoint": None, "inferencePool": name}
    url = service_url(name, namespace, c.ENGINE_PORT)
    return {"url": url, "endpoint": url, "inferencePool": None}


def router_condition(deployment: Mapping[str, Any] | None,
                     engines_ready: int | None = None) -> Condition:
    """RouterReady from the router Deployment as observed (None = not created yet).
    ``engines_ready`` (ready engine pods, when known) explains an unready router."""
    desired = _int(((deployment or {}).get("spec") or {}).get("replicas"))
    available = _int(((deployment or {}).get("status") or {}).get("availableReplicas"))
    if available >= 1:
        return Condition(c.ROUTER_CONDITION, "True", "RouterAvailable",
                         f"{available}/{desired} router pods available")
    why = ("a router pod turns ready once its service discovery has found a ready engine pod"
           " (and the ClusterRole kvpilot-router lets it watch pods)")
    if engines_ready == 0:
        why = "no engine pod is ready yet, and a router pod turns ready once it has found one"
    return Condition(c.ROUTER_CONDITION, "False", "RouterUnavailable",
                     f"0/{desired} router pods available: {why}")


def missing_pool_condition() -> Condition:
    """The cluster does not serve InferencePool: nothing could be applied."""
    return Condition(c.ROUTER_CONDITION, "False", "InferencePoolCRDMissing",
                     f"the {c.INFERENCE_POOL_CRD} CRD ({c.INFERENCE_POOL_API_VERSION}) is not"
                     " installed: install the Gateway API Inference Extension CRDs; no"
                     " InferencePool was applied")


def gateway_condition(pool: Mapping[str, Any] | None) -> Condition:
    """RouterReady from the InferencePool as stored: True once a parent (Gateway) reports
    ``Accepted=True`` in ``status.parents[].conditions``."""
    name = ((pool or {}).get("metadata") or {}).get("name", "")
    for parent in ((pool or {}).get("status") or {}).get("parents") or ():
        for cond in parent.get("conditions") or ():
            if cond.get("type") == "Accepted" and cond.get("status") == "True":
                ref = parent.get("parentRef") or {}
                gateway = "/".join(p for p in (ref.get("namespace"), ref.get("name")) if p)
                return Condition(c.ROUTER_CONDITION, "True", "InferencePoolAccepted",
                                 f"InferencePool {name} accepted by {ref.get('kind', 'Gateway')}"
                                 f" {gateway}")
    return Condition(c.ROUTER_CONDITION, "False", "InferencePoolNotAccepted",
                     f"no Gateway has accepted InferencePool {name} yet: an HTTPRoute of a"
                     " Gateway must send requests to it (backendRef group"
                     " inference.networking.k8s.io, kind InferencePool)")
