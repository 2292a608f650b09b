"""The ``InferenceDeployment`` spec as frozen, validated dataclasses.

The CRD's schema and CEL rules refuse bad specs at ``kubectl apply``; this module checks
the same rules again, because an object can predate a CRD upgrade or come from a cluster
whose API server skipped validation. :func:`parse_spec` is the only way in: it applies the
CRD's defaults, validates every field and raises :class:`SpecError` naming the field, the
value received and what is allowed. Nothing here talks to Kubernetes.

The defaults below must equal the CRD's ``default:`` values
(``tests/operator/test_crd.py`` compares them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpilot.operator.fields import FieldReader, SpecError
from kvpilot.operator.model_uri import ModelSource, parse_model_uri

KV_CACHE_DTYPES = (
    "auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "int4",
)
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
METRIC_SOURCES = ("prometheus", "pods")
# Flags the operator derives from spec fields; engine.extraArgs may not repeat them.
MANAGED_FLAGS = (
    "--model", "--served-model-name", "--host", "--port", "--kv-cache-dtype",
    "--max-num-batched-tokens", "--max-num-seqs", "--block-size", "--enable-prefix-caching",
    "--no-enable-prefix-caching", "--gpu-memory-utilization", "--max-model-len", "--device",
    "--drain-timeout",
)
MAX_REPLICAS = 1000
# The CRD's pattern for model.servedModelName (also checked here for unvalidated specs).
_SERVED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}$")
# The autoscaler's starvation alarm fires at this per-pod usage; a target must stay below.
STARVATION_USAGE = 0.95
# The autoscaler fits its KV forecast over two minutes: it needs a decision at least a minute.
MAX_INTERVAL_SECONDS = 60

DEFAULTS: dict[str, Any] = {
    "engine.imagePullPolicy": "IfNotPresent",
    "engine.kvCacheDtype": "auto",
    "engine.maxNumBatchedTokens": 2048,
    "engine.maxNumSeqs": 256,
    "engine.blockSize": 16,
    "engine.enablePrefixCaching": True,
    "autoscaling.minReplicas": 1,
    "autoscaling.targetCacheUsage": 0.75,
    "autoscaling.targetQueueDepth": 4,
    "autoscaling.startupSeconds": 120,
    "autoscaling.scaleUpStabilizationSeconds": 0,
    "autoscaling.scaleDownStabilizationSeconds": 300,
    "autoscaling.intervalSeconds": 15,
    "autoscaling.metrics.source": "pods",
    "terminationGracePeriodSeconds": 300,
}
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

__all__ = ["InferenceSpec", "SpecError", "check_name", "parse_spec"]


@dataclass(frozen=True)
class EngineSpec:
    """``spec.engine``: the ``kvpilot serve`` settings. ``image`` None = operator default."""

    image: str | None
    image_pull_policy: str
    kv_cache_dtype: str
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float | None
    max_model_len: int | None
    extra_args: tuple[str, ...]


@dataclass(frozen=True)
class MetricsSourceSpec:
    """``spec.autoscaling.metrics``: ``prometheus`` (PromQL at ``url``) or ``pods``."""

    source: str
    url: str | None


@dataclass(frozen=True)
class AutoscalingSpec:
    """``spec.autoscaling``; times in seconds, targets per ready pod."""

    min_replicas: int
    max_replicas: int
    target_cache_usage: float
    target_queue_depth: float
    startup_seconds: int
    scale_up_stabilization_seconds: int
    scale_down_stabilization_seconds: int
    interval_seconds: int
    metrics: MetricsSourceSpec

    def clamp(self, replicas: int) -> int:
        """``replicas`` limited to [min_replicas, max_replicas]."""
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True)
class PodSettings:
    """Pod-level settings passed to the engine pods. Mappings are copies; never mutated."""

    resources: Mapping[str, Any]
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...]
    affinity: Mapping[str, Any] | None
    env: tuple[Mapping[str, Any], ...]
    pod_annotations: Mapping[str, str]
    service_account_name: str | None
    termination_grace_period_seconds: int
    image_pull_secrets: tuple[str, ...] = ()
    priority_class_name: str | None = None


@dataclass(frozen=True)
class InferenceSpec:
    """A whole validated spec. Exactly one of ``replicas``/``autoscaling`` is the source of
    the replica count; with neither the fleet is one static replica."""

    model: ModelSource
    engine: EngineSpec
    replicas: int | None
    autoscaling: AutoscalingSpec | None
    pod: PodSettings
    cost_per_replica_hour: float | None

    @property
    def static_replicas(self) -> int | None:
        """The fixed replica count, or None when the autoscaler decides."""
        if self.autoscaling is not None:
            return None
        return 1 if self.replicas is None else self.replicas


def _parse_engine(raw: Any) -> EngineSpec:
    r = FieldReader(raw, "engine", DEFAULTS)
    extra = r.items("extraArgs")
    for arg in extra:
        if not isinstance(arg, str):
            raise SpecError("engine.extraArgs", arg, "each entry must be a string")
        if arg.split("=", 1)[0] in MANAGED_FLAGS:
            raise SpecError("engine.extraArgs", arg,
                            "set the matching spec field instead of repeating a managed flag")
    engine = EngineSpec(
        image=r.string("image"),
        image_pull_policy=r.choice("imagePullPolicy", PULL_POLICIES),
        kv_cache_dtype=r.choice("kvCacheDtype", KV_CACHE_DTYPES),
        max_num_batched_tokens=r.integer("maxNumBatchedTokens", 1, 1 << 20),
        max_num_seqs=r.integer("maxNumSeqs", 1, 65536),
        block_size=r.choice("blockSize", BLOCK_SIZES),
        enable_prefix_caching=r.boolean("enablePrefixCaching"),
        gpu_memory_utilization=r.number("gpuMemoryUtilization", 0.0, 1.0, False, lo_open=True),
        max_model_len=r.integer("maxModelLen", 1, 1 << 30, required=False),
        extra_args=extra,
    )
    if engine.max_num_batched_tokens < engine.max_num_seqs:
        raise SpecError("engine.maxNumBatchedTokens", engine.max_num_batched_tokens,
                        f"must be >= engine.maxNumSeqs ({engine.max_num_seqs})")
    if engine.max_model_len is not None and engine.max_model_len < engine.block_size:
        raise SpecError("engine.maxModelLen", engine.max_model_len,
                        f"must be >= engine.blockSize ({engine.block_size})")
    return engine


def _parse_autoscaling(raw: Any) -> AutoscalingSpec:
    r = FieldReader(raw, "autoscaling", DEFAULTS)
    m = FieldReader(r.raw.get("metrics"), "autoscaling.metrics", DEFAULTS)
    metrics = MetricsSourceSpec(source=m.choice("source", METRIC_SOURCES), url=m.string("url"))
    if metrics.source == "prometheus" and (
        metrics.url is None or not re.match(r"^https?://\S+$", metrics.url)
    ):
        raise SpecError("autoscaling.metrics.url", metrics.url,
                        "an http(s) URL is required when metrics.source is prometheus")
    spec = AutoscalingSpec(
        min_replicas=r.integer("minReplicas", 1, MAX_REPLICAS),
        max_replicas=r.integer("maxReplicas", 1, MAX_REPLICAS),
        target_cache_usage=r.number("targetCacheUsage", 0.0, STARVATION_USAGE, lo_open=True,
                                    hi_open=True),
        target_queue_depth=r.number("targetQueueDepth", 0.0, 10000.0, lo_open=True),
        startup_seconds=r.integer("startupSeconds", 0, 7200),
        scale_up_stabilization_seconds=r.integer("scaleUpStabilizationSeconds", 0, 3600),
        scale_down_stabilization_seconds=r.integer("scaleDownStabilizationSeconds", 0, 86400),
        interval_seconds=r.integer("intervalSeconds", 1, MAX_INTERVAL_SECONDS),
        metrics=metrics,
    )
    if spec.min_replicas > spec.max_replicas:
        raise SpecError("autoscaling.minReplicas", spec.min_replicas,
                        f"must be <= autoscaling.maxReplicas ({spec.max_replicas})")
    return spec


def _parse_pod(r: FieldReader) -> PodSettings:
    env = r.items("env")
    for item in env:
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            raise SpecError("env", item, "each entry needs a string name (a core/v1 EnvVar)")
    tolerations = r.items("tolerations")
    if not all(isinstance(t, Mapping) for t in tolerations):
        raise SpecError("tolerations", list(tolerations), "a list of core/v1 Toleration objects")
    affinity = r.mapping("affinity") or None
    pull_secrets = r.items("imagePullSecrets")
    for item in pull_secrets:
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str) or not item["name"]:
            raise SpecError("imagePullSecrets", item, "each entry is {name: <secret name>}")
    return PodSettings(
        resources=r.mapping("resources"),
        node_selector=r.mapping("nodeSelector"),
        tolerations=tuple(dict(t) for t in tolerations),
        affinity=affinity,
        env=tuple(dict(e) for e in env),
        pod_annotations=r.mapping("podAnnotations"),
        service_account_name=r.string("serviceAccountName"),
        termination_grace_period_seconds=r.integer("terminationGracePeriodSeconds", 0, 86400),
        image_pull_secrets=tuple(item["name"] for item in pull_secrets),
        priority_class_name=r.string("priorityClassName"),
    )


def parse_spec(raw: Any) -> InferenceSpec:
    """Validate a raw ``spec`` mapping (as stored, camelCase) into an :class:`InferenceSpec`.

    Applies the CRD defaults for missing fields, so it also accepts specs the API server
    did not default. Raises :class:`SpecError` on the first invalid field.
    """
    r = FieldReader(raw, "", DEFAULTS)
    model = FieldReader(r.raw.get("model"), "model", DEFAULTS)
    uri = model.string("uri", required=True)
    served = model.string("servedModelName")
    if served is not None and not _SERVED_NAME.match(served):
        raise SpecError("model.servedModelName", served,
                        "1-128 characters of letters, digits and . _ / : -, starting with a"
                        " letter or digit")
    try:
        source = parse_model_uri(uri, served)
    except ValueError as exc:
        raise SpecError("model.uri", uri, str(exc)) from None
    if r.raw.get("replicas") is not None and r.raw.get("autoscaling") is not None:
        raise SpecError("replicas", r.raw["replicas"],
                        "spec.replicas and spec.autoscaling are mutually exclusive")
    autoscaling = r.raw.get("autoscaling")
    finops = FieldReader(r.raw.get("finops"), "finops", DEFAULTS)
    return InferenceSpec(
        model=source,
        engine=_parse_engine(r.raw.get("engine")),
        replicas=r.integer("replicas", 0, MAX_REPLICAS, required=False),
        autoscaling=None if autoscaling is None else _parse_autoscaling(autoscaling),
        pod=_parse_pod(r),
        cost_per_replica_hour=finops.number("costPerReplicaHour", 0.0, 1e9, required=False),
    )


def check_name(name: str) -> None:
    """Refuse names that cannot name the child objects and label values (DNS-1035, <= 63)."""
    if not (isinstance(name, str) and len(name) <= 63 and _NAME_RE.match(name)):
        raise SpecError("metadata.name", name,
                        "a DNS-1035 label of at most 63 characters is required")
