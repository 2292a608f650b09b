"""The request router in front of an InferenceDeployment's engine pods.

Router mode (``spec.router.mode: router``, the default) runs vllm-router (the Rust proxy
of the vllm-project/router repository, pinned in docker/router.Dockerfile)::

    clients -> Service NAME-router :8000 -> router pods (Deployment NAME-router)
                                              | watch pods (Kubernetes service discovery,
                                              | ServiceAccount NAME-router, RoleBinding to
                                              | the chart's ClusterRole kvpilot-router)
                                              v
                                    ready engine pods :8000 (selected by label)

The router adds a pod when it is Running and Ready and removes it as soon as the pod has
a deletionTimestamp, so a pod being removed gets no new requests while it drains (its
preStop sleep and ``--drain-timeout`` let running streams finish). It also probes every
engine's ``/ready`` itself, which answers 503 while the engine loads or drains.

Gateway mode (``spec.router.mode: gateway``) runs no router: an InferencePool
(``inference.networking.k8s.io/v1``, the Gateway API Inference Extension) selects the
engine pods, and the cluster's Gateway implementation asks the user's endpoint picker
(``spec.router.gateway.endpointPickerRef``) where each request goes.

Every builder here is pure (no I/O, no clock), like the engine's.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from kvpilot.operator import constants as c
from kvpilot.operator.builders.labels import (
    router_name,
    router_object_labels,
    router_selector_labels,
    selector_labels,
)
from kvpilot.operator.constants import CACHE_DIR
from kvpilot.operator.spec import InferenceSpec

ROUTER_COMMAND = ("vllm-router",)
# Numeric UID/GID of the non-root user in docker/router.Dockerfile.
ROUTER_UID = 10001
LIVENESS_PATH = "/liveness"  # 200 while the process serves
# 200 once the router has at least one healthy engine, 503 before: a new router pod gets
# traffic only after its service discovery found an engine (checked with vllm-router 0.1.17).
READINESS_PATH = "/readiness"
# vllm-router's own health checks of each engine: the engine's /ready answers 503 while it
# loads or drains, so a draining pod is also taken out by the router within ~10 s.
ENGINE_HEALTH_PATH = c.READY_PATH
HEALTH_CHECK_INTERVAL_SECONDS = 5
HEALTH_CHECK_TIMEOUT_SECONDS = 3
HEALTH_FAILURE_THRESHOLD = 2
HEALTH_SUCCESS_THRESHOLD = 2
# --retry-max-retries counts attempts, the first one included (vllm-router's retry loop
# stops at attempt + 1 >= max; --disable-retries is documented as the value 1). Two = one
# retry, on a freshly picked engine, and only for a retryable status before any byte of the
# answer was streamed: no request goes to a dead engine more than twice.
MAX_ATTEMPTS = 2
RETRY_INITIAL_BACKOFF_MS = 50
RETRY_MAX_BACKOFF_MS = 500
# Scale to zero (autoscaling.minReplicas 0): the router holds a request that finds no engine
# by retrying it, and vllm-router retries "no available workers" like a failed attempt
# (checked with 0.1.17: a worker added during the retries gets the request). The schedule
# grows by 1.5x from 50 ms to 500 ms, without jitter, and has as many attempts as it takes
# for the waits to add up to activationTimeoutSeconds (hold_attempts); each attempt that
# finds no engine counts in vllm_router_request_errors_total{error_type=
# "no_available_workers"}, which the operator polls every second while the fleet is at zero.
HOLD_BACKOFF_MULTIPLIER = 1.5
# vllm-router's own default; raised when the hold needs more.
REQUEST_TIMEOUT_SECONDS = 1800
# On deletion the kubelet runs this sleep first, so the Service drops the router pod
# before SIGTERM; vllm-router then stops accepting and finishes the streams it proxies.
PRESTOP_SLEEP_SECONDS = 5
# Environment entries of the engine pods the router needs too, copied unchanged (a
# valueFrom.secretKeyRef stays a reference): the engine's API key, for the router's own
# calls to the engines, and a Hugging Face token, for the tokenizer kv_aware downloads.
SHARED_ENV = ("KVPILOT_API_KEY", "HF_TOKEN")
API_KEY_ENV = "KVPILOT_API_KEY"
POD_MONITOR_API_VERSION = "monitoring.coreos.com/v1"
SCRAPE_INTERVAL = "15s"


def _metadata(name: str, namespace: str, owner_ref: Mapping[str, Any],
              labels: Mapping[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": dict(labels),
        "ownerReferences": [dict(owner_ref)],
    }


def _api_key_arg(spec: InferenceSpec) -> list[str]:
    """``--api-key`` for the router's own calls to the engines, when the engines have one:
    ``--api-key`` in engine.extraArgs (passed on as written), else the ``KVPILOT_API_KEY``
    environment entry, which Kubernetes expands into the argument (``$(VAR)``) so the key
    never appears in the pod spec. vllm-router forwards each client's own Authorization
    header unchanged and never adds this key to proxied requests (checked), so the engines
    still authenticate every client."""
    args = spec.engine.extra_args
    for i, arg in enumerate(args):
        if arg.startswith("--api-key="):
            return ["--api-key", arg.split("=", 1)[1]]
        if arg == "--api-key" and i + 1 < len(args):
            return ["--api-key", args[i + 1]]
    if any(item["name"] == API_KEY_ENV for item in spec.pod.env):
        return ["--api-key", f"$({API_KEY_ENV})"]
    return []


def hold_attempts(hold_seconds: float, initial_ms: int = RETRY_INITIAL_BACKOFF_MS,
                  max_ms: int = RETRY_MAX_BACKOFF_MS,
                  multiplier: float = HOLD_BACKOFF_MULTIPLIER) -> int:
    """``--retry-max-retries`` for a router that holds a request ``hold_seconds`` (> 0):
    attempts (the first included) whose backoffs, ``initial_ms`` growing by ``multiplier``
    up to ``max_ms``, add up to at least ``hold_seconds``. Raises ValueError for a
    non-positive hold."""
    if not hold_seconds > 0:
        raise ValueError(f"hold_seconds must be > 0; got {hold_seconds}")
    attempts, waited_ms, backoff = 1, 0.0, float(initial_ms)
    while waited_ms < hold_seconds * 1000:
        waited_ms += min(backoff, max_ms)
        backoff *= multiplier
        attempts += 1
    return attempts


def retry_args(spec: InferenceSpec) -> list[str]:
    """Bounded retries; with scale to zero, the retry schedule that holds a request for
    ``activationTimeoutSeconds`` while no engine serves (then vllm-router answers 503)."""
    auto = spec.autoscaling
    if auto is None or not auto.scale_to_zero:
        return ["--retry-max-retries", str(MAX_ATTEMPTS),
                "--retry-initial-backoff-ms", str(RETRY_INITIAL_BACKOFF_MS),
                "--retry-max-backoff-ms", str(RETRY_MAX_BACKOFF_MS)]
    hold = auto.activation_timeout_seconds
    return ["--retry-max-retries", str(hold_attempts(hold)),
            "--retry-initial-backoff-ms", str(RETRY_INITIAL_BACKOFF_MS),
            "--retry-max-backoff-ms", str(RETRY_MAX_BACKOFF_MS),
            "--retry-backoff-multiplier", str(HOLD_BACKOFF_MULTIPLIER),
            "--retry-jitter-factor", "0",
            "--request-timeout-secs", str(max(REQUEST_TIMEOUT_SECONDS,
                                              math.ceil(hold) + REQUEST_TIMEOUT_SECONDS))]


def router_args(name: str, namespace: str, spec: InferenceSpec) -> list[str]:
    """Arguments after ``vllm-router``: listen, policy, discovery of this resource's engine
    pods in its namespace only, Prometheus metrics, health checks and bounded retries
    (with scale to zero, the retries that hold a request while an engine starts)."""
    selector = [f"{k}={v}" for k, v in sorted(selector_labels(name).items())]
    return [
        "--host", "0.0.0.0", "--port", str(c.ROUTER_PORT),
        "--policy", spec.router.policy,
        "--service-discovery", "--selector", *selector,
        "--service-discovery-port", str(c.ENGINE_PORT),
        "--service-discovery-namespace", namespace,
        "--prometheus-host", "0.0.0.0", "--prometheus-port", str(c.ROUTER_METRICS_PORT),
        "--health-check-endpoint", ENGINE_HEALTH_PATH,
        "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_SECONDS),
        "--health-check-timeout-secs", str(HEALTH_CHECK_TIMEOUT_SECONDS),
        "--health-failure-threshold", str(HEALTH_FAILURE_THRESHOLD),
        "--health-success-threshold", str(HEALTH_SUCCESS_THRESHOLD),
        *retry_args(spec),
        *_api_key_arg(spec),
    ]


def _env(spec: InferenceSpec) -> list[dict[str, Any]]:
    env: dict[str, dict[str, Any]] = {
        key: {"name": key, "value": value}
        for key, value in (
            ("HOME", "/tmp"),
            ("XDG_CACHE_HOME", CACHE_DIR),
            ("HF_HOME", f"{CACHE_DIR}/huggingface"),
            ("PYTHONDONTWRITEBYTECODE", "1"),
            ("PYTHONUNBUFFERED", "1"),
        )
    }
    for item in spec.pod.env:
        if item["name"] in SHARED_ENV:
            env[item["name"]] = copy.deepcopy(dict(item))
    return list(env.values())


def _probe(path: str, period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": c.ROUTER_PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
        "successThreshold": 1,
    }


def _readiness_path(spec: InferenceSpec) -> str:
    """``/readiness`` (ready once an engine is healthy), except with scale to zero: there
    the router must take requests while no engine exists, to hold them, so it is ready
    whenever it serves (``/liveness``)."""
    auto = spec.autoscaling
    return LIVENESS_PATH if auto is not None and auto.scale_to_zero else READINESS_PATH


def _container(name: str, namespace: str, spec: InferenceSpec, image: str) -> dict[str, Any]:
    return {
        "name": "router",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": list(ROUTER_COMMAND),
        "args": router_args(name, namespace, spec),
        "ports": [
            {"name": c.ROUTER_PORT_NAME, "containerPort": c.ROUTER_PORT, "protocol": "TCP"},
            {"name": c.ROUTER_METRICS_PORT_NAME, "containerPort": c.ROUTER_METRICS_PORT,
             "protocol": "TCP"},
        ],
        "env": _env(spec),
        "resources": copy.deepcopy(dict(spec.router.resources)),
        "startupProbe": _probe(LIVENESS_PATH, 2, 3, 30),
        "livenessProbe": _probe(LIVENESS_PATH, 10, 5, 3),
        "readinessProbe": _probe(_readiness_path(spec), 5, 3, 2),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                         {"name": "cache", "mountPath": CACHE_DIR}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def build_router_pod_template(name: str, namespace: str, spec: InferenceSpec,
                              default_image: str) -> dict[str, Any]:
    """The router Deployment's ``spec.template``. The router calls the Kubernetes API (it
    watches pods), so unlike the engine it mounts its ServiceAccount's token. The engine
    pods' scheduling settings (GPU node selectors, tolerations) are not copied: the router
    runs on any node, spread over nodes when it has several replicas."""
    image = spec.router.image or default_image
    pod: dict[str, Any] = {
        "serviceAccountName": router_name(name),
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        # vllm-router drains on SIGTERM: the streams it proxies get the engines' grace period.
        "terminationGracePeriodSeconds": spec.pod.termination_grace_period_seconds,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": ROUTER_UID,
            "runAsGroup": ROUTER_UID,
            "fsGroup": ROUTER_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_container(name, namespace, spec, image)],
        "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}],
        "topologySpreadConstraints": [{
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": router_selector_labels(name)},
        }],
    }
    if spec.pod.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in spec.pod.image_pull_secrets]
    if spec.pod.priority_class_name:
        pod["priorityClassName"] = spec.pod.priority_class_name
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(c.ROUTER_METRICS_PORT),
        "prometheus.io/path": c.METRICS_PATH,
    }
    return {"metadata": {"labels": router_object_labels(name), "annotations": annotations},
            "spec": pod}


def build_router_deployment(name: str, namespace: str, owner_ref: Mapping[str, Any],
                            spec: InferenceSpec, default_image: str) -> dict[str, Any]:
    """The vllm-router Deployment ``NAME-router`` with ``spec.router.replicas`` pods; rolling
    updates add a pod before removing one, and the new one takes traffic only once ready."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(router_name(name), namespace, owner_ref, router_object_labels(name)),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": router_selector_labels(name)},
            "revisionHistoryLimit": 5,
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": build_router_pod_template(name, namespace, spec, default_image),
        },
    }


