"""Replicas on the control-plane bed: `kubectl scale` through the /scale subresource, one
RayCluster per replica, scale-down and zero, and the API server's own rule on the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from operator_proc import OperatorProcess
from scenario import apply, example, items, run_operator, status

pytestmark = pytest.mark.controlplane


@pytest.fixture(scope="module")
def operator(testbed: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    yield from run_operator(testbed, tmp_path_factory)


def _live_clusters(testbed: Any, ns: str) -> list[str]:
    return sorted(c["metadata"]["name"] for c in items(testbed, ns, "rayclusters")
                  if not c["metadata"].get("deletionTimestamp"))  # fmt: skip


def _scale(testbed: Any, ns: str, name: str, replicas: int) -> None:
    testbed.kubectl("-n", ns, "scale", "vdp", name, f"--replicas={replicas}")


def test_scale_a_suspended_resource_then_resume_down_and_to_zero(
    testbed: Any, operator: OperatorProcess, testbed_namespace: str
) -> None:
    ns = testbed_namespace
    doc = example("dp4-tp2.yaml")
    doc["spec"]["suspend"] = True
    doc = apply(testbed, ns, doc)
    name = doc["metadata"]["name"]
    testbed.wait_until(f"{name} Suspended", lambda: status(testbed, ns, name).get("phase")
                       == "Suspended", timeout=60)  # fmt: skip
    _scale(testbed, ns, name, 3)
    testbed.wait_until("three suspended RayClusters", lambda: len(_live_clusters(testbed, ns))
                       == 3, timeout=60)  # fmt: skip
    testbed.kubectl("-n", ns, "patch", "vdp", name, "--type=merge",
                    "-p", '{"spec": {"suspend": false}}')  # fmt: skip

    def launching() -> dict[str, Any] | bool:
        st = status(testbed, ns, name)
        phases = [e.get("phase") for e in st.get("replicaStatuses") or []]
        return len(phases) == 3 and all(p == "Launching" for p in phases) and st

    st = testbed.wait_until("3 replicas Launching", launching, timeout=120)
    clusters = _live_clusters(testbed, ns)
    assert len(clusters) == 3
    assert sorted(e["rayCluster"] for e in st["replicaStatuses"]) == clusters
    assert (st["replicas"], st["readyReplicas"], st["ready"]) == (3, 0, "0/3")
    assert st["selector"] == (f"app.kubernetes.io/instance={name},"
                              "app.kubernetes.io/component=engine,ray.io/node-type=head")
    jobs = sorted(j["metadata"]["name"] for j in items(testbed, ns, "rayjobs"))
    assert jobs == [f"{name}-j00001", f"{name}-r01001", f"{name}-r02001"]
    # The /scale subresource reads back what the status says.
    scale = json.loads(testbed.kubectl("get", "--raw",
                                       f"/apis/vllmdp.io/v1alpha1/namespaces/{ns}/"
                                       f"vllmdataparallels/{name}/scale").stdout)  # fmt: skip
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == st["selector"]
    table = testbed.kubectl("-n", ns, "get", "vdp", name).stdout
    assert "READY" in table and "0/3" in table

    _scale(testbed, ns, name, 1)
    testbed.wait_until("one RayCluster left, replica 0's", lambda: _live_clusters(testbed, ns)
                       == [clusters[0]] and clusters[0], timeout=120)  # fmt: skip
    testbed.wait_until("one replica in status", lambda: [
        e["index"] for e in status(testbed, ns, name).get("replicaStatuses") or []] == [0],
        timeout=60)  # fmt: skip
    testbed.wait_until("only replica 0's head job", lambda: [
        j["metadata"]["name"] for j in items(testbed, ns, "rayjobs")
        if not j["metadata"].get("deletionTimestamp")] == [f"{name}-j00001"], timeout=60)

    _scale(testbed, ns, name, 0)
    testbed.wait_until("no RayCluster", lambda: _live_clusters(testbed, ns) == [], timeout=120)
    st = testbed.wait_until("ScaledToZero", lambda: (s := status(testbed, ns, name)).get(
        "phase") == "ScaledToZero" and s, timeout=60)  # fmt: skip
    assert (st["replicas"], st["ready"]) == (0, "0/0")
    (svc,) = items(testbed, ns, "services", "app.kubernetes.io/component=api")
    assert svc["metadata"]["name"] == f"{name}-api"


def test_the_api_server_refuses_negative_replicas_naming_the_field(
    testbed: Any, operator: OperatorProcess, testbed_namespace: str
) -> None:
    doc = example("dp4-tp2.yaml")
    doc["metadata"]["namespace"] = testbed_namespace
    doc["spec"]["replicas"] = -1
    proc = testbed.kubectl("create", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert proc.returncode != 0, "accepted replicas: -1"
    assert "spec.replicas" in proc.stderr and "greater than or equal to 0" in proc.stderr, \
        proc.stderr  # fmt: skip
    assert items(testbed, testbed_namespace, "vdp") == []


def test_the_api_server_refuses_a_port_change_across_replicas_naming_the_field(
    testbed: Any, operator: OperatorProcess, testbed_namespace: str
) -> None:
    """Issue 38: one EndpointSlice, one port. The CRD's transition rule (CEL with oldSelf)
    refuses a spec.service.port change while replicas > 1, and allows it at one replica."""
    ns = testbed_namespace
    doc = example("dp4-tp2.yaml")
    doc["spec"].update(suspend=True, replicas=2)
    name = apply(testbed, ns, doc)["metadata"]["name"]

    def patch(spec: dict[str, Any]) -> Any:
        return testbed.kubectl("-n", ns, "patch", "vdp", name, "--type=merge", "-p",
                               json.dumps({"spec": spec}), check=False)  # fmt: skip

    refused = patch({"service": {"port": 9000}})
    assert refused.returncode != 0 and "spec.service.port" in refused.stderr, refused.stderr
    assert "at most 1" in refused.stderr, refused.stderr
    assert patch({"replicas": 1}).returncode == 0
    allowed = patch({"service": {"port": 9000}})
    assert allowed.returncode == 0, allowed.stderr
