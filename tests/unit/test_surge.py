"""A Surge update through the reconcile, against the faked world: a second generation beside
the serving one, the route switched only once it serves, the old one drained then deleted;
a new generation that never serves deleted at its deadline; no-engine changes restart nothing."""

from __future__ import annotations

from typing import Any

from vllm_dp_launcher import stages
from vllm_dp_operator import constants as c
from vllm_dp_operator.controller.kube import NETWORKPOLICY, SERVICE
from world import World, serving, spec


def surge(**over: Any) -> dict[str, Any]:
    return spec(update={"strategy": "Surge", "drainSeconds": 30},
                launch={"timeoutSeconds": 300}, **over)  # fmt: skip


def routed_to(w: World) -> str | None:
    """The cluster whose head pod the API Service's slice routes to (ready), if any."""
    eps = w.endpoint_slice() or {}
    for e in eps.get("endpoints") or []:
        if e["conditions"]["ready"]:
            uid = e["targetRef"]["uid"]
            return str(uid).removeprefix("uid-head-").rsplit("-", 1)[0]
    return None


def cluster_names(w: World) -> list[str]:
    return sorted(cl["metadata"]["name"] for cl in w.clusters()
                  if not cl["metadata"].get("deletionTimestamp"))  # fmt: skip


async def test_surge_end_to_end_switches_only_once_the_new_generation_serves() -> None:
    w = await serving(surge())
    [old] = cluster_names(w)
    assert routed_to(w) == old
    w.update(surge(engineArgs=["--max-model-len", "4096"]))
    await w.step()
    new = w.status["update"]["to"]
    assert cluster_names(w) == sorted([old, new])
    assert w.status["update"]["phase"] == "Starting"
    assert (w.status["update"]["from"], w.status["phase"]) == (old, c.PHASE_SERVING)
    old_head = w.head_pod(old)
    assert old_head is not None
    assert routed_to(w) == old
    assert w.ray.stops == []  # the old head job is never stopped
    assert "UpdateStarted" in w.reasons()

    w.cluster_ready()
    await w.step(5)
    new_jobs = [j["metadata"]["name"] for j in w.jobs()
                if j["metadata"]["labels"][c.LABEL_CLUSTER] == new]  # fmt: skip
    assert new_jobs == ["demo-j00002"] and "demo-j00001" in w.job_names()
    assert routed_to(w) == old  # its head job has not served yet

    w.run("demo-j00002")
    w.probe.completes = False  # /health answers, but no completion yet: still the old one
    await w.step(5)
    assert routed_to(w) == old and w.status["update"]["phase"] == "Starting"
    # The old generation still served on its own head pod, whatever the new flow concluded.
    assert w.status.get("servedHeadPod") in (None, old_head["metadata"]["uid"])
    assert w.probe.completion_calls and w.probe.completion_calls[-1].startswith(
        f"{new}-head-svc:")

    w.probe.completes = True
    out = await w.step(5)
    # The switch's own status write wakes nothing: the reconcile asks for its own wake.
    # Soon, when the old head's drain probe starts (its first call tells it to close kept
    # connections), not at the drain's end.
    assert out.retry_after is not None and out.retry_after <= c.DRAIN_PROBE_SECONDS
    assert routed_to(w) == new
    assert w.status["update"]["phase"] == "Draining"
    assert w.status["servedJob"] == "demo-j00002" and w.status["rayCluster"] == new
    new_head = w.head_pod(new)
    assert new_head is not None and w.status["servedHeadPod"] == new_head["metadata"]["uid"]
    assert cluster_names(w) == sorted([old, new])  # the old one drains, still there
    assert "UpdateSwitched" in w.reasons()

    # Kept-alive connections still carry requests to the old engines: it drains by them.
    w.probe.metrics = 'vllm:num_requests_running{engine="0"} 2\n'
    await w.step(10)
    assert cluster_names(w) == sorted([old, new]) and routed_to(w) == new
    assert w.ray.stops == [] and "2 request(s) running" in str(w.status["conditions"])
    w.probe.metrics = 'vllm:num_requests_running{engine="0"} 0\n'
    await w.step(1)
    # Drained: vLLM's own shutdown through Ray's job API, before its pods go.
    assert w.ray.stops == ["demo-j00001"] and cluster_names(w) == sorted([old, new])
    w.ray.jobs["demo-j00001"] = "STOPPED"
    await w.step(1)
    out = await w.step(1)
    assert cluster_names(w) == [new]
    assert "update" not in w.status and "UpdateDone" in w.reasons()
    assert out.status["update"] is None  # the merge patch removes it
    await w.step(1)
    assert routed_to(w) == new and w.status["phase"] == c.PHASE_SERVING
    assert w.job_names() == ["demo-j00002"]
    writes = [(v, k, n) for v, k, n in w.kube.writes if n in ("demo-j00001", old)]
    assert writes.index(("delete", "rayjobs", "demo-j00001")) < writes.index(
        ("delete", "rayclusters", old))


