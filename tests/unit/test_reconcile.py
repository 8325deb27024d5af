"""Reconcile decisions, driven through the handler-facing reconcile with the Kube seam faked."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fake_kube import FakeKube
from vllm_dp_operator import constants as c
from vllm_dp_operator.config import Config
from vllm_dp_operator.kube import POD, RAYCLUSTER, RAYJOB, SERVICE
from vllm_dp_operator.probe import ProbeResult
from vllm_dp_operator.ray_dashboard import NOT_FOUND, UNKNOWN, RayJobLookup, StopResult
from vllm_dp_operator.reconcile import Outcome, Resource, reconcile

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CFG = Config(backoff_base_seconds=10, backoff_cap_seconds=40, stop_confirm_seconds=20)


class FakeProbe:
    """Test double for the health probe: answers what the test sets."""

    def __init__(self) -> None:
        self.ok = False
        self.calls: list[str] = []

    async def check(self, namespace: str, service: str, port: int) -> ProbeResult:
        self.calls.append(f"{service}:{port}")
        return ProbeResult(self.ok, f"probe {service}:{port} ok={self.ok}")


class FakeRayJobs:
    """Test double for the Ray dashboard's job API: one head, jobs by submission id."""

    def __init__(self) -> None:
        self.jobs: dict[str, str] = {}  # submission id -> Ray job status
        self.reachable = True
        self.stops: list[str] = []

    async def lookup(self, namespace: str, cluster: str, submission_id: str) -> RayJobLookup:
        if not self.reachable:
            return RayJobLookup(UNKNOWN, "dashboard: connection refused")
        state = self.jobs.get(submission_id, NOT_FOUND)
        return RayJobLookup(state, f"dashboard: {submission_id} {state}")

    async def stop(self, namespace: str, cluster: str, submission_id: str) -> StopResult:
        if not self.reachable:
            return StopResult(False, "dashboard: connection refused")
        self.stops.append(submission_id)
        return StopResult(submission_id in self.jobs, f"dashboard: stop {submission_id}")


def launch_plan(job: dict[str, Any]) -> dict[str, Any]:
    """The launch plan a head job carries (base64 JSON after --plan-b64)."""
    argv = job["spec"]["entrypoint"].split()
    plan: dict[str, Any] = json.loads(base64.b64decode(argv[argv.index("--plan-b64") + 1]))
    return plan


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
        self.now = T0
        self.kube = FakeKube(clock=lambda: self.now)
        self.probe = FakeProbe()
        self.ray = FakeRayJobs()
        self.spec = raw_spec or spec()
        self.status: dict[str, Any] = {}
        self.generation = 1
        self.events: list[tuple[str, str, str]] = []

    async def step(self, advance: float = 0.0) -> Outcome:
        self.now += timedelta(seconds=advance)
        res = Resource("demo", "default", "uid-demo", self.generation, self.spec, self.status)
        out = await reconcile(res, self.kube, self.probe, self.ray, CFG, self.now)
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

    def job_names(self) -> list[str]:
        return [j["metadata"]["name"] for j in self.jobs()]

    def cluster_ready(self) -> None:
        """Play KubeRay: every cluster ready, with a head pod."""
        for cluster in self.clusters():
            name = cluster["metadata"]["name"]
            groups = cluster["spec"]["workerGroupSpecs"]
            workers = groups[0]["replicas"] if groups else 0
            self.kube.set_status(RAYCLUSTER, "default", name, {
                "state": "ready",
                "readyWorkerReplicas": workers,
                "conditions": [
                    {"type": "HeadPodReady", "status": "True"},
                    {"type": "RayClusterProvisioned", "status": "True"},
                ],
            })  # fmt: skip
            if not self.head_pod(name):
                self.new_head_pod(name)

    def new_head_pod(self, cluster: str, index: int = 0) -> None:
        self.kube.objects[(POD, "default", f"{cluster}-head-{index}")] = {
            "metadata": {"name": f"{cluster}-head-{index}", "uid": f"uid-head-{cluster}-{index}",
                         "labels": {c.LABEL_RAY_CLUSTER: cluster, c.LABEL_RAY_NODE_TYPE: "head"}},
            "status": {"phase": "Running"},
        }  # fmt: skip

    def head_pod(self, cluster: str | None = None) -> dict[str, Any] | None:
        cluster = cluster or self.status["rayCluster"]
        pods = [p for p in self.kube.named(POD)
                if p["metadata"]["labels"].get(c.LABEL_RAY_CLUSTER) == cluster]  # fmt: skip
        return pods[0] if pods else None

    def serving_label(self) -> str | None:
        pod = self.head_pod()
        assert pod is not None
        labels: dict[str, str] = pod["metadata"]["labels"]
        return labels.get(c.LABEL_SERVING)

    def job_status(self, name: str, **status: str) -> None:
        self.kube.set_status(RAYJOB, "default", name, status)

    def run(self, name: str) -> None:
        """Play KubeRay and Ray: the head job's Ray job runs."""
        self.ray.jobs[name] = "RUNNING"
        self.job_status(name, jobStatus="RUNNING", jobDeploymentStatus="Running", jobId=name)

    def reasons(self) -> list[str]:
        return [r for _, r, _ in self.events]


