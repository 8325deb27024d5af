"""The chart's defaults on real kubelets: two operator pods on different nodes, one Lease.

One pod holds the Lease and writes; the other is Ready (its caches synced and the Lease API
answering) and waits. Deleting the leader's pod is a clean shutdown: it releases the Lease and
another pod leads at once, without waiting out the 15 s lease. That is the standby, or the
ReplicaSet's replacement when it asks first: it starts while the old leader shuts down, and
polls the released Lease like the standby does (whoever leads reconciles only from a full
cache).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest

from .bed import RunningCluster
from .vdp import OPERATOR_LABEL, OPERATOR_LEASE, OPERATOR_NS, operator_logs

pytestmark = pytest.mark.cluster


def _holder(cluster: RunningCluster) -> str:
    lease = cluster.kubectl_json("get", "lease", OPERATOR_LEASE, "-n", OPERATOR_NS)
    return str(lease["spec"].get("holderIdentity") or "")


def _ready_pods(cluster: RunningCluster) -> dict[str, dict[str, Any]]:
    pods = cluster.kubectl_json("get", "pods", "-n", OPERATOR_NS, "-l", OPERATOR_LABEL)["items"]
    return {p["metadata"]["name"]: p for p in pods
            if not p["metadata"].get("deletionTimestamp")
            and any(c["type"] == "Ready" and c["status"] == "True"
                    for c in p["status"].get("conditions") or [])}  # fmt: skip


def test_two_ready_replicas_one_leader_and_a_clean_handover(operator: RunningCluster) -> None:
    cluster = operator
    pods = cluster.wait_until("two Ready operator pods", lambda: len(
        p := _ready_pods(cluster)) == 2 and p, 120)  # fmt: skip
    nodes = {p["spec"]["nodeName"] for p in pods.values()}
    assert len(nodes) == 2, f"both operator pods on {nodes}: the anti-affinity did not spread"
    holder = cluster.wait_until("a Lease holder", lambda: _holder(cluster), 60)
    leader = holder.rsplit("_", 1)[0]
    assert leader in pods, (holder, list(pods), operator_logs(cluster))
    (standby,) = set(pods) - {leader}

    start = time.monotonic()
    cluster.kubectl("delete", "pod", leader, "-n", OPERATOR_NS, "--wait=false")
    try:
        new = cluster.wait_until("the standby to lead", lambda: (
            h := _holder(cluster)) and h != holder and h, 30)  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{operator_logs(cluster)}") from exc
    took = time.monotonic() - start
    assert new.rsplit("_", 1)[0] != leader, (new, leader)
    if new.rsplit("_", 1)[0] != standby:
        sys.stderr.write(f"[ha] the replacement pod led first ({new}), not the standby "
                         f"({standby})\n")
    # Released on shutdown: well under the 15 s a crashed leader's lease takes to expire.
    assert took < 10, f"handover took {took:.1f}s\n{operator_logs(cluster)}"
    # The ReplicaSet's replacement becomes the new standby.
    cluster.wait_until("two Ready operator pods again", lambda: len(_ready_pods(cluster)) == 2,
                       180)  # fmt: skip
