"""Reconcile decisions, driven through the handler-facing reconcile with the Kube seam faked."""

from __future__ import annotations

import copy

from vllm_dp_operator import constants as c
from vllm_dp_operator.controller.kube import ENDPOINTSLICE, POD, RAYCLUSTER, RAYJOB, SERVICE
from world import World, launched, serving, spec


async def test_create_makes_cluster_and_service_but_no_job_until_ready() -> None:
    w = World()
    await w.step()
    assert [cl["metadata"]["name"] for cl in w.clusters()] == [w.status["rayCluster"]]
    assert w.kube.named(SERVICE)[0]["metadata"]["name"] == "demo-api"
    assert w.jobs() == []
    assert w.status["phase"] == c.PHASE_PROVISIONING
    assert w.status["layout"]["gpuPods"] == 2 and w.status["layout"]["apiServers"] == 8
    owner = w.clusters()[0]["metadata"]["ownerReferences"][0]
    assert owner["uid"] == "uid-demo" and owner["controller"] is True
    assert c.REASON_CLUSTER_CREATED in w.reasons()


async def test_head_job_created_once_cluster_ready_then_serving_on_health() -> None:
    w = World()
    await w.step()
    await w.step()
    assert w.jobs() == []  # not ready yet: no head job
    w.cluster_ready()
    await w.step()
    (job,) = w.jobs()
    assert job["spec"]["clusterSelector"] == {c.LABEL_RAY_CLUSTER: w.status["rayCluster"]}
    assert job["spec"]["submissionMode"] == "HTTPMode"
    # The head pod it runs on is recorded: a different head later means the job died.
    head = w.head_pod()
    assert head is not None
    assert job["metadata"]["annotations"][c.ANNOTATION_HEAD_POD_UID] == head["metadata"]["uid"]
    assert w.status["phase"] == c.PHASE_LAUNCHING
    assert w.status["headJob"] == job["metadata"]["name"] == "demo-j00001"
    w.run("demo-j00001")
    await w.step()
    assert w.status["phase"] == c.PHASE_LAUNCHING  # running, /health not yet 200
    assert not w.routed()  # the Service routes nowhere yet
    w.probe.ok = True
    await w.step()
    assert w.status["phase"] == c.PHASE_SERVING
    assert w.status["servedJob"] == "demo-j00001"
    assert w.routed()  # now the slice routes to the head
    # /health is asked of the head pod through KubeRay's head Service, not the API Service.
    assert w.probe.calls[-1] == f"{w.status['rayCluster']}-head-svc:8000"
    ready = next(x for x in w.status["conditions"] if x["type"] == c.COND_READY)
    assert ready["status"] == "True"
    assert w.reasons().count(c.REASON_HEALTHY) == 1
    await w.step()
    assert w.reasons().count(c.REASON_HEALTHY) == 1  # no repeat event while steady


async def test_one_failed_probe_keeps_the_route_and_the_phase() -> None:
    # The operator failing to ask is no evidence the engine is gone (a control-plane blink).
    w = await serving()
    w.probe.ok = False
    await w.step()
    assert w.routed()
    assert w.status["phase"] == c.PHASE_SERVING and "still routed" in w.status["message"]
    ready = next(x for x in w.status["conditions"] if x["type"] == c.COND_READY)
    assert ready["status"] == "True" and ready["reason"] == c.REASON_PROBE_FAILING
    assert w.status["probeFailures"] == 1


async def test_routing_stops_only_after_failures_in_a_row_over_the_minimum_time() -> None:
    w = await serving()  # CFG: the defaults, 3 failures over at least 90 s
    w.probe.ok = False
    for advance in (0, 30, 30):  # three failures, but over 60 s only
        await w.step(advance=advance)
        assert w.routed()
    for _ in range(5):  # many more reconciles at once (child events) do not shorten it
        await w.step()
    assert w.routed()
    await w.step(advance=30)
    assert not w.routed()
    assert w.status["phase"] == c.PHASE_LAUNCHING and "not routed" in w.status["message"]
    w.probe.ok = True
    await w.step()
    assert w.routed() and w.status["phase"] == c.PHASE_SERVING
    assert "probeFailures" not in w.status and "probeFailingSince" not in w.status


async def test_an_answer_between_failures_starts_the_count_again() -> None:
    w = await serving()
    w.probe.ok = False
    await w.step()
    await w.step(advance=60)
    w.probe.ok = True
    await w.step(advance=1)
    w.probe.ok = False
    await w.step(advance=30)
    await w.step(advance=30)
    assert w.routed()  # 100 s of failures in all, but not in a row


async def test_shape_change_replaces_cluster_and_drops_the_old_job_with_its_pods() -> None:
    w = await serving()
    old = w.clusters()[0]["metadata"]["name"]
    w.update(spec(dataParallel={"size": 12, "ranksPerNode": 4}))
    await w.step()
    names = [cl["metadata"]["name"] for cl in w.clusters()]
    assert old not in names and names == [w.status["rayCluster"]]
    assert w.jobs() == [] and w.ray.stops == []  # its Ray job goes with the old pods
    assert w.status["phase"] == c.PHASE_PROVISIONING and w.status["layout"]["gpuPods"] == 3
    assert not w.routed()  # the old head goes with its cluster: unrouted at once
    w.cluster_ready()
    await w.step()
    assert w.job_names() == ["demo-j00002"]


async def test_invalid_spec_creates_nothing_and_warns_once() -> None:
    w = World(spec(dataParallel={"size": 1, "ranksPerNode": 1}))
    await w.step()
    await w.step()
    assert w.kube.calls["create"] == 0 and w.kube.objects == {}
    assert w.status["phase"] == c.PHASE_INVALID
    assert "spec.dataParallel.size" in w.status["message"]
    assert w.reasons().count(c.REASON_INVALID_SPEC) == 1


async def test_interrupted_reconcile_converges_without_duplicates() -> None:
    w = await launched()
    # The operator died after creating the job but before its status was written.
    w.status = {}
    await w.step()
    await w.step()
    assert len(w.clusters()) == 1 and w.job_names() == ["demo-j00001"]
    assert len(w.kube.named(SERVICE)) == 1


async def test_api_calls_per_reconcile_are_bounded_and_steady() -> None:
    w = await serving()
    counts = []
    for _ in range(20):
        w.kube.calls.clear()
        await w.step(advance=5)
        counts.append(dict(w.kube.calls))
    assert all(x == counts[0] for x in counts)
    # Steady state: reads only (clusters, head jobs, the head pod, other managers' slices;
    # the slice for the Service's port, the Service, its EndpointSlice, the three
    # NetworkPolicies (the egress one to see that none is there); then the slice and the routed
    # pod again, whose replica is what the status says is routed, the slice's port once
    # more, and the PodDisruptionBudget, which one replica does not have), all from the cache
    # in the controller, and no writes.
    assert counts[0] == {"list": 4, "get": 10}


async def test_suspend_stops_pods_and_head_job_then_resumes() -> None:
    w = await launched()
    w.update(spec(suspend=True))
    await w.step()
    assert w.clusters()[0]["spec"]["suspend"] is True
    assert w.jobs() == [] and w.status["phase"] == c.PHASE_SUSPENDED
    w.update(spec())
    await w.step()
    assert w.clusters()[0]["spec"]["suspend"] is False
    assert len(w.clusters()) == 1  # same cluster, resumed


async def test_a_suspended_resource_holds_no_service_and_resuming_makes_it_again() -> None:
    # A cluster IP per suspended resource would fill a small Service range, cost kube-proxy
    # rules on every node, and each allocation's cost grows with the addresses in use.
    w = World(spec(suspend=True))
    await w.step()
    assert w.clusters() and w.kube.named(SERVICE) == [] and w.kube.named(ENDPOINTSLICE) == []
    assert w.status["phase"] == c.PHASE_SUSPENDED and w.status.get("endpoint") is None
    w.update(spec())
    await w.step()
    assert [s["metadata"]["name"] for s in w.kube.named(SERVICE)] == ["demo-api"]
    assert [s["metadata"]["name"] for s in w.kube.named(ENDPOINTSLICE)] == ["demo-api"]
    assert w.status["endpoint"] == "http://demo-api.default.svc:8000/v1"


async def test_suspending_a_serving_resource_unroutes_it_and_gives_its_service_back() -> None:
    w = await launched()
    w.run("demo-j00001")
    w.probe.ok = True
    await w.step()
    assert w.status["phase"] == c.PHASE_SERVING and w.routed()
    w.update(spec(suspend=True))
    before = len(w.kube.writes)
    await w.step()
    deletes = [(verb, kind) for verb, kind, _ in w.kube.writes[before:] if verb == "delete"]
    # The slice goes before the Service, and both before the head job.
    assert deletes[:3] == [("delete", "endpointslices"), ("delete", "services"),
                           ("delete", "rayjobs")], deletes  # fmt: skip
    assert w.kube.named(SERVICE) == [] and w.kube.named(ENDPOINTSLICE) == []
    assert w.status.get("endpoint") is None
    await w.step()
    assert not [v for v, _, _ in w.kube.writes[before:] if v == "create"]


async def test_a_suspended_resource_leaves_a_service_it_does_not_own() -> None:
    w = World(spec(suspend=True))
    others = {"apiVersion": "v1", "kind": "Service",
              "metadata": {"name": "demo-api", "namespace": "default", "ownerReferences": [
                  {"uid": "uid-other", "controller": True, "kind": "VLLMDataParallel",
                   "apiVersion": "vllmdp.io/v1alpha1", "name": "demo"}]},
              "spec": {"type": "ClusterIP", "ports": []}}  # fmt: skip
    w.kube.objects[(SERVICE, "default", "demo-api")] = others
    await w.step()
    assert w.kube.named(SERVICE) == [others]