async def launched(raw: dict[str, Any] | None = None) -> World:
    """A world whose cluster is ready and whose first head job has been created."""
    w = World(raw)
    await w.step()
    w.cluster_ready()
    await w.step()
    assert w.job_names() == ["demo-j00001"]
    return w


async def serving(raw: dict[str, Any] | None = None) -> World:
    w = await launched(raw)
    w.run("demo-j00001")
    w.probe.ok = True
    await w.step()
    assert w.status["phase"] == c.PHASE_SERVING
    return w


async def test_create_makes_cluster_and_service_but_no_job_until_ready() -> None:
    w = World()
    await w.step()
    assert [cl["metadata"]["name"] for cl in w.clusters()] == [w.status["rayCluster"]]
    assert w.kube.named(SERVICE)[0]["metadata"]["name"] == "demo-api"
    assert w.jobs() == []
    assert w.status["phase"] == c.PHASE_PROVISIONING
    assert w.status["layout"]["gpuPods"] == 2 and w.status["layout"]["apiServers"] == 8
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
    assert job["spec"]["submissionMode"] == "HTTPMode"
    # The head pod it runs on is recorded: a different head later means the job died.
    head = w.head_pod()
    assert head is not None
    assert job["metadata"]["annotations"][c.ANNOTATION_HEAD_POD_UID] == head["metadata"]["uid"]
    assert w.status["phase"] == c.PHASE_LAUNCHING
    assert w.status["headJob"] == job["metadata"]["name"] == "demo-j00001"
    w.run("demo-j00001")
    await w.step()
    assert w.status["phase"] == c.PHASE_LAUNCHING  # running, /health not yet 200
    assert w.serving_label() is None  # the Service routes nowhere yet
    w.probe.ok = True
    await w.step()
    assert w.status["phase"] == c.PHASE_SERVING
    assert w.status["servedJob"] == "demo-j00001"
    assert w.serving_label() == "true"  # now the Service selects the head
    # /health is asked of the head pod through KubeRay's head Service, not the API Service.
    assert w.probe.calls[-1] == f"{w.status['rayCluster']}-head-svc:8000"
    ready = next(x for x in w.status["conditions"] if x["type"] == c.COND_READY)
    assert ready["status"] == "True"
    assert w.reasons().count(c.REASON_HEALTHY) == 1
    await w.step()
    assert w.reasons().count(c.REASON_HEALTHY) == 1  # no repeat event while steady


async def test_service_stops_routing_when_health_fails() -> None:
    w = await serving()
    w.probe.ok = False
    await w.step()
    assert w.serving_label() is None
    assert w.status["phase"] == c.PHASE_LAUNCHING and "served" in w.status["message"]
    w.probe.ok = True
    await w.step()
    assert w.serving_label() == "true"


async def _failed_world() -> World:
    w = await launched()
    w.run("demo-j00001")
    w.ray.jobs["demo-j00001"] = "FAILED"
    w.job_status("demo-j00001", jobStatus="FAILED", jobDeploymentStatus="Failed",
                 message="vllm serve exited 1")  # fmt: skip
    return w


