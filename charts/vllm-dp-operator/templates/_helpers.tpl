{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "vllm-dp-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of every resource name: "<release>-<chart>", or just the release when it already holds the chart name. */}}
{{- define "vllm-dp-operator.fullname" -}}
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

{{/* Labels that select the operator pod; never change them after a release (selectors are immutable). */}}
{{- define "vllm-dp-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vllm-dp-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels on every object the chart renders. */}}
{{- define "vllm-dp-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "vllm-dp-operator.selectorLabels" . }}
app.kubernetes.io/component: operator
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* ServiceAccount the operator runs as. */}}
{{- define "vllm-dp-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "vllm-dp-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Namespaces the operator watches, comma-separated, or "" for all namespaces (VLLMDP_WATCH_NAMESPACES).
*/}}
{{- define "vllm-dp-operator.watchNamespaces" -}}
{{- join "," (.Values.watchNamespaces | default list) }}
{{- end }}

{{/*
Permissions the operator's own code uses, on namespaced resources. One list feeds both the
ClusterRole and the Role so the two scopes cannot drift apart. Keep it in step with
REQUIRED in tests/chart/test_chart_rbac.py.
*/}}
{{- define "vllm-dp-operator.namespacedRules" -}}
# The custom resource: kopf lists/watches it; the operator patches its status. kopf adds no
# finalizer or annotation (no timers, daemons or changing handlers); `patch` lets it remove the
# finalizer that versions before the event-driven controller added.
- apiGroups: ["vllmdp.io"]
  resources: ["vllmdataparallels"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["vllmdp.io"]
  resources: ["vllmdataparallels/status"]
  verbs: ["get", "patch"]
# Children carry blockOwnerDeletion: true; under the OwnerReferencesPermissionEnforcement
# admission plugin (on in OpenShift) creating them needs update on the owner's finalizers.
- apiGroups: ["vllmdp.io"]
  resources: ["vllmdataparallels/finalizers"]
  verbs: ["update"]
# The children: one RayCluster and one RayJob (the head job) per resource. list/watch feed
# the operator's in-memory cache (label app.kubernetes.io/managed-by=vllm-dp-operator).
- apiGroups: ["ray.io"]
  resources: ["rayclusters", "rayjobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Kueue's Workloads (one per RayCluster in a LocalQueue), read only: their conditions say why
# a cluster is Queued or Preempted. Watched where Kueue is installed; harmless where not.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch"]
# The child Service that fronts the OpenAI API (selector-less).
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The NetworkPolicy in front of each resource's Ray pods (networkPolicy.enabled).
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The PodDisruptionBudget over each resource's Ray pods (spec.replicas of 2 or more): a node
# drain takes at most one replica at a time, and only while another routes.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The Service's one EndpointSlice, the operator's: the head pod's address, ready while routed.
# delete: the slices the EndpointSlice and mirroring controllers left for a Service that an
# earlier version gave a selector (neither removes them when the selector goes).
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Only delete, and only the endpoints controller's last Endpoints of such a Service, which the
# mirroring controller would otherwise copy into a slice again.
- apiGroups: [""]
  resources: ["endpoints"]
  verbs: ["delete"]
# Read only, through a watch: the head pod's address and readiness for the EndpointSlice,
# and why Ray pods are Pending. No pod is ever written.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# The launcher's report of a launch, in the head container's log: followed (get, with
# follow) while a head job launches, so routing starts the moment vLLM answers. Read only.
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
# Each resource's Ray token Secret (spec.ray.auth: token): created, never read, listed,
# watched or changed; the operator derives the token from its own key instead.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
# Events posted by the operator and by kopf.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- if eq .Values.healthProbe.mode "apiserver-proxy" }}
# The head pod through the API server (healthProbe.mode=apiserver-proxy) only: GET /health
# and the Ray job API (get), POST a Ray job stop (create).
- apiGroups: [""]
  resources: ["services/proxy"]
  verbs: ["get", "create"]
{{- end }}
{{- end }}

{{/*
kopf's own cluster-wide observation (kopf 1.45, kopf/_core/reactor/observation.py): it
lists/watches CRDs to notice resources appearing; it lists/watches Namespaces only when it
runs with --namespace (to resolve namespace patterns), never with --all-namespaces.
--standalone means no peering objects are read or written.
*/}}
{{- define "vllm-dp-operator.frameworkRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if .Values.watchNamespaces }}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end }}

{{/*
The operator image: repository@digest when image.digest is set (the tag is then ignored),
else repository:tag (the chart's appVersion when the tag is empty).
*/}}
{{- define "vllm-dp-operator.image" -}}
{{- with .Values.image.digest -}}
{{- if not (regexMatch "^sha256:[0-9a-f]{64}$" .) -}}
{{- fail (printf "image.digest: %q is not sha256:<64 lowercase hex>" .) -}}
{{- end -}}
{{- printf "%s@%s" $.Values.image.repository . -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end }}

{{/*
The Secret holding the operator's Ray auth key: rayAuth.existingKeySecret, or the chart's own.
*/}}
{{- define "vllm-dp-operator.rayAuthKeySecret" -}}
{{- .Values.rayAuth.existingKeySecret | default (printf "%s-ray-auth-key" (include "vllm-dp-operator.fullname" .)) -}}
{{- end }}

{{/*
The metrics server's TLS Secret (tls.crt, tls.key, ca.crt): metrics.tls.existingSecret, or
the chart's own; and the metrics Service's in-cluster name its certificate is for.
*/}}
{{- define "vllm-dp-operator.metricsTlsSecret" -}}
{{- .Values.metrics.tls.existingSecret | default (printf "%s-metrics-tls" (include "vllm-dp-operator.fullname" .)) -}}
{{- end }}

{{- define "vllm-dp-operator.metricsHost" -}}
{{- printf "%s-metrics.%s.svc" (include "vllm-dp-operator.fullname" .) .Release.Namespace -}}
{{- end }}
