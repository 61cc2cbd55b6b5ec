{{/* Labels every object carries; component names the workload (gateway, vllm). */}}
{{- define "tidal.labels" -}}
app.kubernetes.io/name: tidal
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/component: {{ .component }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "tidal.selectorLabels" -}}
app.kubernetes.io/name: tidal
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tidal.image" -}}
{{- $repo := required "image.repository is required: an image of this repository with requirements/platform.txt installed" .Values.image.repository -}}
{{- $tag := required "image.tag is required (an immutable tag, not latest)" .Values.image.tag -}}
{{- printf "%s:%s" $repo $tag -}}
{{- end -}}

{{/* Container hardening shared by all Tidal containers. */}}
{{- define "tidal.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .uid }}
runAsGroup: {{ .uid }}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Settings file: values.settings plus the model list and the gateway's listen address. */}}
{{- define "tidal.settings" -}}
{{- $s := deepCopy .Values.settings -}}
{{- $models := list -}}
{{- range .Values.models -}}
{{- $models = append $models (dict "name" .name "replicas" (int .replicas) "update_strategy" .updateStrategy) -}}
{{- end -}}
{{- $_ := set $s "models" $models -}}
{{- $_ := set $s "gateway" (merge (dict "host" "0.0.0.0" "port" (int .Values.gateway.port)) (default (dict) $s.gateway)) -}}
{{- toYaml $s -}}
{{- end -}}
