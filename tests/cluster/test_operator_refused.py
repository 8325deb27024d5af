"""KubeRay's pod creates refused by the API server, said in the resource's status (issue 19).

A ResourceQuota of zero pods in the namespace: the real API server refuses each Ray pod KubeRay
creates, KubeRay records it in its RayCluster's `ReplicaFailure` condition, and the operator
quotes the refusal in the phase message, in the ClusterReady condition and in one Warning
Event. No pod ever starts, so no engine image is needed and nothing is left on the nodes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from .bed import RunningCluster
from .vdp import Vdp

pytestmark = pytest.mark.cluster

NS = "t-refused"
NAME = "refused"


@pytest.fixture(scope="module")
def vdp(operator: RunningCluster) -> Iterator[Vdp]:
    operator.kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=true",
                     timeout=180)  # fmt: skip
    operator.kubectl("create", "namespace", NS)
    operator.apply({"apiVersion": "v1", "kind": "ResourceQuota",
                    "metadata": {"name": "no-pods", "namespace": NS},
                    "spec": {"hard": {"pods": "0"}}})  # fmt: skip
    # Until the quota controller has written its status, admission says "status unknown".
    operator.wait_until("the quota's status", lambda: operator.kubectl_json(
        "get", "resourcequota", "no-pods", "-n", NS).get("status", {}).get("hard"), 60)  # fmt: skip
    operator.apply({"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel",
                    "metadata": {"name": NAME, "namespace": NS},
                    "spec": {"model": "cluster/double-model", "image": "vllm-dp-engine-double:dev",
                             "dataParallel": {"size": 2, "ranksPerNode": 1},
                             "resources": {"cpu": "1", "memory": "1Gi"}, "shmSize": "64Mi"}})
    try:
        yield Vdp(operator, NS, NAME)
    finally:
        operator.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def test_a_quota_refusal_is_quoted_in_status_and_one_warning(vdp: Vdp) -> None:
    quoted = "exceeded quota: no-pods"
    st = vdp.wait("the refusal in the status", lambda: (s := vdp.status()).get(
        "phase") == "Provisioning" and quoted in (s.get("message") or "") and s, 120)  # fmt: skip
    assert st["message"].startswith("KubeRay cannot create the Ray head pod of "), st["message"]
    assert "requested: pods=1" in st["message"] and "limited: pods=0" in st["message"]
    (cond,) = [c for c in st["conditions"] if c["type"] == "ClusterReady"]
    assert (cond["status"], cond["reason"]) == ("False", "PodsRefused")
    assert cond["message"] == st["message"]
    # KubeRay keeps retrying the create (a new generated pod name each time): still one Event.
    vdp.wait("KubeRay's retries", lambda: vdp.cluster.kubectl(
        "get", "events", "-n", NS, "--field-selector", "reason=FailedToCreateHeadPod", "-o",
        "jsonpath={.items[*].count}").stdout.strip() not in ("", "1"), 120)  # fmt: skip
    selector = f"involvedObject.name={NAME},reason=PodsRefused"
    events = json.loads(vdp.cluster.kubectl("get", "events", "-n", NS, "--field-selector",
                                            selector, "-o", "json").stdout)["items"]  # fmt: skip
    assert len(events) == 1 and events[0]["type"] == "Warning", events
    assert events[0]["message"] == st["message"] and events[0].get("count", 1) == 1
    assert vdp.cluster.kubectl_json("get", "pods", "-n", NS)["items"] == []