def build_router_service(name: str, namespace: str,
                         owner_ref: Mapping[str, Any]) -> dict[str, Any]:
    """ClusterIP ``NAME-router`` on port 8000: the endpoint clients use (status.endpoint)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(router_name(name), namespace, owner_ref, router_object_labels(name)),
        "spec": {
            "type": "ClusterIP",
            "selector": router_selector_labels(name),
            "ports": [{
                "name": c.ROUTER_PORT_NAME,
                "port": c.ROUTER_PORT,
                "targetPort": c.ROUTER_PORT_NAME,
                "protocol": "TCP",
            }],
        },
    }


def build_router_pod_disruption_budget(name: str, namespace: str,
                                       owner_ref: Mapping[str, Any]) -> dict[str, Any]:
    """At most one router pod evicted at a time. Built only for two or more replicas: with
    one, ``maxUnavailable: 1`` protects nothing and ``minAvailable: 1`` would block every
    node drain, so a single router is simply replaced (docs/operator.md, "Routing")."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(router_name(name), namespace, owner_ref, router_object_labels(name)),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": router_selector_labels(name)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def build_router_service_account(name: str, namespace: str,
                                 owner_ref: Mapping[str, Any]) -> dict[str, Any]:
    """The router pods' identity, ``NAME-router``, used for nothing but the binding below."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(router_name(name), namespace, owner_ref, router_object_labels(name)),
    }


def build_router_role_binding(name: str, namespace: str,
                              owner_ref: Mapping[str, Any]) -> dict[str, Any]:
    """Grants the router's ServiceAccount, in this namespace only, the chart's ClusterRole
    ``kvpilot-router`` (pods get/list/watch: what vllm-router's discovery watches)."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(router_name(name), namespace, owner_ref, router_object_labels(name)),
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": c.ROUTER_CLUSTER_ROLE,
        },
        "subjects": [{"kind": "ServiceAccount", "name": router_name(name),
                      "namespace": namespace}],
    }


