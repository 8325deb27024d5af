"""Render the PodDisruptionBudget over a resource's Ray pods: a node drain takes down at most
one replica at a time, and only while another replica routes (reconcile/disruption.py keeps it
to the replicas routed now).

One budget over every replica's pods, not one per replica: the eviction API checks one
budget atomically, so two drains at once cannot each take a replica. Ray pods belong to a
RayCluster, which has no scale subresource, so the budget counts pods with an integer
`minAvailable` (a percentage, or `maxUnavailable`, needs the controller's scale).
"""

from __future__ import annotations

from typing import Any

from vllm_dp_operator import constants
from vllm_dp_operator.api import names
from vllm_dp_operator.render.meta import metadata


def min_available(replicas: int, pods_per_replica: int, routed: int) -> int | None:
    """The budget's minAvailable, or None for no budget.

    One replica (or none) has no budget: it would block every drain of its nodes for good.
    With two or more, one pod may go while at least two replicas route: one pod's eviction
    takes down at most its replica, and the next waits until the budget counts every pod
    healthy again. Not one replica's worth of pods: a drain evicts a node's pods at once, and
    those may be of two replicas. Once the evicted replica is unrouted (this reconcile sees the
    pod going) only one routes, and none may go until it routes again; with none routing there
    is nothing to keep. A pod that is not Ready may always be evicted
    (unhealthyPodEvictionPolicy: AlwaysAllow).
    """
    if replicas < 2:
        return None
    total = replicas * pods_per_replica
    if routed >= 2:
        return total - 1
    return total if routed == 1 else 0


def build_disruption_budget(
    instance: str, namespace: str, minimum: int, owner: dict[str, Any] | None
) -> dict[str, Any]:
    """The budget over the resource's Ray pods (every replica's, heads and workers)."""
    selector = {constants.LABEL_INSTANCE: instance,
                constants.LABEL_COMPONENT: constants.COMPONENT_ENGINE}  # fmt: skip
    labels = names.instance_labels(instance, constants.COMPONENT_DISRUPTION)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(names.disruption_budget(instance), namespace, labels, owner),
        "spec": {
            "minAvailable": minimum,
            "selector": {"matchLabels": selector},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }
