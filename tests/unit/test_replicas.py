"""Replicas: a resource is a set of DP groups, each converged as one resource was before."""

from __future__ import annotations

from typing import Any

import pytest
from vllm_dp_operator import constants as c
from vllm_dp_operator.api import names
from vllm_dp_operator.api.crd import build_crd
from vllm_dp_operator.api.models import resolve_count
from vllm_dp_operator.api.validation import SpecError, validate
from vllm_dp_operator.config import RenderOptions
from vllm_dp_operator.controller.kube import POD, RAYCLUSTER, SERVICE
from vllm_dp_operator.plan import build_plan
from vllm_dp_operator.reconcile import replicaset
from vllm_dp_operator.reconcile.replicaset import ReplicaView, decide, rollout
from vllm_dp_operator.reconcile.update import HOLD_FOR_TURN
from vllm_dp_operator.render import build_raycluster
from world import World, serving, spec


def test_replica_zero_keeps_the_names_a_resource_had_before_replicas() -> None:
    assert names.raycluster("demo", "abcdef12") == "demo-abcde"
    assert names.head_job("demo", 1) == "demo-j00001"
    assert names.head_job("demo", 36**5 - 1) == "demo-jzzzzz"
    assert names.raycluster("demo", "abcdef12", 3) == "demo-abcde-r3"
    assert names.head_job("demo", 1, 1) == "demo-r01001"
    assert names.head_job("demo", 2, 35) == "demo-r0z002"


def test_every_child_name_fits_its_limit_at_the_longest_name_and_replica() -> None:
    longest = "a" * c.MAX_NAME_LENGTH
    top = c.MAX_REPLICAS - 1
    assert len(names.head_job(longest, 46655, top)) <= c.KUBERAY_MAX_RAYJOB_NAME
    cluster = names.raycluster(longest, "f" * 8, top)
    assert len(cluster) <= c.KUBERAY_MAX_RAYCLUSTER_NAME
    assert len(names.head_service(cluster)) <= c.DNS_LABEL_MAX
    # Every replica's head job has its own name, for every attempt a tag holds.
    jobs = {names.head_job("d", a, r) for r in range(c.MAX_REPLICAS) for a in (1, 2, 46655)}
    assert len(jobs) == 3 * c.MAX_REPLICAS
    assert len({len(j) for j in jobs}) == 1


def test_replicas_is_validated_with_the_field_named() -> None:
    for bad in (-1, c.MAX_REPLICAS + 1):
        with pytest.raises(SpecError, match="replicas"):
            validate("demo", spec(replicas=bad))
    assert validate("demo", spec(replicas=0)).replicas == 0
    assert validate("demo", spec()).replicas == 1


def test_the_crd_has_a_scale_subresource_and_a_ready_column() -> None:
    version = build_crd()["spec"]["versions"][0]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}  # fmt: skip
    replicas = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "replicas"]  # fmt: skip
    assert (replicas["minimum"], replicas["maximum"], replicas["default"]) == (0, 100, 1)
    assert {"name": "Ready", "type": "string", "jsonPath": ".status.ready"} in version[
        "additionalPrinterColumns"]  # fmt: skip


def _views(*views: ReplicaView) -> dict[int, ReplicaView]:
    return {v.index: v for v in views}


def test_scale_up_takes_the_lowest_free_indices() -> None:
    step = decide(3, _views(ReplicaView(1, routed=True)))
    assert (step.run, step.leave, step.added) == ([0, 1, 2], [], [0, 2])


def test_scale_down_takes_the_not_serving_then_the_failing_then_the_highest() -> None:
    views = _views(ReplicaView(0, routed=True), ReplicaView(1, routed=True, failing=True),
                   ReplicaView(2, routed=False), ReplicaView(3, routed=True))  # fmt: skip
    assert decide(3, views).chosen == [2]
    assert decide(2, views).chosen == [1, 2]
    assert decide(1, views).chosen == [1, 2, 3]
    assert decide(0, views).leave == [0, 1, 2, 3]


def test_a_leaving_replica_finishes_leaving_and_its_index_is_not_reused() -> None:
    views = _views(ReplicaView(0, routed=True), ReplicaView(1, leaving="2026-01-01T00:00:00Z"))
    step = decide(2, views)
    assert (step.run, step.leave) == ([0, 2], [1])


def test_a_status_from_before_replicas_is_replica_zeros() -> None:
    old = {"phase": "Serving", "servedJob": "demo-j00003", "launchAttempts": 3,
           "conditions": [{"type": "SpecValid", "status": "True"},
                          {"type": "Ready", "status": "True"}]}  # fmt: skip
    before = replicaset.previous(old)
    assert before[0]["servedJob"] == "demo-j00003"
    entry = replicaset.entry(0, before[0], routed=True, updated=True)
    assert [cond["type"] for cond in entry["conditions"]] == ["Ready"]
    assert replicaset.previous({}) == {}
    assert replicaset.previous({"replicaStatuses": []}) == {}


def _ready_endpoints(w: World) -> list[str]:
    eps = w.endpoint_slice() or {"endpoints": []}
    return sorted(e["targetRef"]["name"] for e in eps["endpoints"] if e["conditions"]["ready"])


async def _two_serving() -> World:
    w = World(spec(replicas=2))
    await w.step()
    assert sorted(cl["metadata"]["name"].endswith("-r1") for cl in w.clusters()) == [False, True]
    w.cluster_ready()
    await w.step()
    assert sorted(w.job_names()) == ["demo-j00001", "demo-r01001"]
    for job in w.job_names():
        w.run(job)
    w.probe.ok = True
    await w.step()
    return w


async def test_two_replicas_serve_from_two_clusters_behind_one_slice() -> None:
    w = await _two_serving()
    assert w.status["phase"] == c.PHASE_SERVING
    assert (w.status["replicas"], w.status["readyReplicas"], w.status["ready"]) == (2, 2, "2/2")
    assert w.status["updatedReplicas"] == 2
    assert w.status["selector"] == names.head_pods_selector("demo")
    heads = sorted(p["metadata"]["name"] for p in w.kube.named(POD))
    assert _ready_endpoints(w) == heads and len(heads) == 2
    # Each replica's pods say whose they are, as the selector and the slice read them.
    assert sorted(p["metadata"]["labels"][c.LABEL_REPLICA] for p in w.kube.named(POD)) == \
        ["0", "1"]  # fmt: skip
    entries = w.status["replicaStatuses"]
    assert [(e["index"], e["phase"], e["routed"]) for e in entries] == [
        (0, c.PHASE_SERVING, True), (1, c.PHASE_SERVING, True)]  # fmt: skip
    conds = {cond["type"]: cond for cond in w.status["conditions"]}
    assert conds[c.COND_AVAILABLE]["status"] == "True"
    assert "2 of 2" in conds[c.COND_AVAILABLE]["message"]
    assert conds[c.COND_DEGRADED]["status"] == "False"
    # One Service for all of them.
    assert [s["metadata"]["name"] for s in w.kube.named(SERVICE)] == ["demo-api"]


async def test_a_lost_head_pod_unroutes_only_its_replica() -> None:
    w = await _two_serving()
    r1 = next(cl["metadata"]["name"] for cl in w.clusters()
              if cl["metadata"]["name"].endswith("-r1"))  # fmt: skip
    lost = w.head_pod(r1)
    assert lost is not None
    del w.kube.objects[(POD, "default", lost["metadata"]["name"])]
    await w.step()
    remaining = [p["metadata"]["name"] for p in w.kube.named(POD)]
    assert _ready_endpoints(w) == remaining
    assert w.status["phase"] == c.PHASE_SERVING
    assert w.status["readyReplicas"] == 1
    conds = {cond["type"]: cond for cond in w.status["conditions"]}
    assert conds[c.COND_DEGRADED]["status"] == "True"
    assert "replica 1" in conds[c.COND_DEGRADED]["message"]
    assert c.REASON_REPLICA_DEGRADED in w.reasons()


BUSY = 'vllm:num_requests_running{engine="0",model_name="m"} 2\n'
IDLE = 'vllm:num_requests_running{engine="0",model_name="m"} 0\n'


async def test_scale_down_unroutes_drains_stops_then_deletes_the_leaving_replica() -> None:
    w = await _two_serving()
    w.probe.metrics = None  # its running requests unknown: the drain lasts drainSeconds
    w.update(spec(replicas=1, update={"drainSeconds": 30}))
    await w.step()
    eps = {e["targetRef"]["name"]: e["conditions"] for e in w.endpoint_slice()["endpoints"]}
    leaving = next(n for n in eps if "-r1-" in n)
    assert eps[leaving] == {"ready": False, "serving": True, "terminating": True}
    assert [n for n, cond in eps.items() if cond["ready"]] != []
    entry = w.status["replicaStatuses"][1]
    assert (entry["index"], entry["phase"], bool(entry["leaving"])) == (1, c.PHASE_DRAINING, True)
    assert w.status["readyReplicas"] == 1 and w.status["ready"] == "1/1"
    assert len(w.clusters()) == 2 and "demo-r01001" not in w.ray.stops
    await w.step(advance=31)  # the drain ends: its Ray job is stopped through the dashboard
    assert "demo-r01001" in w.ray.stops
    assert len(w.clusters()) == 2
    w.ray.jobs["demo-r01001"] = "STOPPED"
    await w.step(advance=1)  # confirmed ended: the RayJob goes, then the cluster
    await w.step(advance=1)
    assert [cl["metadata"]["name"].endswith("-r1") for cl in w.clusters()
            if not cl["metadata"].get("deletionTimestamp")] == [False]  # fmt: skip
    assert c.REASON_REPLICA_REMOVED in w.reasons()
    for cl in list(w.clusters()):
        if cl["metadata"]["name"].endswith("-r1"):
            del w.kube.objects[(RAYCLUSTER, "default", cl["metadata"]["name"])]
    await w.step(advance=1)
    assert [e["index"] for e in w.status["replicaStatuses"]] == [0]
    assert len(w.endpoint_slice()["endpoints"]) == 1 and _ready_endpoints(w)


async def test_zero_replicas_keep_the_service_and_hold_no_cluster() -> None:
    w = World(spec(replicas=0))
    await w.step()
    assert w.clusters() == []
    assert [s["metadata"]["name"] for s in w.kube.named(SERVICE)] == ["demo-api"]
    assert w.status["phase"] == c.PHASE_SCALED_TO_ZERO
    assert (w.status["replicas"], w.status["ready"]) == (0, "0/0")


async def test_an_upgraded_single_group_resource_keeps_its_cluster_and_route() -> None:
    w = await serving()
    # What an operator before replicas left: no replica label on any child, the group's
    # state at the status's top level, no replicaStatuses.
    for key in list(w.kube.objects):
        labels = w.kube.objects[key]["metadata"].get("labels") or {}
        labels.pop(c.LABEL_REPLICA, None)
    status: dict[str, Any] = {k: v for k, v in w.status.items() if k not in (
        "replicaStatuses", "replicas", "readyReplicas", "updatedReplicas", "ready",
        "selector")}  # fmt: skip
    status["conditions"] = [cond for cond in status["conditions"]
                            if cond["type"] not in (c.COND_AVAILABLE, c.COND_DEGRADED)]
    w.status = status
    uids = sorted(cl["metadata"]["uid"] for cl in w.clusters())
    slice_before = w.endpoint_slice()
    writes = len(w.kube.writes)
    await w.step()
    assert sorted(cl["metadata"]["uid"] for cl in w.clusters()) == uids
    assert w.job_names() == ["demo-j00001"]
    assert w.endpoint_slice() == slice_before and w.routed()
    assert [wr for wr in w.kube.writes[writes:] if wr[1] != "events"] == []
    assert w.status["phase"] == c.PHASE_SERVING
    assert w.status["replicaStatuses"][0]["servedJob"] == "demo-j00001"


async def test_one_replica_mirrors_its_fields_at_the_top_as_before() -> None:
    w = World(spec())
    await w.step()
    w.cluster_ready()
    await w.step()
    entry = w.status["replicaStatuses"][0]
    for key in ("rayCluster", "headJob", "launchAttempts", "phase", "message"):
        assert w.status[key] == entry[key]


async def test_a_leaving_replica_stops_once_its_engines_report_no_request() -> None:
    w = await _two_serving()
    w.probe.metrics = BUSY
    w.update(spec(replicas=1, update={"drainSeconds": 600}))
    await w.step()
    await w.step(advance=5)
    assert w.ray.stops == []
    assert "2 request(s) running" in w.status["replicaStatuses"][1]["message"]
    w.probe.metrics = IDLE
    await w.step(advance=5)
    assert w.ray.stops == ["demo-r01001"]
    assert [cl["metadata"]["name"].endswith("-r1") for cl in w.clusters()].count(True) == 1


async def test_scaling_back_up_while_one_leaves_adds_a_fresh_replica() -> None:
    w = await _two_serving()
    w.probe.metrics = BUSY
    w.update(spec(replicas=1))
    await w.step()
    w.update(spec(replicas=2))
    await w.step()
    indices = [(e["index"], bool(e.get("leaving"))) for e in w.status["replicaStatuses"]]
    assert indices == [(0, False), (2, False), (1, True)]
    assert any(cl["metadata"]["name"].endswith("-r2") for cl in w.clusters())


def test_rollout_recreates_at_most_max_unavailable_and_counts_what_is_down() -> None:
    def turns(*routed: bool) -> list[replicaset.Turn]:
        return [replicaset.Turn(i, True, r) for i, r in enumerate(routed)]

    assert rollout(3, turns(True, True, True), 1, 0) == {0: "Recreate", 1: HOLD_FOR_TURN,
                                                        2: HOLD_FOR_TURN}  # fmt: skip
    # Replica 1 is down anyway: it updates, and no serving one goes down beside it.
    assert rollout(3, turns(True, False, True), 1, 0) == {0: HOLD_FOR_TURN, 1: "Recreate",
                                                         2: HOLD_FOR_TURN}  # fmt: skip
    assert rollout(3, turns(True, True, True), 0, 1) == {0: "Surge", 1: HOLD_FOR_TURN,
                                                        2: HOLD_FOR_TURN}  # fmt: skip
    # An updated replica that does not come up stops the rollout: the rest hold and serve.
    done = replicaset.Turn(0, False, False)
    assert rollout(3, [done, *turns(True, True, True)[1:]], 1, 0) == {1: HOLD_FOR_TURN,
                                                                     2: HOLD_FOR_TURN}


def test_rolling_update_needs_a_surge_or_an_unavailable_replica() -> None:
    with pytest.raises(SpecError, match=r"update\.maxUnavailable"):
        validate("demo", spec(update={"strategy": "RollingUpdate", "maxUnavailable": 0}))
    assert validate("demo", spec(update={"strategy": "RollingUpdate"})).update.max_unavailable == 1


async def _n_serving(n: int, **over: Any) -> World:
    w = World(spec(replicas=n, **over))
    await w.step()
    w.cluster_ready()
    await w.step()
    for job in w.job_names():
        w.run(job)
    w.probe.ok = True
    await w.step()
    assert w.status["readyReplicas"] == n
    return w


async def test_a_rolling_engine_change_takes_one_replica_at_a_time() -> None:
    rolling = {"strategy": "RollingUpdate", "maxUnavailable": 1, "maxSurge": 0}
    w = await _n_serving(3, update=rolling)
    w.probe.metrics = IDLE
    w.update(spec(replicas=3, update=rolling, engineArgs=["--max-model-len", "4096"]))
    await w.step()
    # Replica 0 goes first: unrouted, its old head job stopping once its engines report no
    # request (at once here); 1 and 2 serve what they run.
    assert _ready_endpoints(w) == sorted(
        p["metadata"]["name"] for p in w.kube.named(POD)
        if p["metadata"]["labels"][c.LABEL_REPLICA] != "0")  # fmt: skip
    assert w.ray.stops == ["demo-j00001"]
    held = w.status["replicaStatuses"][1]
    assert held["phase"] == c.PHASE_SERVING and "its turn" in held["message"]
    assert len(w.clusters()) == 3  # no extra group: an engine change reuses the pods
    w.ray.jobs["demo-j00001"] = "STOPPED"
    for _ in range(2):
        await w.step(advance=1)
    assert "demo-j00002" in w.job_names() and w.ray.stops == ["demo-j00001"]
    w.run("demo-j00002")
    await w.step(advance=1)  # replica 0 serves the new engines: replica 1's turn
    await w.step(advance=1)
    assert w.ray.stops == ["demo-j00001", "demo-r01001"]
    assert w.status["readyReplicas"] == 2 and w.status["updatedReplicas"] == 1


