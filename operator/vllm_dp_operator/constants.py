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
DEFAULT_SHM_SIZE: Final = "16Gi"
# Ports the Ray head pod already uses; the API server must not collide with them.
RAY_GCS_PORT: Final = 6379
RAY_DASHBOARD_PORT: Final = 8265
RAY_CLIENT_PORT: Final = 10001
RAY_RESERVED_PORTS: Final = (RAY_GCS_PORT, RAY_DASHBOARD_PORT, RAY_CLIENT_PORT)

# Longest resource name whose children (RayCluster, its pods and head Service) stay
# within Kubernetes' 63-character label and DNS-label limits.
MAX_NAME_LENGTH: Final = 40

# Label keys.
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_CLUSTER_HASH: Final = f"{GROUP}/cluster-hash"
LABEL_JOB_HASH: Final = f"{GROUP}/job-hash"
LABEL_ATTEMPT: Final = f"{GROUP}/attempt"
LABEL_CLUSTER: Final = f"{GROUP}/cluster"
LABEL_RAY_CLUSTER: Final = "ray.io/cluster"
LABEL_RAY_NODE_TYPE: Final = "ray.io/node-type"

APP_NAME: Final = "vllm-dp"
MANAGER: Final = "vllm-dp-operator"
COMPONENT_ENGINE: Final = "engine"
COMPONENT_HEAD_JOB: Final = "head-job"
COMPONENT_API: Final = "api"

# Phases.
PHASE_INVALID: Final = "Invalid"
PHASE_PROVISIONING: Final = "Provisioning"
PHASE_LAUNCHING: Final = "Launching"
PHASE_SERVING: Final = "Serving"
PHASE_BACKOFF: Final = "Backoff"
PHASE_SUSPENDED: Final = "Suspended"

# Condition types.
COND_SPEC_VALID: Final = "SpecValid"
COND_CLUSTER_READY: Final = "ClusterReady"
COND_HEAD_JOB_RUNNING: Final = "HeadJobRunning"
COND_READY: Final = "Ready"

# Condition and event reasons.
REASON_VALID: Final = "Valid"
REASON_INVALID_SPEC: Final = "InvalidSpec"
REASON_CLUSTER_CREATED: Final = "RayClusterCreated"
REASON_CLUSTER_RESHAPED: Final = "RayClusterReshaped"
REASON_CLUSTER_READY: Final = "RayClusterReady"
REASON_PODS_PENDING: Final = "PodsPending"
REASON_WAITING_FOR_NODES: Final = "WaitingForRayNodes"
REASON_SUSPENDED: Final = "Suspended"
REASON_JOB_CREATED: Final = "HeadJobCreated"
REASON_JOB_RUNNING: Final = "HeadJobRunning"
REASON_JOB_PENDING: Final = "HeadJobPending"
REASON_JOB_FAILED: Final = "HeadJobFailed"
REASON_JOB_RELAUNCH: Final = "HeadJobRelaunched"
REASON_JOB_BACKOFF: Final = "HeadJobBackoff"
REASON_ENGINE_CHANGED: Final = "EngineConfigChanged"
REASON_HEALTHY: Final = "EngineHealthy"
REASON_NOT_HEALTHY: Final = "EngineNotHealthy"
REASON_NO_CLUSTER: Final = "NoRayCluster"

EVENT_NORMAL: Final = "Normal"
EVENT_WARNING: Final = "Warning"
