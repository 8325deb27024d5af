"""Pure decisions about head jobs: what a RayJob's status means, where a launch is stuck,
and what to do next while stopping one. No I/O: the reconcile feeds in what it observed."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from vllm_dp_launcher.stages import parse_stage_lines

from vllm_dp_operator import constants
from vllm_dp_operator.engines.ray_dashboard import UNKNOWN, RayJobLookup
from vllm_dp_operator.reconcile.status import parse_rfc3339


class JobState(StrEnum):
    """What a head RayJob is doing, as far as relaunch decisions go."""

    PENDING = "Pending"
    RUNNING = "Running"
    FAILED = "Failed"
    ENDED = "Ended"  # vllm serve exited 0: the engines are gone all the same


def job_state(job: Mapping[str, Any]) -> JobState:
    """Classify a RayJob from jobStatus and jobDeploymentStatus."""
    status = job.get("status") or {}
    deployment = status.get("jobDeploymentStatus")
    ray_status = status.get("jobStatus")
    if deployment in ("Failed", "ValidationFailed") or ray_status in ("FAILED", "STOPPED"):
        return JobState.FAILED
    if deployment == "Complete" or ray_status == "SUCCEEDED":
        return JobState.ENDED
    if ray_status == "RUNNING":
        return JobState.RUNNING
    return JobState.PENDING


def job_failure_detail(job: Mapping[str, Any]) -> str:
    """The reason KubeRay gives for a job, if any."""
    status = job.get("status") or {}
    parts = [
        str(status[key])
        for key in ("jobDeploymentStatus", "jobStatus", "reason", "message")
        if status.get(key)
    ]
    return ", ".join(parts) or "no detail from KubeRay"


# Ray appends the job's last logs (up to 20,000 characters) to a failed job's message.
RAY_LOGS_MARKER = "last available logs"
MESSAGE_LIMIT = 400


def ray_message(message: str) -> str:
    """A Ray job message short enough for status and Events: Ray's own words without the log
    tail it appends, plus the launcher's `exited` stage line from that tail (status, cause)."""
    head, marker, logs = message.partition(RAY_LOGS_MARKER)
    head = head.rstrip(" ,(:") if marker else head
    if len(head) > MESSAGE_LIMIT:
        head = head[: MESSAGE_LIMIT - 3] + "..."
    exited = [s for s in parse_stage_lines(logs) if s.name == "exited"]
    if exited:
        fields = " ".join(f"{k}={v}" for k, v in exited[-1].fields.items())
        head += f"; launcher: stage=exited {fields}"
    return head


def failure_reason(job: Mapping[str, Any]) -> str:
    """Why a failed or ended head job counts as a failure, in words."""
    status = job.get("status") or {}
    ray_status = status.get("jobStatus")
    message = f": {ray_message(str(status['message']))}" if status.get("message") else ""
    if status.get("jobDeploymentStatus") == "ValidationFailed":
        return f"KubeRay rejected the RayJob (ValidationFailed{message})"
    if ray_status == "SUCCEEDED" or status.get("jobDeploymentStatus") == "Complete":
        return (
            "vllm serve ended with exit status 0 (Ray job SUCCEEDED): a serving head job must "
            "never end, and a dead DP engine makes vLLM exit 0 (vllm#48966)"
        )
    if ray_status == "STOPPED":
        return f"its Ray job was stopped by something other than this operator{message}"
    if ray_status == "FAILED":
        return f"its Ray job failed (Ray job FAILED{message})"
    return f"KubeRay marked it failed ({job_failure_detail(job)})"


def launch_stage(job: Mapping[str, Any], health_detail: str) -> str:
    """Where a launch that has not served yet stands, from KubeRay's status and /health."""
    status = job.get("status") or {}
    deployment = status.get("jobDeploymentStatus") or ""
    ray_status = status.get("jobStatus") or ""
    if deployment in ("", "Initializing"):
        return (
            f"KubeRay had not submitted it (RayJob {deployment or 'New'}: it waits for the "
            "RayCluster to be ready and for its dashboard address)"
        )
    if not ray_status:
        return (
            "the Ray dashboard had not accepted it: KubeRay could neither submit the Ray job "
            "nor read its status from the head's dashboard (port "
            f"{constants.RAY_DASHBOARD_PORT} of the head Service)"
        )
    if ray_status == "PENDING":
        return "its Ray job was pending: the launcher had not started on the head"
    return (
        f"the launcher ran (Ray job {ray_status}), but vLLM did not answer /health "
        f"({health_detail}): it waited for Ray nodes, placed engines or loaded the model"
    )


def deadline_passed(job: Mapping[str, Any], now: datetime, timeout_seconds: float) -> bool:
    """Whether a head job is older than the launch deadline."""
    created = parse_rfc3339((job.get("metadata") or {}).get("creationTimestamp"))
    return created is not None and now - created > timedelta(seconds=timeout_seconds)


def submission_id(job: Mapping[str, Any]) -> str:
    """The Ray job's submission id: KubeRay's status, else the spec, else the RayJob name."""
    status = job.get("status") or {}
    spec = job.get("spec") or {}
    return str(status.get("jobId") or spec.get("jobId") or job["metadata"]["name"])


class StopStep(StrEnum):
    """The next step in stopping a head job's Ray job."""

    DELETE = "Delete"  # the Ray job has ended: delete the RayJob
    STOP = "Stop"  # the Ray job runs and no stop was delivered yet: ask the dashboard
    WAIT = "Wait"  # a stop is under way, or the dashboard does not answer yet
    GIVE_UP = "GiveUp"  # no confirmation within the limit: delete it and say so


def stop_step(
    head_uid: str | None,
    launched_on_uid: str | None,
    lookup: RayJobLookup | None,
    started: datetime | None,
    requested: datetime | None,
    now: datetime,
    drain_seconds: float,
    confirm_seconds: float,
) -> tuple[StopStep, str]:
    """Decide the next step of a stop, and say what is known.

    No head pod means no Ray cluster, so no Ray job. A head pod other than the one the job
    was launched on, with a dashboard that does not answer, means the job died with the old
    one. Otherwise only the dashboard can tell. A delivered stop gets the drain grace (Ray's
    SIGKILL comes after it) plus `confirm_seconds`; an undelivered one gets `confirm_seconds`.
    """
    if head_uid is None:
        return StopStep.DELETE, "the Ray head pod is gone, and the Ray job with it"
    if lookup is None:
        lookup = RayJobLookup(UNKNOWN, "the dashboard was not asked")
    if lookup.ended:
        return StopStep.DELETE, lookup.detail
    if lookup.state == UNKNOWN and launched_on_uid and launched_on_uid != head_uid:
        return StopStep.DELETE, f"the head pod it ran on was replaced ({lookup.detail})"
    if requested is None and lookup.state != UNKNOWN:
        return StopStep.STOP, lookup.detail
    if requested is not None:
        limit = requested + timedelta(seconds=drain_seconds + confirm_seconds)
    else:
        limit = (started or now) + timedelta(seconds=confirm_seconds)
    if now >= limit:
        return StopStep.GIVE_UP, lookup.detail
    return StopStep.WAIT, lookup.detail


def annotation_time(job: Mapping[str, Any], key: str) -> datetime | None:
    """A timestamp the operator wrote into one of the RayJob's annotations."""
    annotations = (job.get("metadata") or {}).get("annotations") or {}
    return parse_rfc3339(annotations.get(key))