async def test_failed_head_job_warns_counts_and_relaunches_after_backoff() -> None:
    w = await _failed_world()
    await w.step()
    assert w.status["phase"] == c.PHASE_BACKOFF
    assert w.status["consecutiveFailures"] == 1
    assert "vllm serve exited 1" in w.status["lastFailureReason"]
    warnings = [e for e in w.events if e[0] == c.EVENT_WARNING]
    assert [e[1] for e in warnings] == [c.REASON_JOB_FAILED]
    # The dashboard confirms the Ray job ended, so its RayJob goes; no relaunch in backoff.
    assert w.jobs() == [] and c.REASON_JOB_STOPPED in w.reasons()
    await w.step(advance=5)
    assert w.jobs() == [] and w.status["consecutiveFailures"] == 1  # counted once
    assert "relaunching in 5s" in w.status["message"]
    await w.step(advance=6)
    assert w.job_names() == ["demo-j00002"]
    assert w.status["launchAttempts"] == 2 and w.status["phase"] == c.PHASE_LAUNCHING
    assert c.REASON_JOB_RELAUNCH in w.reasons()


async def test_backoff_doubles_and_is_capped() -> None:
    w = await _failed_world()
    waits = []
    for attempt in range(1, 6):
        await w.step()
        failed_at = w.now
        while not w.job_names():
            await w.step(advance=1)
        waits.append(round((w.now - failed_at).total_seconds()))
        name = f"demo-j0000{attempt + 1}"
        assert w.job_names() == [name]
        w.job_status(name, jobStatus="FAILED")
    assert waits == [10, 20, 40, 40, 40]
    assert w.status["consecutiveFailures"] == 5


@pytest.mark.parametrize(
    ("status", "fragment"),
    [
        ({"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Complete"}, "exit status 0"),
        ({"jobDeploymentStatus": "Complete"}, "exit status 0"),
        ({"jobStatus": "STOPPED"}, "stopped by something other than this operator"),
        ({"jobDeploymentStatus": "ValidationFailed", "message": "name too long"},
         "KubeRay rejected the RayJob (ValidationFailed: name too long)"),
    ],
)
async def test_any_ended_serving_job_is_a_failure_with_the_reason(
    status: dict[str, str], fragment: str
) -> None:
    # A dead DP engine makes vLLM exit 0 (vllm#48966): a SUCCEEDED head job is no success.
    w = await serving()
    w.ray.jobs["demo-j00001"] = status.get("jobStatus", "SUCCEEDED")
    w.job_status("demo-j00001", **status)
    await w.step()
    assert w.status["phase"] == c.PHASE_BACKOFF
    assert w.status["consecutiveFailures"] == 1
    assert fragment in w.status["lastFailureReason"]
    assert fragment in w.status["message"]
    assert w.serving_label() is None
    assert any(e[1] == c.REASON_JOB_FAILED and fragment in e[2] for e in w.events)


async def test_serving_resets_failure_count() -> None:
    w = await _failed_world()
    await w.step()
    await w.step(advance=11)
    w.run("demo-j00002")
    w.probe.ok = True
    await w.step()
    assert w.status["phase"] == c.PHASE_SERVING and w.status["consecutiveFailures"] == 0
    assert w.job_names() == ["demo-j00002"]


