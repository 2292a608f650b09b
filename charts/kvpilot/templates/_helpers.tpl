{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "kvpilot.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified app name: the release name, with the chart name unless already in it. */}}
{{- define "kvpilot.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* chart-version label value. */}}
{{- define "kvpilot.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels: stable for the release's lifetime, so never the chart or app version
(a Deployment's selector is immutable). */}}
{{- define "kvpilot.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpilot.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels on every object: the selector labels plus versions and the manager. */}}
{{- define "kvpilot.labels" -}}
helm.sh/chart: {{ include "kvpilot.chart" . }}
{{ include "kvpilot.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The operator's ServiceAccount name. */}}
{{- define "kvpilot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvpilot.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* image references */}}
{{- define "kvpilot.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- define "kvpilot.engineImage" -}}
{{- printf "%s:%s" .Values.engineImage.repository (default .Chart.AppVersion .Values.engineImage.tag) -}}
{{- end -}}
{{- define "kvpilot.routerImage" -}}
{{- printf "%s:%s" .Values.routerImage.repository (default .Chart.AppVersion .Values.routerImage.tag) -}}
{{- end -}}