async def test_with_an_api_key_the_switch_waits_for_the_launchers_own_completion() -> None:
    # The operator holds no key: its completion through the new head Service proves only that
    # vLLM's API server answers (a 401). The launcher's completion in the pod, with the key,
    # proves generation; until it reports `answered`, the old generation serves.
    keyed = {"apiKeySecretRef": {"name": "api", "key": "key"}}
    w = await serving(surge(**keyed))
    [old] = cluster_names(w)
    w.update(surge(engineArgs=["--max-model-len", "4096"], **keyed))
    await w.step()
    new = w.status["update"]["to"]
    w.cluster_ready()
    await w.step(5)
    w.run("demo-j00002")
    w.probe.stages["demo-j00002"] = stages.SERVING
    await w.step(5)
    assert w.probe.completion_calls, "the operator's own completion is still asked"
    assert routed_to(w) == old and w.status["update"]["phase"] == "Starting"
    assert w.probe.followed_until["demo-j00002"] == stages.ANSWERED
    assert "the launcher's own completion" in w.status["message"], w.status["message"]
    w.probe.stages["demo-j00002"] = stages.ANSWERED
    await w.step(5)
    assert routed_to(w) == new and w.status["update"]["phase"] == "Draining"


async def test_without_a_key_the_operators_completion_suffices() -> None:
    w = await serving(surge())
    w.update(surge(engineArgs=["--max-model-len", "4096"]))
    await w.step()
    new = w.status["update"]["to"]
    w.cluster_ready()
    await w.step(5)
    w.run("demo-j00002")
    w.probe.stages["demo-j00002"] = stages.SERVING  # no `answered` line: not waited for
    await w.step(5)
    assert routed_to(w) == new


async def test_the_serving_head_stays_probed_while_the_new_one_starts() -> None:
    # A hang of the old generation's engine while the new one comes up takes its route by
    # the usual threshold, as it would outside an update: it is probed in a slot of its own.
    w = await serving(surge())
    [old] = cluster_names(w)
    w.update(surge(engineArgs=["--max-model-len", "4096"]))
    await w.step()
    w.probe.down.add(f"{old}-head-svc")
    for _ in range(3):
        await w.step(5)
    assert routed_to(w) == old, "a few failed probes take no route"
    assert w.status["update"]["phase"] == "Starting"
    for _ in range(30):
        await w.step(5)
    assert routed_to(w) is None, "failures in a row past the threshold: the hung head unrouted"
    assert w.status["update"]["phase"] == "Starting"
    # Ready says what the slice says: nothing routes now, whatever the update's progress.
    ready = {cond["type"]: cond for cond in w.status["conditions"]}[c.COND_READY]
    assert (ready["status"], w.status["phase"]) == ("False", c.PHASE_LAUNCHING), ready
    assert w.status["readyReplicas"] == 0


async def test_a_new_generation_that_never_serves_is_deleted_and_not_retried() -> None:
    w = await serving(surge())
    [old] = cluster_names(w)
    w.update(surge(model="Qwen/Qwen2.5-0.5B"))
    await w.step()
    new = w.status["update"]["to"]
    w.probe.down.add(f"{new}-head-svc")
    w.cluster_ready()
    await w.step(5)
    w.run("demo-j00002")
    await w.step(100)
    assert routed_to(w) == old and w.status["phase"] == c.PHASE_SERVING
    await w.step(200)  # past startedAt + spec.launch.timeoutSeconds
    assert cluster_names(w) == [old]
    assert routed_to(w) == old and w.status["phase"] == c.PHASE_SERVING
    assert "update" not in w.status and w.status["failedUpdate"]
    [failed] = [m for t, r, m in w.events if (t, r) == ("Warning", "UpdateFailed")]
    updated = {x["type"]: x for x in w.status["conditions"]}[c.COND_UPDATED]
    assert (updated["status"], updated["reason"]) == ("False", "UpdateFailed")
    # Both say why: the deadline, and what the new generation last did (its /health down).
    for said in (failed, updated["message"]):
        assert "spec.launch.timeoutSeconds" in said and "Last seen of it: " in said, said
        assert "/health" in said.split("Last seen of it: ")[1], said
    assert "demo-j00001" in w.job_names() and "demo-j00002" not in w.job_names()
    for _ in range(3):  # no retry loop: the same spec starts nothing again
        await w.step(600)
        assert cluster_names(w) == [old] and routed_to(w) == old
    assert w.reasons().count("UpdateStarted") == 1
    w.update(surge(model="Qwen/Qwen2.5-1.5B"))  # a new spec change tries again
    await w.step()
    assert w.status["update"]["phase"] == "Starting" and len(cluster_names(w)) == 2


