"""Names, label keys, condition types and reasons used across the operator."""

from __future__ import annotations

from typing import Final

GROUP: Final = "vllmdp.io"
VERSION: Final = "v1alpha1"
KIND: Final = "VLLMDataParallel"
PLURAL: Final = "vllmdataparallels"
SINGULAR: Final = "vllmdataparallel"
SHORT_NAMES: Final = ("vdp",)

RAY_GROUP: Final = "ray.io"
RAY_VERSION_API: Final = "v1"
RAY_VERSION: Final = "2.60.0"

DEFAULT_SERVING_PORT: Final = 8000
# The cluster DNS domain a kubelet's --cluster-domain sets on nearly every cluster.
DEFAULT_CLUSTER_DOMAIN: Final = "cluster.local"
DEFAULT_SHM_SIZE: Final = "16Gi"
RAY_GCS_PORT: Final = 6379
RAY_DASHBOARD_PORT: Final = 8265
RAY_CLIENT_PORT: Final = 10001
#: Each Ray node's dashboard agent; `/api/healthz` there is the node's health (Ray >= 2.53).
RAY_AGENT_PORT: Final = 52365
# Ports Ray and KubeRay take on every Ray pod (or on the head, which serves the API), each with
# its owner: `vllm serve` on one of them fails to bind. Ranges are inclusive.
RESERVED_PORTS: Final = (
    (RAY_GCS_PORT, RAY_GCS_PORT, "the Ray GCS server on the head pod"),
    (8080, 8080, "Ray's metrics agent: KubeRay always passes --metrics-export-port=8080"),
    (RAY_DASHBOARD_PORT, RAY_DASHBOARD_PORT, "the Ray dashboard and job API on the head pod"),
    (RAY_CLIENT_PORT, RAY_CLIENT_PORT, "the Ray client server on the head pod"),
    (10002, 19999, "Ray worker processes (ray start's default --min/max-worker-port range)"),
    (52365, 52365, "the Ray dashboard agent: KubeRay passes --dashboard-agent-listen-port=52365"),
    (32768, 60999, "Linux's ephemeral ports (ip_local_port_range), where NCCL, Gloo, ZMQ and "
     "Ray bind listeners at random on every Ray pod"),
)

# Name limits of the children, all named after the resource (KubeRay utils/constant.go and
# validation.go; Kubernetes DNS labels). The attempt suffix has a fixed width, so the limit
# does not depend on how many head jobs a resource has had.
KUBERAY_MAX_RAYJOB_NAME: Final = 47
KUBERAY_MAX_RAYCLUSTER_NAME: Final = 53
DNS_LABEL_MAX: Final = 63
CLUSTER_HASH_SUFFIX: Final = 6  # "-" + 5 hex characters of the shape hash
ATTEMPT_SUFFIX: Final = 7  # "-j" + 5 base-36 digits of the attempt (see names.head_job)
#: Replicas of one resource (spec.replicas): the head job's name holds the index in two base-36
#: digits (names.head_job), and every replica's head is one endpoint of one EndpointSlice.
MAX_REPLICAS: Final = 100
HEAD_SERVICE_SUFFIX: Final = "-head-svc"  # KubeRay's head Service: <cluster>-head-svc
API_SERVICE_SUFFIX: Final = "-api"
RAY_TOKEN_SECRET_SUFFIX: Final = "-ray-token"
# KubeRay reads the token from this key of authOptions.secretName (utils/constant.go
# RAY_AUTH_TOKEN_SECRET_KEY), and Ray's dashboard takes it in this header too: the API
# server's service proxy consumes `Authorization` itself, so KubeRay sends this one.
RAY_TOKEN_SECRET_KEY: Final = "auth_token"
RAY_AUTH_HEADER: Final = "x-ray-authorization"
#: A head that drains is stopped once no request runs there and no client request came for
#: this long after it was told to close kept-alive connections (engines/drain.py).
DRAIN_QUIET_SECONDS: Final = 3.0
#: How often a head that drains is probed (at most; its drain call and /metrics each time).
DRAIN_PROBE_SECONDS: Final = 2.0
NETWORK_POLICY_SUFFIX: Final = "-ray"  # the NetworkPolicy in front of the Ray pods
API_POLICY_SUFFIX: Final = "-api-port"  # the one that opens the API port, on head pods only
EGRESS_POLICY_SUFFIX: Final = "-egress"  # the opt-in one that limits the Ray pods' egress
DISRUPTION_BUDGET_SUFFIX: Final = "-ray"  # the PodDisruptionBudget over the Ray pods
MAX_NAME_LENGTH: Final = min(
    KUBERAY_MAX_RAYJOB_NAME - ATTEMPT_SUFFIX,
    KUBERAY_MAX_RAYCLUSTER_NAME - CLUSTER_HASH_SUFFIX,
    DNS_LABEL_MAX - CLUSTER_HASH_SUFFIX - len(HEAD_SERVICE_SUFFIX),
    DNS_LABEL_MAX - len(API_SERVICE_SUFFIX),
)
# A DNS-1035 label: the Service, RayCluster and RayJob names must be one (KubeRay rejects
# others with ValidationFailed; the API server rejects such a Service).
DNS1035_PATTERN: Final = "^[a-z]([-a-z0-9]*[a-z0-9])?$"

