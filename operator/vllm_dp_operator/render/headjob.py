"""Render the head job: a KubeRay RayJob on the existing cluster that runs the launcher."""

from __future__ import annotations

import base64
import json
from typing import Any

from vllm_dp_launcher import report as launcher_report

from vllm_dp_operator import constants
from vllm_dp_operator.api import names
from vllm_dp_operator.api.models import VLLMDataParallelSpec
from vllm_dp_operator.plan import Plan
from vllm_dp_operator.render.meta import metadata

LAUNCHER_MODULE = "vllm_dp_launcher"


def plan_b64(plan: Plan) -> str:
    """The launch plan as base64 of its UTF-8 JSON: no shell alters it (RFC 4648 alphabet)."""
    doc = json.dumps(plan.launch_spec(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return base64.b64encode(doc.encode("utf-8")).decode("ascii")


def launcher_entrypoint(plan: Plan) -> str:
    """The one place the launcher's invocation is written.

    Ray's job supervisor runs the entrypoint with `/bin/sh -c`: a `$`, backtick, `;`, `(` or
    non-ASCII text in the plan would be expanded, run or mangled there. Base64 has none of
    them, so the plan reaches the launcher byte for byte.
    """
    return f"python -m {LAUNCHER_MODULE} --plan-b64 {plan_b64(plan)}"


def job_hash(plan: Plan, cluster_name: str) -> str:
    """Hash of what the head job runs and where; a new value means a new head job."""
    return names.content_hash({"cluster": cluster_name, "plan": plan.launch_spec()})


def runtime_env_yaml(spec: VLLMDataParallelSpec, job_name: str) -> str:
    """The Ray job's runtime env: how long a stop waits, and where the launcher reports.

    Ray's job supervisor reads RAY_JOB_STOP_WAIT_TIME_S from its own environment, which is
    this job's runtime env, so the drain grace follows the spec without restarting pods. The
    launcher writes its stage lines, marked with this head job's name, to the head container's
    log too (vllm_dp_launcher.report), where the operator follows them through the API server.
    """
    env = {
        constants.RAY_JOB_STOP_WAIT_ENV: str(spec.launch.drain_seconds),
        launcher_report.REPORT_ENV: constants.STAGE_REPORT_PATH,
        launcher_report.JOB_ENV: job_name,
    }
    return json.dumps({"env_vars": env}, sort_keys=True)  # JSON is YAML


def build_head_job(
    instance: str,
    namespace: str,
    spec: VLLMDataParallelSpec,
    plan: Plan,
    cluster_name: str,
    attempt: int,
    owner: dict[str, Any] | None,
    head_pod_uid: str | None = None,
    replica: int = 0,
) -> dict[str, Any]:
    """A RayJob that submits the launcher to the named RayCluster through the dashboard API.

    HTTPMode has no submitter pod following the logs, whose end KubeRay would take for the
    end of the job while vLLM still serves. The RayJob name is the Ray submission id, so the
    operator can stop and check the Ray job even when the RayJob's status is gone.
    """
    labels = {
        **names.instance_labels(instance, constants.COMPONENT_HEAD_JOB),
        constants.LABEL_JOB_HASH: job_hash(plan, cluster_name),
        constants.LABEL_ATTEMPT: str(attempt),
        constants.LABEL_CLUSTER: cluster_name,
        **names.replica_labels(replica),
    }
    annotations = {constants.ANNOTATION_HEAD_POD_UID: head_pod_uid} if head_pod_uid else None
    name = names.head_job(instance, attempt, replica)
    return {
        "apiVersion": f"{constants.RAY_GROUP}/{constants.RAY_VERSION_API}",
        "kind": "RayJob",
        "metadata": metadata(name, namespace, labels, owner, annotations),
        "spec": {
            "entrypoint": launcher_entrypoint(plan),
            "jobId": name,
            "runtimeEnvYAML": runtime_env_yaml(spec, name),
            # The cluster outlives each launch: a relaunch reuses the running pods.
            "clusterSelector": {constants.LABEL_RAY_CLUSTER: cluster_name},
            "submissionMode": "HTTPMode",
            "shutdownAfterJobFinishes": False,
        },
    }
