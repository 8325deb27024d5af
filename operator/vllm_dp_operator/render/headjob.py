"""Render the head job: a KubeRay RayJob on the existing cluster that runs the launcher."""

from __future__ import annotations

import json
import shlex
from typing import Any

from vllm_dp_operator import constants, names
from vllm_dp_operator.plan import Plan
from vllm_dp_operator.render.meta import metadata

LAUNCHER_MODULE = "vllm_dp_launcher"


def launcher_entrypoint(plan: Plan) -> str:
    """The one place the launcher's invocation is written: the plan travels as JSON."""
    doc = json.dumps(plan.launch_spec(), sort_keys=True, separators=(",", ":"))
    return f"python -m {LAUNCHER_MODULE} --plan {shlex.quote(doc)}"


def job_hash(plan: Plan, cluster_name: str) -> str:
    """Hash of what the head job runs and where; a new value means a new head job."""
    return names.content_hash({"cluster": cluster_name, "plan": plan.launch_spec()})


def build_head_job(
    instance: str,
    namespace: str,
    plan: Plan,
    cluster_name: str,
    attempt: int,
    owner: dict[str, Any] | None,
) -> dict[str, Any]:
    """A RayJob that submits the launcher to the named RayCluster."""
    labels = {
        **names.instance_labels(instance, constants.COMPONENT_HEAD_JOB),
        constants.LABEL_JOB_HASH: job_hash(plan, cluster_name),
        constants.LABEL_ATTEMPT: str(attempt),
        constants.LABEL_CLUSTER: cluster_name,
    }
    return {
        "apiVersion": f"{constants.RAY_GROUP}/{constants.RAY_VERSION_API}",
        "kind": "RayJob",
        "metadata": metadata(names.head_job(instance, attempt), namespace, labels, owner),
        "spec": {
            "entrypoint": launcher_entrypoint(plan),
            # The cluster outlives each launch: a relaunch reuses the running pods.
            "clusterSelector": {constants.LABEL_RAY_CLUSTER: cluster_name},
            "submissionMode": "K8sJobMode",
            "shutdownAfterJobFinishes": False,
        },
    }
