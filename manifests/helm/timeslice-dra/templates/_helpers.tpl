{{/*
Helpers of the timeslice-dra chart. The chart adds no labels or annotations of its own
(helm.sh/chart, app.kubernetes.io/managed-by from the chart...): with default values its objects
are exactly those of manifests/base (tests/test_helm_chart.py). helm install still marks what it
creates (meta.helm.sh/release-* annotations, app.kubernetes.io/managed-by=Helm).
*/}}

{{/* The namespace of the driver's objects. */}}
{{- define "timeslice.namespace" -}}
{{- .Values.namespace.name -}}
{{- end -}}

{{- define "timeslice.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* image, imagePullPolicy (when set) of a container */}}
{{- define "timeslice.containerImage" -}}
image: {{ include "timeslice.image" . }}
{{- with .Values.image.pullPolicy }}
imagePullPolicy: {{ . }}
{{- end }}
{{- end -}}

{{/* The heartbeat file probes of manifests/base (timeslice/driver/liveness.py). */}}
{{- define "timeslice.livenessProbes" -}}
startupProbe:
  exec: {command: ["python3", "-m", "timeslice.driver.liveness", "/tmp/timeslice-live", "30"]}
  periodSeconds: 2
  failureThreshold: 90
livenessProbe:
  exec: {command: ["python3", "-m", "timeslice.driver.liveness", "/tmp/timeslice-live", "30"]}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 2
{{- end -}}

{{/* nodeSelector, tolerations, affinity of a pod spec, from a component's values */}}
{{- define "timeslice.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
