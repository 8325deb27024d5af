"""Head-job lifecycle decisions: failures, the launch deadline, and stopping a head job for
real before the next one, driven through the reconcile with the Kube seam, /health and the Ray
job API faked."""

from __future__ import annotations

import pytest
from vllm_dp_operator import constants as c
from vllm_dp_operator.controller.kube import POD
from vllm_dp_operator.engines.headjobs import STOP_RECHECK_SECONDS
from world import World, launch_plan, launched, serving, spec


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
    assert w.status["nextLaunchTime"] == "2026-01-01T00:00:10Z"
    assert f"relaunching at {w.status['nextLaunchTime']}" in w.status["message"]
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
    assert not w.routed()
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
    assert not w.routed()
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
    assert c.REASON_JOB_STOPPED in w.reasons()


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


async def test_a_head_job_run_again_on_a_new_head_pod_is_routed_only_once_it_answers() -> None:
    # KubeRay submits a head job again when its head pod is replaced: a new Ray head, the same
    # name, still RUNNING. That run has not served, so no request may reach the new pod until
    # vLLM answers there (found on the real-node bed: routed 29 s before the launcher's serving).
    w = await serving()
    cluster = w.status["rayCluster"]
    assert w.status["servedHeadPod"] == f"uid-head-{cluster}-0"
    w.kube.objects.pop((POD, "default", f"{cluster}-head-0"))
    w.new_head_pod(cluster, index=1)
    w.probe.ok = False  # vLLM not up on the new head yet
    await w.step()
    assert w.job_names() == ["demo-j00001"] and not w.routed()
    assert w.status["phase"] == c.PHASE_LAUNCHING, w.status["message"]
    w.probe.ok = True
    await w.step()
    assert w.routed() and w.status["phase"] == c.PHASE_SERVING
    assert w.status["servedHeadPod"] == f"uid-head-{cluster}-1"
    w.probe.ok = False  # served on this pod now: one failed probe keeps the route again
    await w.step()
    assert w.routed() and w.status["phase"] == c.PHASE_SERVING


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


async def test_time_based_steps_ask_for_a_reconcile_when_they_are_due() -> None:
    """The event-driven controller only wakes a resource for time when the reconcile says so."""
    w = await _failed_world()
    out = await w.step()
    assert out.retry_after == pytest.approx(10)  # the backoff's end, not a poll
    out = await w.step(advance=4)
    assert out.retry_after == pytest.approx(6)
    w = await serving(spec(launch={"drainSeconds": 30}))
    w.update(spec(engineArgs=["--enforce-eager"], launch={"drainSeconds": 30}))
    out = await w.step()
    # A stop under way is confirmed through the Ray job API, which cannot be watched.
    assert out.retry_after == STOP_RECHECK_SECONDS
    w = await launched(spec(launch={"timeoutSeconds": 600}))
    out = await w.step(advance=100)
    assert out.retry_after == pytest.approx(501)  # the launch deadline (+1 s of rounding)


def test_failure_reason_leaves_out_the_log_tail_ray_appends() -> None:
    """Seen on real pods: a failed Ray job's message carries up to 20,000 characters of its
    logs; status and Events get Ray's own words and the launcher's `exited` line only."""
    from vllm_dp_operator.engines.jobstate import failure_reason

    logs = "\n".join(["(EngineCoreActor pid=336) Loading safetensors ..."] * 400 + [
        "2026-11-30 14:44:40,048 vllm-dp-launcher stage=exited status=6 cause=engine-ended "
        "engine_status=0"])  # fmt: skip
    message = ("Job entrypoint command failed with exit code 6, last available logs "
               f"(truncated to 20,000 chars):\n{logs}\n")  # fmt: skip
    reason = failure_reason({"status": {"jobStatus": "FAILED", "message": message}})
    assert reason == ("its Ray job failed (Ray job FAILED: Job entrypoint command failed with "
                      "exit code 6; launcher: stage=exited status=6 cause=engine-ended "
                      "engine_status=0)")  # fmt: skip
    short = failure_reason({"status": {"jobStatus": "FAILED", "message": "x" * 5000}})
    assert len(short) < 500


async def test_a_launching_status_holds_still_between_probes() -> None:
    # A countdown in the message made every 5 s probe a status patch; a deadline time does not.
    w = await launched(spec(launch={"timeoutSeconds": 600}))
    w.run("demo-j00001")
    await w.step()
    before = w.status
    assert w.status["launchDeadline"] in w.status["message"]
    await w.step(advance=5)
    assert w.status == before


async def test_a_backoff_status_holds_still_until_the_relaunch() -> None:
    w = await _failed_world()
    await w.step()
    before = w.status
    await w.step(advance=4)
    assert w.status == before


async def test_a_replaced_head_pod_is_routed_only_on_an_answer_from_that_pod() -> None:
    # KubeRay replaced the head pod; the same head job runs again on the new Ray head. A 200
    # the dead pod gave must not route the new one before its own vLLM answers (issue 38,
    # item 3): the probe is keyed by the head pod's uid, so the new pod starts unprobed.
    w = await serving()
    w.probe.fresh = True
    await w.step(1)  # the pool holds the serving head's target
    assert w.routed()
    cluster = w.status["rayCluster"]
    old = w.head_pod(cluster)
    assert old is not None and w.routed()
    del w.kube.objects[(POD, "default", old["metadata"]["name"])]
    w.new_head_pod(cluster, index=1)
    await w.step(1)
    assert not w.routed(), "routed on the dead pod's last answer"
    assert w.status["servedHeadPod"] == old["metadata"]["uid"]
    await w.step(1)  # the new pod's own first answer
    assert w.routed() and w.status["servedHeadPod"] != old["metadata"]["uid"]


async def test_a_hung_engine_is_unrouted_then_stopped_and_relaunched() -> None:
    # It served, then stopped answering: unrouted past the unroute threshold (90 s), and past
    # relaunch_hung_after_seconds (300 s) stopped and relaunched as a failure (issue 38, item
    # 4), where before it held its GPUs unrouted for ever.
    w = await serving()
    w.probe.ok = False
    unrouted_at = None
    for second in range(5, 400, 5):
        await w.step(5)
        if unrouted_at is None and not w.routed():
            unrouted_at = second
        if w.ray.stops:
            break
    assert unrouted_at is not None and 90 <= unrouted_at < 300, unrouted_at
    assert w.ray.stops == ["demo-j00001"], "the hung head job is stopped"
    assert c.REASON_JOB_HUNG in w.reasons()
    assert w.status["consecutiveFailures"] == 1
    assert "taken as hung" in w.status["lastFailureReason"]
    w.ray.jobs["demo-j00001"] = "STOPPED"
    for _ in range(20):
        await w.step(5)
    assert "demo-j00002" in w.job_names()
