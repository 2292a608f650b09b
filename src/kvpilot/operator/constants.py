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

# Labels on every child object. The selector uses only the two stable ones: a label that
# can change (a version) in a Deployment selector would orphan the running pods.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_OWNER = f"{GROUP}/inference-deployment"
ENGINE_COMPONENT = "engine"
ENGINE_NAME = "kvpilot-engine"

# The engine's HTTP port and endpoints (docs/architecture.md, "HTTP (engine)").
ENGINE_PORT = 8000
ENGINE_PORT_NAME = "http"
HEALTH_PATH = "/health"
READY_PATH = "/ready"
METRICS_PATH = "/metrics"

# Prometheus relabels the owner pod label into this series label, so engine series,
# operator series and alerts join on (namespace, inference_deployment).
SERIES_LABEL = "inference_deployment"

# Condition types, in the order they are listed in status.
CONDITION_TYPES = ("Ready", "Progressing", "MetricsAvailable", "ScalingActive", "ScalingLimited")
# The ones the reconcile loop owns; the autoscaler timer owns the rest.
RECONCILE_CONDITIONS = ("Ready", "Progressing")
AUTOSCALER_CONDITIONS = ("MetricsAvailable", "ScalingActive", "ScalingLimited")
