"""The ``InferenceDeployment`` spec as frozen, validated dataclasses.

The CRD's schema and CEL rules refuse bad specs at ``kubectl apply``; this module checks
the same rules again, because an object can predate a CRD upgrade or come from a cluster
whose API server skipped validation. :func:`parse_spec` is the only way in: it applies the
CRD's defaults, validates every field and raises :class:`SpecError` naming the field, the
value received and what is allowed. Nothing here talks to Kubernetes.

:data:`DEFAULTS` must equal the CRD's ``default:`` values (``tests/operator/test_crd.py``
compares them); those under ``autoscaling`` come from the one table in
:data:`kvpilot.autoscaler.spec.DEFAULTS`. ``spec.autoscaling`` becomes the policy's own
:class:`~kvpilot.autoscaler.spec.AutoscalingSpec`: the operator, the simulator and the
policy share one spec.
"""

from __future__ import annotations

import copy
import dataclasses
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from kvpilot.autoscaler.spec import DEFAULTS as AUTOSCALING_DEFAULTS
from kvpilot.autoscaler.spec import (
    METRIC_SOURCES,
    STARVATION_USAGE,
    AutoscalingSpec,
    MetricsSourceSpec,
)
from kvpilot.flags.check import VLLMFlagError, split_vllm_flags
from kvpilot.flags.serve import MANAGED_FLAGS
from kvpilot.operator.constants import CACHE_DIR
from kvpilot.operator.model_uri import (
    MODELS_DIR,
    ModelSource,
    parse_model_uri,
    with_fetch_options,
)

KV_CACHE_DTYPES = (
    "auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1", "int4",
)
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# The managed flags engine.tensorParallelSize sets (vLLM's long and short spellings).
TENSOR_PARALLEL_FLAGS = ("--tensor-parallel-size", "-tp")
MAX_TENSOR_PARALLEL_SIZE = 64
# The /dev/shm sizeLimit of a tensor-parallel pod when engine.shmSize is not set.
DEFAULT_SHM_SIZE = "2Gi"
# engine.shmSize (the CRD's pattern): a whole number of bytes with an optional suffix.
_SHM_SIZE = re.compile(r"^[1-9][0-9]*(Ki|Mi|Gi|Ti|k|M|G|T)?$")
# A GPU count written as a quantity string ("4"): what the CRD's rules read with int().
_WHOLE_NUMBER = re.compile(r"^[0-9]+$")
# Resources that are whole GPUs (nvidia.com/gpu, amd.com/gpu) and NVIDIA MIG slices.
GPU_RESOURCE_SUFFIX = "/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
# Why engine.extraArgs may hold no positional argument (kvpilot serve's would be the model).
POSITIONAL_REASON = ("a positional argument: the engine would take it for the model, which "
                     "the operator sets from model.uri")
MAX_REPLICAS = 1000
ROUTER_MODES = ("router", "gateway")
# vllm-router's --policy values this operator offers (it has more: random, round_robin...).
ROUTER_POLICIES = ("kv_aware", "cache_aware", "power_of_two", "consistent_hash")
# The request headers vllm-router 0.1.17's consistent_hash policy hashes on, in the order
# it checks them (src/policies/hash_key.rs); it has no flag to name another header, so a
# header outside this list would be ignored and every request hashed on its body instead.
SESSION_HEADERS = ("x-session-id", "x-user-id", "x-tenant-id", "x-correlation-id",
                   "x-request-id", "x-trace-id")
FAILURE_MODES = ("FailClose", "FailOpen")
MAX_ROUTER_REPLICAS = 100
# The router's Deployment and Service are named NAME-router: a Service name is a DNS-1035
# label of at most 63 characters, so the InferenceDeployment's name gets 56.
MAX_NAME_WITH_ROUTER = 56
# Set by the operator when the router's kv_aware policy needs the engines' KV events.
KV_EVENTS_FLAG = "--kv-events-config"
# The CRD's pattern for model.servedModelName (also checked here for unvalidated specs).
_SERVED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}$")
# The autoscaler fits its KV forecast over two minutes: it needs a decision at least a minute.
MAX_INTERVAL_SECONDS = 60

