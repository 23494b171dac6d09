{{/* Chart name, truncated to the DNS label limit. */}}
{{- define "kvfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped base name of every object. */}}
{{- define "kvfleet.fullname" -}}
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

{{/* Labels on every object. */}}
{{- define "kvfleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvfleet
{{- end -}}

{{/* Selector labels of one component: call with (dict "root" $ "component" "router"). */}}
{{- define "kvfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvfleet.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvfleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "kvfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvfleet.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* etcd endpoints the processes use: the bundled etcd, or the external ones; empty when neither. */}}
{{- define "kvfleet.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- printf "http://%s-etcd:%d" (include "kvfleet.fullname" .) (int .Values.etcd.clientPort) -}}
{{- else if .Values.etcd.external.endpoints -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- end -}}
{{- end -}}

{{/* Kafka bootstrap brokers, comma-separated; empty when Kafka is off. */}}
{{- define "kvfleet.kafkaBrokers" -}}
{{- if .Values.kafka.brokers -}}
{{- join "," .Values.kafka.brokers -}}
{{- end -}}
{{- end -}}

{{/* Headless service of the workers. */}}
{{- define "kvfleet.workerHeadless" -}}
{{- printf "%s-worker-headless" (include "kvfleet.fullname" .) -}}
{{- end -}}

{{/* Direct mode (no etcd): every worker's stable gRPC address, for the router's --workers. */}}
{{- define "kvfleet.workerAddresses" -}}
{{- $full := include "kvfleet.fullname" . -}}
{{- $svc := include "kvfleet.workerHeadless" . -}}
{{- $addrs := list -}}
{{- range $i := until (int .Values.worker.replicas) -}}
{{- $addrs = append $addrs (printf "%s-worker-%d.%s.%s.svc.%s:%d" $full $i $svc $.Release.Namespace $.Values.clusterDomain (int $.Values.worker.grpcPort)) -}}
{{- end -}}
{{- join "," $addrs -}}
{{- end -}}

{{/* The non-root, read-only container securityContext every kvfleet container runs with. */}}
{{- define "kvfleet.containerSecurityContext" -}}
{{- toYaml .Values.containerSecurityContext -}}
{{- end -}}

{{/* GPUs a worker pod asks for: `nvidia.com/gpu` in its resource limits or requests (0 when none). */}}
{{- define "kvfleet.workerGpus" -}}
{{- $r := .Values.worker.resources | default dict -}}
{{- $limit := index ($r.limits | default dict) "nvidia.com/gpu" | default 0 -}}
{{- $request := index ($r.requests | default dict) "nvidia.com/gpu" | default 0 -}}
{{- max (int $limit) (int $request) -}}
{{- end -}}

{{/*
"true" when workers get a disk KV tier (it needs the host tier above it).
*/}}
{{- define "kvfleet.diskTier" -}}
{{- $t := .Values.worker.kvTiers -}}
{{- if and $t.disk.enabled (gt (float64 $t.hostCacheGiB) 0.0) }}true{{ end -}}
{{- end }}

{{/*
Size of the disk tier's volume: the tier's GiB plus 1 GiB of headroom (the block being
staged, the directory), in Mi so fractional GiB render as a valid quantity.
*/}}
{{- define "kvfleet.diskTierSize" -}}
{{- printf "%dMi" (int (mulf (addf (float64 .Values.worker.kvTiers.disk.sizeGiB) 1.0) 1024.0)) -}}
{{- end }}
