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


def build_endpoint(
    namespace: str, head_pod: dict[str, Any] | None, ready: bool, terminating: bool = False
) -> dict[str, Any] | None:
    """One replica's head pod as an endpoint, `ready` as routed; None without a pod or an IP.

    `terminating`: the replica leaves (scale-down). New connections go elsewhere, and the
    endpoint still serves as a last resort where no ready one is left (kube-proxy's rule for
    terminating endpoints), since its engines do until they stop.
    """
    ip = ((head_pod or {}).get("status") or {}).get("podIP") if head_pod else None
    if head_pod is None or not ip:
        return None
    meta = head_pod["metadata"]
    endpoint: dict[str, Any] = {
        "addresses": [ip],
        # ready: route new connections; serving: its engines answer (while it leaves, a last
        # resort); terminating: the replica leaves (a terminating pod is never routed here).
        "conditions": {"ready": ready and not terminating, "serving": ready,
                       "terminating": terminating},
        "targetRef": {"kind": "Pod", "namespace": namespace, "name": meta["name"],
                      "uid": meta.get("uid", "")},
    }  # fmt: skip
    node = (head_pod.get("spec") or {}).get("nodeName")
    if node:
        endpoint["nodeName"] = node
    return endpoint


def build_endpoint_slice(
    instance: str,
    namespace: str,
    spec: VLLMDataParallelSpec,
    head_pod: dict[str, Any] | None,
    ready: bool,
    owner: dict[str, Any] | None,
    others: list[dict[str, Any]] | tuple[()] = (),
    terminating: bool = False,
    port: int | None = None,
) -> dict[str, Any]:
    """The slice of `<instance>-api`: one replica's head pod's IP, `ready` as routed (none
    without an IP), beside `others`, the other replicas' endpoints as they stand.

    Unrouted keeps the endpoint with ready false (clients see no endpoint, and `kubectl get
    endpointslices` still shows which pod it is). Its port is the Service's port, by name: a
    slice's ports are matched to the Service's by name. Endpoints are ordered by pod name, so
    a slice's content does not depend on which replica wrote it last. `port`: the port the
    routed generation's engines listen on (a Surge that changes spec.service.port switches it
    with the endpoint); the spec's when not given.
    """
    labels = names.instance_labels(instance, constants.COMPONENT_API)
    labels[constants.LABEL_SERVICE_NAME] = names.service(instance)
    labels[constants.LABEL_SLICE_MANAGED_BY] = constants.SLICE_MANAGER
    mine = build_endpoint(namespace, head_pod, ready, terminating)
    endpoints = sorted([*others, *([mine] if mine else [])],
                       key=lambda e: (e.get("targetRef") or {}).get("name") or "")  # fmt: skip
    ip = next((e["addresses"][0] for e in endpoints), None)
    api_port = spec.service.port if port is None else port
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": metadata(names.endpoint_slice(instance), namespace, labels, owner),
        "addressType": _address_type(ip) if ip else "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": constants.API_PORT_NAME, "protocol": "TCP", "port": api_port}],
    }
