"""Scenario 2: invalid specs are refused by `kubectl apply` itself, with the CRD's CEL
(or schema) message, and nothing is stored."""

from __future__ import annotations

import pytest
import yaml

from e2e.tests import helpers as h


def _autoscaling(**over):
    auto = {"minReplicas": 1, "maxReplicas": 2, "metrics": {"source": "pods"}}
    auto.update(over)
    return auto


PROMETHEUS = {"source": "prometheus", "url": "http://prometheus.monitoring:9090"}

CASES = {
    "min-over-max": ({"autoscaling": _autoscaling(minReplicas=5, maxReplicas=2)},
                     "autoscaling.minReplicas must be <= autoscaling.maxReplicas"),
    "replicas-and-autoscaling": ({"replicas": 2, "autoscaling": _autoscaling()},
                                 "spec.replicas and spec.autoscaling are mutually exclusive"),
    "unknown-kv-dtype": ({"engine": {"kvCacheDtype": "fp3"}}, "kvCacheDtype"),
    "zero-budget": ({"engine": {"maxNumBatchedTokens": 0}}, "maxNumBatchedTokens"),
    "bad-model-uri": ({"model": {"uri": "gs://bucket/model"}},
                      "unsupported model.uri gs://bucket/model"),
    # The CEL rule reads the GPU quantity (an int-or-string map value) with int(): no GPU
    # node is needed, the object is refused before any pod exists.
    "tensor-parallel-not-dividing-gpus": (
        {"engine": {"tensorParallelSize": 3}, "resources": {"limits": {"nvidia.com/gpu": 4}}},
        "engine.tensorParallelSize must divide the pod's GPU count"),
    "keda-needs-prometheus": ({"autoscaling": _autoscaling(engine="keda")},
                              "autoscaling.engine keda needs autoscaling.metrics.source prometheus"),
    # KEDA reads a threshold as a milli-quantity: 0.0001 would reach its HPA as 0.
    "keda-threshold-under-a-thousandth": (
        {"autoscaling": _autoscaling(engine="keda", targetQueueDepth=0.0001, metrics=PROMETHEUS)},
        "KEDA reads its thresholds in thousandths"),
    # Latency targets (spec.autoscaling.slo): the schema's bounds and the CEL rules, in the API server.
    "slo-zero-itl": ({"autoscaling": _autoscaling(slo={"itlSeconds": 0})}, "itlSeconds"),
    "slo-negative-ttft": ({"autoscaling": _autoscaling(slo={"ttftSeconds": -1})}, "ttftSeconds"),
    "slo-over-a-day": ({"autoscaling": _autoscaling(slo={"ttftSeconds": 90000})}, "ttftSeconds"),
    "slo-not-a-number": ({"autoscaling": _autoscaling(slo={"itlSeconds": "fast"})}, "itlSeconds"),
    "slo-percentile-one": ({"autoscaling": _autoscaling(slo={"itlSeconds": 0.5, "percentile": 1})},
                           "percentile"),
    "slo-without-target": ({"autoscaling": _autoscaling(slo={"percentile": 0.9})},
                           "autoscaling.slo needs ttftSeconds or itlSeconds"),
    "slo-with-keda": ({"autoscaling": _autoscaling(engine="keda", metrics=PROMETHEUS, slo={"itlSeconds": 0.5})},
                      "autoscaling.engine keda cannot take autoscaling.slo"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_invalid_spec_refused(cluster, case):
    overrides, message = CASES[case]
    doc = h.small_infd(f"bad-{case}", autoscaling=None, replicas=1)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(doc["spec"].get(key), dict):
            doc["spec"][key] = {**doc["spec"][key], **value}
        else:
            doc["spec"][key] = value
        if key == "autoscaling" and "replicas" not in overrides:
            doc["spec"].pop("replicas", None)
    result = h.apply(cluster, "default", doc, check=False)
    assert result.returncode != 0, result.stdout
    assert "is invalid" in result.stderr and message in result.stderr, result.stderr
    gone = cluster.kubectl("get", "infd", doc["metadata"]["name"], check=False)
    assert "NotFound" in gone.stderr


def test_keda_mode_with_integer_targets_is_admitted(cluster):
    """The KEDA threshold rule converts each target with double(): integer values (a
    queue depth of 4) are admitted by the API server's CEL. A server-side dry run: the
    apiserver validates, nothing is stored (and no KEDA is needed)."""
    doc = h.small_infd("keda-admitted", autoscaling=_autoscaling(
        engine="keda", targetQueueDepth=4, targetCacheUsage=0.75, targetSaturation=1,
        metrics=PROMETHEUS))
    doc["spec"].pop("replicas", None)
    result = cluster.kubectl("apply", "--dry-run=server", "-n", "default", "-f", "-",
                             input=yaml.safe_dump(doc), check=False)
    assert result.returncode == 0, result.stderr
    gone = cluster.kubectl("get", "infd", "keda-admitted", check=False)
    assert "NotFound" in gone.stderr


def test_slo_is_admitted(cluster):
    """A latency target within bounds passes the API server (server-side dry run)."""
    doc = h.small_infd("slo-admitted", autoscaling=_autoscaling(
        slo={"ttftSeconds": 10, "itlSeconds": 0.5, "percentile": 0.9}))
    doc["spec"].pop("replicas", None)
    result = cluster.kubectl("apply", "--dry-run=server", "-n", "default", "-f", "-",
                             input=yaml.safe_dump(doc), check=False)
    assert result.returncode == 0, result.stderr


def test_scale_refused_with_autoscaling(cluster):
    """C16, second half: `kubectl scale` on an autoscaled resource is refused by the API
    server with a message saying why (the object never needs a pod for this)."""
    doc = h.small_infd("scale-refused")
    h.apply(cluster, "default", doc)
    try:
        result = cluster.kubectl("scale", "infd", "scale-refused", "--replicas=3", check=False)
        assert result.returncode != 0
        assert "spec.replicas and spec.autoscaling are mutually exclusive" in result.stderr, \
            result.stderr
        assert "replicas" not in h.infd(cluster, "default", "scale-refused")["spec"]
    finally:
        cluster.kubectl("delete", "infd", "scale-refused", "--timeout=120s", check=False)
