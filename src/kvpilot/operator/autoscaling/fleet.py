"""What the autoscaler knows about a fleet before it reads any metric: how many replicas
the engine Deployment asks for, which pods are ready (to be read) and how many are still
coming (supply that does not serve yet).

::

    Deployment spec.replicas = 4          pods: chat-a Ready, chat-b Ready, chat-c Ready,
                                                chat-d ContainerCreating, chat-e Terminating
    -> ready = (chat-a, chat-b, chat-c), pending_replicas = 4 - 3 = 1

Pending is the Deployment's count minus the ready pods, whether the missing pods exist yet
or not: right after a scale-up the ReplicaSet may not have created them, and right after an
operator restart the only record of that scale-up is the Deployment itself. Counting them
as supply is what keeps one pressure from being answered twice (llm-d WVA's cascade guard).
Terminating pods are neither ready nor pending.

The fleet's request-router pods (label ``app.kubernetes.io/component: router`` and the
owner label) are listed too: the ready ones are read for the demand they hold, on their
container port named ``metrics`` (vllm-router's default Prometheus port, 29000, when no
port has that name). They are neither supply nor engines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpilot.operator import constants as c
from kvpilot.operator.api import KubeApi
from kvpilot.operator.autoscaling.metrics_source import EnginePod
from kvpilot.operator.builders.labels import router_selector_labels, selector_labels


@dataclass(frozen=True)
class FleetObservation:
    """Attributes:
        deployment_replicas: the engine Deployment's ``spec.replicas`` (None = no
            Deployment yet: the reconcile creates it, the autoscaler waits).
        ready: the ready, non-terminating engine pods, by name.
        pending_replicas: ``deployment_replicas`` minus ready pods, at least 0.
        routers: the ready router pods, each with its metrics port (empty: no router).
    """

    deployment_replicas: int | None
    ready: tuple[EnginePod, ...]
    pending_replicas: int
    routers: tuple[EnginePod, ...] = ()


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    """True for a pod that serves: condition Ready=True and not being deleted."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def metrics_port(pod: Mapping[str, Any]) -> int:
    """A router pod's container port named ``metrics``, else the one the operator gives it
    (vllm-router's default ``--prometheus-port``)."""
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            number = port.get("containerPort")
            if (port.get("name") == c.ROUTER_METRICS_PORT_NAME and isinstance(number, int)
                    and not isinstance(number, bool)):
                return number
    return c.ROUTER_METRICS_PORT


def fleet_from(deployment: Mapping[str, Any] | None,
               pods: Sequence[Mapping[str, Any]],
               routers: Sequence[Mapping[str, Any]] = ()) -> FleetObservation:
    """The observation from the objects as read (pure)."""
    ready = tuple(sorted(
        (EnginePod(p["metadata"]["name"], (p.get("status") or {}).get("podIP"))
         for p in pods if pod_is_ready(p)),
        key=lambda pod: pod.name,
    ))
    ready_routers = tuple(sorted(
        (EnginePod(p["metadata"]["name"], (p.get("status") or {}).get("podIP"), metrics_port(p))
         for p in routers if pod_is_ready(p)),
        key=lambda pod: pod.name,
    ))
    if deployment is None:
        return FleetObservation(None, ready, 0, ready_routers)
    replicas = (deployment.get("spec") or {}).get("replicas")
    replicas = replicas if isinstance(replicas, int) and not isinstance(replicas, bool) else 1
    return FleetObservation(replicas, ready, max(0, replicas - len(ready)), ready_routers)


def observe_routers(api: KubeApi, namespace: str, name: str) -> tuple[EnginePod, ...]:
    """The ready router pods alone (one LIST): what scale to zero polls while the fleet
    is at zero. Raises the api module's errors."""
    return fleet_from(None, [], api.list_pods(namespace, router_selector_labels(name))).routers


def observe_fleet(api: KubeApi, namespace: str, name: str) -> FleetObservation:
    """Read the engine Deployment, its pods and the router pods. Raises the api module's
    errors."""
    deployment = api.get("apps/v1", "Deployment", namespace, name)
    if deployment is None:
        return fleet_from(None, [])
    pods = api.list_pods(namespace, selector_labels(name))
    routers = api.list_pods(namespace, router_selector_labels(name))
    return fleet_from(deployment, pods, routers)