DEFAULTS: dict[str, Any] = {
    "engine.imagePullPolicy": "IfNotPresent",
    "engine.kvCacheDtype": "auto",
    "engine.maxNumBatchedTokens": 2048,
    "engine.maxNumSeqs": 256,
    "engine.blockSize": 16,
    "engine.enablePrefixCaching": True,
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
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_T = TypeVar("_T")

__all__ = ["METRIC_SOURCES", "AutoscalingSpec", "EndpointPickerRef", "FieldReader",
           "InferenceSpec", "MetricsSourceSpec", "RouterSpec", "SpecError", "check_name",
           "gpu_count", "nonzero_quantity", "parse_spec"]


class SpecError(ValueError):
    """A field the operator cannot use. ``field`` is the dotted path under ``spec`` (or a
    ``metadata.`` path); the message names the field, the value and what is allowed."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        where = field if field.startswith("metadata.") else f"spec.{field}"
        super().__init__(f"{where}: got {value!r}; {allowed}")


class FieldReader:
    """Typed access to one object of the spec. A missing field takes its value from
    ``defaults`` (dotted paths); every error is a :class:`SpecError` naming the full path,
    the value and the allowed range. ``raw`` None reads as an empty object."""

    def __init__(self, raw: Any, path: str, defaults: Mapping[str, Any]) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise SpecError(path, raw, "an object is required")
        self.raw: Mapping[str, Any] = raw
        self.path, self.defaults = path, defaults

    def _key(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _get(self, key: str) -> Any:
        value = self.raw.get(key)
        return self.defaults.get(self._key(key)) if value is None else value

    def integer(self, key: str, lo: int, hi: int) -> int:
        """A required integer in [lo, hi] (bools refused)."""
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise SpecError(self._key(key), value, f"an integer in [{lo}, {hi}] is required")
        return value

    def optional_integer(self, key: str, lo: int, hi: int) -> int | None:
        """:meth:`integer`, or None when the field is absent and has no default."""
        return None if self._get(key) is None else self.integer(key, lo, hi)

    def number(self, key: str, lo: float, hi: float, lo_open: bool = False,
               hi_open: bool = False) -> float:
        """A required number in the interval (open at an end when ``*_open``), as float."""
        value = self._get(key)
        bad = isinstance(value, bool) or not isinstance(value, (int, float))
        if bad or value > hi or value < lo or (lo_open and value == lo) or (hi_open and value == hi):
            interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
            raise SpecError(self._key(key), value, f"a number in {interval} is required")
        return float(value)

    def optional_number(self, key: str, lo: float, hi: float, lo_open: bool = False,
                        hi_open: bool = False) -> float | None:
        """:meth:`number`, or None when the field is absent and has no default."""
        if self._get(key) is None:
            return None
        return self.number(key, lo, hi, lo_open, hi_open)

    def choice(self, key: str, allowed: tuple[_T, ...]) -> _T:
        """One of ``allowed`` (compared by equality; bools refused)."""
        value = self._get(key)
        if isinstance(value, bool) or value not in allowed:
            raise SpecError(self._key(key), value, f"one of {', '.join(map(str, allowed))}")
        return cast(_T, value)

    def string(self, key: str) -> str | None:
        """A non-empty string, or None when absent."""
        return None if self._get(key) is None else self.required_string(key)

    def required_string(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str) or not value:
            raise SpecError(self._key(key), value, "a non-empty string is required")
        return value

    def boolean(self, key: str) -> bool:
        value = self._get(key)
        if not isinstance(value, bool):
            raise SpecError(self._key(key), value, "true or false")
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        """A copy of an object field ({} when absent)."""
        value = self.raw.get(key) or {}
        if not isinstance(value, Mapping):
            raise SpecError(self._key(key), value, "an object is required")
        return dict(value)

    def items(self, key: str) -> tuple[Any, ...]:
        """The entries of a list field (() when absent)."""
        value = self.raw.get(key) or []
        if not isinstance(value, list):
            raise SpecError(self._key(key), value, "a list is required")
        return tuple(value)


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
    # Resolved by parse_spec: engine.tensorParallelSize, else the pod's whole-GPU count
    # (1 for CPU pods and MIG slices).
    tensor_parallel_size: int = 1
    shm_size: str | None = None

    @property
    def shm_size_limit(self) -> str | None:
        """The /dev/shm volume's sizeLimit: engine.shmSize, else 2Gi with tensor
        parallelism (its workers exchange tensors through shared memory), else none."""
        if self.shm_size is not None:
            return self.shm_size
        return DEFAULT_SHM_SIZE if self.tensor_parallel_size > 1 else None


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
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    runtime_class_name: str | None = None
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = ()
    volumes: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    env_from: tuple[Mapping[str, Any], ...] = ()


# The pod's own volumes and where the engine mounts them (builders/pod.py): a user volume
# or mount may not take these names or paths.
RESERVED_VOLUME_NAMES = ("tmp", "cache", "models", "dshm")
RESERVED_MOUNT_PATHS = ("/tmp", CACHE_DIR, MODELS_DIR, "/dev/shm")
# Labels kvpilot puts on the pods (selectors, ownership): podLabels may not set them.
RESERVED_LABEL_PREFIXES = ("app.kubernetes.io/", "kvpilot.dev/")
# Labels the Deployment controller puts on the pods it creates.
RESERVED_LABEL_KEYS = ("pod-template-hash",)
_LABEL_KEY_RE = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                           r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_DNS_SUBDOMAIN_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def is_dns_subdomain(name: str) -> bool:
    """A Kubernetes object name of the DNS-1123 subdomain kind (Secrets, RuntimeClasses,
    Leases): at most 253 lowercase letters, digits, '-' and '.'."""
    return len(name) <= 253 and _DNS_SUBDOMAIN_RE.fullmatch(name) is not None


@dataclass(frozen=True)
class EndpointPickerRef:
    """``spec.router.gateway.endpointPickerRef``: the user's endpoint picker (EPP) Service
    the InferencePool hands routing decisions to. ``port`` is its Service port (gRPC ext-proc)."""

    name: str
    port: int
    failure_mode: str


@dataclass(frozen=True)
class RouterSpec:
    """``spec.router``: what sits in front of the engine pods.

    Attributes:
        enabled: False = no router; clients use the engine Service.
        mode: ``router`` (a vllm-router Deployment) or ``gateway`` (an InferencePool for the
            cluster's Gateway API implementation).
        policy: vllm-router's ``--policy`` (router mode).
        session_header: the header consistent_hash routes on (only with that policy).
        replicas: router pods (router mode).
        resources: the router container's requests/limits (a copy; never mutated).
        image: image override; None = the operator's ``--router-image``.
        endpoint_picker: the gateway mode's endpoint picker (None in router mode).
    """

    enabled: bool = True
    mode: str = "router"
    policy: str = "kv_aware"
    session_header: str | None = None
    replicas: int = 1
    resources: Mapping[str, Any] = field(default_factory=lambda: copy.deepcopy(
        DEFAULTS["router.resources"]))
    image: str | None = None
    endpoint_picker: EndpointPickerRef | None = None

    @property
    def runs_router(self) -> bool:
        """True when the operator runs the vllm-router Deployment."""
        return self.enabled and self.mode == "router"

    @property
    def uses_gateway(self) -> bool:
        """True when the operator applies an InferencePool instead."""
        return self.enabled and self.mode == "gateway"

    @property
    def wants_kv_events(self) -> bool:
        """True when the engines must publish KV-cache events (router mode, kv_aware)."""
        return self.runs_router and self.policy == "kv_aware"


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
    router: RouterSpec = field(default_factory=RouterSpec)

    @property
    def static_replicas(self) -> int | None:
        """The fixed replica count, or None when the autoscaler decides."""
        if self.autoscaling is not None:
            return None
        return 1 if self.replicas is None else self.replicas


def _check_serve_flags(extra: tuple[str, ...]) -> None:
    """Refuse ``engine.extraArgs`` the engine would refuse (:mod:`kvpilot.flags.check`): vLLM
    flags kvpilot cannot honour, unknown flags and positional arguments (the operator sets
    ``--model``); vLLM's no-op flags pass, as the engine accepts them. One SpecError names
    every such argument with its reason."""
    try:
        split_vllm_flags(extra, positional_reason=POSITIONAL_REASON)
    except VLLMFlagError as exc:
        bad = [p.arg for p in exc.problems]
        raise SpecError("engine.extraArgs", bad[0] if len(bad) == 1 else bad,
                        f"kvpilot serve would fail: {exc}") from None


def _parse_engine(raw: Any) -> EngineSpec:
    r = FieldReader(raw, "engine", DEFAULTS)
    extra = r.items("extraArgs")
    for arg in extra:
        if not isinstance(arg, str):
            raise SpecError("engine.extraArgs", arg, "each entry must be a string")
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            field_hint = (" (engine.tensorParallelSize; default: the pod's GPU count)"
                          if flag in TENSOR_PARALLEL_FLAGS else "")
            raise SpecError("engine.extraArgs", arg, "set the matching spec field"
                            f"{field_hint} instead of repeating a managed flag")
        if arg in ("-h", "--help"):
            raise SpecError("engine.extraArgs", arg, "the engine would print its help and exit")
    _check_serve_flags(extra)
    engine = EngineSpec(
        image=r.string("image"),
        image_pull_policy=r.choice("imagePullPolicy", PULL_POLICIES),
        kv_cache_dtype=r.choice("kvCacheDtype", KV_CACHE_DTYPES),
        max_num_batched_tokens=r.integer("maxNumBatchedTokens", 1, 1 << 20),
        max_num_seqs=r.integer("maxNumSeqs", 1, 65536),
        block_size=r.choice("blockSize", BLOCK_SIZES),
        enable_prefix_caching=r.boolean("enablePrefixCaching"),
        gpu_memory_utilization=r.optional_number("gpuMemoryUtilization", 0.0, 1.0, lo_open=True),
        max_model_len=r.optional_integer("maxModelLen", 1, 1 << 30),
        extra_args=extra,
        # 0 until parse_spec resolves it (absent = the pod's GPU count): see _parallelism.
        tensor_parallel_size=r.optional_integer("tensorParallelSize", 1,
                                                MAX_TENSOR_PARALLEL_SIZE) or 0,
        shm_size=r.string("shmSize"),
    )
    if engine.shm_size is not None and not _SHM_SIZE.fullmatch(engine.shm_size):
        raise SpecError("engine.shmSize", engine.shm_size,
                        "a positive whole quantity of bytes such as 2Gi, 512Mi or 8G")
    if engine.max_num_batched_tokens < engine.max_num_seqs:
        raise SpecError("engine.maxNumBatchedTokens", engine.max_num_batched_tokens,
                        f"must be >= engine.maxNumSeqs ({engine.max_num_seqs})")
    if engine.max_model_len is not None and engine.max_model_len < engine.block_size:
        raise SpecError("engine.maxModelLen", engine.max_model_len,
                        f"must be >= engine.blockSize ({engine.block_size})")
    return engine


def _asked_resources(resources: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """Each resource the pod asks for -> (``resources.limits`` or ``resources.requests``,
    its quantity): the limit, else the request."""
    asked: dict[str, tuple[str, Any]] = {}
    for section in ("requests", "limits"):
        quantities = resources.get(section) or {}
        if not isinstance(quantities, Mapping):
            raise SpecError(f"resources.{section}", quantities,
                            "a map of resource names to quantities")
        asked.update({name: (f"resources.{section}", qty) for name, qty in quantities.items()})
    return asked


def _whole_number(where: str, quantity: Any) -> int:
    """A GPU quantity (4 or "4") as an int; SpecError when it is not a whole number."""
    if isinstance(quantity, int) and not isinstance(quantity, bool) and quantity >= 0:
        return quantity
    if isinstance(quantity, str) and _WHOLE_NUMBER.fullmatch(quantity):
        return int(quantity)
    raise SpecError(where, quantity, "a whole number of GPUs, such as 4 or \"4\"")


def gpu_count(resources: Mapping[str, Any]) -> int:
    """Whole GPUs the pod asks for: the quantities of its ``*/gpu`` resources
    (nvidia.com/gpu, amd.com/gpu; the limit, else the request), summed. 0 for a CPU pod
    and for MIG slices (``nvidia.com/mig-*``), which are not whole GPUs."""
    return sum(_whole_number(f"{where}.{name}", qty)
               for name, (where, qty) in _asked_resources(resources).items()
               if name.endswith(GPU_RESOURCE_SUFFIX))


def nonzero_quantity(quantity: object) -> bool:
    """Whether a resource quantity asks for anything (a limit of 0 asks for none)."""
    return str(quantity).strip() not in ("0", "0.0", "")


def _mig_slices(resources: Mapping[str, Any]) -> list[str]:
    """The MIG slice resources the pod asks for at least one of."""
    return sorted(name for name, (_, qty) in _asked_resources(resources).items()
                  if name.startswith(MIG_RESOURCE_PREFIX) and nonzero_quantity(qty))


def _parallelism(engine: EngineSpec, resources: Mapping[str, Any]) -> EngineSpec:
    """``engine`` with its tensor-parallel size resolved and checked against the pod:
    engine.tensorParallelSize, else the pod's whole-GPU count (1 without GPUs). It must
    divide the GPU count (a CPU pod may use any size: the engine runs its workers with
    gloo, for tests) and be 1 on MIG slices."""
    gpus = gpu_count(resources)
    explicit = engine.tensor_parallel_size or None
    tp = explicit or max(gpus, 1)
    if gpus and gpus % tp:
        divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
        gpu_names = ", ".join(n for n in _asked_resources(resources) if n.endswith(GPU_RESOURCE_SUFFIX))
        raise SpecError("engine.tensorParallelSize", tp,
                        f"a divisor of the pod's {gpus} GPUs ({gpu_names}): "
                        f"{', '.join(map(str, divisors))}; one engine runs over"
                        " tensorParallelSize GPUs (leave it unset to use them all)")
    mig = _mig_slices(resources)
    if tp > 1 and mig:
        raise SpecError("engine.tensorParallelSize", tp,
                        f"1 on MIG slices ({', '.join(mig)}): a process sees one MIG device,"
                        " so an engine cannot span several")
    return dataclasses.replace(engine, tensor_parallel_size=tp)


def _parse_autoscaling(raw: Any) -> AutoscalingSpec:
    """The CRD's ranges first (each error names its ``spec.autoscaling`` path), then the
    policy's own checks in :class:`AutoscalingSpec` (a ValueError left by them means the
    ranges here let through what the policy refuses: reported on ``autoscaling``)."""
    r = FieldReader(raw, "autoscaling", DEFAULTS)
    m = FieldReader(r.raw.get("metrics"), "autoscaling.metrics", DEFAULTS)
    source, url = m.choice("source", METRIC_SOURCES), m.string("url")
    if source == "prometheus" and (url is None or not re.fullmatch(r"https?://\S+", url)):
        raise SpecError("autoscaling.metrics.url", url,
                        "an http(s) URL is required when metrics.source is prometheus")
    min_replicas = r.integer("minReplicas", 0, MAX_REPLICAS)
    max_replicas = r.integer("maxReplicas", 1, MAX_REPLICAS)
    if min_replicas > max_replicas:
        raise SpecError("autoscaling.minReplicas", min_replicas,
                        f"must be <= autoscaling.maxReplicas ({max_replicas})")
    try:
        return AutoscalingSpec(
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            target_cache_usage=r.number("targetCacheUsage", 0.0, STARVATION_USAGE,
                                        lo_open=True, hi_open=True),
            target_queue_depth=r.number("targetQueueDepth", 0.0, 10000.0, lo_open=True),
            startup_seconds=r.integer("startupSeconds", 0, 7200),
            scale_up_stabilization_seconds=r.integer("scaleUpStabilizationSeconds", 0, 3600),
            scale_down_stabilization_seconds=r.integer("scaleDownStabilizationSeconds", 0,
                                                       86400),
            interval_seconds=r.integer("intervalSeconds", 1, MAX_INTERVAL_SECONDS),
            node_startup_seconds=r.integer("nodeStartupSeconds", 0, 3600),
            scale_to_zero_after_seconds=r.integer("scaleToZeroAfterSeconds", 1, 86400),
            activation_timeout_seconds=r.integer("activationTimeoutSeconds", 1, 3600),
            metrics=MetricsSourceSpec(source, url),
        )
    except ValueError as exc:
        if isinstance(exc, SpecError):
            raise
        raise SpecError("autoscaling", dict(r.raw), str(exc)) from None


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
    pod_labels = _pod_labels(r.mapping("podLabels"))
    runtime_class = r.string("runtimeClassName")
    if runtime_class is not None and not is_dns_subdomain(runtime_class):
        raise SpecError("runtimeClassName", runtime_class, "a RuntimeClass name (a DNS-1123 subdomain)")
    spread = _objects(r, "topologySpreadConstraints", "a list of core/v1 TopologySpreadConstraint objects")
    for item in spread:
        if not isinstance(item.get("topologyKey"), str) or item.get("whenUnsatisfiable") not in (
                "DoNotSchedule", "ScheduleAnyway") or not isinstance(item.get("maxSkew"), int):
            raise SpecError("topologySpreadConstraints", dict(item),
                            "each needs maxSkew (integer), topologyKey and whenUnsatisfiable "
                            "(DoNotSchedule or ScheduleAnyway)")
    volumes = _objects(r, "volumes", "a list of core/v1 Volume objects")
    names = [v.get("name") for v in volumes]
    for volume in volumes:
        name = volume.get("name")
        if not isinstance(name, str) or not name:
            raise SpecError("volumes", dict(volume), "each volume needs a name")
        if name in RESERVED_VOLUME_NAMES:
            raise SpecError("volumes", name, f"a name other than kvpilot's own volumes "
                                             f"({', '.join(RESERVED_VOLUME_NAMES)})")
        if names.count(name) > 1:
            raise SpecError("volumes", name, "unique volume names")
    mounts = _objects(r, "volumeMounts", "a list of core/v1 VolumeMount objects")
    for mount in mounts:
        if mount.get("name") not in names:
            raise SpecError("volumeMounts", dict(mount), f"a mount of one of spec.volumes ({', '.join(map(str, names)) or 'none'})")
        path = mount.get("mountPath")
        if not isinstance(path, str) or not path.startswith("/"):
            raise SpecError("volumeMounts", dict(mount), "an absolute mountPath")
        # The path the kubelet mounts at: '//models' and '/tmp/../models' are /models. A
        # parent of a reserved path ('/', '/dev') would cover it.
        norm = "/" + posixpath.normpath(path).lstrip("/")
        clash = [p for p in RESERVED_MOUNT_PATHS
                 if norm == p or norm.startswith(p + "/") or p.startswith(norm.rstrip("/") + "/")]
        if clash:
            raise SpecError("volumeMounts", path, f"a path outside kvpilot's own mounts ({', '.join(RESERVED_MOUNT_PATHS)})")
    env_from = _objects(r, "envFrom", "a list of core/v1 EnvFromSource objects")
    for source in env_from:
        refs = [k for k in ("configMapRef", "secretRef") if isinstance(source.get(k), Mapping)]
        if len(refs) != 1 or not isinstance(source[refs[0]].get("name"), str):
            raise SpecError("envFrom", dict(source), "each entry is {configMapRef: {name}} or {secretRef: {name}}, "
                                                     "with an optional prefix")
    return PodSettings(
        pod_labels=pod_labels,
        runtime_class_name=runtime_class,
        topology_spread_constraints=tuple(copy.deepcopy(dict(x)) for x in spread),
        volumes=tuple(copy.deepcopy(dict(x)) for x in volumes),
        volume_mounts=tuple(copy.deepcopy(dict(x)) for x in mounts),
        env_from=tuple(copy.deepcopy(dict(x)) for x in env_from),
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


def _objects(r: FieldReader, key: str, what: str) -> tuple[Mapping[str, Any], ...]:
    """``key``'s list of objects; SpecError naming it when an entry is not an object."""
    items = r.items(key)
    if not all(isinstance(x, Mapping) for x in items):
        raise SpecError(key, list(items), what)
    return tuple(items)


def _pod_labels(labels: Mapping[str, Any]) -> dict[str, str]:
    """``podLabels``, checked: valid keys and values, none of kvpilot's own."""
    out: dict[str, str] = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL_KEY_RE.fullmatch(key):
            raise SpecError("podLabels", key, "a label key ([prefix/]name, name at most 63 characters)")
        if key.startswith(RESERVED_LABEL_PREFIXES) or key in RESERVED_LABEL_KEYS:
            raise SpecError("podLabels", key, f"a key outside kvpilot's own label prefixes "
                                              f"({', '.join(RESERVED_LABEL_PREFIXES)}) and the "
                                              f"controllers' ({', '.join(RESERVED_LABEL_KEYS)})")
        if not isinstance(value, str) or not _LABEL_VALUE_RE.fullmatch(value):
            raise SpecError(f"podLabels.{key}", value, "a label value (at most 63 characters: "
                                                      "letters, digits, '-', '_', '.')")
        out[key] = value
    return out


_SERVICE_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _resources(r: FieldReader) -> dict[str, Any]:
    """``router.resources``: the CRD's default when absent; requests/limits maps only."""
    raw = r.raw.get("resources")
    if raw is None:
        return copy.deepcopy(dict(r.defaults["router.resources"]))
    value = r.mapping("resources")
    for key, quantities in value.items():
        if key not in ("requests", "limits") or not isinstance(quantities, Mapping):
            raise SpecError("router.resources", value,
                            "an object with requests and/or limits maps (core/v1 quantities)")
    return copy.deepcopy(value)


def _parse_router(raw: Any) -> RouterSpec:
    """``spec.router`` with the CRD's defaults; the same rules as the CRD's CEL."""
    r = FieldReader(raw, "router", DEFAULTS)
    mode, policy = r.choice("mode", ROUTER_MODES), r.choice("policy", ROUTER_POLICIES)
    header = r.string("sessionHeader")
    if policy == "consistent_hash" and header is None:
        raise SpecError("router.sessionHeader", None,
                        "required when router.policy is consistent_hash: the header clients"
                        f" put the session id in, one of {', '.join(SESSION_HEADERS)}")
    if header is not None and policy != "consistent_hash":
        raise SpecError("router.sessionHeader", header,
                        f"only with router.policy consistent_hash (policy is {policy})")
    if header is not None and header not in SESSION_HEADERS:
        raise SpecError("router.sessionHeader", header,
                        f"one of {', '.join(SESSION_HEADERS)} (the headers vllm-router's"
                        " consistent_hash reads; it cannot be given another)")
    picker = None
    gateway = FieldReader(r.raw.get("gateway"), "router.gateway", DEFAULTS)
    if mode == "gateway":
        if gateway.raw.get("endpointPickerRef") is None:
            raise SpecError("router.gateway.endpointPickerRef", None,
                            "required when router.mode is gateway: the endpoint picker"
                            " Service ({name, port}) the InferencePool hands requests to")
        ref = FieldReader(gateway.raw["endpointPickerRef"], "router.gateway.endpointPickerRef",
                          DEFAULTS)
        name = ref.required_string("name")
        if len(name) > 63 or not _SERVICE_NAME_RE.fullmatch(name):
            raise SpecError("router.gateway.endpointPickerRef.name", name,
                            "a Service name (a DNS-1035 label of at most 63 characters)")
        picker = EndpointPickerRef(name, ref.integer("port", 1, 65535),
                                   ref.choice("failureMode", FAILURE_MODES))
    return RouterSpec(
        enabled=r.boolean("enabled"),
        mode=mode,
        policy=policy,
        session_header=header,
        replicas=r.integer("replicas", 1, MAX_ROUTER_REPLICAS),
        resources=_resources(r),
        image=r.string("image"),
        endpoint_picker=picker,
    )


def parse_spec(raw: Any) -> InferenceSpec:
    """Validate a raw ``spec`` mapping (as stored, camelCase) into an :class:`InferenceSpec`.

    Applies the CRD defaults for missing fields, so it also accepts specs the API server
    did not default. Raises :class:`SpecError` on the first invalid field.
    """
    r = FieldReader(raw, "", DEFAULTS)
    model = FieldReader(r.raw.get("model"), "model", DEFAULTS)
    uri = model.required_string("uri")
    served = model.string("servedModelName")
    if served is not None and not _SERVED_NAME.fullmatch(served):
        raise SpecError("model.servedModelName", served,
                        "1-128 characters of letters, digits and . _ / : -, starting with a"
                        " letter or digit")
    try:
        source = parse_model_uri(uri, served)
    except ValueError as exc:
        raise SpecError("model.uri", uri, str(exc)) from None
    secret, mount = model.string("credentialsSecret"), model.string("ociMount")
    if secret is not None and not is_dns_subdomain(secret):
        raise SpecError("model.credentialsSecret", secret, "a Secret name (a DNS-1123 subdomain)")
    try:
        source = with_fetch_options(source, secret, mount)
    except ValueError as exc:
        where = "model.ociMount" if mount is not None and "ociMount" in str(exc) else "model.credentialsSecret"
        raise SpecError(where, mount if where == "model.ociMount" else secret, str(exc)) from None
    if r.raw.get("replicas") is not None and r.raw.get("autoscaling") is not None:
        raise SpecError("replicas", r.raw["replicas"],
                        "spec.replicas and spec.autoscaling are mutually exclusive")
    autoscaling = r.raw.get("autoscaling")
    finops = FieldReader(r.raw.get("finops"), "finops", DEFAULTS)
    engine, router = _parse_engine(r.raw.get("engine")), _parse_router(r.raw.get("router"))
    if router.wants_kv_events:
        for arg in engine.extra_args:
            if arg.split("=", 1)[0] == KV_EVENTS_FLAG:
                raise SpecError("engine.extraArgs", arg,
                                f"{KV_EVENTS_FLAG} is set by the operator while router.policy"
                                " is kv_aware (the router subscribes to those events)")
    scaling = None if autoscaling is None else _parse_autoscaling(autoscaling)
    if scaling is not None and scaling.scale_to_zero and not router.runs_router:
        where = "router.enabled is false" if not router.enabled else f"router.mode is {router.mode}"
        raise SpecError("autoscaling.minReplicas", 0,
                        f">= 1 while {where}: scale to zero needs the operator's router"
                        " (router.mode: router) to hold the first request while an engine"
                        " starts")
    replicas = r.optional_integer("replicas", 0, MAX_REPLICAS)
    pod = _parse_pod(r)
    return InferenceSpec(
        model=source,
        engine=_parallelism(engine, pod.resources),
        replicas=replicas,
        autoscaling=scaling,
        pod=pod,
        cost_per_replica_hour=finops.optional_number("costPerReplicaHour", 0.0, 1e9),
        router=router,
    )


def check_name(name: str, router: RouterSpec | None = None) -> None:
    """Refuse names that cannot name the child objects and label values (DNS-1035, <= 63;
    <= 56 while the router runs, whose Service is NAME-router). Raises SpecError."""
    if not (isinstance(name, str) and len(name) <= 63 and _NAME_RE.fullmatch(name)):
        raise SpecError("metadata.name", name,
                        "a DNS-1035 label of at most 63 characters is required")
    if router is not None and router.runs_router and len(name) > MAX_NAME_WITH_ROUTER:
        raise SpecError("metadata.name", name,
                        f"at most {MAX_NAME_WITH_ROUTER} characters while spec.router runs in"
                        " router mode (its Deployment and Service are named NAME-router)")