# Launch and stop timing defaults (spec.launch).
DEFAULT_LAUNCH_TIMEOUT_SECONDS: Final = 3600
DEFAULT_DRAIN_SECONDS: Final = 30
DEFAULT_UPDATE_DRAIN_SECONDS: Final = 30
# Extra CPU and memory the head pod gets per vLLM API server process it runs.
HEAD_CPU_PER_API_SERVER: Final = 1
HEAD_MEMORY_PER_API_SERVER_MI: Final = 2048
# Where a model cache claim is mounted by default: outside /root, which is 0700 in vLLM's image.
DEFAULT_MODEL_CACHE_PATH: Final = "/var/cache/huggingface"

# Label keys.
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_CLUSTER_HASH: Final = f"{GROUP}/cluster-hash"
LABEL_JOB_HASH: Final = f"{GROUP}/job-hash"
LABEL_ATTEMPT: Final = f"{GROUP}/attempt"
LABEL_CLUSTER: Final = f"{GROUP}/cluster"
#: The replica a RayCluster, head job or Ray pod belongs to; absent on children that versions
#: before replicas made, which are replica 0's.
LABEL_REPLICA: Final = f"{GROUP}/replica"
#: A namespace label: its pods may reach the API port of every resource that sets no
#: spec.service.allowFrom (a gateway's, an ingress controller's or Prometheus's namespace), by
#: default (VLLMDP_API_NAMESPACE_LABELS).
LABEL_API_ACCESS: Final = f"{GROUP}/api-access"
LABEL_RAY_CLUSTER: Final = "ray.io/cluster"
LABEL_RAY_NODE_TYPE: Final = "ray.io/node-type"
# The head pod label that versions before the EndpointSlice routing set, and their Service selected.
# The operator neither sets nor removes it now (it writes no pods); named for the docs' sake.
LEGACY_LABEL_SERVING: Final = f"{GROUP}/serving"
# EndpointSlice labels: the Service a slice belongs to, and who manages it. Ours is not the
# EndpointSlice controller's value, so neither it nor the mirroring controller touches it.
LABEL_SERVICE_NAME: Final = "kubernetes.io/service-name"
LABEL_SLICE_MANAGED_BY: Final = "endpointslice.kubernetes.io/managed-by"
# A label value (no slash), in the EndpointSlice controller's own form (`<controller>.<domain>`).
SLICE_MANAGER: Final = f"vllm-dp-operator.{GROUP}"
# Kueue: the LocalQueue and WorkloadPriorityClass of a job, and the uid of a Workload's job.
KUEUE_GROUP: Final = "kueue.x-k8s.io"
LABEL_KUEUE_QUEUE: Final = f"{KUEUE_GROUP}/queue-name"
LABEL_KUEUE_PRIORITY: Final = f"{KUEUE_GROUP}/priority-class"
LABEL_KUEUE_JOB_UID: Final = f"{KUEUE_GROUP}/job-uid"
KUEUE_VERSION: Final = "v1beta2"
# Annotations on a head RayJob: the head pod it was launched on, and how its stop went.
ANNOTATION_HEAD_POD_UID: Final = f"{GROUP}/head-pod-uid"
ANNOTATION_RETIRE_STARTED: Final = f"{GROUP}/retire-started-at"
ANNOTATION_STOP_REQUESTED: Final = f"{GROUP}/stop-requested-at"
#: When a serving head job that a rolling update's turn replaces began to drain.
ANNOTATION_DRAIN_STARTED: Final = f"{GROUP}/drain-started-at"
#: On the resource: a new value asks for new engines, as `kubectl rollout restart` does.
ANNOTATION_RESTARTED_AT: Final = f"{GROUP}/restartedAt"
#: On a RayCluster: the resource's `<generation>/<restartedAt>` it runs what was asked for.
ANNOTATION_ACCEPTED: Final = f"{GROUP}/accepted"
#: On a RayCluster: the operator-wide inputs it was rendered with (image, release, Ray).
ANNOTATION_RENDERED_WITH: Final = f"{GROUP}/rendered-with"
#: On a RayCluster: the API port its engines listen on (spec.service.port when rendered).
ANNOTATION_API_PORT: Final = f"{GROUP}/api-port"
# Ray job stop: SIGTERM, then SIGKILL after this many seconds (Ray's job supervisor).
RAY_JOB_STOP_WAIT_ENV: Final = "RAY_JOB_STOP_WAIT_TIME_S"
#: Where the launcher also writes its stage lines: the head container's stdout, so its log
#: (vllm_dp_launcher.report.CONTAINER_STDOUT).
STAGE_REPORT_PATH: Final = "container-stdout"
#: The Ray head container KubeRay runs (render/raycluster.py), whose log the operator follows.
HEAD_CONTAINER: Final = "ray-head"