async def test_a_held_old_generation_is_still_probed_and_unrouted_when_hung() -> None:
    """After a failed Surge the hold lasts until the next spec change: the old head keeps its
    /health probes, so a hung engine loses the route by the usual threshold, and regains it."""
    w = await serving(surge())
    [old] = cluster_names(w)
    w.update(surge(model="Qwen/Qwen2.5-0.5B"))
    await w.step()
    w.probe.down.add(f"{w.status['update']['to']}-head-svc")
    await w.step(301)
    assert w.status["failedUpdate"] and routed_to(w) == old
    w.probe.ok = False
    for _ in range(w.cfg.unroute_after_failures + 1):
        await w.step(w.cfg.unroute_after_seconds)
    assert routed_to(w) is None
    w.probe.ok = True
    await w.step(1)
    assert routed_to(w) == old and w.status["phase"] == c.PHASE_SERVING
    assert w.probe.calls[-1].startswith(f"{old}-head-svc:")


async def test_a_queued_resource_queues_its_second_generation_in_the_same_queue() -> None:
    """Through Kueue the second RayCluster carries the same queue labels and is made suspended
    (Kueue admits it); while it waits the old one serves, and the operator writes neither's
    suspend."""
    raw = surge(scheduling={"queueName": "gpu"})
    w = World(raw)
    await w.step()
    for cluster in w.clusters():
        cluster["spec"]["suspend"] = False  # Kueue admits the first
    w.cluster_ready()
    await w.step()
    w.run("demo-j00001")
    w.probe.ok = True
    await w.step()
    [old] = cluster_names(w)
    assert w.status["phase"] == c.PHASE_SERVING and routed_to(w) == old
    w.update({**raw, "engineArgs": ["--max-model-len", "4096"]})
    await w.step()
    new = w.status["update"]["to"]
    [second] = [cl for cl in w.clusters() if cl["metadata"]["name"] == new]
    assert second["metadata"]["labels"][c.LABEL_KUEUE_QUEUE] == "gpu"
    assert second["spec"]["suspend"] is True
    await w.step(5)
    assert w.status["phase"] == c.PHASE_SERVING and routed_to(w) == old
    assert f"updating to {new}: Queued in LocalQueue gpu" in w.status["message"]
    patches = [x for x in w.kube.writes if x[0] == "patch" and x[1] == "rayclusters"]
    assert patches == []


async def test_changes_without_new_engines_restart_nothing_under_either_strategy() -> None:
    for raw in (spec(), surge()):
        w = await serving(raw)
        clusters, jobs = cluster_names(w), w.job_names()
        writes = len(w.kube.writes)
        changed = {**raw, "service": {"type": "NodePort", "annotations": {"a": "b"}}}
        w.update(changed)
        await w.step(1)
        await w.step(1)
        assert cluster_names(w) == clusters and w.job_names() == jobs
        assert "update" not in w.status and w.ray.stops == []
        assert w.kube.objects[(SERVICE, "default", "demo-api")]["spec"]["type"] == "NodePort"
        kinds = {kind for _, kind, *_ in w.kube.writes[writes:]}
        # The cluster is told that it runs what the new generation asks (one annotation),
        # so that a later render of the operator's own replaces nothing.
        assert kinds <= {"services", "rayclusters"}, kinds
        assert [v for v, kind, _ in w.kube.writes[writes:] if kind == "rayclusters"] == ["patch"]
        [cluster] = w.clusters()
        assert cluster["metadata"]["annotations"][c.ANNOTATION_ACCEPTED] == "2/"


