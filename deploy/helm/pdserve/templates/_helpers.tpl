{{/* The release's name prefix: "<release>" when it names the chart already, else "<release>-pdserve". */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of one component (router, prefill, decode): dict "root" $ "component" C. */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "pdserve.secretName" -}}
{{- if .Values.secrets.existingSecret -}}
{{- .Values.secrets.existingSecret -}}
{{- else -}}
{{- printf "%s-secrets" (include "pdserve.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The config file every process reads: values.config plus the keys the chart's values set. */}}
{{- define "pdserve.config" -}}
{{- $cfg := deepCopy (.Values.config | default dict) -}}
{{- $model := dict "name" .Values.model.name "quantization" .Values.model.quantization -}}
{{- if .Values.model.maxModelLen }}{{ $_ := set $model "max_model_len" (int .Values.model.maxModelLen) }}{{ end -}}
{{- $_ := set $cfg "model" (mergeOverwrite (get $cfg "model" | default dict) $model) -}}
{{- if .Values.model.servedModelName -}}
{{- $_ := set $cfg "server" (mergeOverwrite (get $cfg "server" | default dict) (dict "served_model_name" .Values.model.servedModelName)) -}}
{{- end -}}
{{- $deployment := get $cfg "deployment" | default dict -}}
{{- range $role := list "prefill" "decode" -}}
{{- $v := get $.Values $role -}}
{{- $r := dict "threads" (int $v.threads) -}}
{{- if gt (int $v.expertParallel) 1 }}{{ $_ := set $r "expert_parallel" (int $v.expertParallel) }}{{ end -}}
{{- if $v.quantization }}{{ $_ := set $r "quantization" $v.quantization }}{{ end -}}
{{- if $v.maxNumSeqs }}{{ $_ := set $r "max_num_seqs" (int $v.maxNumSeqs) }}{{ end -}}
{{- if $v.maxNumBatchedTokens }}{{ $_ := set $r "max_num_batched_tokens" (int $v.maxNumBatchedTokens) }}{{ end -}}
{{- if $v.deviceMemoryGb }}{{ $_ := set $r "device_memory_gb" (float64 $v.deviceMemoryGb) }}{{ end -}}
{{- $_ := set $deployment $role (mergeOverwrite (get $deployment $role | default dict) $r) -}}
{{- end -}}
{{- $_ := set $cfg "deployment" $deployment -}}
{{- if not (kindIs "invalid" .Values.router.encoderWorkers) -}}
{{- $_ := set $cfg "router" (mergeOverwrite (get $cfg "router" | default dict) (dict "encoder_workers" (int .Values.router.encoderWorkers))) -}}
{{- end -}}
{{- if .Values.inferencePool.enabled -}}
{{- $_ := set $cfg "cache" (mergeOverwrite (get $cfg "cache" | default dict) (dict "kv_events_format" .Values.inferencePool.kvEventsFormat)) -}}
{{- end -}}
{{- if .Values.controller.enabled -}}
{{- $c := dict "enabled" true "backend" "kubernetes" "namespace" .Release.Namespace "prefill_deployment" (printf "%s-prefill" (include "pdserve.fullname" .)) "decode_deployment" (printf "%s-decode" (include "pdserve.fullname" .)) "slo_ttft_ms" (float64 .Values.controller.sloTtftMs) "slo_tpot_ms" (float64 .Values.controller.sloTpotMs) "min_workers" (int .Values.controller.minWorkers) "max_workers" (int .Values.controller.maxWorkers) -}}
{{- $_ := set $cfg "controller" (mergeOverwrite (get $cfg "controller" | default dict) $c) -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* The pod spec of a worker: dict "root" $ "role" "prefill"|"decode". */}}
{{- define "pdserve.workerPodSpec" -}}
{{- $root := .root -}}
{{- $v := get $root.Values .role -}}
{{- $port := int $root.Values.router.port -}}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
terminationGracePeriodSeconds: {{ int $v.terminationGracePeriodSeconds }}
containers:
  - name: {{ .role }}
    image: {{ include "pdserve.image" $root }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    args:
      - worker
      - --role
      - {{ .role }}
      - --config
      - /etc/pdserve/pdserve.yaml
      - --router-url
      - {{ printf "http://%s-router-internal:%d" (include "pdserve.fullname" $root) (int $root.Values.router.service.port) | quote }}
      - --host
      - 0.0.0.0
      - --port
      - {{ $port | quote }}
      - --kv-port
      - {{ int $v.kvPort | quote }}
      - --kv-events-endpoint
      - {{ printf "tcp://0.0.0.0:%d" (int $v.kvEventsPort) | quote }}
      - --threads
      - {{ int $v.threads | quote }}
      {{- if gt (int $v.podsPerGroup) 1 }}
      {{- include "pdserve.epHostArgs" $v | nindent 6 }}
      {{- end }}
    env:
      - name: PDSERVE_ADVERTISE_HOST
        valueFrom: {fieldRef: {fieldPath: status.podIP}}
      - name: PDSERVE_INTERNAL_TOKEN
        valueFrom: {secretKeyRef: {name: {{ include "pdserve.secretName" $root }}, key: internal-token}}
      {{- if and $root.Values.inferencePool.enabled (eq $root.Values.inferencePool.role .role) }}
      - name: PDSERVE_WORKER_API_KEYS
        valueFrom: {secretKeyRef: {name: {{ include "pdserve.secretName" $root }}, key: worker-api-keys}}
      {{- end }}
    ports:
      - {name: http, containerPort: {{ $port }}}
      - {name: {{ ternary "kv-bootstrap" "kv" (eq .role "prefill") }}, containerPort: {{ int $v.kvPort }}}
      - {name: kv-events, containerPort: {{ int $v.kvEventsPort }}}
      {{- if gt (int $v.podsPerGroup) 1 }}
      - {name: ep-rendezvous, containerPort: {{ int $v.epRendezvousPort }}}
      {{- end }}
    # Ready: /health answers 200 (503 once the engine failed or shuts down); alive: the same page,
    # allowed a minute of failures (a dead engine gets the pod restarted); started: the model loaded.
    readinessProbe: {httpGet: {path: /health, port: http}, periodSeconds: 5, failureThreshold: 2}
    livenessProbe: {httpGet: {path: /health, port: http}, periodSeconds: 10, failureThreshold: 6, timeoutSeconds: 5}
    startupProbe: {httpGet: {path: /health, port: http}, periodSeconds: 5, failureThreshold: 120}
    lifecycle:
      # Drain before SIGTERM: the worker refuses new work and hands what is still running after
      # drainSeconds to the router, which continues it elsewhere (POST /internal/leave).
      preStop:
        exec:
          command:
            - python
            - -c
            - {{ printf "import os, urllib.request as u; u.urlopen(u.Request('http://127.0.0.1:%d/internal/leave', data=b'{\"drain_timeout_s\": %d}', headers={'content-type': 'application/json', 'x-pdserve-internal-token': os.environ['PDSERVE_INTERNAL_TOKEN']}), timeout=%d).read()" $port (int $v.drainSeconds) (add (int $v.drainSeconds) 30) | quote }}
    {{- with $v.resources }}
    resources: {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      - {name: config, mountPath: /etc/pdserve}
      {{- if $root.Values.model.volume }}
      - {name: model, mountPath: {{ $root.Values.model.mountPath }}, readOnly: true}
      {{- end }}
      {{- if gt (int $v.expertParallel) 1 }}
      - {name: dshm, mountPath: /dev/shm}
      {{- end }}
volumes:
  - name: config
    configMap: {name: {{ include "pdserve.fullname" $root }}-config}
  {{- if $root.Values.model.volume }}
  - name: model
    {{- toYaml $root.Values.model.volume | nindent 4 }}
  {{- end }}
  {{- if gt (int $v.expertParallel) 1 }}
  # EP ranks share the weights and the KV pool through /dev/shm (the runtime's default is 64 MiB).
  - name: dshm
    emptyDir: {medium: Memory}
  {{- end }}
{{- with $v.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "pdserve.podAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.router.port | quote }}
prometheus.io/path: /metrics
checksum/config: {{ include "pdserve.config" . | sha256sum | trunc 16 }}
{{- with .Values.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end -}}


{{/* Expert-parallel ranks across the pods of a LeaderWorkerSet group: each pod runs expertParallel ÷
podsPerGroup ranks, and they meet at the leader's address (LWS_LEADER_ADDRESS, set by the
LeaderWorkerSet controller; Kubernetes expands $(VAR) in args). */}}
{{- define "pdserve.epHostArgs" -}}
{{- if gt (int .podsPerGroup) 1 -}}
- --ep-local-ranks
- {{ div (int .expertParallel) (int .podsPerGroup) | quote }}
- --ep-rendezvous
- {{ printf "$(LWS_LEADER_ADDRESS):%d" (int .epRendezvousPort) | quote }}
{{- end -}}
{{- end -}}

{{/* The pod of a LeaderWorkerSet group's other ranks: dict "root" $ "role" "prefill"|"decode". No
HTTP port: its ranks follow rank 0's steps, and exit when rank 0 is lost (the group restarts). */}}
{{- define "pdserve.epRankPodSpec" -}}
{{- $root := .root -}}
{{- $v := get $root.Values .role -}}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
containers:
  - name: {{ .role }}-ranks
    image: {{ include "pdserve.image" $root }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    args:
      - ep-rank
      - --role
      - {{ .role }}
      - --config
      - /etc/pdserve/pdserve.yaml
      - --threads
      - {{ int $v.threads | quote }}
      {{- include "pdserve.epHostArgs" $v | nindent 6 }}
      - --pod-index
      - "$(LWS_WORKER_INDEX)"
    env:
      - name: PDSERVE_INTERNAL_TOKEN
        valueFrom: {secretKeyRef: {name: {{ include "pdserve.secretName" $root }}, key: internal-token}}
    {{- with $v.resources }}
    resources: {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      - {name: config, mountPath: /etc/pdserve}
      {{- if $root.Values.model.volume }}
      - {name: model, mountPath: {{ $root.Values.model.mountPath }}, readOnly: true}
      {{- end }}
volumes:
  - name: config
    configMap: {name: {{ include "pdserve.fullname" $root }}-config}
  {{- if $root.Values.model.volume }}
  - name: model
    {{- toYaml $root.Values.model.volume | nindent 4 }}
  {{- end }}
{{- with $v.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
