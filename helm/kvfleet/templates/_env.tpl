{{/* Environment shared by routers and workers: the ConfigMap's settings. */}}
{{- define "kvfleet.configEnv" -}}
{{- $cm := printf "%s-config" (include "kvfleet.fullname" .) -}}
{{- range $k := list "KVFLEET_MODEL" "KVFLEET_BLOCK_SIZE" "KVFLEET_POLICY" "RUST_LOG" "KVFLEET_ETCD" "KVFLEET_KAFKA" "KVFLEET_TOPIC_PREFIX" }}
- name: {{ $k }}
  valueFrom:
    configMapKeyRef:
      name: {{ $cm }}
      key: {{ $k }}
{{- end }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- end -}}

{{/* Control-plane flags, present only when the service is configured. */}}
{{- define "kvfleet.controlArgs" -}}
{{- if include "kvfleet.etcdEndpoints" . }}
- --etcd=$(KVFLEET_ETCD)
{{- end }}
{{- if include "kvfleet.kafkaBrokers" . }}
- --kafka=$(KVFLEET_KAFKA)
- --topic-prefix=$(KVFLEET_TOPIC_PREFIX)
- --kafka-session-timeout-ms={{ .Values.kafka.sessionTimeoutMs }}
{{- end }}
{{- end -}}

{{/* The model volume, when enabled (pod spec `volumes` entry). */}}
{{- define "kvfleet.modelVolume" -}}
{{- if .Values.worker.modelVolume.existingClaim }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.worker.modelVolume.existingClaim }}
    readOnly: true
{{- else if .Values.worker.modelVolume.hostPath }}
- name: models
  hostPath:
    path: {{ .Values.worker.modelVolume.hostPath }}
    type: Directory
{{- end }}
{{- end -}}
