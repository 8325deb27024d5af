"""Pure status computation: conditions, and what the observed children mean."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any


def rfc3339(moment: datetime) -> str:
    """A timestamp as Kubernetes writes it."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str | None) -> datetime | None:
    """Parse a Kubernetes timestamp; None stays None."""
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


def set_condition(
    conditions: Iterable[Mapping[str, Any]],
    type_: str,
    status: bool | None,
    reason: str,
    message: str,
    generation: int,
    now: datetime,
) -> list[dict[str, Any]]:
    """Conditions with one set; lastTransitionTime moves only when the status flips."""
    value = "Unknown" if status is None else ("True" if status else "False")
    out: list[dict[str, Any]] = []
    found = False
    for cond in conditions:
        if cond.get("type") != type_:
            out.append(dict(cond))
            continue
        found = True
        flipped = cond.get("status") != value
        out.append(
            {
                "type": type_,
                "status": value,
                "reason": reason,
                "message": message,
                "lastTransitionTime": rfc3339(now)
                if flipped
                else cond.get("lastTransitionTime", rfc3339(now)),
                "observedGeneration": generation,
            }
        )
    if not found:
        out.append(
            {
                "type": type_,
                "status": value,
                "reason": reason,
                "message": message,
                "lastTransitionTime": rfc3339(now),
                "observedGeneration": generation,
            }
        )
    return out


def condition_status(conditions: Iterable[Mapping[str, Any]], type_: str) -> str | None:
    """The status string of one condition, or None when absent."""
    for cond in conditions:
        if cond.get("type") == type_:
            return str(cond.get("status"))
    return None


@dataclass(frozen=True)
class ClusterReadiness:
    """Whether every planned Ray node is up, and if not, why."""

    ready: bool
    message: str


def pod_ready(pod: Mapping[str, Any] | None) -> bool:
    """Whether a pod's own Ready condition is True (False for no pod)."""
    if pod is None:
        return False
    return condition_status((pod.get("status") or {}).get("conditions") or [], "Ready") == "True"


def cluster_readiness(
    cluster: Mapping[str, Any], worker_pods: int, head_pod: Mapping[str, Any] | None = None
) -> ClusterReadiness:
    """Read a RayCluster's status: ready when the head and all planned workers are ready.

    KubeRay writes `HeadPodReady` only with its `RayClusterStatusConditions` feature gate on;
    without it the head's readiness is the head pod's own Ready condition.
    """
    status = cluster.get("status") or {}
    conds = status.get("conditions") or []
    gated = condition_status(conds, "HeadPodReady")
    head_ready = gated == "True" if gated is not None else pod_ready(head_pod)
    provisioned = (
        condition_status(conds, "RayClusterProvisioned") == "True" or status.get("state") == "ready"
    )
    ready_workers = int(status.get("readyWorkerReplicas") or 0)
    if head_ready and provisioned and ready_workers >= worker_pods:
        return ClusterReadiness(True, f"head and {worker_pods} worker pod(s) ready")
    head = "ready" if head_ready else "not ready"
    return ClusterReadiness(
        False, f"Ray head {head}, {ready_workers}/{worker_pods} worker pod(s) ready"
    )


@dataclass(frozen=True)
class PodAsks:
    """What each Ray pod asks the scheduler for, to explain why one does not fit."""

    gpus: int
    gpu_resource: str
    cpu: str | None  # a worker pod's; None when the spec leaves it unset
    head_cpu: str | None
    memory: str | None
    head_memory: str | None


def explain_pending(pods: Iterable[Mapping[str, Any]], asks: PodAsks) -> str:
    """Say in a user's words why Ray pods are not running, or '' when none is stuck."""
    pods = list(pods)
    unschedulable = []
    for pod in pods:
        if (pod.get("status") or {}).get("phase") != "Pending":
            continue
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
                unschedulable.append(cond.get("message") or "unschedulable")
    if not unschedulable:
        return ""
    return (
        f"{len(unschedulable)} of {len(pods)} Ray pod(s) cannot be scheduled: "
        f"{unschedulable[0]} {pending_hint(unschedulable[0], asks)}"
    )


def pending_hint(scheduler_message: str, asks: PodAsks) -> str:
    """What to change, for each reason the scheduler gave (GPUs when it names none we know)."""
    gpu = (
        f"Each pod needs {asks.gpus} {asks.gpu_resource}; free GPUs, add GPU nodes, or lower "
        "dataParallel.size, tensorParallelSize or gpu.perPod."
    )
    hints = []
    if f"Insufficient {asks.gpu_resource}" in scheduler_message:
        hints.append(gpu)
    for kind, each, head in (("cpu", asks.cpu, asks.head_cpu),
                             ("memory", asks.memory, asks.head_memory)):  # fmt: skip
        if f"Insufficient {kind}" not in scheduler_message:
            continue
        asked = (f"The head asks {head} and each worker {each} of {kind} (resources.{kind}, "
                 f"plus a share per API server on the head)" if each
                 else f"resources.{kind} is unset, so the namespace's defaults apply")  # fmt: skip
        hints.append(f"{asked}; lower resources.{kind} or apiServerCount, or add nodes with "
                     f"more free {kind}.")  # fmt: skip
    if "untolerated taint" in scheduler_message:
        hints.append("Add a matching entry to tolerations, or untaint the GPU nodes.")
    if "node affinity/selector" in scheduler_message:
        hints.append("Check nodeSelector against the GPU nodes' labels.")
    return " ".join(hints) or gpu


#: KubeRay's ReplicaFailure reasons for a refused create (utils/constant.go), and which pod.
_REFUSED_CREATES = {"FailedCreateHeadPod": "head", "FailedCreateWorkerPod": "worker"}
# The API server's refusal names the pod, whose generated name changes with every retry.
_POD_NAME = re.compile(r'^pods? "[^"]*" is forbidden: ')


def explain_refused(cluster: Mapping[str, Any]) -> str | None:
    """Why KubeRay cannot create the Ray pods, quoting the API server's refusal, or None.

    KubeRay sets its `ReplicaFailure` condition (gate RayClusterStatusConditions, on by
    default) with the reason FailedCreateHeadPod or FailedCreateWorkerPod and, as message,
    that reason and the create's error on the next line.
    """
    for cond in (cluster.get("status") or {}).get("conditions") or []:
        pod = _REFUSED_CREATES.get(str(cond.get("reason")))
        if cond.get("type") != "ReplicaFailure" or cond.get("status") != "True" or pod is None:
            continue
        lines = str(cond.get("message") or "").splitlines()
        refusal = " ".join(line.strip() for line in lines if line.strip() != cond["reason"])
        refusal = _POD_NAME.sub("forbidden: ", refusal) or "no reason given"
        return (f"KubeRay cannot create the Ray {pod} pod of {cluster['metadata']['name']}: "
                f"the API server refused it: {refusal}")  # fmt: skip
    return None


def waits_for_secret(pods: Iterable[Mapping[str, Any]], secret: str) -> bool:
    """Whether a container of these pods cannot start because the Secret is missing."""
    missing = f'secret "{secret}" not found'
    for pod in pods:
        status = pod.get("status") or {}
        for container in [*(status.get("initContainerStatuses") or []),
                          *(status.get("containerStatuses") or [])]:  # fmt: skip
            waiting = (container.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") == "CreateContainerConfigError" and \
                    missing in str(waiting.get("message") or ""):  # fmt: skip
                return True
    return False
