{{/* Chart name, overridable with nameOverride. */}}
{{- define "switchboard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name prefix of every resource, truncated to leave room for a role suffix. */}}
{{- define "switchboard.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* chart-version label value. */}}
{{- define "switchboard.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component (immutable: name, instance, component only). */}}
{{- define "switchboard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "switchboard.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Standard labels of one component. */}}
{{- define "switchboard.labels" -}}
helm.sh/chart: {{ include "switchboard.chart" .root }}
{{ include "switchboard.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: switchboard
{{- end }}

{{/* Headless Service listing every gateway pod (ready or not): engines resolve it. */}}
{{- define "switchboard.gatewayDiscoveryName" -}}
{{ include "switchboard.fullname" . }}-gateway-discovery
{{- end }}

{{/* Fully qualified NAME:PORT engines pass as --gateway-address. */}}
{{- define "switchboard.gatewayAddress" -}}
{{ include "switchboard.gatewayDiscoveryName" . }}.{{ .Release.Namespace }}.svc:{{ .Values.gateway.handshakePort }}
{{- end }}

{{/* The coordinator's Service DNS name. */}}
{{- define "switchboard.coordinatorHost" -}}
{{ include "switchboard.fullname" . }}-coordinator.{{ .Release.Namespace }}.svc
{{- end }}

{{/* image reference: repository:tag (tag defaults to appVersion). */}}
{{- define "switchboard.image" -}}
{{ .image.repository }}:{{ .image.tag | default .root.Chart.AppVersion }}
{{- end }}

{{/* Workers per engine pod (TP x PP): its GPUs when GPUs are enabled. */}}
{{- define "switchboard.workersPerEngine" -}}
{{ mul .Values.engine.tensorParallelSize .Values.engine.pipelineParallelSize }}
{{- end }}

{{/* The model flags gateways and engines share. */}}
{{- define "switchboard.modelArgs" -}}
- --model
- {{ .Values.model.path | quote }}
{{- with .Values.model.servedModelName }}
- --served-model-name
- {{ . | quote }}
{{- end }}
- --dtype
- {{ .Values.model.dtype | quote }}
{{- with .Values.model.maxModelLen }}
- --max-model-len
- {{ . | quote }}
{{- end }}
- --data-parallel-size
- {{ .Values.dataParallelSize | quote }}
{{- end }}

{{/* Volumes of gateway and engine pods: the model (read-only) and a writable /tmp. */}}
{{- define "switchboard.modelVolume" -}}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
- name: tmp
  emptyDir: {}
{{- end }}

{{/* Mounts matching switchboard.modelVolume. */}}
{{- define "switchboard.modelMounts" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end }}

{{/* Exec probe of an engine pod: exit 0 when the engine core and TP x PP workers run
(their process titles, set with setproctitle, are their /proc cmdlines). */}}
{{- define "switchboard.engineProbe" -}}
{{- $script := printf "import glob,sys\nt=[]\nfor f in glob.glob('/proc/[0-9]*/cmdline'):\n  try: t.append(open(f,'rb').read())\n  except OSError: pass\nw=sum(b'switchboard::Worker_' in c for c in t)\ne=sum(b'switchboard::EngineCore_' in c for c in t)\nsys.exit(0 if e and w>=%d else 1)" (include "switchboard.workersPerEngine" . | int) }}
{{- list "python" "-c" $script | toJson }}
{{- end }}
