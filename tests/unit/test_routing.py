"""Routing through the operator's EndpointSlice: its renderer, when it flips, no pod writes."""

from __future__ import annotations

import re
from typing import Any

import pytest
from vllm_dp_operator import constants as c
from vllm_dp_operator.api.validation import validate
from vllm_dp_operator.controller.kube import ENDPOINTS, ENDPOINTSLICE, POD, SERVICE
from vllm_dp_operator.reconcile.routing import MIRRORING_MANAGER, route_ready
from vllm_dp_operator.render import build_endpoint_slice, build_service
from vllm_dp_operator.render.meta import owner_reference
from world import World, launched, serving, spec

OWNER = owner_reference("demo", "uid-demo")


def _pod(ready: bool = True, ip: str | None = "10.0.0.7", **meta: Any) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Running",
                              "conditions": [{"type": "Ready", "status": str(ready)}]}  # fmt: skip
    if ip:
        status["podIP"] = ip
    return {"metadata": {"name": "demo-abcde-head-x", "uid": "uid-head", **meta},
            "spec": {"nodeName": "node-a"}, "status": status}  # fmt: skip


def test_slice_belongs_to_the_service_by_label_port_name_and_owner() -> None:
    model = validate("demo", spec(service={"port": 8123}))
    eps = build_endpoint_slice("demo", "ns", model, _pod(), True, OWNER)
    svc = build_service("demo", "ns", model, OWNER)
    labels = eps["metadata"]["labels"]
    assert labels[c.LABEL_SERVICE_NAME] == svc["metadata"]["name"] == "demo-api"
    # Not the EndpointSlice controller's value: neither it nor the mirroring controller
    # touches a slice another manager owns.
    assert labels[c.LABEL_SLICE_MANAGED_BY] == "vllm-dp-operator.vllmdp.io"
    assert labels[c.LABEL_MANAGED_BY] == c.MANAGER  # so the operator's reflector watches it
    assert labels[c.LABEL_INSTANCE] == "demo"  # so a change wakes its resource
    assert eps["metadata"]["ownerReferences"] == [OWNER]
    # kube-proxy pairs a slice's ports with the Service's by name.
    [svc_port] = svc["spec"]["ports"]
    assert eps["ports"] == [{"name": svc_port["name"], "protocol": "TCP", "port": 8123}]
    assert "selector" not in svc["spec"]  # selector-less: only our slice gives it endpoints
    [endpoint] = eps["endpoints"]
    assert endpoint["addresses"] == ["10.0.0.7"] and eps["addressType"] == "IPv4"
    assert endpoint["conditions"] == {"ready": True, "serving": True, "terminating": False}
    assert endpoint["targetRef"] == {"kind": "Pod", "namespace": "ns",
                                     "name": "demo-abcde-head-x", "uid": "uid-head"}
    assert endpoint["nodeName"] == "node-a"


LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def test_every_label_value_is_one_the_api_server_accepts() -> None:
    # A slash is no label value: the API server refused "vllmdp.io/operator" on the real bed.
    model = validate("demo", spec())
    for obj in (build_endpoint_slice("demo", "ns", model, _pod(), True, OWNER),
                build_service("demo", "ns", model, OWNER)):  # fmt: skip
        for key, value in obj["metadata"]["labels"].items():
            assert LABEL_VALUE.match(value) and len(value) <= 63, (key, value)


def test_unrouted_slice_keeps_the_endpoint_not_ready_and_no_address_means_none() -> None:
    model = validate("demo", spec())
    [endpoint] = build_endpoint_slice("demo", "ns", model, _pod(), False, OWNER)["endpoints"]
    assert endpoint["conditions"]["ready"] is False and endpoint["conditions"]["serving"] is False
    assert build_endpoint_slice("demo", "ns", model, _pod(ip=None), True, OWNER)["endpoints"] == []
    assert build_endpoint_slice("demo", "ns", model, None, True, OWNER)["endpoints"] == []
    v6 = build_endpoint_slice("demo", "ns", model, _pod(ip="fd00::7"), True, OWNER)
    assert v6["addressType"] == "IPv6"


@pytest.mark.parametrize(
    ("routed", "pod", "current", "want"),
    [
        (True, _pod(), None, True),
        (False, _pod(), None, False),
        (True, None, None, False),  # head pod gone
        (True, _pod(ready=False), None, False),  # head pod not Ready
        (True, _pod(deletionTimestamp="2026-01-01T00:00:00Z"), None, False),  # going away
        (True, _pod(ip=None), None, False),
        # None keeps what the slice says for this pod, and never routes another pod.
        (None, _pod(), {"endpoints": [{"targetRef": {"uid": "uid-head"},
                                       "conditions": {"ready": True}}]}, True),
        (None, _pod(), {"endpoints": [{"targetRef": {"uid": "uid-old"},
                                       "conditions": {"ready": True}}]}, False),
        (None, _pod(), None, False),
    ],
)
def test_route_ready(routed: bool | None, pod: Any, current: Any, want: bool) -> None:
    assert route_ready(routed, pod, current) is want


async def test_the_slice_exists_unready_before_the_first_answer() -> None:
    w = await launched()
    w.run("demo-j00001")
    await w.step()
    eps = w.endpoint_slice()
    assert eps is not None and [e["conditions"]["ready"] for e in eps["endpoints"]] == [False]
    assert "selector" not in w.kube.objects[(SERVICE, "default", "demo-api")]["spec"]


