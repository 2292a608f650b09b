"""The engine pod template.

Layout of one engine pod::

    [init: model-download]  hf:// snapshot of ORG/NAME, s3:// and oci:// (kvpilot
                            fetch-model, credentials from model.credentialsSecret)
                            -> emptyDir /models
    [engine]                kvpilot serve ... on :8000 (/health, /ready, /metrics);
                            with the kv_aware router, KV events on ZMQ :5557 (replay :5558)
        /tmp    emptyDir   (root filesystem is read-only)
        /cache  emptyDir   (HF, Triton and torch caches)
        /models emptyDir (hf, s3, oci) | PVC read-only (pvc);
                /models/NAME an image volume (oci with model.ociMount ImageVolume)
        /etc/kvpilot/adapters  the adapters ConfigMap, read-only (LoRA on: spec.adapters
                 or engine.lora; only its name is in the template, so a new adapter list
                 changes no pod)
        /dev/shm memory emptyDir (GPU pods and tensor-parallel pods: torch uses shared
                 memory; its workers exchange tensors through it. sizeLimit: engine.shmSize,
                 else 2Gi with tensorParallelSize > 1, else none)

Probes: a startup probe on /health that tolerates slow model loads (at least 10 minutes,
or 5 x autoscaling.startupSeconds), liveness on /health, readiness on /ready (the engine
answers 503 while loading or draining). On deletion a short preStop sleep lets the
Service drop the pod before SIGTERM starts the engine's drain, and the engine's
``--drain-timeout`` is what terminationGracePeriodSeconds leaves after it (minus 5 s to exit),
so in-flight generations run as long as the grace period allows and the engine exits 0
before the kubelet's SIGKILL.
"""

from __future__ import annotations

import copy
import hashlib
import math
from typing import Any

from kvpilot.operator import constants as c
from kvpilot.operator.builders.engine_args import (
    ENGINE_COMMAND,
    engine_args,
    gpu_resource_names,
    prestop_sleep_seconds,
)
from kvpilot.operator.builders.labels import adapters_name, object_labels, selector_labels
from kvpilot.operator.constants import CACHE_DIR
from kvpilot.operator.model_uri import MODELS_DIR
from kvpilot.operator.spec import InferenceSpec

# Numeric UID/GID of the `kvpilot` user in docker/engine.Dockerfile.
ENGINE_UID = 10001
DEFAULT_STARTUP_SECONDS = 120
MIN_STARTUP_BUDGET_SECONDS = 600
STARTUP_PERIOD_SECONDS = 10
# Downloads an hf:// repository's weights, config and tokenizer (not *.bin/*.pth copies).
HF_DOWNLOAD_SCRIPT = (
    "import sys\n"
    "from huggingface_hub import snapshot_download\n"
    "snapshot_download(repo_id=sys.argv[1], local_dir=sys.argv[2], allow_patterns=["
    "'*.json', '*.safetensors', 'tokenizer*', '*.model', '*.txt', '*.gguf'])\n"
)


def startup_budget_seconds(spec: InferenceSpec) -> int:
    """How long the startup probe waits for the first healthy answer."""
    expected = spec.autoscaling.startup_seconds if spec.autoscaling else DEFAULT_STARTUP_SECONDS
    return math.ceil(max(MIN_STARTUP_BUDGET_SECONDS, 5 * expected))


def _container_security() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def fleet_hash_seed(name: str) -> str:
    """``PYTHONHASHSEED`` of every engine pod of the InferenceDeployment ``name``: the
    seed of vLLM's KV block hashes (``NONE_HASH``), the same across the fleet and across
    restarts and rollouts, so every pod reports a prefix's blocks with the same hashes
    and a prefix indexer (llm-d's, with this value as its ``hashSeed``) can recompute
    them. A decimal integer below 2**32 (what Python accepts), from the name's SHA-256."""
    return str(int.from_bytes(hashlib.sha256(f"kvpilot-fleet/{name}".encode()).digest()[:4], "big"))


def _env(spec: InferenceSpec, lora: bool = False, hash_seed: str | None = None) -> list[dict[str, Any]]:
    """Cache locations on writable volumes (and, for the engine with ``lora``, the switch
    of the runtime LoRA routes; with ``hash_seed``, ``PYTHONHASHSEED``), then the user's env
    (a user entry replaces ours of the same name: server-side apply refuses duplicate
    names)."""
    env: dict[str, dict[str, Any]] = {
        name: {"name": name, "value": value}
        for name, value in (
            ("HOME", "/tmp"),
            ("XDG_CACHE_HOME", CACHE_DIR),
            ("HF_HOME", f"{CACHE_DIR}/huggingface"),
            ("TRITON_CACHE_DIR", f"{CACHE_DIR}/triton"),
            ("TORCHINDUCTOR_CACHE_DIR", f"{CACHE_DIR}/torchinductor"),
            ("PYTHONDONTWRITEBYTECODE", "1"),
            ("PYTHONUNBUFFERED", "1"),
        )
    }
    if lora:
        # Mounts vLLM's runtime routes POST /v1/load_lora_adapter and
        # /v1/unload_lora_adapter, through which the operator keeps the pod in step.
        env[c.RUNTIME_LORA_ENV] = {"name": c.RUNTIME_LORA_ENV, "value": "true"}
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = {"name": "PYTHONHASHSEED", "value": hash_seed}
    for item in spec.pod.env:
        env[item["name"]] = copy.deepcopy(dict(item))
    return list(env.values())


