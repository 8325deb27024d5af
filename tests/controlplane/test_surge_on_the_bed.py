"""A Surge update on the control-plane test bed (real API server, scheduler, KubeRay, kwok GPU
nodes): the second generation beside the first, the API Service's EndpointSlice on the old
head until the new one answers /health and one completion, then on the new head; the old
cluster deleted after its drain; status.update shown, then cleared. And the failure path: a
new generation that never serves is deleted at its deadline while the old one stays routed.

vLLM is the /health double (tests/doubles/health_server.py) in the test bed's pod network;
its `/_double/only` control has only the listed pod IPs answer, so a new head "loads" for as
long as the test says.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from operator_proc import OperatorProcess
from scenario import (
    api_endpoints,
    apply,
    double_in_pod_network,
    example,
    head_pod,
    items,
    pod_api,
    run_operator,
    status,
    wait_phase,
)

pytestmark = pytest.mark.controlplane


@pytest.fixture(scope="module")
def operator(testbed: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    yield from run_operator(testbed, tmp_path_factory)


@pytest.fixture
def ns(testbed_namespace: str) -> str:
    """A fresh namespace per test (conftest's testbed_namespace), under a short name."""
    return testbed_namespace


def engine(pod_ip: str, method: str, path: str, body: Any = None) -> Any:
    """Call the vLLM double at a pod IP."""
    return pod_api(pod_ip, 8000, method, path, body)


def live_clusters(testbed: Any, ns: str) -> list[str]:
    return sorted(cl["metadata"]["name"] for cl in items(testbed, ns, "rayclusters")
                  if not cl["metadata"].get("deletionTimestamp"))  # fmt: skip


def surge_doc(name: str, timeout: int) -> dict[str, Any]:
    doc = example("dp4-tp2.yaml")
    doc["metadata"]["name"] = name
    doc["spec"]["update"] = {"strategy": "Surge", "drainSeconds": 5}
    doc["spec"]["launch"] = {"timeoutSeconds": timeout}
    return doc


def serving_first(testbed: Any, ns: str, doc: dict[str, Any]) -> tuple[dict[str, Any], str, str]:
    """Apply, wait for Serving and the route; then only the first head answers."""
    name = doc["metadata"]["name"]
    doc = apply(testbed, ns, doc)
    st = wait_phase(testbed, ns, name, "Serving", timeout=90)
    old = st["rayCluster"]
    old_ip = head_pod(testbed, ns, old)["status"]["podIP"]
    testbed.wait_until("the API Service to route to the first head",
                       lambda: api_endpoints(testbed, ns, name) == [old_ip])
    engine(old_ip, "POST", "/_double/only", {"addresses": [old_ip]})
    return doc, old, old_ip


def test_surge_switches_once_the_new_generation_serves_then_drains_the_old(
    testbed: Any, operator: OperatorProcess, ns: str
) -> None:
    name = "surger"
    with double_in_pod_network(testbed, "health_server.py", 8000):
        doc, old, old_ip = serving_first(testbed, ns, surge_doc(name, 300))

        doc["spec"]["engineArgs"] = ["--max-model-len=8192"]
        testbed.apply(doc)
        st = testbed.wait_until("status.update Starting", lambda: (
            s if (s := status(testbed, ns, name)).get("update", {}).get("phase") == "Starting"
            else None), timeout=30)  # fmt: skip
        new = st["update"]["to"]
        assert st["update"]["from"] == old and new != old and st["update"]["startedAt"]
        assert st["phase"] == "Serving"
        testbed.wait_until("both RayClusters", lambda: live_clusters(testbed, ns) ==
                           sorted([old, new]), timeout=30)  # fmt: skip
        new_ip = testbed.wait_until("the new head pod's IP", lambda: next(
            (p["status"].get("podIP") for p in items(
                testbed, ns, "pods", f"ray.io/cluster={new},ray.io/node-type=head")
             if not p["metadata"].get("deletionTimestamp")), None), timeout=90)
        testbed.wait_until("the new head job", lambda: any(
            j["metadata"]["labels"].get("vllmdp.io/cluster") == new
            for j in items(testbed, ns, "rayjobs")), timeout=90)  # fmt: skip
        # The new head job runs but its vLLM does not answer: the old head keeps the route.
        for _ in range(5):
            assert api_endpoints(testbed, ns, name) == [old_ip]
            assert status(testbed, ns, name)["update"]["phase"] == "Starting"
            time.sleep(1)
        assert live_clusters(testbed, ns) == sorted([old, new])

        engine(old_ip, "POST", "/_double/only", {"addresses": None})  # the new one loads
        testbed.wait_until("the API Service to route to the new head",
                           lambda: api_endpoints(testbed, ns, name) == [new_ip], timeout=30)
        asked = [a for a in engine(old_ip, "GET", "/_double/log")
                 if a["address"] == new_ip and a["path"] == "/v1/completions"]  # fmt: skip
        assert asked, "no completion reached the new head"
        assert asked[-1]["request"]["max_tokens"] == 1
        assert asked[-1]["request"]["model"] == doc["spec"]["servedModelName"]
        st = status(testbed, ns, name)
        assert st["update"]["phase"] == "Draining" and st["update"]["drainingSince"]
        assert st["rayCluster"] == new and st["phase"] == "Serving"
        assert old in live_clusters(testbed, ns)  # draining, still there, not routed

        testbed.wait_until("the old RayCluster to go after the drain",
                           lambda: live_clusters(testbed, ns) == [new], timeout=60)
        testbed.wait_until("status.update cleared",
                           lambda: "update" not in status(testbed, ns, name), timeout=30)
        assert api_endpoints(testbed, ns, name) == [new_ip]
        reasons = [e.get("reason") for e in items(testbed, ns, "events")]
        for reason in ("UpdateStarted", "UpdateSwitched", "UpdateDone"):
            assert reason in reasons, reasons
        printed = testbed.kubectl("-n", ns, "get", "vdp", name).stdout
        assert "UPDATE" in printed.splitlines()[0]


def test_a_new_generation_that_never_serves_is_deleted_and_the_old_stays_routed(
    testbed: Any, operator: OperatorProcess, ns: str
) -> None:
    name = "surgefail"
    with double_in_pod_network(testbed, "health_server.py", 8000):
        doc = surge_doc(name, 20)
        doc, old, old_ip = serving_first(testbed, ns, doc)
        doc["spec"]["engineArgs"] = ["--max-model-len=4096"]
        testbed.apply(doc)
        st = testbed.wait_until("status.update Starting", lambda: (
            s if (s := status(testbed, ns, name)).get("update", {}).get("phase") == "Starting"
            else None), timeout=30)  # fmt: skip
        new = st["update"]["to"]
        testbed.wait_until("a Warning UpdateFailed", lambda: any(
            e.get("reason") == "UpdateFailed" and e.get("type") == "Warning"
            for e in items(testbed, ns, "events")), timeout=60)  # fmt: skip
        testbed.wait_until("the new RayCluster to go",
                           lambda: live_clusters(testbed, ns) == [old], timeout=30)
        st = status(testbed, ns, name)
        assert "update" not in st and st["failedUpdate"] and st["phase"] == "Serving"
        cond = {c["type"]: c for c in st["conditions"]}["Updated"]
        assert (cond["status"], cond["reason"]) == ("False", "UpdateFailed")
        assert new in cond["message"] and "spec.launch.timeoutSeconds" in cond["message"]
        assert api_endpoints(testbed, ns, name) == [old_ip]
        time.sleep(5)  # no retry: the same spec starts no second attempt
        assert live_clusters(testbed, ns) == [old]
        assert api_endpoints(testbed, ns, name) == [old_ip]
        starts = [e for e in items(testbed, ns, "events") if e.get("reason") == "UpdateStarted"]
        assert sum(int(e.get("count") or 1) for e in starts) == 1