APP_NAME: Final = "vllm-dp"
MANAGER: Final = "vllm-dp-operator"
COMPONENT_ENGINE: Final = "engine"
COMPONENT_DISRUPTION: Final = "disruption-budget"
COMPONENT_HEAD_JOB: Final = "head-job"
COMPONENT_API: Final = "api"
COMPONENT_RAY_AUTH: Final = "ray-auth"
# The API Service's one port: its EndpointSlice's port must carry the same name.
API_PORT_NAME: Final = "http"
COMPONENT_NETWORK_POLICY: Final = "network-policy"

# Phases.
PHASE_INVALID: Final = "Invalid"
PHASE_PROVISIONING: Final = "Provisioning"
PHASE_LAUNCHING: Final = "Launching"
PHASE_SERVING: Final = "Serving"
PHASE_BACKOFF: Final = "Backoff"
PHASE_SUSPENDED: Final = "Suspended"
# In a Kueue queue, not admitted yet (or again); Preempted: evicted by Kueue, waiting to return.
PHASE_QUEUED: Final = "Queued"
PHASE_PREEMPTED: Final = "Preempted"
#: spec.replicas is 0: the Service stays, no RayCluster is held.
PHASE_SCALED_TO_ZERO: Final = "ScaledToZero"
#: A replica's own phase while it leaves (scale-down): unrouted, its engines finishing.
PHASE_DRAINING: Final = "Draining"

# Condition types.
COND_SPEC_VALID: Final = "SpecValid"
COND_CLUSTER_READY: Final = "ClusterReady"
COND_HEAD_JOB_RUNNING: Final = "HeadJobRunning"
COND_READY: Final = "Ready"
#: Whether the engines run what the spec asks for (a Surge update's progress and failure).
COND_UPDATED: Final = "Updated"
# While Serving: whether every planned DP rank reports in vLLM's /metrics.
COND_ENGINES_REPORTING: Final = "EnginesReporting"
COND_LORA_READY: Final = "LoRAReady"
# Whether the operator can list and watch every child kind (False only while one is not
# served, 404, or not readable, 403; present only on resources once told so).
COND_CHILDREN_WATCHED: Final = "ChildrenWatched"
#: How many replicas route, of how many: True while at least one does.
COND_AVAILABLE: Final = "Available"
#: True while a replica that should serve does not (named in the message).
COND_DEGRADED: Final = "Degraded"