async def test_engine_change_stops_the_old_ray_job_and_confirms_before_the_next() -> None:
    w = await serving(spec(launch={"drainSeconds": 30}))
    cluster_before = w.clusters()[0]["metadata"]["name"]
    w.update(spec(engineArgs=["--max-model-len", "8192"], launch={"drainSeconds": 30}))
    await w.step()
    # Drain first: the Service stops routing to the head, then Ray is asked to stop the job.
    assert w.serving_label() is None
    assert w.ray.stops == ["demo-j00001"]
    assert w.job_names() == ["demo-j00001"]  # no new job while the old one may still run
    old = w.jobs()[0]["metadata"]["annotations"]
    assert c.ANNOTATION_STOP_REQUESTED in old and c.ANNOTATION_RETIRE_STARTED in old
    assert c.REASON_JOB_STOPPING in w.reasons()
    assert w.status["phase"] == c.PHASE_LAUNCHING and "stopping head job demo-j00001" in (
        w.status["message"])
    await w.step(advance=10)
    assert w.job_names() == ["demo-j00001"] and w.ray.stops == ["demo-j00001"]  # asked once
    w.ray.jobs["demo-j00001"] = "STOPPED"  # Ray's SIGTERM (or SIGKILL after the drain) landed
    await w.step(advance=1)
    assert w.job_names() == ["demo-j00002"]
    (job,) = w.jobs()
    assert "--max-model-len" in launch_plan(job)["command"]
    assert [cl["metadata"]["name"] for cl in w.clusters()] == [cluster_before]
    writes = [(v, n) for v, kind, n in w.kube.writes if kind == "rayjobs"]
    assert writes.index(("delete", "demo-j00001")) < writes.index(("create", "demo-j00002"))
    assert c.REASON_JOB_STOPPED in w.reasons() and c.REASON_ENGINE_CHANGED not in w.reasons()


async def test_delivered_stop_waits_drain_plus_confirm_then_goes_ahead_with_a_warning() -> None:
    w = await serving(spec(launch={"drainSeconds": 30}))
    w.update(spec(engineArgs=["--enforce-eager"], launch={"drainSeconds": 30}))
    await w.step()
    assert w.ray.stops == ["demo-j00001"]  # delivered, but Ray never reports the end
    await w.step(advance=49)  # drain 30 + confirm 20 not yet over
    assert w.job_names() == ["demo-j00001"]
    await w.step(advance=2)
    assert w.job_names() == ["demo-j00002"]
    warning = next(e for e in w.events if e[1] == c.REASON_JOB_STOP_UNCONFIRMED)
    assert warning[0] == c.EVENT_WARNING and "demo-j00001" in warning[2]


async def test_unreachable_dashboard_never_blocks_a_relaunch_forever() -> None:
    w = await serving()
    w.ray.reachable = False
    w.update(spec(engineArgs=["--enforce-eager"]))
    await w.step()
    assert w.ray.stops == [] and w.job_names() == ["demo-j00001"]
    await w.step(advance=19)
    assert w.job_names() == ["demo-j00001"]
    await w.step(advance=2)  # confirm_seconds (20) without an answer: go ahead, say so
    assert w.job_names() == ["demo-j00002"]
    assert c.REASON_JOB_STOP_UNCONFIRMED in w.reasons()


async def test_a_replaced_head_pod_took_the_old_ray_job_with_it() -> None:
    w = await serving()
    cluster = w.status["rayCluster"]
    w.kube.objects.pop((POD, "default", f"{cluster}-head-0"))
    w.new_head_pod(cluster, index=1)  # KubeRay made a new head: new UID, fresh Ray
    w.ray.reachable = False  # its dashboard is not up yet
    w.update(spec(engineArgs=["--enforce-eager"]))
    await w.step()
    assert w.job_names() == ["demo-j00002"]
    job = w.jobs()[0]
    assert job["metadata"]["annotations"][c.ANNOTATION_HEAD_POD_UID] == f"uid-head-{cluster}-1"
    assert "replaced" in next(e[2] for e in w.events if e[1] == c.REASON_JOB_STOPPED)


