"""Reconcile decisions, driven through the handler-facing reconcile with the Kube seam faked."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fake_kube import FakeKube
from vllm_dp_operator import constants as c
from vllm_dp_operator.config import Config
from vllm_dp_operator.kube import POD, RAYCLUSTER, RAYJOB, SERVICE
from vllm_dp_operator.probe import ProbeResult
from vllm_dp_operator.reconcile import Outcome, Resource, reconcile

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CFG = Config(backoff_base_seconds=10, backoff_cap_seconds=40)


class FakeProbe:
    """Test double for the health probe: answers what the test sets."""

    def __init__(self) -> None:
        self.ok = False
        self.calls = 0

    async def check(self, namespace: str, service: str, port: int) -> ProbeResult:
        self.calls += 1
        return ProbeResult(self.ok, f"probe {service}:{port} ok={self.ok}")


def spec(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "dataParallel": {"size": 8, "ranksPerNode": 4},
    }
    base.update(over)
    return base


class World:
    """A resource, its status as kopf would persist it, and the faked cluster around it."""

    def __init__(self, raw_spec: dict[str, Any] | None = None) -> None:
        self.kube = FakeKube()
        self.probe = FakeProbe()
        self.spec = raw_spec or spec()
        self.status: dict[str, Any] = {}
        self.generation = 1
        self.now = T0
        self.events: list[tuple[str, str, str]] = []

    async def step(self, advance: float = 0.0) -> Outcome:
        self.now += timedelta(seconds=advance)
        res = Resource("demo", "default", "uid-demo", self.generation, self.spec, self.status)
        out = await reconcile(res, self.kube, self.probe, CFG, self.now)
        self.status = {k: v for k, v in out.status.items() if v is not None}
        self.events += [(e.type, e.reason, e.message) for e in out.events]
        return out

    def update(self, raw_spec: dict[str, Any]) -> None:
        self.spec = raw_spec
        self.generation += 1

    def clusters(self) -> list[dict[str, Any]]:
        return self.kube.named(RAYCLUSTER)

    def jobs(self) -> list[dict[str, Any]]:
        return self.kube.named(RAYJOB)

    def cluster_ready(self) -> None:
        for cluster in self.clusters():
            groups = cluster["spec"]["workerGroupSpecs"]
            workers = groups[0]["replicas"] if groups else 0
            self.kube.set_status(RAYCLUSTER, "default", cluster["metadata"]["name"], {
                "state": "ready",
                "readyWorkerReplicas": workers,
                "conditions": [
                    {"type": "HeadPodReady", "status": "True"},
                    {"type": "RayClusterProvisioned", "status": "True"},
                ],
            })  # fmt: skip

    def job_status(self, name: str, **status: str) -> None:
        self.kube.set_status(RAYJOB, "default", name, status)

    def reasons(self) -> list[str]:
        return [r for _, r, _ in self.events]


async def test_create_makes_cluster_and_service_but_no_job_until_ready() -> None:
    w = World()
    await w.step()
    assert [cl["metadata"]["name"] for cl in w.clusters()] == [w.status["rayCluster"]]
    assert w.kube.named(SERVICE)[0]["metadata"]["name"] == "demo-api"
    assert w.jobs() == []
    assert w.status["phase"] == c.PHASE_PROVISIONING
    assert w.status["layout"]["gpuPods"] == 2
    owner = w.clusters()[0]["metadata"]["ownerReferences"][0]
    assert owner["uid"] == "uid-demo" and owner["controller"] is True
    assert c.REASON_CLUSTER_CREATED in w.reasons()


async def test_head_job_created_once_cluster_ready_then_serving_on_health() -> None:
    w = World()
    await w.step()
    await w.step()
    assert w.jobs() == []  # not ready yet: no head job
    w.cluster_ready()
    await w.step()
    (job,) = w.jobs()
    assert job["spec"]["clusterSelector"] == {c.LABEL_RAY_CLUSTER: w.status["rayCluster"]}
    assert w.status["phase"] == c.PHASE_LAUNCHING
    assert w.status["headJob"] == job["metadata"]["name"] == "demo-launch-1"
    w.job_status("demo-launch-1", jobStatus="RUNNING", jobDeploymentStatus="Running")
    await w.step()
    assert w.status["phase"] == c.PHASE_LAUNCHING  # running, /health not yet 200
    w.probe.ok = True
    await w.step()
    assert w.status["phase"] == c.PHASE_SERVING
    ready = next(x for x in w.status["conditions"] if x["type"] == c.COND_READY)
    assert ready["status"] == "True"
    assert w.reasons().count(c.REASON_HEALTHY) == 1
    await w.step()
    assert w.reasons().count(c.REASON_HEALTHY) == 1  # no repeat event while steady


async def _failed_world() -> World:
    w = World()
    await w.step()
    w.cluster_ready()
    await w.step()
    w.job_status("demo-launch-1", jobStatus="FAILED", jobDeploymentStatus="Failed")
    return w


async def test_failed_head_job_warns_counts_and_relaunches_after_backoff() -> None:
    w = await _failed_world()
    out = await w.step()
    assert w.status["phase"] == c.PHASE_BACKOFF
    assert w.status["consecutiveFailures"] == 1
    assert out.retry_after == pytest.approx(10)
    warnings = [e for e in w.events if e[0] == c.EVENT_WARNING]
    assert [e[1] for e in warnings] == [c.REASON_JOB_FAILED]
    assert len(w.jobs()) == 1  # no relaunch during backoff
    await w.step(advance=5)
    assert len(w.jobs()) == 1 and w.status["consecutiveFailures"] == 1  # counted once
    await w.step(advance=6)
    assert [j["metadata"]["name"] for j in w.jobs()] == ["demo-launch-1", "demo-launch-2"]
    assert w.status["launchAttempts"] == 2 and w.status["phase"] == c.PHASE_LAUNCHING
    assert c.REASON_JOB_RELAUNCH in w.reasons()


async def test_backoff_doubles_and_is_capped() -> None:
    w = await _failed_world()
    waits = []
    for attempt in range(1, 6):
        out = await w.step()
        waits.append(out.retry_after)
        await w.step(advance=out.retry_after or 0)
        w.job_status(f"demo-launch-{attempt + 1}", jobStatus="FAILED")
    assert waits == [10, 20, 40, 40, 40]
    assert w.status["consecutiveFailures"] == 5
    assert len(w.jobs()) <= 2  # old attempts are cleaned up, the list does not grow


async def test_serving_resets_failure_count_and_drops_old_jobs() -> None:
    w = await _failed_world()
    await w.step()
    await w.step(advance=11)
    w.job_status("demo-launch-2", jobStatus="RUNNING")
    w.probe.ok = True
    await w.step()
    assert w.status["phase"] == c.PHASE_SERVING and w.status["consecutiveFailures"] == 0
    assert [j["metadata"]["name"] for j in w.jobs()] == ["demo-launch-2"]


async def test_engine_only_change_relaunches_head_job_on_same_cluster() -> None:
    w = World()
    await w.step()
    w.cluster_ready()
    await w.step()
    cluster_before = w.clusters()[0]["metadata"]["name"]
    w.update(spec(engineArgs=["--max-model-len", "8192"], apiServerCount=2))
    await w.step()
    assert [cl["metadata"]["name"] for cl in w.clusters()] == [cluster_before]
    (job,) = w.jobs()
    assert job["metadata"]["name"] == "demo-launch-2"
    assert "--max-model-len" in job["spec"]["entrypoint"]
    assert c.REASON_ENGINE_CHANGED in w.reasons()


async def test_shape_change_replaces_cluster_and_stops_old_job() -> None:
    w = World()
    await w.step()
    w.cluster_ready()
    await w.step()
    old = w.clusters()[0]["metadata"]["name"]
    w.update(spec(dataParallel={"size": 12, "ranksPerNode": 4}))
    await w.step()
    names = [cl["metadata"]["name"] for cl in w.clusters()]
    assert old not in names and names == [w.status["rayCluster"]]
    assert w.jobs() == []
    assert w.status["phase"] == c.PHASE_PROVISIONING and w.status["layout"]["gpuPods"] == 3
    svc = w.kube.named(SERVICE)[0]
    assert svc["spec"]["selector"][c.LABEL_RAY_CLUSTER] == w.status["rayCluster"]
    w.cluster_ready()
    await w.step()
    assert [j["metadata"]["name"] for j in w.jobs()] == ["demo-launch-2"]


async def test_invalid_spec_creates_nothing_and_warns_once() -> None:
    w = World(spec(dataParallel={"size": 1, "ranksPerNode": 1}))
    await w.step()
    await w.step()
    assert w.kube.calls["create"] == 0 and w.kube.objects == {}
    assert w.status["phase"] == c.PHASE_INVALID
    assert "spec.dataParallel.size" in w.status["message"]
    assert w.reasons().count(c.REASON_INVALID_SPEC) == 1


async def test_interrupted_reconcile_converges_without_duplicates() -> None:
    w = World()
    await w.step()
    w.cluster_ready()
    await w.step()
    # The operator died after creating the job but before its status was written.
    w.status = {}
    await w.step()
    await w.step()
    assert len(w.clusters()) == 1 and len(w.jobs()) == 1
    assert len(w.kube.named(SERVICE)) == 1


async def test_api_calls_per_reconcile_are_bounded_and_steady() -> None:
    w = World()
    await w.step()
    w.cluster_ready()
    await w.step()
    w.job_status("demo-launch-1", jobStatus="RUNNING")
    w.probe.ok = True
    await w.step()
    counts = []
    for _ in range(20):
        w.kube.calls.clear()
        await w.step(advance=5)
        counts.append(dict(w.kube.calls))
    assert all(x == counts[0] for x in counts)
    assert counts[0] == {"list": 2, "get": 1}  # steady state: reads only, no writes


async def test_suspend_stops_pods_and_head_job_then_resumes() -> None:
    w = World()
    await w.step()
    w.cluster_ready()
    await w.step()
    w.update(spec(suspend=True))
    await w.step()
    assert w.clusters()[0]["spec"]["suspend"] is True
    assert w.jobs() == [] and w.status["phase"] == c.PHASE_SUSPENDED
    w.update(spec())
    await w.step()
    assert w.clusters()[0]["spec"]["suspend"] is False
    assert len(w.clusters()) == 1  # same cluster, resumed


async def test_pending_pods_explained_in_status() -> None:
    w = World(spec(dataParallel={"size": 8, "ranksPerNode": 1}, gpu={"perPod": 8}))
    await w.step()
    name = w.status["rayCluster"]
    for i in range(2):
        await w.kube.create(POD, "default", {
            "metadata": {"name": f"p{i}", "labels": {c.LABEL_RAY_CLUSTER: name}},
            "status": {"phase": "Pending", "conditions": [{
                "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
            }]},
        })  # fmt: skip
    await w.step()
    assert w.status["phase"] == c.PHASE_PROVISIONING
    msg = w.status["message"]
    assert "Insufficient nvidia.com/gpu" in msg and "needs 8 nvidia.com/gpu" in msg
    cond = next(x for x in w.status["conditions"] if x["type"] == c.COND_CLUSTER_READY)
    assert cond["reason"] == c.REASON_PODS_PENDING


async def test_condition_transition_time_moves_only_on_flip() -> None:
    w = World()
    await w.step()
    first = next(x for x in w.status["conditions"] if x["type"] == c.COND_CLUSTER_READY)
    await w.step(advance=30)
    same = next(x for x in w.status["conditions"] if x["type"] == c.COND_CLUSTER_READY)
    assert same["lastTransitionTime"] == first["lastTransitionTime"]
    w.cluster_ready()
    await w.step(advance=30)
    flipped = next(x for x in w.status["conditions"] if x["type"] == c.COND_CLUSTER_READY)
    assert flipped["status"] == "True"
    assert flipped["lastTransitionTime"] != first["lastTransitionTime"]


async def test_attempt_numbers_never_repeat_even_without_status() -> None:
    w = World()
    await w.step()
    w.cluster_ready()
    await w.step()
    w.update(spec(engineArgs=["--max-model-len", "4096"]))
    # The operator lost its status, and the old head job is still terminating.
    w.status = {}
    old = w.jobs()[0]
    old["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    w.kube.objects[(RAYJOB, "default", "demo-launch-1")] = old
    await w.step()
    names = {j["metadata"]["name"] for j in w.jobs()}
    assert names == {"demo-launch-1", "demo-launch-2"}
    assert w.status["headJob"] == "demo-launch-2" and w.status["launchAttempts"] == 2
