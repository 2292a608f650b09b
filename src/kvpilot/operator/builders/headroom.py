"""The node-headroom placeholder Deployment (``NAME-headroom``): pods that ask for exactly
what one engine pod asks for (so the cluster autoscaler adds the same kind of node for
them), run nothing (``sleep infinity`` in the engine image, which also pre-pulls that
image onto the new node), and carry a PriorityClass below the engines' so the scheduler
preempts them the moment an engine pod needs their room. Sized by
:func:`kvpilot.autoscaler.headroom.headroom`; see docs/autoscaling.md, "Node headroom".
"""

from __future__ import annotations

import copy
from typing import Any

from kvpilot.operator.builders.children import Owner
from kvpilot.operator.builders.labels import (
    headroom_name,
    headroom_object_labels,
    headroom_selector_labels,
)
from kvpilot.operator.builders.pod import build_pod_template
from kvpilot.operator.spec import InferenceSpec


def build_headroom_deployment(owner: Owner, spec: InferenceSpec, replicas: int, default_image: str,
                              priority_class: str) -> dict[str, Any]:
    """The placeholder Deployment with ``replicas`` pods (0 keeps the object, no pods).

    The pod takes the engine pod's scheduling constraints (node selector, tolerations,
    affinity, topology spread, runtime class, pull secrets) and its container's resources,
    requests and limits alike; nothing else of the engine's.
    """
    engine = build_pod_template(owner.name, spec, default_image)["spec"]
    container = engine["containers"][0]
    pod: dict[str, Any] = {
        "priorityClassName": priority_class,
        "terminationGracePeriodSeconds": 0,  # preempted at once
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": copy.deepcopy(engine["securityContext"]),
        "containers": [{
            "name": "placeholder",
            "image": container["image"],
            "imagePullPolicy": container["imagePullPolicy"],
            "command": ["sleep", "infinity"],
            "resources": copy.deepcopy(container["resources"]),
            "securityContext": copy.deepcopy(container["securityContext"]),
        }],
    }
    for key in ("nodeSelector", "tolerations", "affinity", "topologySpreadConstraints", "runtimeClassName",
                "imagePullSecrets"):
        if key in engine:
            pod[key] = copy.deepcopy(engine[key])
    labels = headroom_object_labels(owner.name)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": headroom_name(owner.name), "namespace": owner.namespace, "labels": labels,
                     "ownerReferences": [owner.reference()]},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": headroom_selector_labels(owner.name)},
            "strategy": {"type": "Recreate"},
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }
