"""The PodDisruptionBudget over a resource's Ray pods: a drain takes at most one replica at a
time, and only while another replica routes."""

from __future__ import annotations

import pytest
from test_replicas import _two_serving
from vllm_dp_operator import constants as c
from vllm_dp_operator.controller.kube import PDB, POD
from vllm_dp_operator.render.disruption import build_disruption_budget, min_available
from vllm_dp_operator.render.meta import owner_reference
from world import World, spec


@pytest.mark.parametrize(("replicas", "pods", "routed", "minimum"), [
    (0, 2, 0, None), (1, 2, 1, None),  # one replica: no budget, a drain is never blocked
    (2, 2, 2, 3), (3, 2, 3, 5), (3, 2, 2, 5), (2, 1, 2, 1),  # one pod may go
    (2, 2, 1, 4), (3, 1, 1, 3),  # the only one routing: none may go
    (2, 2, 0, 0),  # nothing routes: nothing to keep
])  # fmt: skip
def test_the_minimum_lets_one_replica_go_only_while_another_routes(
    replicas: int, pods: int, routed: int, minimum: int | None
) -> None:
    assert min_available(replicas, pods, routed) == minimum


def test_the_budget_counts_every_ray_pod_of_the_resource_and_lets_unready_ones_go() -> None:
    owner = owner_reference("demo", "uid-1")
    pdb = build_disruption_budget("demo", "ns1", 2, owner)
    assert (pdb["apiVersion"], pdb["kind"]) == ("policy/v1", "PodDisruptionBudget")
    assert pdb["metadata"]["name"] == "demo-ray" and pdb["metadata"]["ownerReferences"] == [owner]
    assert pdb["metadata"]["labels"][c.LABEL_MANAGED_BY] == c.MANAGER
    assert pdb["spec"] == {
        "minAvailable": 2, "unhealthyPodEvictionPolicy": "AlwaysAllow",
        "selector": {"matchLabels": {c.LABEL_INSTANCE: "demo",
                                     c.LABEL_COMPONENT: c.COMPONENT_ENGINE}}}  # fmt: skip


def _budget(w: World) -> int | None:
    found = w.kube.named(PDB)
    return None if not found else int(found[0]["spec"]["minAvailable"])


async def test_one_replica_has_no_budget() -> None:
    w = World(spec())
    await w.step()
    assert w.kube.named(PDB) == []


async def test_the_budget_follows_how_many_replicas_route() -> None:
    w = await _two_serving()  # DP=8 at 4 ranks a node: 2 pods a replica, 4 in all
    assert _budget(w) == 3
    # Replica 1's head pod is lost: replica 0 routes alone, and keeps every pod.
    r1 = next(p for p in w.kube.named(POD) if "-r1-" in p["metadata"]["name"])
    del w.kube.objects[(POD, "default", r1["metadata"]["name"])]
    await w.step()
    assert w.status["readyReplicas"] == 1 and _budget(w) == 4
    writes = len(w.kube.writes)
    await w.step(5)
    assert not [x for x in w.kube.writes[writes:] if x[1] == "poddisruptionbudgets"]
    # Scaled to one: no budget.
    w.update(spec(replicas=1, update={"drainSeconds": 0}))
    await w.step()
    assert w.kube.named(PDB) == []


async def test_a_replica_whose_pod_is_evicted_is_unrouted_at_once_the_other_stays() -> None:
    # A node drain evicts replica 1's worker pod: the pod lingers while its preStop hook drains
    # the head, but the replica's engines go with it, so it leaves the slice now.
    w = await _two_serving()
    r1 = next(cl["metadata"]["name"] for cl in w.clusters()
              if cl["metadata"]["name"].endswith("-r1"))  # fmt: skip
    head = w.head_pod(r1)
    assert head is not None
    worker = {"metadata": {"name": f"{r1}-worker-0", "uid": f"uid-worker-{r1}",
                           "labels": {**head["metadata"]["labels"],
                                      c.LABEL_RAY_NODE_TYPE: "worker"},
                           "deletionTimestamp": "2026-01-01T00:00:00Z"},
              "spec": {"nodeName": "node-b"}, "status": {"phase": "Running"}}  # fmt: skip
    w.kube.objects[(POD, "default", worker["metadata"]["name"])] = worker
    await w.step()
    ready = {e["targetRef"]["name"]: e["conditions"]["ready"]
             for e in w.endpoint_slice()["endpoints"]}  # fmt: skip
    assert ready[head["metadata"]["name"]] is False
    assert [n for n, ok in ready.items() if ok] and all("-r1-" not in n for n, ok in ready.items()
                                                         if ok)  # fmt: skip
    assert w.status["readyReplicas"] == 1 and _budget(w) == 4