async def test_pending_pods_explained_in_status() -> None:
    w = World(spec(dataParallel={"size": 8, "ranksPerNode": 1}, gpu={"perPod": 8}))
    await w.step()
    name = w.status["rayCluster"]
    for i in range(2):
        await w.kube.create(POD, "default", {
            "metadata": {"name": f"p{i}", "labels": {c.LABEL_RAY_CLUSTER: name}},
            "status": {"phase": "Pending", "conditions": [{
                "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
            }]},
        })  # fmt: skip
    await w.step()
    assert w.status["phase"] == c.PHASE_PROVISIONING
    msg = w.status["message"]
    assert "Insufficient nvidia.com/gpu" in msg and "needs 8 nvidia.com/gpu" in msg
    cond = next(x for x in w.status["conditions"] if x["type"] == c.COND_CLUSTER_READY)
    assert cond["reason"] == c.REASON_PODS_PENDING


async def test_condition_transition_time_moves_only_on_flip() -> None:
    w = World()
    await w.step()
    first = next(x for x in w.status["conditions"] if x["type"] == c.COND_CLUSTER_READY)
    await w.step(advance=30)
    same = next(x for x in w.status["conditions"] if x["type"] == c.COND_CLUSTER_READY)
    assert same["lastTransitionTime"] == first["lastTransitionTime"]
    w.cluster_ready()
    await w.step(advance=30)
    flipped = next(x for x in w.status["conditions"] if x["type"] == c.COND_CLUSTER_READY)
    assert flipped["status"] == "True"
    assert flipped["lastTransitionTime"] != first["lastTransitionTime"]


async def test_attempt_numbers_never_repeat_even_without_status() -> None:
    w = await launched()
    w.update(spec(engineArgs=["--max-model-len", "4096"]))
    # The operator lost its status, and the old head job is still terminating.
    w.status = {}
    old = w.jobs()[0]
    old["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    w.kube.objects[(RAYJOB, "default", "demo-j00001")] = old
    await w.step()
    assert set(w.job_names()) == {"demo-j00001", "demo-j00002"}
    assert w.status["headJob"] == "demo-j00002" and w.status["launchAttempts"] == 2


def _born_again(w: World, raw_spec: dict[str, object]) -> int:
    """The resource is deleted and created again under its name before the garbage collector
    takes the old one's children; return how many writes were made so far."""
    w.uid, w.status, w.generation, w.spec = "uid-demo-2", {}, 1, raw_spec
    return len(w.kube.writes)


async def test_a_deleted_namesakes_children_are_not_adopted_or_counted() -> None:
    # Without Ray token auth the same spec gives the same child names (with it, the token's
    # Secret, and so the cluster's shape, carry the uid: the next test).
    raw = spec(ray={"auth": "disabled"})
    w = await launched(raw)
    w.run("demo-j00001")
    (old_cluster,) = [cl["metadata"]["name"] for cl in w.clusters()]
    before = _born_again(w, raw)  # the same spec: the same child names
    await w.step()
    # Its ready cluster and running head job are not this resource's: nothing launches on
    # them, its attempt is not counted, and the cluster of that name waits for the collector.
    assert w.kube.writes[before:] == []
    assert w.job_names() == ["demo-j00001"] and w.status["launchAttempts"] == 0
    assert w.status["phase"] == c.PHASE_PROVISIONING and w.status["rayCluster"] == old_cluster
    del w.kube.objects[(RAYCLUSTER, "default", old_cluster)]  # the collector, at last
    await w.step()
    (cluster,) = w.clusters()
    assert cluster["metadata"]["ownerReferences"][0]["uid"] == "uid-demo-2"


async def test_a_namesake_with_token_auth_gets_its_own_token_secret_and_cluster() -> None:
    w = await launched()
    (old_cluster,) = w.clusters()
    old_secret = old_cluster["spec"]["authOptions"]["secretName"]
    before = _born_again(w, spec())
    await w.step()
    made = [(verb, kind, name) for verb, kind, name in w.kube.writes[before:]]
    new = [cl for cl in w.clusters() if cl["metadata"]["name"] != old_cluster["metadata"]["name"]]
    assert len(new) == 1 and new[0]["metadata"]["ownerReferences"][0]["uid"] == "uid-demo-2"
    secret = new[0]["spec"]["authOptions"]["secretName"]
    assert secret != old_secret and ("create", "secrets", secret) in made
    assert all(verb == "create" for verb, _, _ in made), made  # the namesake's stay as they are


async def test_a_deleted_namesakes_children_are_never_changed_or_deleted() -> None:
    w = await launched()
    old = {(k.plural, n): copy.deepcopy(o) for (k, _, n), o in w.kube.objects.items()}
    before = _born_again(w, spec(dataParallel={"size": 12, "ranksPerNode": 4}))
    await w.step()
    made = w.kube.writes[before:]
    assert made and all(verb == "create" for verb, _, _ in made), made
    for (plural, name), obj in old.items():
        now = next(o for (k, _, n), o in w.kube.objects.items() if (k.plural, n) == (plural, name))
        assert now == obj, f"{plural}/{name} changed"
    assert w.status["launchAttempts"] == 0