def _volumes(name: str, spec: InferenceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, engine volume mounts)."""
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}},
                                     {"name": "cache", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": "tmp", "mountPath": "/tmp"},
                                    {"name": "cache", "mountPath": CACHE_DIR}]
    if spec.model.image_volume:
        # The kubelet pulls the image (imagePullSecrets apply) and mounts it read-only.
        volumes.append({"name": "models", "image": {"reference": spec.model.oci_reference,
                                                    "pullPolicy": "IfNotPresent"}})
        mounts.append({"name": "models", "mountPath": spec.model.model_arg, "readOnly": True})
    elif spec.model.scheme == "hf" or spec.model.fetched:
        volumes.append({"name": "models", "emptyDir": {}})
        mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
    elif spec.model.scheme == "pvc":
        volumes.append({
            "name": "models",
            "persistentVolumeClaim": {"claimName": spec.model.claim_name, "readOnly": True},
        })
        mounts.append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
    # The container runtime's /dev/shm is 64 MiB: too small for torch, whose DataLoader
    # and tensor-parallel workers (NCCL's shared-memory transport, gloo on CPU) exchange
    # tensors through it. A memory emptyDir counts against the container's memory limit,
    # so a tensor-parallel pod gets a bound (engine.shmSize, else 2Gi), as vLLM's chart does.
    limit = spec.engine.shm_size_limit
    if gpu_resource_names(spec) or spec.engine.tensor_parallel_size > 1 or limit is not None:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory",
                                                     **({"sizeLimit": limit} if limit else {})}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if spec.lora_enabled:
        volumes.append({"name": c.ADAPTERS_VOLUME, "configMap": {"name": adapters_name(name)}})
        mounts.append({"name": c.ADAPTERS_VOLUME, "mountPath": c.ADAPTERS_DIR, "readOnly": True})
    return volumes, mounts


def _probe(path: str, period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": c.ENGINE_PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
        "successThreshold": 1,
    }


def _engine_ports(spec: InferenceSpec) -> list[dict[str, Any]]:
    """The HTTP port, plus the KV-event publisher's two ZMQ ports when the router
    subscribes to them (declared so that they are named and visible, like any served port)."""
    ports = [{"name": c.ENGINE_PORT_NAME, "containerPort": c.ENGINE_PORT, "protocol": "TCP"}]
    if spec.router.wants_kv_events:
        ports += [
            {"name": c.KV_EVENTS_PORT_NAME, "containerPort": c.KV_EVENTS_PORT, "protocol": "TCP"},
            {"name": c.KV_EVENTS_REPLAY_PORT_NAME, "containerPort": c.KV_EVENTS_REPLAY_PORT,
             "protocol": "TCP"},
        ]
    return ports


def _engine_container(name: str, spec: InferenceSpec, image: str,
                      mounts: list[dict[str, Any]]) -> dict[str, Any]:
    startup_failures = math.ceil(startup_budget_seconds(spec) / STARTUP_PERIOD_SECONDS)
    return {
        "name": "engine",
        "image": image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": list(ENGINE_COMMAND),
        "args": engine_args(spec),
        "ports": _engine_ports(spec),
        "env": _env(spec, lora=spec.lora_enabled, hash_seed=fleet_hash_seed(name)),
        "resources": copy.deepcopy(dict(spec.pod.resources)),
        "startupProbe": _probe(c.HEALTH_PATH, STARTUP_PERIOD_SECONDS, 5, startup_failures),
        "livenessProbe": _probe(c.HEALTH_PATH, 15, 10, 4),
        "readinessProbe": _probe(c.READY_PATH, 5, 3, 2),
        "lifecycle": {
            "preStop": {"exec": {"command": ["sleep", str(prestop_sleep_seconds(spec))]}}
        },
        "securityContext": _container_security(),
        "volumeMounts": mounts + [copy.deepcopy(dict(m)) for m in spec.pod.volume_mounts],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        **_env_from(spec),
    }


def _env_from(spec: InferenceSpec) -> dict[str, Any]:
    """``{"envFrom": [...]}`` when the spec has some, else {} (no empty list to apply).
    While LoRA is on, the engine downloads adapters itself: ``model.credentialsSecret``
    comes last (its keys win, as in the download container), whatever the adapters' URIs,
    so a new s3:// adapter needs no new pod."""
    env_from = [copy.deepcopy(dict(x)) for x in spec.pod.env_from]
    if spec.lora_enabled and spec.model.credentials_secret:
        env_from.append({"secretRef": {"name": spec.model.credentials_secret}})
    return {"envFrom": env_from} if env_from else {}