# Condition and event reasons.
REASON_VALID: Final = "Valid"
REASON_INVALID_SPEC: Final = "InvalidSpec"
REASON_CLUSTER_CREATED: Final = "RayClusterCreated"
REASON_CLUSTER_RESHAPED: Final = "RayClusterReshaped"
REASON_CLUSTER_READY: Final = "RayClusterReady"
REASON_PODS_PENDING: Final = "PodsPending"
# KubeRay's pod creates are refused (PodSecurity or another admission, a ResourceQuota).
REASON_PODS_REFUSED: Final = "PodsRefused"
REASON_WAITING_FOR_NODES: Final = "WaitingForRayNodes"
REASON_SUSPENDED: Final = "Suspended"
REASON_QUEUED: Final = "Queued"
REASON_PREEMPTED: Final = "Preempted"
REASON_JOB_CREATED: Final = "HeadJobCreated"
REASON_JOB_RUNNING: Final = "HeadJobRunning"
REASON_JOB_PENDING: Final = "HeadJobPending"
REASON_JOB_FAILED: Final = "HeadJobFailed"
REASON_JOB_TIMED_OUT: Final = "LaunchTimedOut"
#: A head job that served stopped answering its probes for good: stopped and relaunched.
REASON_JOB_HUNG: Final = "HeadJobHung"
REASON_JOB_STOPPING: Final = "HeadJobStopping"
REASON_JOB_STOPPED: Final = "HeadJobStopped"
REASON_JOB_STOP_UNCONFIRMED: Final = "HeadJobStopUnconfirmed"
REASON_JOB_RELAUNCH: Final = "HeadJobRelaunched"
REASON_JOB_BACKOFF: Final = "HeadJobBackoff"
REASON_HEALTHY: Final = "EngineHealthy"
REASON_UPDATED: Final = "Updated"
REASON_UPDATE_STARTED: Final = "UpdateStarted"
REASON_UPDATE_SWITCHED: Final = "UpdateSwitched"
REASON_UPDATE_DONE: Final = "UpdateDone"
REASON_UPDATE_IN_PROGRESS: Final = "UpdateInProgress"
REASON_UPDATE_FAILED: Final = "UpdateFailed"
REASON_UPDATE_WITHDRAWN: Final = "UpdateWithdrawn"
REASON_UPDATE_PENDING: Final = "UpdatePending"
REASON_NOT_HEALTHY: Final = "EngineNotHealthy"
#: Served, still routed, but the operator's own probes fail (below the unroute threshold).
REASON_PROBE_FAILING: Final = "ProbeFailing"
REASON_NO_CLUSTER: Final = "NoRayCluster"
REASON_PHASE_CHANGED: Final = "PhaseChanged"
REASON_RANKS_REPORTING: Final = "AllRanksReporting"
REASON_RANKS_MISSING: Final = "RanksNotReporting"
REASON_METRICS_UNAVAILABLE: Final = "MetricsUnavailable"
REASON_NOT_SERVING: Final = "NotServing"
REASON_KIND_NOT_SERVED: Final = "KindNotServed"
REASON_WATCH_FORBIDDEN: Final = "WatchForbidden"
REASON_WATCHING: Final = "Watching"
REASON_REPLICAS_AVAILABLE: Final = "ReplicasAvailable"
REASON_NO_REPLICA_AVAILABLE: Final = "NoReplicaAvailable"
REASON_SCALED_TO_ZERO: Final = "ScaledToZero"
REASON_REPLICA_DEGRADED: Final = "ReplicaDegraded"
REASON_ALL_REPLICAS_SERVE: Final = "AllReplicasServe"
REASON_SCALED: Final = "Scaled"
REASON_REPLICA_DRAINING: Final = "ReplicaDraining"
REASON_REPLICA_REMOVED: Final = "ReplicaRemoved"
REASON_ADAPTERS_LOADED: Final = "AdaptersLoaded"
REASON_ADAPTERS_LOADING: Final = "AdaptersLoading"
REASON_ADAPTER_FAILED: Final = "AdapterFailed"

EVENT_NORMAL: Final = "Normal"
EVENT_WARNING: Final = "Warning"