async def test_a_rolling_turn_drains_its_serving_head_before_the_stop() -> None:
    """The replica whose turn it is leaves the slice, and its head job is stopped only once
    its engines report no request (or spec.update.drainSeconds passes): its kept-alive
    clients move to the replicas that serve, told by its drain gate, before vLLM stops."""
    rolling = {"strategy": "RollingUpdate", "maxUnavailable": 1, "maxSurge": 0,
               "drainSeconds": 600}  # fmt: skip
    w = await _n_serving(2, update=rolling)
    w.probe.metrics = BUSY
    w.update(spec(replicas=2, update=rolling, engineArgs=["--max-model-len", "4096"]))
    await w.step()
    await w.step(advance=5)
    assert len(_ready_endpoints(w)) == 1  # replica 0 unrouted, replica 1 serves
    assert w.ray.stops == []
    assert "draining head job demo-j00001" in w.status["replicaStatuses"][0]["message"]
    w.probe.metrics = IDLE
    await w.step(advance=5)
    assert w.ray.stops == ["demo-j00001"]


def test_replicas_prefer_other_nodes_and_zones_without_a_new_shape() -> None:
    model = validate("demo", spec())
    plan = build_plan(model)
    first = build_raycluster("demo", "ns", model, plan, RenderOptions(), None, 0)
    second = build_raycluster("demo", "ns", model, plan, RenderOptions(), None, 1)
    shape = first["metadata"]["labels"][c.LABEL_CLUSTER_HASH]
    assert second["metadata"]["labels"][c.LABEL_CLUSTER_HASH] == shape
    assert first["metadata"]["name"] == f"demo-{shape[:5]}"
    assert second["metadata"]["name"] == f"demo-{shape[:5]}-r1"
    for group in (second["spec"]["headGroupSpec"], *second["spec"]["workerGroupSpecs"]):
        pod = group["template"]
        assert pod["metadata"]["labels"][c.LABEL_REPLICA] == "1"
        keys = [(t["topologyKey"], t["whenUnsatisfiable"])
                for t in pod["spec"]["topologySpreadConstraints"]]
        assert keys == [("kubernetes.io/hostname", "ScheduleAnyway"),
                        ("topology.kubernetes.io/zone", "ScheduleAnyway")]


async def test_a_suspended_resource_scaled_down_makes_no_slice_and_waits_for_no_drain() -> None:
    w = World(spec(replicas=2, suspend=True))
    await w.step()
    assert len(w.clusters()) == 2 and w.endpoint_slice() is None
    w.update(spec(replicas=1, suspend=True, update={"drainSeconds": 600}))
    await w.step()
    assert w.endpoint_slice() is None
    live = [cl["metadata"]["name"] for cl in w.clusters()
            if not cl["metadata"].get("deletionTimestamp")]  # fmt: skip
    assert len(live) == 1 and not live[0].endswith("-r1")


@pytest.mark.parametrize(("value", "total", "up", "count"), [
    (2, 10, False, 2), ("25%", 10, False, 2), ("25%", 10, True, 3), ("10%", 3, False, 0),
    ("10%", 3, True, 1), ("100%", 4, False, 4), ("0%", 4, True, 0),
])  # fmt: skip
def test_percentages_round_as_a_deployment_rounds_them(value: int | str, total: int, up: bool,
                                                       count: int) -> None:  # fmt: skip
    assert resolve_count(value, total, round_up=up) == count


def test_percentages_pass_validation_and_accept_the_api_servers_forms() -> None:
    raw = spec(replicas=4, update={"strategy": "RollingUpdate", "maxUnavailable": "25%",
                                   "maxSurge": "50%"})  # fmt: skip
    model = validate("demo", raw)
    assert (model.update.max_unavailable, model.update.max_surge) == ("25%", "50%")


async def test_one_port_per_slice_a_replica_on_another_port_waits() -> None:
    """Replicas share one slice, which has one port: a replica whose generation listens on
    another port than the one a serving replica's endpoint uses is not routed (it waits),
    and the slice's port never switches under a serving endpoint."""
    w = await _two_serving()
    assert len(_ready_endpoints(w)) == 2
    # Replica 1's cluster says it listens on 9000 (as after a port change that reached it).
    for cl in w.clusters():
        if cl["metadata"]["name"].endswith("-r1"):
            cl["metadata"]["annotations"][c.ANNOTATION_API_PORT] = "9000"
    await w.step(5)
    eps = w.endpoint_slice() or {}
    assert eps["ports"][0]["port"] == 8000
    [routed] = _ready_endpoints(w)
    assert "-r1-" not in routed, routed
