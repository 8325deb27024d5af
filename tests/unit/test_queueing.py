"""Kueue and the gang schedulers: the labels a RayCluster carries, the phases a Workload means,
and a RayCluster in a Kueue queue whose spec.suspend the operator never writes."""

from __future__ import annotations

import pytest
from vllm_dp_operator import constants as c
from vllm_dp_operator.api.models import Scheduling
from vllm_dp_operator.controller.kube import RAYCLUSTER, RAYJOB, WORKLOAD
from vllm_dp_operator.reconcile.queueing import queue_state
from vllm_dp_operator.render.scheduling import GANG_LABEL, scheduling_labels
from world import World, spec

QUOTA = ("couldn't assign flavors to pod set head: insufficient quota for nvidia.com/gpu in "
         "flavor gpu, previously considered podsets requests (4) + current podset request (4) > "
         "maximum capacity (8) in ClusterQueue gpu-cq")  # fmt: skip


def cond(type_: str, status: bool, reason: str = "R", message: str = "") -> dict[str, str]:
    return {"type": type_, "status": "True" if status else "False", "reason": reason,
            "message": message}  # fmt: skip


def workload(*conds: dict[str, str]) -> dict[str, object]:
    return {"metadata": {"name": "wl"}, "status": {"conditions": list(conds)}}


@pytest.mark.parametrize(("scheduling", "labels"), [
    ({"queueName": "gpu", "priorityClassName": "high"},
     {c.LABEL_KUEUE_QUEUE: "gpu", c.LABEL_KUEUE_PRIORITY: "high"}),
    ({"schedulerName": "volcano", "queueName": "q", "priorityClassName": "p"},
     {"volcano.sh/queue-name": "q", "ray.io/priority-class-name": "p"}),
    ({"schedulerName": "yunikorn", "queueName": "root.team"},
     {"yunikorn.apache.org/queue": "root.team", GANG_LABEL: "true"}),
    ({"schedulerName": "scheduler-plugins"}, {GANG_LABEL: "true"}),
    ({"schedulerName": "kai-scheduler", "queueName": "team"}, {"kai.scheduler/queue": "team"}),
])  # fmt: skip
def test_each_scheduler_gets_the_labels_its_kuberay_plugin_reads(
    scheduling: dict[str, str], labels: dict[str, str]
) -> None:
    assert scheduling_labels(Scheduling.model_validate(scheduling)) == labels


def test_no_workload_yet_is_queued_and_says_what_to_check() -> None:
    st = queue_state("demo-abcde", "gpu", None)
    assert st.phase == c.PHASE_QUEUED and "ray.io/raycluster integration" in st.message


def test_pending_workload_is_queued_with_kueues_own_words() -> None:
    st = queue_state("demo-abcde", "gpu", workload(cond("QuotaReserved", False, "Pending", QUOTA)))
    assert (st.phase, st.reason) == (c.PHASE_QUEUED, c.REASON_QUEUED)
    assert st.message == f"Queued in LocalQueue gpu: {QUOTA}"


def test_evicted_by_priority_is_preempted_and_says_both_why_and_what_it_waits_for() -> None:
    preempted = "Preempted to accommodate a workload (UID: u1) due to prioritization in the CQ"
    st = queue_state("demo-abcde", "gpu", workload(
        cond("Evicted", True, "Preempted", preempted), cond("Preempted", True, "InClusterQueue",
                                                            preempted),
        cond("QuotaReserved", False, "Pending", QUOTA)))  # fmt: skip
    assert (st.phase, st.reason) == (c.PHASE_PREEMPTED, c.REASON_PREEMPTED)
    assert preempted in st.message and QUOTA in st.message and "LocalQueue gpu" in st.message


def test_evicted_for_another_reason_is_queued_with_that_reason() -> None:
    st = queue_state("demo-abcde", "gpu", workload(
        cond("Evicted", True, "Deactivated", "The workload is deactivated"),
        cond("QuotaReserved", False)))  # fmt: skip
    assert st.phase == c.PHASE_QUEUED and st.message.startswith("Evicted by Kueue: The workload")