def build_router_pod_monitor(name: str, namespace: str, owner_ref: Mapping[str, Any],
                             extra_labels: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    """A PodMonitor ``NAME-router`` scraping the router pods' metrics port (vllm_router_*
    series), with the owner's name in the ``inference_deployment`` series label as for the
    engines. ``extra_labels`` go on the PodMonitor itself; ours win on a clash."""
    owner_label = "__meta_kubernetes_pod_label_" + "".join(
        ch if ch.isalnum() else "_" for ch in c.LABEL_OWNER
    )
    labels = {**dict(extra_labels), **router_object_labels(name)}
    return {
        "apiVersion": POD_MONITOR_API_VERSION,
        "kind": "PodMonitor",
        "metadata": _metadata(router_name(name), namespace, owner_ref, labels),
        "spec": {
            "selector": {"matchLabels": router_selector_labels(name)},
            "podMetricsEndpoints": [{
                "port": c.ROUTER_METRICS_PORT_NAME,
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


def build_inference_pool(name: str, namespace: str, owner_ref: Mapping[str, Any],
                         spec: InferenceSpec, labels: Mapping[str, str]) -> dict[str, Any]:
    """The InferencePool ``NAME`` of gateway mode: the engine pods (the engine Service's
    selector) on the engine port, and the endpoint picker Service the Gateway consults.

    Raises ValueError when the spec has no endpoint picker (parse_spec refuses that)."""
    picker = spec.router.endpoint_picker
    if picker is None:
        raise ValueError("gateway mode needs spec.router.gateway.endpointPickerRef")
    return {
        "apiVersion": c.INFERENCE_POOL_API_VERSION,
        "kind": c.INFERENCE_POOL_KIND,
        "metadata": _metadata(name, namespace, owner_ref, labels),
        "spec": {
            "selector": {"matchLabels": selector_labels(name)},
            "targetPorts": [{"number": c.ENGINE_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": picker.name,
                "port": {"number": picker.port},
                "failureMode": picker.failure_mode,
            },
        },
    }
