{{/* Chart name, release-scoped full name and the standard labels. */}}
{{- define "kvd.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvd.labels" -}}
{{ include "kvd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvd.authSecretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "kvd.fullname" .)) -}}
{{- end -}}

{{/* Refuse values that cannot run, before anything renders. */}}
{{- define "kvd.validate" -}}
{{- if not (has .Values.mode (list "sidecar" "daemonset")) }}
{{- fail (printf "mode must be sidecar or daemonset, got %q" .Values.mode) }}
{{- end }}
{{- if eq .Values.mode "daemonset" }}
{{- if ne (int .Values.engine.securityContext.runAsUser) (int .Values.node.uid) }}
{{- fail (printf "mode daemonset: engine.securityContext.runAsUser (%v) must be node.uid (%v): the socket directory and the pool files are that uid's alone" .Values.engine.securityContext.runAsUser .Values.node.uid) }}
{{- end }}
{{- if ne (int .Values.kvd.securityContext.runAsUser) (int .Values.node.uid) }}
{{- fail (printf "mode daemonset: kvd.securityContext.runAsUser (%v) must be node.uid (%v)" .Values.kvd.securityContext.runAsUser .Values.node.uid) }}
{{- end }}
{{- if not (and (hasPrefix "/" .Values.node.socketDir) (hasPrefix "/" .Values.node.poolDir)) }}
{{- fail "mode daemonset: node.socketDir and node.poolDir must be absolute paths" }}
{{- end }}
{{- if eq (clean .Values.node.socketDir) (clean .Values.node.poolDir) }}
{{- fail "mode daemonset: node.socketDir and node.poolDir must differ" }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Pod labels of the per-node daemon and of engines served by it (daemonset mode). */}}
{{- define "kvd.nodeSelectorLabels" -}}
{{ include "kvd.selectorLabels" . }}
app.kubernetes.io/component: kvd-node
{{- end -}}

{{- define "kvd.engineSelectorLabels" -}}
{{ include "kvd.selectorLabels" . }}
app.kubernetes.io/component: engine
{{- end -}}

{{- define "kvd.engineSocket" -}}
{{- printf "ipc://%s/engine.sock" (clean .Values.node.socketDir) -}}
{{- end -}}
