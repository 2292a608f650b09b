"""KEDA mode (``spec.autoscaling.engine: keda``): the ScaledObject that lets KEDA's HPA
scale the engine Deployment instead of the operator's own autoscaler
(docs/autoscaling.md, "KEDA mode").

The triggers are the policy's reactive sizing rules written as HPA metrics, on the
Prometheus of ``spec.autoscaling.metrics.url`` and the series the ``prometheus`` metric
source reads (S = ``{namespace="NS",inference_deployment="NAME"}``; ``max by (pod)`` drops
duplicate scrapes, as there):

==============  =====================================================  ===========  ==========================
trigger         query                                                  metricType   threshold
==============  =====================================================  ===========  ==========================
kv-cache-usage  ``avg(max by (pod) (kvpilot:gpu_cache_usage_factor{S}))``  Value        targetCacheUsage
queue-depth     ``sum(max by (pod) (kvpilot:num_requests_waiting{S}))``    AverageValue targetQueueDepth
saturation      ``sum(max by (pod) (kvpilot:num_requests_running{S}))``    AverageValue maxNumSeqs x targetSaturation
==============  =====================================================  ===========  ==========================

The HPA sizes a ``Value`` metric as ``ceil(ready replicas x value / threshold)`` (mean usage x
replicas = the KV used, so ``ceil(used / target)``, the headroom rule) and an
``AverageValue`` one as ``ceil(sum / threshold)`` (the queue per replica; running requests
per replica against ``maxNumSeqs x targetSaturation``, the saturation rule), and takes the
highest. ``ignoreNullValues: "false"``: an empty answer is an error for KEDA, not zero, so
a series that matches nothing never scales the fleet down (the policy's rule too).

Latency targets (``spec.autoscaling.slo``) are not translated: a trigger on
``histogram_quantile`` would scale on the latency after it is missed, size nothing ahead
of the load and never hold a scale-down for the latency the smaller fleet would give.
The spec parser and the CRD's CEL refuse ``slo`` in KEDA mode by name
(docs/autoscaling.md, "KEDA mode").
"""

from __future__ import annotations

from typing import Any

from kvpilot.operator.autoscaling.metrics_source.names import EngineMetricNames
from kvpilot.operator.autoscaling.metrics_source.promql import SeriesSelector
from kvpilot.operator.builders.labels import object_labels
from kvpilot.operator.spec import InferenceSpec

SCALED_OBJECT_API_VERSION = "keda.sh/v1alpha1"
SCALED_OBJECT_KIND = "ScaledObject"
# The HPA scales down one replica per period at most, like the policy (one per decision).
SCALE_DOWN_PODS_PER_PERIOD = 1


def _threshold(value: float) -> str:
    """A trigger threshold as KEDA reads it: a string of a float, no exponent, in
    thousandths (KEDA turns it into a milli-quantity; the spec parser refuses a target
    under 0.001 in KEDA mode, so this is never "0")."""
    text = f"{value:.3f}".rstrip("0").rstrip(".")
    return text or "0"


def scaled_object_queries(namespace: str, name: str,
                          names: EngineMetricNames | None = None) -> dict[str, str]:
    """The three triggers' PromQL, by trigger name (the table in the module docstring).

    Raises:
        ValueError: a label name of the selector is not a Prometheus label name.
    """
    names = names or EngineMetricNames()
    selector = SeriesSelector(namespace, name)
    s, pod = selector.matchers(), selector.pod_label
    return {
        "kv-cache-usage": f"avg(max by ({pod}) ({names.kv_usage}{s}))",
        "queue-depth": f"sum(max by ({pod}) ({names.num_waiting}{s}))",
        "saturation": f"sum(max by ({pod}) ({names.num_running}{s}))",
    }


def build_scaled_object(owner_reference: dict[str, Any], namespace: str, name: str,
                        spec: InferenceSpec) -> dict[str, Any]:
    """The KEDA ScaledObject ``name`` for an InferenceDeployment in KEDA mode.

    Scale target: the engine Deployment ``name``. Bounds: ``minReplicaCount`` /
    ``maxReplicaCount`` from ``minReplicas`` / ``maxReplicas``; ``pollingInterval``
    (seconds) from ``intervalSeconds``; ``cooldownPeriod`` and the HPA's scale-down
    ``stabilizationWindowSeconds`` (seconds) from ``scaleDownStabilizationSeconds`` (the
    HPA's window is at most 3600 s: a longer one is capped there), its scale-up window from
    ``scaleUpStabilizationSeconds``; scale-down by one pod per ``intervalSeconds`` at most.

    Raises:
        ValueError: ``spec`` is not in KEDA mode (no autoscaling, or ``engine`` is not
            ``keda``), its metrics source has no Prometheus URL, or it sets ``slo`` (the
            parser refuses that first; KEDA mode cannot run the latency model).
    """
    auto = spec.autoscaling
    if auto is None or not auto.keda:
        raise ValueError("a ScaledObject is built only for spec.autoscaling.engine keda")
    if auto.slo is not None:
        raise ValueError("spec.autoscaling.slo is not allowed in KEDA mode: KEDA's HPA cannot"
                         " run the latency model")
    url = auto.metrics.url
    if auto.metrics.source != "prometheus" or not url:
        raise ValueError("KEDA mode needs spec.autoscaling.metrics.source prometheus and its url")
    queries = scaled_object_queries(namespace, name)
    per_replica = spec.engine.max_num_seqs * auto.target_saturation
    triggers = [
        ("kv-cache-usage", "Value", auto.target_cache_usage),
        ("queue-depth", "AverageValue", auto.target_queue_depth),
        ("saturation", "AverageValue", per_replica),
    ]
    interval = int(auto.interval_seconds)
    return {
        "apiVersion": SCALED_OBJECT_API_VERSION,
        "kind": SCALED_OBJECT_KIND,
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": object_labels(name),
            "ownerReferences": [owner_reference],
        },
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicaCount": auto.min_replicas,
            "maxReplicaCount": auto.max_replicas,
            "pollingInterval": interval,
            "cooldownPeriod": int(auto.scale_down_stabilization_seconds),
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleDown": {
                            "stabilizationWindowSeconds":
                                min(3600, int(auto.scale_down_stabilization_seconds)),
                            "policies": [{"type": "Pods", "value": SCALE_DOWN_PODS_PER_PERIOD,
                                          "periodSeconds": interval}],
                        },
                        "scaleUp": {
                            "stabilizationWindowSeconds":
                                int(auto.scale_up_stabilization_seconds),
                        },
                    },
                },
            },
            "triggers": [
                {
                    "type": "prometheus",
                    "name": trigger,
                    "metricType": metric_type,
                    "metadata": {
                        "serverAddress": url.rstrip("/"),  # KEDA appends /api/v1/query
                        "query": queries[trigger],
                        "threshold": _threshold(threshold),
                        "ignoreNullValues": "false",
                    },
                }
                for trigger, metric_type, threshold in triggers
            ],
        },
    }
