{{/* ---------- names and labels ---------- */}}

{{- define "rsinfer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "rsinfer.fullname" -}}
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

{{- define "rsinfer.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "rsinfer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* What tells one component from another; call with (dict "root" $ "component" "api" "pool" "") */}}
{{- define "rsinfer.componentLabels" -}}
app.kubernetes.io/component: {{ .component }}
{{- with .pool }}
rsinfer.io/pool: {{ . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component: release + componentLabels; same argument. */}}
{{- define "rsinfer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rsinfer.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{ include "rsinfer.componentLabels" . }}
{{- end }}

{{- define "rsinfer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rsinfer.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Deployment name of one stage of one pool */}}
{{- define "rsinfer.stageName" -}}
{{- printf "%s-%s-%s" (include "rsinfer.fullname" .root) .pool.name .stage | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "rsinfer.image" -}}
{{- $img := .image -}}
{{- printf "%s:%s" $img.repository (default .root.Chart.AppVersion ($img.tag | toString)) }}
{{- end }}

{{/* ---------- Redis ---------- */}}

{{- define "rsinfer.redisNamespace" -}}
{{- default .Release.Name .Values.redisNamespace }}
{{- end }}

{{- define "rsinfer.redisHost" -}}
{{- printf "%s-redis" (include "rsinfer.fullname" .) }}
{{- end }}

{{/* The URL every process (and, as host:port, KEDA's operator in its own namespace) connects to. */}}
{{- define "rsinfer.redisUrl" -}}
{{- if eq .Values.redis.mode "internal" }}
{{- printf "redis://%s.%s.svc:%d/0" (include "rsinfer.redisHost" .) .Release.Namespace (int .Values.redis.internal.port) }}
{{- else }}
{{- .Values.redis.external.url }}
{{- end }}
{{- end }}

{{- define "rsinfer.redisTls" -}}
{{- if hasPrefix "rediss://" (include "rsinfer.redisUrl" .) }}true{{ end }}
{{- end }}

{{/* "true" when the Redis is a Redis Cluster (redis.external.cluster). */}}
{{- define "rsinfer.redisCluster" -}}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.cluster }}true{{ end }}
{{- end }}

{{- define "rsinfer.secretName" -}}
{{- default (include "rsinfer.fullname" .) .Values.auth.existingSecret }}
{{- end }}

{{/* One redis-streams trigger of a KEDA ScaledObject; call with (dict "name" "url" (parsed Redis URL) "auth"
(TriggerAuthentication name, or false) "stream" "group" "target" ({lagCount: n} or {pendingEntriesCount: n})
"activation" (activationLagCount, optional)). */}}
{{- define "rsinfer.kedaTrigger" -}}
{{- if .nodes }}
- type: redis-cluster-streams
  name: {{ .name }}
  metadata:
    addresses: {{ .nodes | quote }}
{{- else }}
- type: redis-streams
  name: {{ .name }}
  metadata:
    address: {{ .address | quote }}
    databaseIndex: {{ trimPrefix "/" .url.path | default "0" | quote }}
{{- end }}
    {{- if eq .url.scheme "rediss" }}
    enableTLS: "true"
    {{- end }}
    stream: {{ .stream | quote }}
    consumerGroup: {{ .group | quote }}
    {{- range $k, $v := .target }}
    {{ $k }}: {{ $v | toString | quote }}
    {{- end }}
    {{- if hasKey . "activation" }}
    activationLagCount: {{ .activation | toString | quote }}
    {{- end }}
  {{- if .auth }}
  authenticationRef:
    name: {{ .auth }}
  {{- end }}
{{- end }}

{{/* The API pod's terminationGracePeriodSeconds: given, or its preStop drain + open streams' grace + 10 s. */}}
{{- define "rsinfer.apiTerminationGrace" -}}
{{- $api := .Values.api }}
{{- $api.terminationGracePeriodSeconds | default (add (int $api.drainSeconds) (int (default 20 $api.settings.grace_period_s)) 10) | int | toString }}
{{- end }}

{{/* API processes per pod (--api-workers): api.workers, else the whole cores of the API's CPU request (1 at least,
64 at most). */}}
{{- define "rsinfer.apiWorkers" -}}
{{- $api := .Values.api }}
{{- if $api.workers }}
{{- int $api.workers | toString }}
{{- else }}
{{- $cpu := toString (dig "requests" "cpu" "1" ($api.resources | default dict)) }}
{{- $cores := hasSuffix "m" $cpu | ternary (div (int (trimSuffix "m" $cpu)) 1000) (int (floor (float64 $cpu))) }}
{{- min 64 (max 1 $cores) | toString }}
{{- end }}
{{- end }}

{{/* ---------- settings: values -> ConfigMap keys -> env ---------- */}}

{{/* One settings value as the string pydantic parses: whole floats without an exponent. */}}
{{- define "rsinfer.settingString" -}}
{{- if and (kindIs "float64" .) (eq (floor .) .) }}
{{- printf "%.0f" . }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}

{{/* A settings map {foo_bar: v} as env names {RSINFER_FOO_BAR: "v"} */}}
{{- define "rsinfer.settingsEnvMap" -}}
{{- $out := dict }}
{{- range $k, $v := . }}
{{- $_ := set $out (printf "RSINFER_%s" (upper $k)) (include "rsinfer.settingString" $v) }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/* The port each worker serves its own /metrics on; empty while metrics.workers.enabled is off. */}}
{{- define "rsinfer.workerMetricsPort" -}}
{{- if .Values.metrics.workers.enabled }}
{{- toString (int .Values.metrics.workers.port) }}
{{- end }}
{{- end }}

{{/* Every ConfigMap entry, as {scope: {ENV: value}}: "common", "api" and "<pool>.<stage>". */}}
{{- define "rsinfer.configScopes" -}}
{{- $common := include "rsinfer.settingsEnvMap" .Values.settings | fromYaml }}
{{- $_ := set $common "RSINFER_REDIS_URL" (include "rsinfer.redisUrl" .) }}
{{- /* said, not detected: a process may start while its Redis is down */}}
{{- $_ := set $common "RSINFER_REDIS_CLUSTER" (ternary "yes" "no" (eq (include "rsinfer.redisCluster" .) "true")) }}
{{- $_ := set $common "RSINFER_NAMESPACE" (include "rsinfer.redisNamespace" .) }}
{{- with .Values.tracing.otlpEndpoint }}
{{- $_ := set $common "RSINFER_OTLP_ENDPOINT" . }}
{{- end }}
{{- with .Values.objectStorage }}
{{- if .url }}
{{- $_ := set $common "RSINFER_STORAGE_URL" .url }}
{{- $_ := set $common "RSINFER_STORAGE_ADDRESSING_STYLE" .addressingStyle }}
{{- with .endpointUrl }}{{ $_ := set $common "RSINFER_STORAGE_ENDPOINT_URL" . }}{{ end }}
{{- with .region }}{{ $_ := set $common "RSINFER_STORAGE_REGION" . }}{{ end }}
{{- end }}
{{- end }}
{{- $api := include "rsinfer.settingsEnvMap" .Values.api.settings | fromYaml }}
{{- $_ := set $api "RSINFER_PORT" (toString (int .Values.api.port)) }}
{{- /* a drain (the preStop hook) not followed by SIGTERM within the pod's grace period is undone */}}
{{- if not (hasKey .Values.api.settings "drain_timeout_s") }}
{{- $_ := set $api "RSINFER_DRAIN_TIMEOUT_S" (include "rsinfer.apiTerminationGrace" .) }}
{{- end }}
{{- $_ := set $api "RSINFER_API_WORKERS" (include "rsinfer.apiWorkers" .) }}
{{- /* the API takes requests for every pool's model even while its stages are scaled to zero */}}
{{- $served := list }}
{{- range .Values.modelPools }}
{{- $served = append $served .servedModelName }}
{{- end }}
{{- $_ := set $api "RSINFER_MODELS" (join "," $served) }}
{{- $scopes := dict "common" $common "api" $api }}
{{- range $pool := .Values.modelPools }}
{{- range $stage := list "tokenizer" "scheduler" "detokenizer" }}
{{- $cfg := include "rsinfer.stage" (dict "root" $ "pool" $pool "stage" $stage) | fromYaml }}
{{- $env := include "rsinfer.settingsEnvMap" $cfg.settings | fromYaml }}
{{- $_ := set $env "RSINFER_SERVED_MODEL_NAME" $pool.servedModelName }}
{{- with include "rsinfer.workerMetricsPort" $ }}
{{- $_ := set $env "RSINFER_METRICS_PORT" . }}
{{- end }}
{{- with include "rsinfer.modelRef" $pool }}
{{- $_ := set $env "RSINFER_MODEL" . }}
{{- end }}
{{- $_ := set $scopes (printf "%s.%s" $pool.name $stage) $env }}
{{- end }}
{{- end }}
{{- toYaml $scopes }}
{{- end }}

{{/* env entries reading one scope of the ConfigMap; call with (dict "root" $ "scope" "api") */}}
{{- define "rsinfer.configEnv" -}}
{{- $scopes := include "rsinfer.configScopes" .root | fromYaml }}
{{- $name := printf "%s-config" (include "rsinfer.fullname" .root) }}
{{- $prefix := ternary "" (printf "%s." .scope) (eq .scope "common") }}
{{- range $env, $_ := get $scopes .scope }}
- name: {{ $env }}
  valueFrom:
    configMapKeyRef:
      name: {{ $name }}
      key: {{ printf "%s%s" $prefix $env }}
{{- end }}
{{- end }}

{{/* What every rsinfer container gets: identity, Redis, secrets, writable cache, common settings. */}}
{{- define "rsinfer.commonEnv" -}}
- name: RSINFER_WORKER_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{ include "rsinfer.configEnv" (dict "root" . "scope" "common") | trim }}
- name: RSINFER_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "rsinfer.secretName" . }}
      key: {{ .Values.auth.redisPasswordKey }}
      optional: true
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.tlsCaSecret }}
- name: RSINFER_REDIS_TLS_CA
  value: /etc/rsinfer/redis-ca/{{ .Values.redis.external.tlsCaKey }}
{{- end }}
{{- with .Values.objectStorage.credentialsSecret }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.objectStorage.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.objectStorage.secretAccessKeyKey }}
{{- end }}
- name: RSINFER_CACHE
  value: /var/cache/rsinfer
