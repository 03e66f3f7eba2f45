{{/*
Names. KubeRay appends 6 characters to a RayService name for its RayCluster and "-serve-svc" to that, and
rejects RayService names over 47 characters or that are not DNS-1035 labels (start with a letter). The
chart caps its base name at 40 so that every object it names (base + a suffix of at most 13 characters,
e.g. "-redis-auth") stays within 53 characters.
*/}}
{{- define "moray.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "moray.fullname" -}}
{{- $name := "" -}}
{{- if .Values.fullnameOverride -}}
{{- $name = .Values.fullnameOverride -}}
{{- else -}}
{{- $base := default .Chart.Name .Values.nameOverride -}}
{{- if contains $base .Release.Name -}}
{{- $name = .Release.Name -}}
{{- else -}}
{{- $name = printf "%s-%s" .Release.Name $base -}}
{{- end -}}
{{- end -}}
{{- $name = $name | trunc 40 | trimSuffix "-" -}}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) -}}
{{- fail (printf "the resource base name %q must be a DNS-1035 label (lower-case letters, digits and '-', starting with a letter): KubeRay rejects other RayService names; set fullnameOverride" $name) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{- define "moray.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "moray.labels" -}}
helm.sh/chart: {{ include "moray.chart" . }}
app.kubernetes.io/name: {{ include "moray.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: moray
{{- end -}}

{{/*
Labels that select this release's Ray pods. KubeRay sets app.kubernetes.io/name=kuberay on the pods it
creates, so selectors use app.kubernetes.io/instance and moray.dev/component instead.
*/}}
{{- define "moray.raySelectorLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
moray.dev/component: ray
{{- end -}}

{{/* Labels of a Ray pod: dict "root" $ "role" head|worker "extra" map. */}}
{{- define "moray.rayPodLabels" -}}
{{- $root := .root -}}
{{- $l := include "moray.labels" $root | fromYaml -}}
{{- $l = mergeOverwrite $l (include "moray.raySelectorLabels" $root | fromYaml) (dict "moray.dev/role" .role) -}}
{{- $l = mergeOverwrite $l ($root.Values.podLabels | default dict) (.extra | default dict) -}}
{{- toYaml $l -}}
{{- end -}}

{{- define "moray.redisSelectorLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
moray.dev/component: redis
{{- end -}}

{{- define "moray.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "moray.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "moray.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString (default .Chart.AppVersion .Values.image.tag)) -}}
{{- end -}}

{{/*
moray.tpuSlice: the GKE facts for one TPU slice, from a ClusterConfig TPUConfig dict ({type, topology};
the same defaults as cluster/config.py: v6e, 2x4). Returns JSON:
  {accelerator, topology, chips, hosts, chipsPerHost}
Rule (GKE TPU docs; one Kubernetes node = one TPU VM = one Ray host; one worker-group replica = one slice):
  chips        = product of the topology dimensions
  v5e, v6e     (2-D topologies AxB):   chips <= 8 -> 1 host with all chips (ct5lp-hightpu-{1,4,8}t,
                                        ct6e-standard-{1,4,8}t); more -> chips/4 hosts of 4 chips
  v4, v5p, v7x (3-D topologies AxBxC): chips <= 4 -> 1 host with all chips; more -> chips/4 hosts of 4
  e.g. v6e 2x4 = 8 chips on 1 host; v6e 4x4 = 4 hosts x 4 chips; tpu7x 2x2x4 = 4 hosts x 4 chips.
The KubeRay TPU webhook checks numOfHosts == chips / google.com/tpu-per-pod, which this satisfies.
*/}}
{{- define "moray.tpuSlice" -}}
{{- $tpu := . | default dict -}}
{{- $accelerators := dict "v4" "tpu-v4-podslice" "v5e" "tpu-v5-lite-podslice" "v5p" "tpu-v5p-slice" "v6e" "tpu-v6e-slice" "v7x" "tpu7x" -}}
{{- $type := toString (default "v6e" $tpu.type) -}}
{{- $topology := toString (default "2x4" $tpu.topology) -}}
{{- if not (hasKey $accelerators $type) -}}
{{- fail (printf "TPU type %q is not one of v4, v5e, v5p, v6e, v7x" $type) -}}
{{- end -}}
{{- if not (regexMatch "^[1-9][0-9]*x[1-9][0-9]*(x[1-9][0-9]*)?$" $topology) -}}
{{- fail (printf "TPU topology %q does not parse: expected positive integers joined by x, e.g. 2x4 or 2x2x4" $topology) -}}
{{- end -}}
{{- $dims := splitList "x" $topology -}}
{{- $planar := has $type (list "v5e" "v6e") -}}
{{- if and $planar (ne (len $dims) 2) -}}
{{- fail (printf "TPU %s takes a 2-D topology such as 2x4 or 4x4, got %q" $type $topology) -}}
{{- end -}}
{{- if and (not $planar) (ne (len $dims) 3) -}}
{{- fail (printf "TPU %s takes a 3-D topology such as 2x2x1 or 2x2x4, got %q" $type $topology) -}}
{{- end -}}
{{- $chips := 1 -}}
{{- range $dims -}}
{{- $chips = mul $chips (atoi .) -}}
{{- end -}}
{{- $singleHostMax := ternary 8 4 $planar -}}
{{- $hosts := 1 -}}
{{- $chipsPerHost := $chips -}}
{{- if gt (int $chips) (int $singleHostMax) -}}
{{- if ne (mod $chips 4) 0 -}}
{{- fail (printf "TPU %s topology %s has %d chips, which do not split into hosts of 4 chips" $type $topology $chips) -}}
{{- end -}}
{{- $hosts = div $chips 4 -}}
{{- $chipsPerHost = 4 -}}
{{- end -}}
{{- dict "accelerator" (get $accelerators $type) "topology" $topology "chips" $chips "hosts" $hosts "chipsPerHost" $chipsPerHost | toJson -}}
{{- end -}}

{{/* True ("true") when any rendered pool runs on TPU. */}}
{{- define "moray.usesTPU" -}}
{{- $uses := false -}}
{{- range $pool := include "moray.pools" . | fromJsonArray -}}
{{- $res := (get $.Values.cluster $pool | default dict).resources | default dict -}}
{{- if $res.tpu -}}{{- $uses = true -}}{{- end -}}
{{- end -}}
{{- ternary "true" "" $uses -}}
{{- end -}}

{{/* The pools that get a worker group: decode always, prefill only when mode is disaggregated. */}}
{{- define "moray.pools" -}}
{{- if eq (toString (default "disaggregated" .Values.cluster.mode)) "disaggregated" -}}
{{- list "prefill" "decode" | toJson -}}
{{- else -}}
{{- list "decode" | toJson -}}
{{- end -}}
{{- end -}}

{{/* The Secret with the Redis password as JSON {name, key}; empty without one. */}}
{{- define "moray.redisPasswordSecret" -}}
{{- if .Values.redis.enabled -}}
{{- if .Values.redis.auth.existingSecret -}}
{{- dict "name" .Values.redis.auth.existingSecret "key" .Values.redis.auth.existingSecretKey | toJson -}}
{{- else -}}
{{- dict "name" (printf "%s-redis-auth" (include "moray.fullname" .)) "key" "password" | toJson -}}
{{- end -}}
{{- else if and .Values.redis.external.url .Values.redis.external.passwordSecret.name -}}
{{- dict "name" .Values.redis.external.passwordSecret.name "key" .Values.redis.external.passwordSecret.key | toJson -}}
{{- end -}}
{{- end -}}

{{/* The Secret with the API keys as JSON {name, key}; empty without one. */}}
{{- define "moray.apiKeysSecret" -}}
{{- if .Values.apiKeys.existingSecret -}}
{{- dict "name" .Values.apiKeys.existingSecret "key" .Values.apiKeys.existingSecretKey | toJson -}}
{{- else if .Values.apiKeys.keys -}}
{{- dict "name" (printf "%s-api-keys" (include "moray.fullname" .)) "key" "api-keys" | toJson -}}
{{- end -}}
{{- end -}}

{{/*
moray.clusterArgs: the ClusterConfig dict passed as the Serve application's args: the `cluster` values
unchanged, plus what the chart owns (JSON):
  engine.compilation_cache_dir  <- compilationCache.mountPath (the local-disk volume)
  kv_index.backend              <- the in-chart Redis Service or redis.external.url (no password in it)
  kv_index.password_env         <- the env var that carries the Redis password from its Secret
  server.api_keys_env           <- the env var that carries the API keys from their Secret
Secrets never appear in serveConfigV2: it is stored in clear text in the RayService object.
*/}}
{{- define "moray.clusterArgs" -}}
{{- $c := deepCopy .Values.cluster -}}
{{- $engine := get $c "engine" | default dict -}}
{{- if .Values.compilationCache.enabled -}}
{{- if and (hasKey $engine "compilation_cache_dir") (ne (toString $engine.compilation_cache_dir) .Values.compilationCache.mountPath) -}}
{{- fail (printf "cluster.engine.compilation_cache_dir (%v) differs from compilationCache.mountPath (%s): the chart mounts the cache volume there and sets the engine field itself; set compilationCache.mountPath instead" $engine.compilation_cache_dir .Values.compilationCache.mountPath) -}}
{{- end -}}
{{- $_ := set $engine "compilation_cache_dir" .Values.compilationCache.mountPath -}}
{{- end -}}
{{- if and (ne .Values.model.source "image") (not (hasPrefix (printf "%s/" (trimSuffix "/" .Values.model.mountPath)) (toString $engine.model))) -}}
{{- fail (printf "cluster.engine.model (%v) must be a path under model.mountPath (%s), where the %s model volume is mounted" $engine.model .Values.model.mountPath .Values.model.source) -}}
{{- end -}}
{{- $_ := set $c "engine" $engine -}}
{{- $kv := get $c "kv_index" | default dict -}}
{{- $backend := toString (default "memory" $kv.backend) -}}
{{- if regexMatch "^(redis|rediss)://[^/@]*:[^/@]+@" $backend -}}
{{- fail "cluster.kv_index.backend carries a password: serveConfigV2 is stored in clear text; put the password in a Secret (redis.auth or redis.external.passwordSecret) and give the URL without it" -}}
{{- end -}}
{{- if and .Values.redis.enabled .Values.redis.external.url -}}
{{- fail "set redis.enabled (a Redis in this release) or redis.external.url (an existing one), not both" -}}
{{- end -}}
{{- if .Values.redis.enabled -}}
{{- $_ := set $kv "backend" (printf "redis://%s-redis.%s.svc:%d/0" (include "moray.fullname" .) .Release.Namespace (int .Values.redis.port)) -}}
{{- else if .Values.redis.external.url -}}
{{- $_ := set $kv "backend" .Values.redis.external.url -}}
{{- end -}}
{{- if include "moray.redisPasswordSecret" . -}}
{{- $_ := set $kv "password_env" "MORAY_REDIS_PASSWORD" -}}
{{- end -}}
{{- if $kv -}}
{{- $_ := set $c "kv_index" $kv -}}
{{- end -}}
{{- $server := get $c "server" | default dict -}}
{{- if $server.api_keys -}}
{{- fail "cluster.server.api_keys would put bearer tokens in clear text into serveConfigV2; use apiKeys.keys or apiKeys.existingSecret (the chart passes them through the MORAY_API_KEYS env var)" -}}
{{- end -}}
{{- if include "moray.apiKeysSecret" . -}}
{{- $_ := set $server "api_keys_env" "MORAY_API_KEYS" -}}
{{- $_ := set $c "server" $server -}}
{{- end -}}
{{- $c | toJson -}}
{{- end -}}

{{/*
The Serve config (serveConfigV2) as YAML: what cluster.app.serve_config (`moray serve-config`) writes for
the same ClusterConfig, except proxy_location (serve.proxyLocation; Disabled with cluster.server.ingress:
direct; see values.yaml).
*/}}
{{- define "moray.serveConfig" -}}
{{- $args := include "moray.clusterArgs" . | fromJson -}}
{{- $server := $args.server | default dict -}}
{{- $app := dict "name" (default "moray" $args.name) "route_prefix" "/" "import_path" .Values.serve.importPath "args" $args -}}
{{- if .Values.serve.runtimeEnv -}}
{{- $_ := set $app "runtime_env" .Values.serve.runtimeEnv -}}
{{- end -}}
{{- $http := dict "host" (default "0.0.0.0" $server.host) "port" (int (default 8000 $server.http_port)) "request_timeout_s" (default 600.0 $server.request_timeout_s) -}}
{{- $grpc := dict "port" (int (default 9000 $server.grpc_port)) "grpc_servicer_functions" .Values.serve.grpcServicerFunctions -}}
{{- /* direct ingress: the front ends (placed on the head) listen on the serving ports; no proxy may hold them */ -}}
{{- $proxy := ternary "Disabled" .Values.serve.proxyLocation (eq ($server.ingress | default "serve") "direct") -}}
{{- $cfg := dict "proxy_location" $proxy "http_options" $http "grpc_options" $grpc "applications" (list $app) -}}
{{- toYaml $cfg -}}
{{- end -}}

{{- define "moray.httpPort" -}}
{{- int (default 8000 (.Values.cluster.server | default dict).http_port) -}}
{{- end -}}

{{- define "moray.grpcPort" -}}
{{- int (default 9000 (.Values.cluster.server | default dict).grpc_port) -}}
{{- end -}}

{{/* Env vars every Ray container gets. Argument: dict "root" $ "tpu" bool. */}}
{{- define "moray.rayEnv" -}}
{{- $root := .root -}}
- name: JAX_PLATFORMS
  value: {{ ternary "tpu,cpu" "cpu" .tpu | quote }}
{{- if $root.Values.compilationCache.enabled }}
- name: JAX_COMPILATION_CACHE_DIR
  value: {{ $root.Values.compilationCache.mountPath | quote }}
{{- end }}
{{- with include "moray.redisPasswordSecret" $root }}
{{- $s := fromJson . }}
- name: MORAY_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $s.name }}
      key: {{ $s.key }}
{{- end }}
{{- with include "moray.apiKeysSecret" $root }}
{{- $s := fromJson . }}
- name: MORAY_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ $s.name }}
      key: {{ $s.key }}
{{- end }}
{{- with $root.Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Volumes of a Ray pod (model weights, XLA cache). */}}
{{- define "moray.rayVolumes" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "gcsfuse" }}
- name: model
  csi:
    driver: gcsfuse.csi.storage.gke.io
    readOnly: true
    volumeAttributes:
      bucketName: {{ required "model.gcsfuse.bucket is required when model.source is gcsfuse" $m.gcsfuse.bucket | quote }}
      mountOptions: {{ $m.gcsfuse.mountOptions | quote }}
{{- else if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" $m.pvc.claimName | quote }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" $m.hostPath.path | quote }}
    type: Directory
{{- else if eq $m.source "makeModel" }}
- name: model
  emptyDir: {}
{{- end }}
{{- $cc := .Values.compilationCache -}}
{{- if $cc.enabled }}
- name: xla-cache
{{- if eq $cc.volume "hostPath" }}
  hostPath:
    path: {{ $cc.hostPath | quote }}
    type: DirectoryOrCreate
{{- else }}
  emptyDir:
    {{- with $cc.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "moray.rayVolumeMounts" -}}
{{- if ne .Values.model.source "image" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- if .Values.compilationCache.enabled }}
- name: xla-cache
  mountPath: {{ .Values.compilationCache.mountPath }}
{{- end }}
{{- end -}}

{{/*
Init containers of a Ray pod: with a hostPath compile cache, one that gives the directory to the
non-root user (the kubelet creates it owned by root); with model.source makeModel, one that writes the
tiny test checkpoint (the CPU profile).
*/}}
{{- define "moray.rayInitContainers" -}}
{{- $cc := .Values.compilationCache -}}
{{- if and $cc.enabled (eq $cc.volume "hostPath") }}
{{- $uid := int (default 1000 .Values.podSecurityContext.runAsUser) }}
{{- $gid := int (default 100 .Values.podSecurityContext.runAsGroup) }}
- name: xla-cache-owner
  image: {{ include "moray.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["sh", "-c", "chown {{ $uid }}:{{ $gid }} {{ $cc.mountPath }} && chmod 0775 {{ $cc.mountPath }}"]
  securityContext:
    runAsUser: 0
    runAsNonRoot: false
    allowPrivilegeEscalation: false
    capabilities: {drop: [ALL], add: [CHOWN, FOWNER]}
  volumeMounts:
    - name: xla-cache
      mountPath: {{ $cc.mountPath }}
  resources:
    requests: {cpu: 50m, memory: 32Mi}
    limits: {cpu: 100m, memory: 64Mi}
{{- end }}
{{- if eq .Values.model.source "makeModel" }}
{{- $mm := .Values.model.makeModel }}
- name: make-model
  image: {{ include "moray.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["moray", "make-model", {{ .Values.cluster.engine.model | quote }}, "--arch", {{ $mm.arch | quote }}, "--preset", {{ $mm.preset | quote }}, "--seed", {{ $mm.seed | toString | quote }}]
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  resources:
    requests: {cpu: 500m, memory: 1Gi}
    limits: {cpu: "2", memory: 2Gi}
{{- end }}
{{- end -}}

{{/* Pod annotations of a Ray pod (GCSFuse sidecar injection when the model comes from GCS). */}}
{{- define "moray.rayPodAnnotations" -}}
{{- $a := dict -}}
{{- if eq .root.Values.model.source "gcsfuse" -}}
{{- $a = mergeOverwrite $a (dict "gke-gcsfuse/volumes" "true") (.root.Values.model.gcsfuse.sidecarAnnotations | default dict) -}}
{{- end -}}
{{- $a = mergeOverwrite $a (.root.Values.podAnnotations | default dict) (.extra | default dict) -}}
{{- if $a }}{{ toYaml $a }}{{ end -}}
{{- end -}}

{{/* The readiness probe: raylet health from the dashboard agent, no Serve proxy needed (kuberay#2552). */}}
{{- define "moray.readinessProbe" -}}
{{- $p := .Values.readinessProbe -}}
httpGet:
  path: {{ $p.path }}
  port: {{ $p.port }}
initialDelaySeconds: {{ $p.initialDelaySeconds }}
periodSeconds: {{ $p.periodSeconds }}
timeoutSeconds: {{ $p.timeoutSeconds }}
failureThreshold: {{ $p.failureThreshold }}
{{- end -}}