async def test_recreate_still_relaunches_on_the_same_pods() -> None:
    w = await serving(spec())
    [old] = cluster_names(w)
    w.update(spec(engineArgs=["--max-model-len", "4096"]))
    await w.step()
    assert cluster_names(w) == [old] and "update" not in w.status
    assert not w.routed()  # Recreate: the old engines stop, serving pauses


async def test_a_switch_whose_status_write_was_lost_goes_on_from_the_slice() -> None:
    # The leader patched the slice to the new head, then died before its status write: the
    # successor reads a status that still says Starting. Issue 38, item 7.
    w = await serving(surge())
    [old] = cluster_names(w)
    w.update(surge(engineArgs=["--max-model-len", "4096"]))
    await w.step()
    new = w.status["update"]["to"]
    w.cluster_ready()
    await w.step(5)
    w.run("demo-j00002")
    before = dict(w.status)
    await w.step(5)
    assert routed_to(w) == new and w.status["update"]["phase"] == "Draining"
    w.status = before  # the status write never landed
    assert w.status["update"]["phase"] == "Starting"
    writes = len(w.kube.writes)
    slices = []
    for _ in range(3):
        await w.step(1)
        slices.append(routed_to(w))
    assert slices == [new, new, new]
    # Never back to the old head, not even for a moment within a reconcile.
    assert [x for x in w.kube.writes[writes:] if x[1] == "endpointslices"] == []
    assert w.status["update"]["phase"] == "Draining"
    assert w.status["servedJob"] == "demo-j00002" and w.status["rayCluster"] == new
    assert old in cluster_names(w)  # it drains, as after any switch


async def test_a_surge_that_changes_the_port_moves_the_service_at_the_switch() -> None:
    """Issue 38: a Surge that changes spec.service.port. Until the switch the old head is
    probed, routed and reachable where it listens (its RayCluster's port, read from its
    annotation: the cache keeps no pod template); at the switch the slice and the Service move
    to the new port together; the API policy opens both ports while both generations live."""
    w = await serving(surge())
    w.kube.slimmed = True  # reads as the operator's cache answers them
    [old] = cluster_names(w)
    w.update(surge(engineArgs=["--max-model-len", "4096"], service={"port": 9000}))
    await w.step()
    new = w.status["update"]["to"]

    def ports() -> tuple[int, int, list[int]]:
        eps = w.endpoint_slice() or {}
        [svc] = w.kube.named(SERVICE)
        [api] = [p for p in w.kube.named(NETWORKPOLICY)
                 if p["metadata"]["name"].endswith("-api-port")]  # fmt: skip
        opened = sorted(p["port"] for rule in api["spec"]["ingress"] for p in rule["ports"])
        return eps["ports"][0]["port"], svc["spec"]["ports"][0]["port"], opened

    w.cluster_ready()
    await w.step(5)
    w.run("demo-j00002")
    w.probe.completes = False
    w.probe.calls.clear()
    await w.step(5)
    assert routed_to(w) == old and w.status["update"]["phase"] == "Starting"
    slice_port, service_port, opened = ports()
    assert (slice_port, service_port) == (8000, 8000)  # the old head, where it listens
    assert set(opened) == {8000, 9000}
    assert f"{old}-head-svc:8000" in w.probe.calls and f"{new}-head-svc:9000" in w.probe.calls
    assert ":8000/" in w.status["endpoint"]

    w.probe.completes = True
    await w.step(5)
    assert routed_to(w) == new and w.status["update"]["phase"] == "Draining"
    assert ports()[:2] == (9000, 9000)  # slice and Service together, in the switch's reconcile
    assert ":9000/" in w.status["endpoint"]
    w.probe.metrics = 'vllm:num_requests_running{engine="0"} 0\n'
    for _ in range(4):
        await w.step(1)
        w.ray.jobs["demo-j00001"] = "STOPPED"
    assert cluster_names(w) == [new]
    await w.step(1)
    assert ports()[:2] == (9000, 9000)
    # The old port stays open until the policy changes for another reason: nothing listens
    # there, and an edit of a policy is not free for the enforcer (routing.md).
    assert set(ports()[2]) == {8000, 9000}
    w.update(surge(engineArgs=["--max-model-len", "4096"],
                   service={"port": 9000, "allowFrom": [
                       {"namespaceSelector": {"matchLabels": {"team": "clients"}}}]}))
    await w.step(1)
    assert set(ports()[2]) == {9000}

