"""A refused pod create (PodSecurity, a ResourceQuota) is said in the status and one Warning.

The condition's shape is KubeRay v1.6.2's: raycluster_controller.go calculateStatus sets
`ReplicaFailure` (gate RayClusterStatusConditions, on by default) with the reason of the
marker error (utils/constant.go: FailedCreateHeadPod, FailedCreateWorkerPod) and as message
`errors.Join(marker, createErr).Error()`: the reason, a newline, the API server's refusal.
"""

from __future__ import annotations

from typing import Any

from vllm_dp_operator import constants as c
from vllm_dp_operator.controller.kube import RAYCLUSTER
from vllm_dp_operator.reconcile.status import explain_refused
from world import World, spec

PSS = ('pods "demo-6c1f2-head-{}" is forbidden: violates PodSecurity "restricted:latest": '
       'allowPrivilegeEscalation != false (container "ray-head" must set '
       "securityContext.allowPrivilegeEscalation=false)")  # fmt: skip
QUOTA = ('pods "demo-6c1f2-gpu-worker-{}" is forbidden: exceeded quota: no-pods, requested: '
         "pods=1, used: pods=0, limited: pods=0")  # fmt: skip


def replica_failure(reason: str, error: str) -> dict[str, Any]:
    """The condition exactly as KubeRay writes it (metav1.Condition, no observedGeneration)."""
    return {"type": "ReplicaFailure", "status": "True", "reason": reason,
            "message": f"{reason}\n{error}", "lastTransitionTime": "2026-01-01T00:00:05Z"}


def cluster(*conditions: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "demo-6c1f2"},
            "status": {"conditions": [{"type": "HeadPodReady", "status": "False",
                                       "reason": "HeadPodNotFound"}, *conditions]}}  # fmt: skip


def test_a_refused_head_pod_is_quoted_without_its_generated_name() -> None:
    msg = explain_refused(cluster(replica_failure("FailedCreateHeadPod", PSS.format("x7k2p"))))
    assert msg == ("KubeRay cannot create the Ray head pod of demo-6c1f2: the API server refused "
                   'it: forbidden: violates PodSecurity "restricted:latest": '
                   'allowPrivilegeEscalation != false (container "ray-head" must set '
                   "securityContext.allowPrivilegeEscalation=false)")  # fmt: skip
    again = explain_refused(cluster(replica_failure("FailedCreateHeadPod", PSS.format("q9z3m"))))
    assert again == msg, "the same refusal reads the same on KubeRay's next try"


def test_a_quota_refusal_of_a_worker_is_quoted() -> None:
    msg = explain_refused(cluster(replica_failure("FailedCreateWorkerPod", QUOTA.format("ab12c"))))
    assert msg is not None and msg.startswith("KubeRay cannot create the Ray worker pod")
    assert msg.endswith("exceeded quota: no-pods, requested: pods=1, used: pods=0, limited: pods=0")


def test_other_replica_failures_and_a_cleared_condition_say_nothing() -> None:
    assert explain_refused(cluster()) is None
    assert explain_refused(cluster(replica_failure("FailedDeleteWorkerPod", "boom"))) is None
    cleared = {**replica_failure("FailedCreateHeadPod", PSS.format("x")), "status": "False"}
    assert explain_refused(cluster(cleared)) is None
    assert explain_refused({"metadata": {"name": "x"}}) is None


async def test_the_status_and_one_warning_quote_the_refusal() -> None:
    w = World(spec())
    await w.step()
    name = w.clusters()[0]["metadata"]["name"]
    for suffix in ("x7k2p", "q9z3m", "t4w8n"):  # KubeRay retries, each pod named anew
        refusal = PSS.replace("demo-6c1f2", name).format(suffix)
        w.kube.set_status(RAYCLUSTER, "default", name, {"state": "", "conditions": [
            replica_failure("FailedCreateHeadPod", refusal)]})  # fmt: skip
        await w.step(advance=5)
    assert w.status["phase"] == c.PHASE_PROVISIONING
    assert 'violates PodSecurity "restricted:latest"' in w.status["message"]
    (cond,) = [x for x in w.status["conditions"] if x["type"] == c.COND_CLUSTER_READY]
    assert cond["status"] == "False" and cond["reason"] == c.REASON_PODS_REFUSED
    assert cond["message"] == w.status["message"]
    warnings = [(r, m) for t, r, m in w.events if r == c.REASON_PODS_REFUSED]
    assert len(warnings) == 1 and warnings[0][1] == w.status["message"]
    assert all(t == c.EVENT_WARNING for t, r, _ in w.events if r == c.REASON_PODS_REFUSED)
    # The namespace admits the pods now: KubeRay drops the condition, the refusal goes.
    w.kube.set_status(RAYCLUSTER, "default", name, {"state": "", "conditions": []})
    await w.step(advance=5)
    assert "PodSecurity" not in w.status["message"]
