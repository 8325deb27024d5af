"""Render the Service in front of vLLM's OpenAI-compatible API server on the head pod."""

from __future__ import annotations

from typing import Any

from vllm_dp_operator import constants
from vllm_dp_operator.api import names
from vllm_dp_operator.api.models import VLLMDataParallelSpec
from vllm_dp_operator.render.meta import metadata


def build_service(
    instance: str,
    namespace: str,
    spec: VLLMDataParallelSpec,
    cluster_name: str,
    owner: dict[str, Any] | None,
) -> dict[str, Any]:
    """A Service selecting the head pod of one RayCluster once its vLLM answers /health.

    Ray's readiness passes long before vLLM listens; the operator labels the head pod only
    while /health answers, so clients never reach a closed port. (A readiness gate on the head
    would deadlock: KubeRay waits for a ready head before the cluster is ready, and the head
    job starts only then.)
    """
    labels = names.instance_labels(instance, constants.COMPONENT_API)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(
            names.service(instance), namespace, labels, owner, spec.service.annotations
        ),
        "spec": {
            "type": str(spec.service.type),
            # KubeRay's -serve-svc would select worker pods too; only the head serves.
            "selector": {
                constants.LABEL_RAY_CLUSTER: cluster_name,
                constants.LABEL_RAY_NODE_TYPE: "head",
                constants.LABEL_SERVING: "true",
            },
            "ports": [
                {
                    "name": "http",
                    "protocol": "TCP",
                    "port": spec.service.port,
                    "targetPort": spec.service.port,
                }
            ],
        },
    }