def test_quota_reserved_but_checks_pending_is_still_queued() -> None:
    st = queue_state("demo-abcde", "gpu", workload(
        cond("QuotaReserved", True), cond("Admitted", False, "R", "The workload has not all "
                                                                  "admission checks")))
    assert st.phase == c.PHASE_QUEUED and "admission checks" in st.message


def kueue_spec(**over: object) -> dict[str, object]:
    return spec(scheduling={"queueName": "gpu", "priorityClassName": "low"}, **over)


def admit(w: World, admitted: bool = True) -> None:
    """Play Kueue: resume (or suspend) every cluster."""
    for cluster in w.clusters():
        cluster["spec"]["suspend"] = not admitted


async def test_a_queued_cluster_is_made_suspended_and_its_suspend_never_written() -> None:
    w = World(kueue_spec())
    await w.step()
    (cluster,) = w.clusters()
    assert cluster["spec"]["suspend"] is True
    assert cluster["metadata"]["labels"][c.LABEL_KUEUE_QUEUE] == "gpu"
    assert w.status["phase"] == c.PHASE_QUEUED
    uid = cluster["metadata"]["uid"]
    w.kube.objects[(WORKLOAD, "default", "wl")] = {
        "metadata": {"name": "wl", "namespace": "default",
                     "labels": {c.LABEL_KUEUE_JOB_UID: uid}},
        "status": {"conditions": [cond("QuotaReserved", False, "Pending", QUOTA)]}}  # fmt: skip
    await w.step()
    assert w.status["phase"] == c.PHASE_QUEUED and QUOTA in w.status["message"]
    assert w.jobs() == []
    admit(w)
    w.cluster_ready()
    await w.step()
    assert w.status["phase"] == c.PHASE_LAUNCHING and len(w.jobs()) == 1
    # Preempted: Kueue suspends it again. The head job goes, counted as no failure.
    w.kube.set_status(WORKLOAD, "default", "wl", {"conditions": [
        cond("Evicted", True, "Preempted", "Preempted to accommodate a workload"),
        cond("QuotaReserved", False, "Pending", QUOTA)]})  # fmt: skip
    admit(w, admitted=False)
    await w.step()
    await w.step()
    assert w.status["phase"] == c.PHASE_PREEMPTED and w.jobs() == []
    assert w.status.get("consecutiveFailures", 0) == 0
    patches = [x for x in w.kube.writes if x[0] == "patch" and x[1] == RAYCLUSTER.plural]
    assert patches == [], "the operator never writes a RayCluster Kueue owns"


async def test_the_resources_own_suspend_deletes_the_queued_cluster_and_resume_queues_anew(
) -> None:  # fmt: skip
    w = World(kueue_spec())
    await w.step()
    admit(w)
    w.cluster_ready()
    await w.step()
    assert w.jobs()
    w.update(kueue_spec(suspend=True))
    await w.step()
    assert w.clusters() == [] and w.jobs() == []
    assert w.status["phase"] == c.PHASE_SUSPENDED and "quota" in w.status["message"]
    w.update(kueue_spec())
    await w.step()
    (cluster,) = w.clusters()
    assert cluster["spec"]["suspend"] is True and w.status["phase"] == c.PHASE_QUEUED
    assert not [x for x in w.kube.writes if x[0] == "patch" and x[1] == RAYCLUSTER.plural]
    assert RAYJOB.plural in {x[1] for x in w.kube.writes if x[0] == "delete"}


async def test_another_queue_is_another_cluster_and_no_queue_keeps_the_old_name() -> None:
    plain, queued, other = World(spec()), World(kueue_spec()), World(spec(scheduling={
        "queueName": "other"}))  # fmt: skip
    for w in (plain, queued, other):
        await w.step()
    names = {w.clusters()[0]["metadata"]["name"] for w in (plain, queued, other)}
    assert len(names) == 3
    assert plain.clusters()[0]["spec"]["suspend"] is False


def test_evicted_while_the_old_reservation_is_released_is_already_preempted() -> None:
    st = queue_state("demo-abcde", "gpu", workload(
        cond("Evicted", True, "Preempted", "Preempted to accommodate a workload"),
        cond("QuotaReserved", True), cond("Admitted", True)))  # fmt: skip
    assert st.phase == c.PHASE_PREEMPTED and st.message.endswith("waiting for quota")
