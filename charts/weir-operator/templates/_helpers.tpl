{{/*
The chart name, or nameOverride.
*/}}
{{- define "weir-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The fullname prefixes every object name: fullnameOverride, or the release
name when it already contains the chart name, or "<release>-<chart>".
Truncated to 63 characters (the limit of label values and DNS labels).
*/}}
{{- define "weir-operator.fullname" -}}
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

{{/*
"weir-operator-0.1.0", for the helm.sh/chart label.
*/}}
{{- define "weir-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels on every object.
*/}}
{{- define "weir-operator.labels" -}}
helm.sh/chart: {{ include "weir-operator.chart" . }}
{{ include "weir-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Labels that select the operator's pods (Deployment selector, metrics Service).
Never change them: a Deployment's selector is immutable.
*/}}
{{- define "weir-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "weir-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The operator's ServiceAccount name.
*/}}
{{- define "weir-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "weir-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Where the worker ServiceAccount is created: worker pods run in their
StreamJob's namespace, so in watchNamespace when the operator watches only
that one, in the release namespace otherwise.
*/}}
{{- define "weir-operator.workerNamespace" -}}
{{- default .Release.Namespace .Values.watchNamespace }}
{{- end }}

{{/*
The image reference: repository:tag, the tag defaulting to appVersion, and
@digest when a digest is set (the kubelet then pulls exactly that manifest;
the tag stays for people reading the pod).
*/}}
{{- define "weir-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- with .Values.image.digest }}@{{ . }}{{ end }}
{{- end }}

{{/*
The default worker image: workerImage.repository:tag, the tag defaulting to
appVersion, and @digest as for the operator image.
*/}}
{{- define "weir-operator.controlKeySecret" -}}
{{ include "weir-operator.fullname" . }}-control-key
{{- end }}

{{- define "weir-operator.workerImage" -}}
{{- printf "%s:%s" .Values.workerImage.repository (.Values.workerImage.tag | default .Chart.AppVersion) }}
{{- with .Values.workerImage.digest }}@{{ . }}{{ end }}
{{- end }}

{{/*
The rules of the operator's job permissions (StreamJobs and what it creates
for them), in the watched namespace(s). Exactly what the operator uses.
*/}}
{{- define "weir-operator.jobRules" -}}
- apiGroups: ["weir.dev"]
  resources: ["streamjobs"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["weir.dev"]
  resources: ["streamjobs/status"]
  verbs: ["get", "patch"]
- apiGroups: ["weir.dev"]
  resources: ["streamjobs/finalizers"]
  verbs: ["update", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "create", "patch"]
{{- /* Each job's control token Secret is only created: its token is
derived from the operator's control key, so no Secret of a job namespace
is ever read or changed. */}}
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- if .Values.networkPolicy.enabled }}
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch"]
{{- end }}
{{- end }}