- name: HOME
  value: /tmp
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Volumes and mounts every rsinfer container gets: writable /tmp and cache, the Redis CA. */}}
{{- define "rsinfer.commonVolumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.podCache.sizeLimit }}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.tlsCaSecret }}
- name: redis-ca
  secret:
    secretName: {{ .Values.redis.external.tlsCaSecret }}
{{- end }}
{{- end }}

{{- define "rsinfer.commonMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /var/cache/rsinfer
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.tlsCaSecret }}
- name: redis-ca
  mountPath: /etc/rsinfer/redis-ca
  readOnly: true
{{- end }}
{{- end }}

{{/* ---------- the scheduler's compiled kernels ---------- */}}

{{/* Where every compiler the scheduler may run keeps its kernels: flashinfer's JIT, Triton, TorchInductor,
CUDA's PTX cache, and anything else under ~/.cache. One directory, so one volume can keep them all. */}}
{{- define "rsinfer.kernelCacheEnv" -}}
- name: FLASHINFER_WORKSPACE_BASE
  value: /var/cache/rsinfer/kernels
- name: TRITON_CACHE_DIR
  value: /var/cache/rsinfer/kernels/triton
- name: TORCHINDUCTOR_CACHE_DIR
  value: /var/cache/rsinfer/kernels/inductor
- name: CUDA_CACHE_PATH
  value: /var/cache/rsinfer/kernels/cuda
- name: XDG_CACHE_HOME
  value: /var/cache/rsinfer/kernels/xdg
{{- end }}

{{/* The claim holding a pool's kernel cache, empty when it stays on the pod's emptyDir;
call with (dict "root" $ "pool" $pool "cfg" <the pool's scheduler stage>) */}}
{{- define "rsinfer.kernelCacheClaim" -}}
{{- $kc := .cfg.kernelCache | default dict }}
{{- if $kc.persistent }}
{{- $kc.claimName | default (printf "%s-%s-kernel-cache" (include "rsinfer.fullname" .root) .pool.name | trunc 63 | trimSuffix "-") }}
{{- end }}
{{- end }}

{{/* Pod template annotations that roll pods when their configuration changes. */}}
{{- define "rsinfer.checksums" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{ include "rsinfer.secretChecksum" . }}
{{- end }}

{{/* A checksum of what is known of the secrets without them: which Secret, where the Redis password comes from,
whether there is an API key, and auth.secretRevision (bump it when you change a secret). A hash of the secrets
themselves in the pod annotations, which anyone who can read a Deployment sees, would let them test guesses of a
weak key offline. auth.reloader leaves rolling on every change of the Secret to Stakater Reloader. */}}
{{- define "rsinfer.secretChecksum" -}}
checksum/secret: {{ printf "%s|%s|%s|%s" (include "rsinfer.secretName" .) (include "rsinfer.redisPasswordOrigin" .) (ternary "keyed" "open" (not (empty .Values.auth.apiKey))) (toString .Values.auth.secretRevision) | sha256sum }}
{{- end }}

{{/* Workload metadata annotations: Stakater Reloader's, when auth.reloader (it rolls the pods whenever the Secret
changes, an existingSecret included). */}}
{{- define "rsinfer.workloadAnnotations" -}}
{{- if .Values.auth.reloader -}}
secret.reloader.stakater.com/reload: {{ include "rsinfer.secretName" . | quote }}
{{- end }}
{{- end }}

{{/* "true" when rendered against a cluster (helm install/upgrade): lookup sees it. Under `helm template` and
GitOps renders (Argo CD) lookup sees nothing. */}}
{{- define "rsinfer.online" -}}
{{- if lookup "v1" "Secret" .Release.Namespace "" }}true{{ end }}
{{- end }}

{{/* Where the Redis password comes from (never the password): existing-secret, values, none (an external Redis
without one), generated (rendered against the cluster: random at install, kept by lookup on upgrades) or
derived (rendered without a cluster and none given: from the release's identity, the same at every render, so
no sync changes it under running pods; it keeps out nobody who knows the release's name: give
auth.existingSecret or auth.redisPassword for GitOps). */}}
{{- define "rsinfer.redisPasswordOrigin" -}}
{{- if .Values.auth.existingSecret }}existing-secret
{{- else if .Values.auth.redisPassword }}values
{{- else if ne .Values.redis.mode "internal" }}none
{{- else if include "rsinfer.online" . }}generated
{{- else }}derived
{{- end }}
{{- end }}

{{- define "rsinfer.derivedRedisPassword" -}}
{{- printf "rsinfer-redis-password|%s|%s" .Release.Namespace (include "rsinfer.fullname" .) | sha256sum | trunc 32 }}
{{- end }}

{{/* "true" when any stage of any pool is scaled by KEDA (whose operator then connects to Redis). */}}
{{- define "rsinfer.kedaEnabled" -}}
{{- range $pool := .Values.modelPools }}
{{- range $stage := list "tokenizer" "scheduler" "detokenizer" }}
{{- $cfg := include "rsinfer.stage" (dict "root" $ "pool" $pool "stage" $stage) | fromYaml }}
{{- if $cfg.keda.enabled }}true{{ end }}
{{- end }}
{{- end }}
{{- end }}

{{/* ---------- model pools ---------- */}}

{{/* Deep merge of two maps where the override wins key by key, false and 0 included. */}}
{{- define "rsinfer.merge" -}}
{{- $out := deepCopy .base }}
{{- range $k, $v := .override }}
{{- if and (kindIs "map" $v) (kindIs "map" (get $out $k)) }}
{{- $_ := set $out $k (include "rsinfer.merge" (dict "base" (get $out $k) "override" $v) | fromYaml) }}
{{- else }}
{{- $_ := set $out $k $v }}
{{- end }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/* The configuration of one stage of one pool: stages.<stage> merged with the pool's override. */}}
{{- define "rsinfer.stage" -}}
{{- include "rsinfer.merge" (dict "base" (get .root.Values.stages .stage) "override" (get .pool .stage | default dict)) }}
{{- end }}

{{/* RSINFER_MODEL of a pool; empty for the demo model. */}}
{{- define "rsinfer.modelRef" -}}
{{- $m := .model }}
{{- if eq $m.source "hub" }}
{{- $m.hubId }}
{{- else if has $m.source (list "pvc" "volume") }}
{{- printf "/models/%s" ($m.path | default "" | trimPrefix "/") | trimSuffix "/" }}
{{- end }}
{{- end }}

{{/* ---------- the API's pods ---------- */}}

{{/* Whether an HPA scales the API: api.autoscaling.enabled; unset (null), whether its files are in shared object
storage (without, one pod: see rsinfer.apiReplicas). "true" or empty. */}}
{{- define "rsinfer.apiAutoscaled" -}}
{{- $on := .Values.api.autoscaling.enabled }}
{{- if kindIs "invalid" $on }}{{ $on = not (empty .Values.objectStorage.url) }}{{ end }}
{{- if $on }}true{{ end }}
{{- end }}

{{/* The API's replicas without an HPA: api.replicas; unset (null), 2 with shared object storage, else 1. */}}
{{- define "rsinfer.apiReplicas" -}}
{{- $n := .Values.api.replicas }}
{{- if kindIs "invalid" $n }}{{ $n = ternary 2 1 (not (empty .Values.objectStorage.url)) }}{{ end }}
{{- int $n }}
{{- end }}

{{/* The most API pods there may be. */}}
{{- define "rsinfer.apiMaxPods" -}}
{{- if include "rsinfer.apiAutoscaled" . }}{{ int .Values.api.autoscaling.maxReplicas }}{{ else }}{{ include "rsinfer.apiReplicas" . }}{{ end }}
{{- end }}

{{/* ---------- checks the schema cannot express ---------- */}}

{{- define "rsinfer.validate" -}}
{{- $names := dict }}
{{- $served := dict }}
{{- range .Values.modelPools }}
{{- if hasKey $names .name }}
{{- fail (printf "modelPools: pool name %q is used twice" .name) }}
{{- end }}
{{- if hasKey $served .servedModelName }}
{{- fail (printf "modelPools: servedModelName %q is used twice" .servedModelName) }}
{{- end }}
{{- $_ := set $names .name true }}
{{- $_ := set $served .servedModelName true }}
{{- end }}
{{- range .Values.redis.internal.extraArgs }}
{{- if has (toString .) (list "--maxmemory" "--maxmemory-policy") }}
{{- fail (printf "redis.internal.extraArgs: %s is the chart's (redis.internal.maxmemory; the policy is always noeviction: an evicting Redis would drop requests' streams and records silently)" .) }}
{{- end }}
{{- end }}
{{- if and (eq .Values.redis.mode "external") (not .Values.redis.external.url) }}
{{- fail "redis.mode is external: set redis.external.url (redis://host:6379/0 or rediss://...)" }}
{{- end }}
{{- if and .Values.redis.external.tlsCaSecret (eq .Values.redis.mode "external") (not (include "rsinfer.redisTls" .)) }}
{{- fail "redis.external.tlsCaSecret is set but redis.external.url is not a rediss:// URL" }}
{{- end }}
{{- if include "rsinfer.redisCluster" . }}
{{- $db := trimPrefix "/" (urlParse .Values.redis.external.url).path }}
{{- if not (or (eq $db "") (eq $db "0")) }}
{{- fail (printf "redis.external.cluster: a Redis Cluster has database 0 only, not %q; set the url's path to /0" $db) }}
{{- end }}
{{- end }}
{{- range $pool := .Values.modelPools }}
{{- range $stage := list "tokenizer" "scheduler" "detokenizer" }}
{{- $cfg := include "rsinfer.stage" (dict "root" $ "pool" $pool "stage" $stage) | fromYaml }}
{{- $drain := $cfg.settings.grace_period_s | default 20 }}
{{- if le (float64 $cfg.terminationGracePeriodSeconds) (float64 $drain) }}
{{- fail (printf "modelPools %s, %s: terminationGracePeriodSeconds (%v) must exceed settings.grace_period_s (%v): a worker removed by a scale-down drains for the grace period, then hands back what it still holds, before Kubernetes kills it" $pool.name $stage $cfg.terminationGracePeriodSeconds $drain) }}
{{- end }}
{{- if gt (int $cfg.keda.minReplicaCount) (int $cfg.keda.maxReplicaCount) }}
{{- fail (printf "modelPools %s, %s: keda.minReplicaCount (%v) exceeds keda.maxReplicaCount (%v)" $pool.name $stage $cfg.keda.minReplicaCount $cfg.keda.maxReplicaCount) }}
{{- end }}
{{- end }}
{{- end }}
{{- $pods := int (include "rsinfer.apiMaxPods" .) }}
{{- if and (gt $pods 1) (not .Values.objectStorage.url) (not .Values.objectStorage.allowPerPod) }}
{{- fail (printf "the API may run %d pods but objectStorage.url is empty: the Files and Batch APIs would keep each file in one pod's cache directory, where the other pods do not find it (uploads 404, batches fail). Set objectStorage.url (s3://bucket/prefix; MinIO, Ceph... with objectStorage.endpointUrl), or run one API pod (api.replicas: 1 and api.autoscaling.enabled: false), or set objectStorage.allowPerPod: true if this release does not use Files and Batches" $pods) }}
{{- end }}
{{- with .Values.api.settings.drain_timeout_s }}
{{- if le (float64 .) (float64 $.Values.api.drainSeconds) }}
{{- fail (printf "api.settings.drain_timeout_s (%v) must exceed api.drainSeconds (%v): the preStop hook's drain would be undone before SIGTERM" . $.Values.api.drainSeconds) }}
{{- end }}
{{- end }}
{{- with .Values.api.terminationGracePeriodSeconds }}
{{- $need := add (int $.Values.api.drainSeconds) (int (default 20 $.Values.api.settings.grace_period_s)) }}
{{- if le (int .) (int $need) }}
{{- fail (printf "api.terminationGracePeriodSeconds (%d) must exceed drainSeconds + settings.grace_period_s (%d)" (int .) (int $need)) }}
{{- end }}
{{- end }}
{{- end }}