def _spread(name: str, spec: InferenceSpec) -> list[dict[str, Any]]:
    """The user's topology spread constraints; one without a labelSelector spreads this
    InferenceDeployment's engine pods (its selector), which is what one almost always
    means."""
    out = []
    for item in spec.pod.topology_spread_constraints:
        constraint = copy.deepcopy(dict(item))
        constraint.setdefault("labelSelector", {"matchLabels": selector_labels(name)})
        out.append(constraint)
    return out


def _download_container(spec: InferenceSpec, image: str) -> dict[str, Any]:
    """The ``model-download`` init container: huggingface_hub for hf://, ``kvpilot
    fetch-model`` for s3:// and oci:// (progress lines in its log). The credentials Secret
    comes after the user's envFrom, so its keys win."""
    dest = spec.model.model_arg
    if spec.model.scheme == "hf":
        command = ["python3", "-c", HF_DOWNLOAD_SCRIPT, spec.model.hf_repo or "", dest]
    else:
        command = ["kvpilot", "fetch-model", spec.model.uri, dest]
    env_from = [copy.deepcopy(dict(x)) for x in spec.pod.env_from]
    if spec.model.credentials_secret:
        env_from.append({"secretRef": {"name": spec.model.credentials_secret}})
    return {
        "name": "model-download",
        "image": image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": command,
        "env": _env(spec),
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
        "securityContext": _container_security(),
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "cache", "mountPath": CACHE_DIR},
            {"name": "models", "mountPath": MODELS_DIR},
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # Credentials for a private hub repository, bucket or registry.
        **({"envFrom": env_from} if env_from else {}),
    }


def _tolerations(spec: InferenceSpec) -> list[dict[str, Any]]:
    """The user's tolerations, plus ``<gpu resource>:NoSchedule`` for each GPU resource asked
    for (GPU node pools are commonly tainted so that only GPU pods land there)."""
    tolerations = [copy.deepcopy(dict(t)) for t in spec.pod.tolerations]
    keys = {t.get("key") for t in tolerations}
    # A MIG slice runs on a node of the GPU pool, tainted like any other (nvidia.com/gpu).
    taints = {"nvidia.com/gpu" if n.startswith("nvidia.com/mig-") else n
              for n in gpu_resource_names(spec)}
    for name in sorted(taints):
        if name not in keys:
            tolerations.append({"key": name, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def build_pod_template(name: str, spec: InferenceSpec, default_image: str) -> dict[str, Any]:
    """The Deployment's ``spec.template`` for the InferenceDeployment ``name``."""
    image = spec.engine.image or default_image
    volumes, mounts = _volumes(name, spec)
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(c.ENGINE_PORT),
        "prometheus.io/path": c.METRICS_PATH,
        **spec.pod.pod_annotations,
    }
    pod: dict[str, Any] = {
        "enableServiceLinks": False,
        # The engine never calls the Kubernetes API.
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": spec.pod.termination_grace_period_seconds,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": ENGINE_UID,
            "runAsGroup": ENGINE_UID,
            "fsGroup": ENGINE_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_engine_container(name, spec, image, mounts)],
        "volumes": volumes + [copy.deepcopy(dict(v)) for v in spec.pod.volumes],
    }
    if spec.model.scheme == "hf" or (spec.model.fetched and not spec.model.image_volume):
        pod["initContainers"] = [_download_container(spec, image)]
    if spec.pod.service_account_name:
        pod["serviceAccountName"] = spec.pod.service_account_name
    if spec.pod.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in spec.pod.image_pull_secrets]
    if spec.pod.priority_class_name:
        pod["priorityClassName"] = spec.pod.priority_class_name
    if spec.pod.node_selector:
        pod["nodeSelector"] = dict(spec.pod.node_selector)
    if tolerations := _tolerations(spec):
        pod["tolerations"] = tolerations
    if spec.pod.affinity:
        pod["affinity"] = copy.deepcopy(dict(spec.pod.affinity))
    if spec.pod.runtime_class_name:
        pod["runtimeClassName"] = spec.pod.runtime_class_name
    if spread := _spread(name, spec):
        pod["topologySpreadConstraints"] = spread
    # The user's labels first: kvpilot's own (the selector among them) always win, and
    # the spec refuses keys under their prefixes anyway.
    labels = {**spec.pod.pod_labels, **object_labels(name)}
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod}
