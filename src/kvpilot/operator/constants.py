"""Names the operator, the chart, the CRD and the alerts share. Change one here and the
tests that compare the chart and CRD against these values fail until they agree."""

from __future__ import annotations

GROUP = "kvpilot.dev"
VERSION = "v1alpha1"
PLURAL = "inferencedeployments"
KIND = "InferenceDeployment"
API_VERSION = f"{GROUP}/{VERSION}"

# Server-side apply field manager for every object the operator writes.
FIELD_MANAGER = "kvpilot-operator"
# Kopf's finalizer and its progress/diff-base annotations live under our group.
FINALIZER = f"{GROUP}/finalizer"
ANNOTATION_PREFIX = GROUP
# On the engine Deployment when another controller owns its spec.replicas (KEDA mode):
# repairs then ignore replica changes (kvpilot.operator.repair).
ANNOTATION_REPLICAS_OWNER = f"{GROUP}/replicas-owner"
REPLICAS_OWNER_KEDA = "keda"

# Labels on every child object. The selector uses only the two stable ones: a label that
# can change (a version) in a Deployment selector would orphan the running pods.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_OWNER = f"{GROUP}/inference-deployment"
ENGINE_COMPONENT = "engine"
ENGINE_NAME = "kvpilot-engine"
ROUTER_COMPONENT = "router"
# The writable cache directory of engine and router pods (an emptyDir).
CACHE_DIR = "/cache"
# The node-headroom placeholder pods (NAME + HEADROOM_SUFFIX, builders/headroom.py).
HEADROOM_COMPONENT = "headroom"
HEADROOM_SUFFIX = "-headroom"
# Their PriorityClass (the chart creates it, below the engines' priority).
DEFAULT_HEADROOM_PRIORITY_CLASS = "kvpilot-headroom"
ROUTER_NAME = "kvpilot-router"

# LoRA adapters (spec.adapters): the ConfigMap NAME + ADAPTERS_SUFFIX holds the list the
# engine loads at start-up (key ADAPTERS_FILE_KEY, mounted read-only at ADAPTERS_DIR); the
# operator keeps running pods in step through the engine's runtime LoRA API, which the
# engine mounts only with RUNTIME_LORA_ENV true (vLLM's switch).
ADAPTERS_SUFFIX = "-adapters"
ADAPTERS_DIR = "/etc/kvpilot/adapters"
ADAPTERS_FILE_KEY = "adapters.json"
ADAPTERS_VOLUME = "kvpilot-adapters"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
MODELS_LIST_PATH = "/v1/models"
LOAD_ADAPTER_PATH = "/v1/load_lora_adapter"
UNLOAD_ADAPTER_PATH = "/v1/unload_lora_adapter"

# The engine's HTTP port and endpoints (docs/architecture.md, "HTTP (engine)").
ENGINE_PORT = 8000
ENGINE_PORT_NAME = "http"
HEALTH_PATH = "/health"
READY_PATH = "/ready"
METRICS_PATH = "/metrics"

# The engine's KV-cache event publisher (ZMQ PUB, vLLM's --kv-events-config shape), on when
# the router routes with the kv_aware policy: live events on one port, replay on the next.
KV_EVENTS_PORT = 5557
KV_EVENTS_PORT_NAME = "kv-events"
KV_EVENTS_REPLAY_PORT = 5558
KV_EVENTS_REPLAY_PORT_NAME = "kv-replay"
KV_EVENTS_TOPIC = "kv-events"

# The request router (vllm-router) in front of the engine pods: its Deployment, Service,
# ServiceAccount, RoleBinding and PDB are named NAME + ROUTER_SUFFIX; the ClusterRole its
# RoleBinding grants (pods get/list/watch for Kubernetes service discovery) is shipped by
# the chart under this fixed name.
ROUTER_SUFFIX = "-router"
ROUTER_PORT = 8000
ROUTER_PORT_NAME = "http"
ROUTER_METRICS_PORT = 29000
ROUTER_METRICS_PORT_NAME = "metrics"
ROUTER_CLUSTER_ROLE = "kvpilot-router"
# Gateway mode: an InferencePool (Gateway API Inference Extension) instead of the router.
INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
INFERENCE_POOL_KIND = "InferencePool"
INFERENCE_POOL_CRD = "inferencepools.inference.networking.k8s.io"

# Prometheus relabels the owner pod label into this series label, so engine series,
# operator series and alerts join on (namespace, inference_deployment).
SERIES_LABEL = "inference_deployment"

# Condition types, in the order they are listed in status.
CONDITION_TYPES = ("Ready", "Progressing", "RouterReady", "MetricsAvailable", "ScalingActive",
                   "ScalingLimited", "AdaptersReady")
# The ones the reconcile loop owns (RouterReady only while a router is wanted); the
# autoscaler timer owns the rest.
RECONCILE_CONDITIONS = ("Ready", "Progressing", "RouterReady")
# The ones the engine Deployment watch and a refused reconcile write.
WORKLOAD_CONDITIONS = ("Ready", "Progressing")
ROUTER_CONDITION = "RouterReady"
AUTOSCALER_CONDITIONS = ("MetricsAvailable", "ScalingActive", "ScalingLimited")
# The one the adapter sync owns (kvpilot.operator.adapters).
ADAPTERS_CONDITION = "AdaptersReady"
