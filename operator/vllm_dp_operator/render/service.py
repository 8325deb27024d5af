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
    owner: dict[str, Any] | None,
    port: int | None = None,
) -> dict[str, Any]:
    """A Service with no selector in front of the head pod's vLLM, on `port`: the port its
    slice routes to (the serving generation's, which a Surge that changes spec.service.port
    moves at its switch), the spec's when not given.

    Its endpoints are the operator's own EndpointSlice (`endpointslice.py`): the head pod's
    address, ready only while the operator routes to it. Ray's readiness passes long before
    vLLM listens, and a label on the head pod would need write access to every pod in the
    cluster. (A readiness gate on the head would deadlock: KubeRay waits for a ready head
    before the cluster is ready, and the head job starts only then.) KubeRay's -serve-svc would
    select worker pods too; only the head serves.
    """
    api_port = spec.service.port if port is None else port
    labels = names.instance_labels(instance, constants.COMPONENT_API)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(
            names.service(instance), namespace, labels, owner, spec.service.annotations
        ),
        "spec": {
            "type": str(spec.service.type),
            "ports": [
                {
                    "name": constants.API_PORT_NAME,
                    "protocol": "TCP",
                    "port": api_port,
                    "targetPort": api_port,
                }
            ],
        },
    }
