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
{{- if .Values.supervisor.enabled -}}
{{- $_ := set $s "fleet" (merge (dict "runtime" "kubernetes" "kubernetes" (include "tidal.fleetKubernetes" . | fromYaml)) (default (dict) $s.fleet)) -}}
{{- end -}}
{{- if .Values.capacity.enabled -}}
{{- $_ := set $s "capacity" (merge (dict "mode" "tidal" "host" "tidal-capacity" "port" (int .Values.capacity.port)) (default (dict) $s.capacity)) -}}
{{- end -}}
{{- if .Values.metrics.pushgateway.enabled -}}
{{- $push := printf "http://tidal-pushgateway.%s.svc:9091" .Release.Namespace -}}
{{- $_ := set $s "prometheus" (merge (dict "pushgateway_url" $push) (default (dict) $s.prometheus)) -}}
{{- end -}}
{{- toYaml $s -}}
{{- end -}}

{{/* fleet.kubernetes (serving/kube_settings.py): supervisor.kubernetes plus what the rest of the values say. */}}
{{- define "tidal.fleetKubernetes" -}}
{{- $v := .Values.vllm -}}
{{- $k := deepCopy (default (dict) .Values.supervisor.kubernetes) -}}
{{- $pods := dict -}}
{{- range .Values.models -}}
{{- $p := dict "gpus" (int (default 1 .gpus)) -}}
{{- with .instanceType }}{{ $_ := set $p "instance_type" . }}{{ end -}}
{{- $_ := set $pods .name $p -}}
{{- end -}}
{{- $_ := set $k "namespace" .Release.Namespace -}}
{{- $_ := set $k "instance" .Release.Name -}}
{{- $_ := set $k "image" (printf "%s:%s" $v.image.repository $v.image.tag) -}}
{{- $_ := set $k "weights_image" (include "tidal.image" .) -}}
{{- $_ := set $k "image_pull_policy" $v.image.pullPolicy -}}
{{- $_ := set $k "service_account" .Values.serviceAccounts.fleet.name -}}
{{- $_ := set $k "node_selector" $v.nodeSelector -}}
{{- $_ := set $k "tolerations" $v.tolerations -}}
{{- $_ := set $k "cpu_request" $v.resources.requests.cpu -}}
{{- $_ := set $k "cpu_limit" $v.resources.limits.cpu -}}
{{- $_ := set $k "memory_request" $v.resources.requests.memory -}}
{{- $_ := set $k "memory_limit" $v.resources.limits.memory -}}
{{- $_ := set $k "shm_size" $v.shmSizeLimit -}}
{{- $_ := set $k "port" (int $v.port) -}}
{{- $_ := set $k "startup_timeout_s" (int $v.startupTimeoutSeconds) -}}
{{- $_ := set $k "models" $pods -}}
{{- toYaml $k -}}
{{- end -}}
