"""Render the head job: a KubeRay RayJob on the existing cluster that runs the launcher."""

from __future__ import annotations

import json
import shlex
from typing import Any

from vllm_dp_operator import constants, names
from vllm_dp_operator.config import RenderOptions
from vllm_dp_operator.models import VLLMDataParallelSpec
from vllm_dp_operator.plan import Plan
from vllm_dp_operator.render.meta import metadata
from vllm_dp_operator.render.raycluster import gpu_tolerations

LAUNCHER_MODULE = "vllm_dp_launcher"


def launcher_entrypoint(plan: Plan) -> str:
    """The one place the launcher's invocation is written: the plan travels as JSON."""
    doc = json.dumps(plan.launch_spec(), sort_keys=True, separators=(",", ":"))
    return f"python -m {LAUNCHER_MODULE} --plan {shlex.quote(doc)}"


def job_hash(plan: Plan, cluster_name: str) -> str:
    """Hash of what the head job runs and where; a new value means a new head job."""
    return names.content_hash({"cluster": cluster_name, "plan": plan.launch_spec()})


def _submitter_template(
    instance: str, spec: VLLMDataParallelSpec, options: RenderOptions
) -> dict[str, Any]:
    # KubeRay's default submitter pod has no tolerations and never schedules on a cluster of
    # tainted GPU nodes alone; KubeRay still fills in the `ray job submit` command.
    return {
        "metadata": {"labels": names.instance_labels(instance, constants.COMPONENT_HEAD_JOB)},
        "spec": {
            "restartPolicy": "Never",
            "enableServiceLinks": False,
            "tolerations": gpu_tolerations(spec),
            "containers": [
                {
                    "name": "ray-job-submitter",
                    "image": spec.image or options.default_image,
                    "imagePullPolicy": "IfNotPresent",
                    "resources": {
                        "requests": {"cpu": "100m", "memory": "256Mi"},
                        "limits": {"cpu": "1", "memory": "1Gi"},
                    },
                }
            ],
        },
    }


def build_head_job(
    instance: str,
    namespace: str,
    spec: VLLMDataParallelSpec,
    plan: Plan,
    options: RenderOptions,
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
            # One retry mechanism: the operator's backoff, not the submitter Job's as well.
            "submitterConfig": {"backoffLimit": 0},
            "submitterPodTemplate": _submitter_template(instance, spec, options),
        },
    }
