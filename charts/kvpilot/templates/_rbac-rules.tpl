{{/*
The operator's permissions, shared by the ClusterRole (all namespaces) and the per-namespace
Roles (values.watchNamespaces). Each rule says why it is needed; nothing here deletes:
children are removed by garbage collection through their owner references.
*/}}
{{- define "kvpilot.rules" -}}
# Watch InferenceDeployments and patch their metadata for Kopf's finalizer and its
# kvpilot.dev/ annotations (handler progress, last-handled spec). The spec is never written.
- apiGroups: ["kvpilot.dev"]
  resources: ["inferencedeployments"]
  verbs: ["get", "list", "watch", "patch"]
# Write status (replica counts, conditions, observed signals, autoscaler state); each write
# reads the object first (the get above) and patches under its resourceVersion.
- apiGroups: ["kvpilot.dev"]
  resources: ["inferencedeployments/status"]
  verbs: ["patch"]
# Set blockOwnerDeletion on the children's owner reference: with the
# OwnerReferencesPermissionEnforcement admission plugin (on in most clusters) the API
# server requires `update` on the owner's finalizers subresource for that. It is only a
# permission check: the operator writes finalizers through the patch above.
- apiGroups: ["kvpilot.dev"]
  resources: ["inferencedeployments/finalizers"]
  verbs: ["update"]
# Server-side apply the engine Deployment (create on the first apply), read its replica
# count before each apply, and watch it to copy pod readiness into the owner's status.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
# Server-side apply the engine Service (create on the first apply); read it first, so an
# existing Service of that name that kvpilot does not control is never taken over.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch"]
# The same for the engine PodDisruptionBudget.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch"]
# The same for the engine PodMonitor, when the Prometheus operator's API exists.
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["get", "create", "patch"]
# Find the ready engine pods whose /metrics the autoscaler scrapes (metrics.source: pods)
# and count pending pods as supply (one list per interval; no watch).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
# Record reconciles and every scaling decision as Events on the InferenceDeployment.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}
