{{/*
The operator's permissions, shared by the ClusterRole (all namespaces) and the per-namespace
Roles (values.watchNamespaces). Each rule says why it is needed. Children go with their
InferenceDeployment by garbage collection (owner references); the only deletes are of the
request-router objects the operator made, when a spec turns its router off or switches mode,
the node-headroom placeholders, the KEDA ScaledObject when a spec leaves KEDA mode, and the
adapters ConfigMap when a spec turns LoRA off.
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
# Server-side apply the engine and router Deployments (create on the first apply), read the
# engine's replica count before each apply, and watch both to copy pod readiness into the
# owner's status (Ready, RouterReady) and to restore one within seconds when someone
# deletes or edits it; delete the router's when its spec no longer wants it.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Server-side apply the engine and router Services (create on the first apply); read them
# first, so an existing Service of that name that kvpilot does not control is never taken
# over; delete the router's as above; watch them (only those labelled as kvpilot's) to
# restore one within seconds when someone deletes or edits it.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The router's ServiceAccount: the same apply, read-first and delete rules.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch", "delete"]
# The same for the engine and router PodDisruptionBudgets.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch", "delete"]
# The same for the engine and router PodMonitors, when the Prometheus operator's API exists.
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["get", "create", "patch", "delete"]
# The RoleBinding that grants a router's ServiceAccount the kvpilot-router ClusterRole in
# its own namespace (the same apply, read-first and delete rules).
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["rolebindings"]
  verbs: ["get", "create", "patch", "delete"]
# Creating that RoleBinding needs `bind` on the role it grants (Kubernetes refuses to let
# anyone hand out permissions they lack otherwise): on kvpilot-router only, nothing else.
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["clusterroles"]
  resourceNames: ["kvpilot-router"]
  verbs: ["bind"]
# Gateway mode: the InferencePool (Gateway API Inference Extension) selecting the engine
# pods, when the cluster serves that API; read it for RouterReady (a Gateway accepted it).
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "create", "patch", "delete"]
# KEDA mode (spec.autoscaling.engine: keda): the ScaledObject that lets KEDA scale the engine
# Deployment (the same apply, read-first and delete rules; deleted when a spec switches back
# to the operator's own autoscaler). Nothing lists or watches ScaledObjects, and server-side
# apply needs no update.
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "create", "patch", "delete"]
# LoRA adapters: the ConfigMap NAME-adapters the engine pods mount (the adapter list they
# load at start-up); the same apply and read-first rules, deleted when a spec turns LoRA
# off. Nothing lists or watches ConfigMaps (the resync restores a deleted one).
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch", "delete"]
# Find the ready engine pods whose /metrics the autoscaler scrapes (metrics.source: pods)
# and count pending pods as supply (one list per interval); watch the engine pods for
# container restarts (OOM kills, failed liveness probes), reported as EngineRestarted Events.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# Record reconciles and every scaling decision as Events on the InferenceDeployment.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}
