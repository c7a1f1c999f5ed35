{{/*
Names, labels and the few derived settings every template shares. Derived settings live here
(not in each template) so that the Deployment's flags, the RBAC and the peering objects can never
disagree about, e.g., whether leader election is on.
*/}}

{{/* The chart name, overridable. */}}
{{- define "oobleck.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's base name for every object (63 characters at most: a DNS label). */}}
{{- define "oobleck.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels that select the operator's pods (stable across upgrades: a selector is immutable). */}}
{{- define "oobleck.selectorLabels" -}}
app.kubernetes.io/name: {{ include "oobleck.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels on every object; `component` is set per template. */}}
{{- define "oobleck.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "oobleck.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: oobleck
{{- end }}

{{/* The operator's ServiceAccount name. */}}
{{- define "oobleck.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "oobleck.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The image reference: a digest pins it; the tag defaults to the chart's appVersion. */}}
{{- define "oobleck.image" -}}
{{- $repository := required "image.repository is required" .Values.image.repository }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" $repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" $repository (default .Chart.AppVersion .Values.image.tag | toString) }}
{{- end }}
{{- end }}

{{/*
"true" when kopf peering (leader election) is on: asked for, or implied by more than one replica
(two unpeered operators would both act on every job).
*/}}
{{- define "oobleck.peering" -}}
{{- if or .Values.leaderElection.enabled (gt (int .Values.replicaCount) 1) }}true{{ end }}
{{- end }}

{{/* "true" when the operator serves every namespace (no operator.watchNamespaces given). */}}
{{- define "oobleck.clusterwide" -}}
{{- if empty .Values.operator.watchNamespaces }}true{{ end }}
{{- end }}

{{/* Annotations of the chart's CRDs: kept on uninstall unless crds.keep is false (deleting a CRD deletes every object of its kind). */}}
{{- define "oobleck.crdAnnotations" -}}
{{- if .Values.crds.keep }}
helm.sh/resource-policy: keep
{{- end }}
{{- end }}

{{/* The operator's ServiceAccount as the subject of a binding. */}}
{{- define "oobleck.subjects" }}
subjects:
  - kind: ServiceAccount
    name: {{ include "oobleck.serviceAccountName" . }}
    namespace: {{ .Release.Namespace }}
{{- end }}
