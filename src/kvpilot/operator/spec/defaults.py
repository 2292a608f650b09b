"""The CRD's ``default:`` values, one table for every section of the spec (dotted paths
under ``spec``). ``tests/operator/test_crd.py`` compares it with the CRD; those under
``autoscaling`` come from the one table in :data:`kvpilot.autoscaler.spec.DEFAULTS`."""

from __future__ import annotations

from typing import Any

from kvpilot.autoscaler.spec import DEFAULTS as AUTOSCALING_DEFAULTS

DEFAULTS: dict[str, Any] = {
    "engine.imagePullPolicy": "IfNotPresent",
    "engine.kvCacheDtype": "auto",
    "engine.maxNumBatchedTokens": 2048,
    "engine.maxNumSeqs": 256,
    "engine.blockSize": 16,
    "engine.enablePrefixCaching": True,
    # vLLM's defaults (--max-loras 1, --max-lora-rank 16); spec/adapters.py says why they do
    # not follow the adapter list.
    "engine.lora.maxLoras": 1,
    "engine.lora.maxLoraRank": 16,
    **{f"autoscaling.{key}": value for key, value in AUTOSCALING_DEFAULTS.items()},
    "terminationGracePeriodSeconds": 300,
    "router.enabled": True,
    "router.mode": "router",
    "router.policy": "kv_aware",
    "router.replicas": 1,
    "router.resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                         "limits": {"memory": "512Mi"}},
    "router.gateway.endpointPickerRef.port": 9002,
    "router.gateway.endpointPickerRef.failureMode": "FailClose",
}
