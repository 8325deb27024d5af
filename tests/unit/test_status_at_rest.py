"""Status is a function of what means something: KubeRay's stamps on a RayCluster move none of it.

KubeRay rewrites a converged cluster's status with new stamps (`lastUpdateTime`, its state
transition times, its conditions' `lastTransitionTime`, `observedGeneration`), and every such
write wakes the resource. The reconcile fed the cluster before and after such a rewrite must
conclude the same status, in every phase a resource rests in, and post no Event.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from vllm_dp_operator import constants as c
from vllm_dp_operator.controller.kube import RAYCLUSTER
from world import World, serving, spec


def _kuberay_rewrite(w: World, round_: int) -> None:
    """Play KubeRay's write of a cluster whose state did not change: new stamps only."""
    stamp = f"2026-01-01T00:0{round_}:00Z"
    for cluster in w.clusters():
        status = copy.deepcopy(cluster.get("status") or {})
        status.update(lastUpdateTime=stamp, observedGeneration=round_,
                      stateTransitionTimes={status.get("state") or "suspended": stamp})
        status["conditions"] = [{**cond, "lastTransitionTime": stamp}
                                for cond in status.get("conditions") or []]  # fmt: skip
        w.kube.set_status(RAYCLUSTER, "default", cluster["metadata"]["name"], status)


async def _at_rest(phase: str) -> World:
    if phase == c.PHASE_SERVING:
        return await serving()
    w = World({**spec(), "suspend": True} if phase == c.PHASE_SUSPENDED else None)
    await w.step()
    if phase == c.PHASE_LAUNCHING:
        w.cluster_ready()
    for _ in range(2):  # the follow-up after its creates: a fixed point
        await w.step()
    assert w.status["phase"] == phase
    return w


@pytest.mark.parametrize("phase", [c.PHASE_SUSPENDED, c.PHASE_PROVISIONING, c.PHASE_LAUNCHING,
                                   c.PHASE_SERVING])  # fmt: skip
async def test_kuberay_stamps_move_no_status_key(phase: str) -> None:
    w = await _at_rest(phase)
    before: dict[str, Any] = copy.deepcopy(w.status)
    events = len(w.events)
    for round_ in range(1, 4):
        _kuberay_rewrite(w, round_)
        await w.step(advance=5)
        assert w.status == before, f"round {round_}: {phase} status moved"
    assert len(w.events) == events
