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

{{/* CURVE is on unless curve.insecure: "true" or "". */}}
{{- define "switchboard.curveOn" -}}
{{- if and .Values.curve.insecure .Values.curve.secretName }}
{{- fail "curve.insecure=true turns CURVE off: it cannot use curve.secretName (drop one of them)" }}
{{- end }}
{{- if not .Values.curve.insecure }}true{{ end }}
{{- end }}

{{/* The chart makes the keys itself (its hook Job, curve-keys-job.yaml): "true" or "". */}}
{{- define "switchboard.curveKeysByChart" -}}
{{- if and (include "switchboard.curveOn" .) (not .Values.curve.secretName) }}true{{ end }}
{{- end }}

{{/* The Secret holding the keys: curve.secretName, else the one the hook Job keeps. */}}
{{- define "switchboard.curveSecretName" -}}
{{- .Values.curve.secretName | default (printf "%s-curve" (include "switchboard.fullname" .)) }}
{{- end }}

{{/* A pod template's annotations (ctx: dict "root" . "annotations" MAP): MAP, plus the keys'
generation when the chart makes them, so that a rotation restarts every pod. */}}
{{- define "switchboard.podAnnotations" -}}
{{- $annotations := deepCopy (.annotations | default dict) }}
{{- if include "switchboard.curveKeysByChart" .root }}
{{- $_ := set $annotations "switchboard.io/curve-generation" (toString .root.Values.curve.generation) }}
{{- end }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* CURVE keys (included when switchboard.curveOn): `--curve-keys-dir` args, the mount, and a
Secret volume that projects only the role's files (ctx: dict "root" . "role"
gateway|engine|coordinator):
gateway: its pair, the engines' public keys as allowed-engines/, the coordinator's public key;
engine: every engine pair (each picks engine-<rank>), the gateway's and coordinator's public
keys; coordinator: its pair, allowed-engines/ and allowed-gateways/. */}}
{{- define "switchboard.curveArgs" -}}
- --curve-keys-dir
- {{ .Values.curve.mountPath | quote }}
{{- end }}

{{- define "switchboard.curveMount" -}}
- name: curve-keys
  mountPath: {{ .Values.curve.mountPath }}
  readOnly: true
{{- end }}

{{- define "switchboard.curveVolume" -}}
{{- $root := .root }}
{{- $dp := int $root.Values.dataParallelSize -}}
- name: curve-keys
  secret:
    secretName: {{ include "switchboard.curveSecretName" $root }}
    defaultMode: 0440
    items:
      {{- if eq .role "gateway" }}
      - {key: gateway.key, path: gateway.key}
      - {key: gateway.key_secret, path: gateway.key_secret}
      {{- if gt $dp 1 }}
      - {key: coordinator.key, path: coordinator.key}
      {{- end }}
      {{- range $r := until $dp }}
      - {key: engine-{{ $r }}.key, path: allowed-engines/engine-{{ $r }}.key}
      {{- end }}
      {{- else if eq .role "engine" }}
      - {key: gateway.key, path: gateway.key}
      {{- if gt $dp 1 }}
      - {key: coordinator.key, path: coordinator.key}
      {{- end }}
      {{- range $r := until $dp }}
      - {key: engine-{{ $r }}.key_secret, path: engine-{{ $r }}.key_secret}
      {{- end }}
      {{- else }}
      - {key: coordinator.key, path: coordinator.key}
      - {key: coordinator.key_secret, path: coordinator.key_secret}
      - {key: gateway.key, path: allowed-gateways/gateway.key}
      {{- range $r := until $dp }}
      - {key: engine-{{ $r }}.key, path: allowed-engines/engine-{{ $r }}.key}
      {{- end }}
      {{- end }}
{{- end }}

{{/* TLS and keys of the gateways' fronts (docs/operations.md "Security"). */}}
{{- define "switchboard.tlsArgs" -}}
{{- $tls := .Values.tls -}}
- --ssl-certfile
- {{ printf "%s/tls.crt" $tls.mountPath | quote }}
- --ssl-keyfile
- {{ printf "%s/tls.key" $tls.mountPath | quote }}
{{- if $tls.clientAuth }}
- --ssl-ca-certs
- {{ printf "%s/ca.crt" $tls.mountPath | quote }}
{{- end }}
{{- end }}

{{/* The gateway's exec probe over TLS (the kubelet's gRPC probe has no TLS); ctx: dict "root"
. "service" NAME. */}}
{{- define "switchboard.gatewayTlsProbe" -}}
{{- $root := .root -}}
{{- $cmd := list "python" "-m" "switchboard.cli.probe" "--port" (toString $root.Values.gateway.port) "--service" .service -}}
{{- $cmd = concat $cmd (list "--ssl-certfile" (printf "%s/tls.crt" $root.Values.tls.mountPath) "--ssl-keyfile" (printf "%s/tls.key" $root.Values.tls.mountPath)) -}}
{{- if $root.Values.tls.clientAuth }}
{{- $cmd = concat $cmd (list "--ssl-ca-certs" (printf "%s/ca.crt" $root.Values.tls.mountPath)) -}}
{{- end }}
{{- $cmd | toJson }}
{{- end }}
