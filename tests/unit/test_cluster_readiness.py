"""A RayCluster's readiness with and without KubeRay's `RayClusterStatusConditions` gate.

With the gate off KubeRay writes no conditions, so `HeadPodReady` never appears: the head's
readiness then comes from the head pod's own Ready condition.
"""

from __future__ import annotations

from typing import Any

from vllm_dp_operator import constants as c
from vllm_dp_operator.controller.kube import POD, RAYCLUSTER
from vllm_dp_operator.reconcile.status import cluster_readiness
from world import World

# What KubeRay writes with the feature gate off: no conditions at all.
NO_GATE = {"status": {"state": "ready", "readyWorkerReplicas": 1}}


def pod(ready: str) -> dict[str, Any]:
    return {"metadata": {"name": "h"}, "status": {"phase": "Running", "conditions": [
        {"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": ready}]}}


def test_without_conditions_a_ready_head_pod_makes_the_cluster_ready() -> None:
    readiness = cluster_readiness(NO_GATE, 1, pod("True"))
    assert readiness.ready, readiness.message


def test_without_conditions_an_unready_or_missing_head_pod_does_not() -> None:
    assert cluster_readiness(NO_GATE, 1, pod("False")).message == (
        "Ray head not ready, 1/1 worker pod(s) ready")
    assert not cluster_readiness(NO_GATE, 1, None).ready


def test_the_gate_s_condition_wins_over_the_pod() -> None:
    gated = {"status": {**NO_GATE["status"], "conditions": [
        {"type": "HeadPodReady", "status": "False"},
        {"type": "RayClusterProvisioned", "status": "True"}]}}  # fmt: skip
    assert not cluster_readiness(gated, 1, pod("True")).ready


async def test_a_cluster_without_conditions_launches_once_its_head_pod_is_ready() -> None:
    w = World()
    await w.step()
    (cluster,) = w.clusters()
    name = cluster["metadata"]["name"]
    workers = cluster["spec"]["workerGroupSpecs"][0]["replicas"]
    w.kube.set_status(RAYCLUSTER, "default", name,
                      {"state": "ready", "readyWorkerReplicas": workers})  # fmt: skip
    w.new_head_pod(name)
    head = w.kube.objects[(POD, "default", f"{name}-head-0")]
    head["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    await w.step()
    assert w.status["phase"] == c.PHASE_PROVISIONING
    assert w.job_names() == []

    head["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    await w.step()
    assert w.status["phase"] == c.PHASE_LAUNCHING, w.status["message"]
    assert w.job_names() == ["demo-j00001"]
