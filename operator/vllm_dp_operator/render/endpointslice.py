"""Render the API Service's EndpointSlice: the head pod's address, ready only while routed.

The API Service has no selector, so the EndpointSlice controller leaves it alone, and this
slice, which the operator owns, is what kube-proxy and Gateway implementations route by. The
operator decides when to route (`engines/headjobs.py`); nothing here writes a pod.
"""

from __future__ import annotations

from typing import Any

from vllm_dp_operator import constants
from vllm_dp_operator.api import names
from vllm_dp_operator.api.models import VLLMDataParallelSpec
from vllm_dp_operator.render.meta import metadata


def _address_type(ip: str) -> str:
    return "IPv6" if ":" in ip else "IPv4"


def build_endpoint_slice(
    instance: str,
    namespace: str,
    spec: VLLMDataParallelSpec,
    head_pod: dict[str, Any] | None,
    ready: bool,
    owner: dict[str, Any] | None,
) -> dict[str, Any]:
    """The slice of `<instance>-api`: the head pod's IP, `ready` as routed; none without an IP.

    Unrouted keeps the endpoint with ready false (clients see no endpoint, and `kubectl get
    endpointslices` still shows which pod it is). Its port is the Service's port, by name: a
    slice's ports are matched to the Service's by name.
    """
    labels = names.instance_labels(instance, constants.COMPONENT_API)
    labels[constants.LABEL_SERVICE_NAME] = names.service(instance)
    labels[constants.LABEL_SLICE_MANAGED_BY] = constants.SLICE_MANAGER
    ip = ((head_pod or {}).get("status") or {}).get("podIP") if head_pod else None
    endpoints: list[dict[str, Any]] = []
    if head_pod is not None and ip:
        meta = head_pod["metadata"]
        endpoint: dict[str, Any] = {
            "addresses": [ip],
            # ready: route new connections; serving: the same (a terminating pod is never
            # routed here); terminating: the operator drops a head pod that is going away.
            "conditions": {"ready": ready, "serving": ready, "terminating": False},
            "targetRef": {"kind": "Pod", "namespace": namespace, "name": meta["name"],
                          "uid": meta.get("uid", "")},
        }  # fmt: skip
        node = (head_pod.get("spec") or {}).get("nodeName")
        if node:
            endpoint["nodeName"] = node
        endpoints.append(endpoint)
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": metadata(names.endpoint_slice(instance), namespace, labels, owner),
        "addressType": _address_type(ip) if ip else "IPv4",
        "endpoints": endpoints,
        "ports": [
            {"name": constants.API_PORT_NAME, "protocol": "TCP", "port": spec.service.port}
        ],
    }