@pytest.mark.parametrize(
    ("status", "health_ok", "stage"),
    [
        ({}, False, "KubeRay had not submitted it"),
        ({"jobDeploymentStatus": "Running"}, False, "the Ray dashboard had not accepted it"),
        ({"jobDeploymentStatus": "Running", "jobStatus": "PENDING"}, False,
         "its Ray job was pending"),
        ({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}, False,
         "vLLM did not answer /health"),
    ],
)
async def test_launch_deadline_stops_the_job_and_names_the_stage(
    status: dict[str, str], health_ok: bool, stage: str
) -> None:
    w = await launched(spec(launch={"timeoutSeconds": 60}))
    w.job_status("demo-j00001", **status)
    if status.get("jobStatus") in ("PENDING", "RUNNING"):
        w.ray.jobs["demo-j00001"] = status["jobStatus"]
    await w.step(advance=59)
    assert w.status["phase"] == c.PHASE_LAUNCHING and w.status["consecutiveFailures"] == 0
    assert stage in w.status["message"]  # the status says where it is before the deadline too
    await w.step(advance=2)
    assert w.status["consecutiveFailures"] == 1
    assert "spec.launch.timeoutSeconds (60s)" in w.status["lastFailureReason"]
    assert stage in w.status["lastFailureReason"]
    event = next(e for e in w.events if e[1] == c.REASON_JOB_TIMED_OUT)
    assert event[0] == c.EVENT_WARNING and stage in event[2]
    if "demo-j00001" in w.ray.jobs:
        assert w.ray.stops == ["demo-j00001"]  # stopped for real before any relaunch
        w.ray.jobs["demo-j00001"] = "STOPPED"
    await w.step(advance=11)
    assert w.job_names() == ["demo-j00002"]  # relaunched after the backoff


async def test_launch_deadline_does_not_apply_once_served() -> None:
    w = await serving(spec(launch={"timeoutSeconds": 60}))
    w.probe.ok = False  # a served engine that stops answering is not a slow launch
    await w.step(advance=3600)
    assert w.status["consecutiveFailures"] == 0 and w.job_names() == ["demo-j00001"]


async def test_shape_change_replaces_cluster_and_drops_the_old_job_with_its_pods() -> None:
    w = await serving()
    old = w.clusters()[0]["metadata"]["name"]
    w.update(spec(dataParallel={"size": 12, "ranksPerNode": 4}))
    await w.step()
    names = [cl["metadata"]["name"] for cl in w.clusters()]
    assert old not in names and names == [w.status["rayCluster"]]
    assert w.jobs() == [] and w.ray.stops == []  # its Ray job goes with the old pods
    assert w.status["phase"] == c.PHASE_PROVISIONING and w.status["layout"]["gpuPods"] == 3
    svc = w.kube.named(SERVICE)[0]
    assert svc["spec"]["selector"][c.LABEL_RAY_CLUSTER] == w.status["rayCluster"]
    w.cluster_ready()
    await w.step()
    assert w.job_names() == ["demo-j00002"]


async def test_invalid_spec_creates_nothing_and_warns_once() -> None:
    w = World(spec(dataParallel={"size": 1, "ranksPerNode": 1}))
    await w.step()
    await w.step()
    assert w.kube.calls["create"] == 0 and w.kube.objects == {}
    assert w.status["phase"] == c.PHASE_INVALID
    assert "spec.dataParallel.size" in w.status["message"]
    assert w.reasons().count(c.REASON_INVALID_SPEC) == 1


async def test_interrupted_reconcile_converges_without_duplicates() -> None:
    w = await launched()
    # The operator died after creating the job but before its status was written.
    w.status = {}
    await w.step()
    await w.step()
    assert len(w.clusters()) == 1 and w.job_names() == ["demo-j00001"]
    assert len(w.kube.named(SERVICE)) == 1


async def test_api_calls_per_reconcile_are_bounded_and_steady() -> None:
    w = await serving()
    counts = []
    for _ in range(20):
        w.kube.calls.clear()
        await w.step(advance=5)
        counts.append(dict(w.kube.calls))
    assert all(x == counts[0] for x in counts)
    # Steady state: reads only (clusters, head jobs, the head pod; the Service), no writes.
    assert counts[0] == {"list": 3, "get": 1}


async def test_suspend_stops_pods_and_head_job_then_resumes() -> None:
    w = await launched()
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
    w = await launched()
    w.update(spec(engineArgs=["--max-model-len", "4096"]))
    # The operator lost its status, and the old head job is still terminating.
    w.status = {}
    old = w.jobs()[0]
    old["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    w.kube.objects[(RAYJOB, "default", "demo-j00001")] = old
    await w.step()
    assert set(w.job_names()) == {"demo-j00001", "demo-j00002"}
    assert w.status["headJob"] == "demo-j00002" and w.status["launchAttempts"] == 2
