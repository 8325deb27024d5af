"""The labels that put a RayCluster into a queue: Kueue's, or those KubeRay's batch-scheduler
plugins read (KubeRay v1.6.2, `controllers/ray/batchscheduler/`)."""

from __future__ import annotations

from vllm_dp_operator import constants as c
from vllm_dp_operator.api.models import Scheduler, Scheduling, VLLMDataParallelSpec

#: Per scheduler: the label of the queue and of the priority class (None: not read).
_KEYS: dict[str, tuple[str | None, str | None]] = {
    Scheduler.KUEUE: (c.LABEL_KUEUE_QUEUE, c.LABEL_KUEUE_PRIORITY),
    Scheduler.VOLCANO: ("volcano.sh/queue-name", "ray.io/priority-class-name"),
    Scheduler.YUNIKORN: ("yunikorn.apache.org/queue", None),
    Scheduler.SCHEDULER_PLUGINS: (None, None),
    Scheduler.KAI_SCHEDULER: ("kai.scheduler/queue", None),
}
#: YuniKorn and scheduler-plugins place the pods as one gang only when this label is there.
_GANG = {Scheduler.YUNIKORN, Scheduler.SCHEDULER_PLUGINS}
GANG_LABEL = "ray.io/gang-scheduling-enabled"


def scheduling_labels(scheduling: Scheduling | None) -> dict[str, str]:
    """The RayCluster labels of a scheduling section ({} without one)."""
    if scheduling is None:
        return {}
    queue_key, priority_key = _KEYS[scheduling.scheduler_name]
    labels: dict[str, str] = {}
    if queue_key and scheduling.queue_name:
        labels[queue_key] = scheduling.queue_name
    if priority_key and scheduling.priority_class_name:
        labels[priority_key] = scheduling.priority_class_name
    if scheduling.scheduler_name in _GANG:
        labels[GANG_LABEL] = "true"
    return labels


def kueue_queue(spec: VLLMDataParallelSpec) -> str | None:
    """The Kueue LocalQueue the RayCluster is in, if any: Kueue then owns its spec.suspend."""
    s = spec.scheduling
    if s is None or s.scheduler_name != Scheduler.KUEUE:
        return None
    return s.queue_name
