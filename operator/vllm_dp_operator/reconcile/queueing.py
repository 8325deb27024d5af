"""What Kueue's Workload says about a RayCluster it holds suspended: pure, like status.py.

Kueue creates one Workload per RayCluster in a LocalQueue (labelled with the cluster's uid),
reserves quota for it in a ClusterQueue, and then unsuspends the cluster. While the cluster is
suspended the resource is `Queued`, with Kueue's own words (the QuotaReserved condition's
message, e.g. "couldn't assign flavors to pod set head: insufficient unused quota for
nvidia.com/gpu in flavor gpu, 4 more needed"), or `Preempted` once Kueue evicted it to
make room for a workload of higher priority.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_dp_operator import constants as c

#: Kueue's Workload conditions (apis/kueue/v1beta2/workload_types.go).
QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
EVICTED = "Evicted"
PREEMPTED = "Preempted"


@dataclass(frozen=True)
class QueueState:
    """The phase, condition reason and message of a RayCluster Kueue has not let run."""

    phase: str
    reason: str
    message: str


def _cond(workload: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    for cond in (workload.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return None


def _true(cond: Mapping[str, Any] | None) -> bool:
    return cond is not None and cond.get("status") == "True"


def _said(cond: Mapping[str, Any] | None) -> str:
    return str((cond or {}).get("message") or "").strip().rstrip(".")


def queue_state(cluster: str, queue: str, workload: Mapping[str, Any] | None) -> QueueState:
    """Why a suspended RayCluster in LocalQueue `queue` waits, from its Workload (or None)."""
    if workload is None:
        return QueueState(c.PHASE_QUEUED, c.REASON_QUEUED,
                          f"Queued in LocalQueue {queue}: waiting for Kueue to make a Workload "
                          f"for RayCluster {cluster} (is Kueue running, with its "
                          "ray.io/raycluster integration on?)")  # fmt: skip
    reserved, admitted = _cond(workload, QUOTA_RESERVED), _cond(workload, ADMITTED)
    evicted, preempted = _cond(workload, EVICTED), _cond(workload, PREEMPTED)
    waiting = (_said(reserved) if not _true(reserved) else "") or "waiting for quota"
    # Kueue resets Evicted and Preempted to False when it reserves quota again: True means the
    # eviction is the latest news, even while the old reservation is still being released.
    if _true(evicted) or _true(preempted):
        why = _said(evicted) or _said(preempted)
        by_priority = _true(preempted) or (evicted or {}).get("reason") == PREEMPTED
        phase, reason = ((c.PHASE_PREEMPTED, c.REASON_PREEMPTED) if by_priority
                         else (c.PHASE_QUEUED, c.REASON_QUEUED))  # fmt: skip
        verb = "Preempted" if by_priority else "Evicted"
        return QueueState(phase, reason,
                          f"{verb} by Kueue: {why}. RayCluster {cluster} is suspended and back "
                          f"in LocalQueue {queue}: {waiting}")  # fmt: skip
    if _true(reserved) and not _true(admitted):
        return QueueState(c.PHASE_QUEUED, c.REASON_QUEUED,
                          f"Queued in LocalQueue {queue}: quota reserved, waiting for admission "
                          f"checks: {_said(admitted) or 'none reported yet'}")  # fmt: skip
    if _true(admitted):
        return QueueState(c.PHASE_QUEUED, c.REASON_QUEUED,
                          f"Admitted by Kueue in LocalQueue {queue}: waiting for it to resume "
                          f"RayCluster {cluster}")  # fmt: skip
    return QueueState(c.PHASE_QUEUED, c.REASON_QUEUED, f"Queued in LocalQueue {queue}: {waiting}")