async def test_head_pod_not_ready_unroutes_and_ready_again_routes() -> None:
    w = await serving()
    pod = w.head_pod()
    assert pod is not None
    pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    await w.step()
    assert not w.routed()
    pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    await w.step()
    assert w.routed() and w.status["phase"] == c.PHASE_SERVING


async def test_a_cluster_not_ready_for_a_worker_keeps_the_route() -> None:
    # A lost worker is no evidence by itself: its engine's death ends the head job, which
    # unroutes; until then the head keeps serving.
    w = await serving()
    cluster = w.clusters()[0]
    cluster["status"]["readyWorkerReplicas"] = 0
    await w.step()
    assert w.status["phase"] == c.PHASE_PROVISIONING
    assert w.routed()


async def test_a_cluster_not_ready_and_a_failed_head_job_unroutes() -> None:
    w = await serving()
    w.clusters()[0]["status"]["readyWorkerReplicas"] = 0
    w.job_status("demo-j00001", jobStatus="FAILED", jobDeploymentStatus="Failed")
    await w.step()
    assert w.status["phase"] == c.PHASE_PROVISIONING
    assert not w.routed()


async def test_head_pod_deleted_unroutes() -> None:
    w = await serving()
    pod = w.head_pod()
    assert pod is not None
    del w.kube.objects[(POD, "default", pod["metadata"]["name"])]
    await w.step()
    eps = w.endpoint_slice()
    assert eps is not None and eps["endpoints"] == []


async def test_a_deleted_or_edited_slice_is_repaired() -> None:
    w = await serving()
    del w.kube.objects[(ENDPOINTSLICE, "default", "demo-api")]
    await w.step()
    assert w.routed()
    eps = w.endpoint_slice()
    assert eps is not None
    eps["endpoints"][0]["conditions"]["ready"] = False
    eps["ports"][0]["port"] = 9999
    await w.step()
    assert w.routed() and w.endpoint_slice()["ports"][0]["port"] == 8000  # type: ignore[index]


async def test_migration_drops_the_selector_and_the_controllers_slices() -> None:
    w = await serving()
    svc = w.kube.objects[(SERVICE, "default", "demo-api")]
    svc["spec"]["selector"] = {c.LABEL_RAY_CLUSTER: w.status["rayCluster"],
                               c.LEGACY_LABEL_SERVING: "true"}  # fmt: skip
    labels = {**svc["metadata"]["labels"], c.LABEL_SERVICE_NAME: "demo-api"}
    for name, manager in (("demo-api-x1y2z", "endpointslice-controller.k8s.io"),
                          ("demo-api-m1r2r", MIRRORING_MANAGER)):  # fmt: skip
        w.kube.objects[(ENDPOINTSLICE, "default", name)] = {
            "metadata": {"name": name, "labels": {**labels, c.LABEL_SLICE_MANAGED_BY: manager}},
            "endpoints": [{"addresses": ["10.9.9.9"], "conditions": {"ready": True}}],
        }
    w.kube.objects[(ENDPOINTS, "default", "demo-api")] = {"metadata": {"name": "demo-api"}}
    await w.step()
    assert "selector" not in svc["spec"]
    assert [e["metadata"]["name"] for e in w.kube.named(ENDPOINTSLICE)] == ["demo-api"]
    # The endpoints controller's last Endpoints would be mirrored again: it goes too.
    assert (ENDPOINTS, "default", "demo-api") not in w.kube.objects
    assert w.routed()


async def test_no_path_writes_a_pod() -> None:
    w = await serving()
    w.probe.ok = False
    for advance in (0, 30, 30, 31):  # unrouted by failed probes
        await w.step(advance=advance)
    assert not w.routed()
    w.probe.ok = True
    await w.step()
    assert w.routed()
    w.ray.jobs["demo-j00001"] = "FAILED"  # the head job fails: unrouted, relaunched
    w.job_status("demo-j00001", jobStatus="FAILED", jobDeploymentStatus="Failed")
    await w.step()
    assert not w.routed()
    await w.step(advance=11)
    w.update(spec(engineArgs=["--max-model-len", "8192"]))  # an engine change
    for _ in range(3):
        await w.step(advance=30)
    w.update(spec(suspend=True))
    await w.step()
    assert not w.routed()
    assert w.pod_writes() == []
    assert {kind for _, kind, _ in w.kube.writes} <= {"services", "endpointslices",
                                                      "rayclusters", "rayjobs",
                                                      "secrets", "networkpolicies"}  # fmt: skip
    assert {verb for verb, kind, _ in w.kube.writes if kind == "secrets"} <= {"create"}


async def test_a_fresh_world_creates_service_and_slice_first() -> None:
    w = World()
    await w.step()
    kinds = [kind for verb, kind, _ in w.kube.writes if verb == "create"]
    # The NetworkPolicy first (the Ray pods are never up without it), the Ray token Secret
    # before the cluster whose pods read it.
    assert kinds[:6] == ["networkpolicies", "networkpolicies", "services", "secrets",
                         "rayclusters", "endpointslices"]  # fmt: skip
