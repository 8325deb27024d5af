"""The event-driven controller: real reflectors, queue and workers over the FakeApi double.

The resync and probe periods are an hour here, so anything that happens within the tests'
deadlines was caused by a watch event, not by a timer.
"""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import pytest
from fake_api import FakeApi
from kubernetes_asyncio.client.exceptions import ApiException
from vllm_dp_operator import constants as c
from vllm_dp_operator.config import Config
from vllm_dp_operator.controller.events import EVENT, EventPoster
from vllm_dp_operator.controller.kube import (
    ENDPOINTSLICE,
    POD,
    RAYCLUSTER,
    RAYJOB,
    SERVICE,
    VDP,
    Kind,
)
from vllm_dp_operator.controller.manager import Controller, next_wake
from vllm_dp_operator.engines.probe import EngineReading, ProbeResult
from vllm_dp_operator.reconcile.outcome import Event, Outcome
from world import FakeRayJobs

HOUR = 3600.0
CFG = Config(resync_seconds=HOUR, probe_launching_seconds=HOUR, probe_serving_seconds=HOUR,
             backoff_base_seconds=0.0, backoff_cap_seconds=0.0, workers=4)  # fmt: skip
KEY = ("default", "demo")
SPEC = {"model": "m", "dataParallel": {"size": 4, "ranksPerNode": 2}}


class FakeProbe:
    """Test double for the health probe: answers what the test sets, counts calls."""

    def __init__(self) -> None:
        self.ok = False
        self.calls = 0

    async def check(self, namespace: str, service: str, port: int) -> ProbeResult:
        self.calls += 1
        return ProbeResult(self.ok, f"ok={self.ok}")

    async def engines(self, namespace: str, service: str, port: int,
                      ranks: int = 0) -> EngineReading:
        return EngineReading({}, "no engines in this double")


class Bed:
    """A FakeApi with one VLLMDataParallel, and a controller over it."""

    def __init__(self, cfg: Config = CFG, api: FakeApi | None = None) -> None:
        self.api = api or FakeApi()
        self.probe = FakeProbe()
        self.events: list[Event] = []
        self.ray = FakeRayJobs()
        self.ctl = Controller(self.api, cfg, self.probe, self.ray,
                              post_event=lambda _t, e: self.events.append(e))

    def add_owner(self, spec: dict[str, Any] = SPEC) -> None:
        self.api.put(VDP, {"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND,
                           "metadata": {"name": "demo", "generation": 1}, "spec": spec})
        self.kopf_event("ADDED")

    def kopf_event(self, type_: str | None) -> None:
        """Stand in for kopf's watch of the owner kind."""
        self.ctl.owner_event(type_, copy.deepcopy(self.api.objects[(VDP, *KEY)]))

    def owner(self) -> dict[str, Any]:
        return self.api.objects[(VDP, *KEY)]

    def status(self) -> dict[str, Any]:
        st: dict[str, Any] = self.owner().get("status") or {}
        return st

    def names(self, kind: Kind) -> list[str]:
        return [o["metadata"]["name"] for o in self.api.named(kind)]

    def cluster_ready(self) -> None:
        """Play KubeRay: a head pod (with the template's labels) and a ready cluster."""
        (cluster,) = self.api.named(RAYCLUSTER)
        name = cluster["metadata"]["name"]
        labels = {c.LABEL_RAY_CLUSTER: name, c.LABEL_RAY_NODE_TYPE: "head",
                  c.LABEL_INSTANCE: "demo", c.LABEL_MANAGED_BY: c.MANAGER}  # fmt: skip
        self.api.put(POD, {"metadata": {"name": f"{name}-head", "labels": labels},
                           "status": {"phase": "Running", "podIP": "10.0.0.9", "conditions": [
                               {"type": "Ready", "status": "True"}]}})  # fmt: skip
        workers = cluster["spec"]["workerGroupSpecs"][0]["replicas"]
        self.api.set_status(RAYCLUSTER, "default", name, {
            "state": "ready", "readyWorkerReplicas": workers,
            "conditions": [{"type": "HeadPodReady", "status": "True"},
                           {"type": "RayClusterProvisioned", "status": "True"}]})  # fmt: skip

    async def until(self, what: str, check: Callable[[], Any], timeout: float = 1.0) -> float:
        """Wait for `check`; return the seconds it took, or fail naming what never happened."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not check():
            if loop.time() - start > timeout:
                raise AssertionError(f"{what}: not within {timeout}s; status {self.status()}")
            await asyncio.sleep(0.002)
        return loop.time() - start

    async def owner_with_cluster(self) -> None:
        """The resource added, its RayCluster made, and the controller at rest."""
        self.add_owner()
        await self.until("the RayCluster", lambda: self.names(RAYCLUSTER))
        await self.settle()

    async def settle(self) -> None:
        """Wait until no key is queued or in flight."""
        await self.until("an idle queue", lambda: not len(self.ctl.queue)
                         and not self.ctl.queue.in_flight)  # fmt: skip
        await asyncio.sleep(0.02)
        await self.until("an idle queue", lambda: not len(self.ctl.queue)
                         and not self.ctl.queue.in_flight)  # fmt: skip


@pytest.fixture
async def bed() -> AsyncIterator[Bed]:
    b = Bed()
    b.ctl.start()
    yield b
    await b.ctl.stop()


async def test_child_events_reconcile_within_a_second_with_no_timer(bed: Bed) -> None:
    bed.add_owner()
    await bed.until("the RayCluster and Service", lambda: bed.names(RAYCLUSTER)
                    and bed.names(SERVICE))  # fmt: skip
    await bed.settle()
    assert bed.status()["phase"] == c.PHASE_PROVISIONING
    due = bed.ctl.queue.due_in(KEY)
    assert due is not None and due > HOUR * 0.8, "only the safety resync is scheduled"

    bed.cluster_ready()  # KubeRay: the RayCluster becomes ready
    took = await bed.until("a head job after the RayCluster became ready",
                           lambda: bed.names(RAYJOB) == ["demo-j00001"])  # fmt: skip
    assert took < 1.0
    await bed.settle()
    assert bed.status()["phase"] == c.PHASE_LAUNCHING

    bed.api.set_status(RAYJOB, "default", "demo-j00001",
                       {"jobStatus": "FAILED", "jobDeploymentStatus": "Failed"})  # KubeRay
    took = await bed.until("a relaunch after the head job failed (backoff 0)",
                           lambda: "demo-j00002" in bed.names(RAYJOB))  # fmt: skip
    assert took < 1.0
    await bed.until("the failure counted", lambda: bed.status().get("consecutiveFailures") == 1)
    assert [e.reason for e in bed.events].count(c.REASON_JOB_FAILED) == 1


async def test_own_writes_echo_wakes_nothing_but_one_follow_up_runs(bed: Bed) -> None:
    await bed.owner_with_cluster()
    # The first reconcile creates; the one after it sees the cluster it made (from the cache)
    # and says what it waits for. The watch's ADDED echoes of both creates wake nothing more.
    assert bed.ctl.reconciles == 2
    assert "Ray head not ready" in bed.status()["message"]


async def test_in_a_burst_children_come_before_status_and_events() -> None:
    bed = Bed(replace(CFG, workers=1))
    bed.ctl.post_event = bed.ctl._post  # the real background poster, gated like the status
    bed.ctl.poster = EventPoster(bed.api, gate=bed.ctl._quiet)
    bed.ctl.start()
    try:
        await bed.until("the caches filled", lambda: bed.ctl.synced)
        for name in ("a", "b", "c"):
            bed.api.put(VDP, {"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND,
                              "metadata": {"name": name, "generation": 1}, "spec": SPEC})
            bed.ctl.owner_event("ADDED", copy.deepcopy(bed.api.objects[(VDP, "default", name)]))
        await bed.until("three statuses", lambda: sum(
            1 for (k, _, _), o in bed.api.objects.items() if k == VDP and o.get("status")) == 3)
        await bed.until("the events", lambda: bed.ctl.poster.posted >= 3)  # type: ignore[union-attr]
        kinds = [(k, type_) for _, k, type_, _ in bed.api.log]
        last_child = max(i for i, (k, t) in enumerate(kinds) if k == RAYCLUSTER and t == "ADDED")
        first_report = min(i for i, (k, t) in enumerate(kinds)
                           if (k == VDP and t == "MODIFIED") or k == EVENT)
        assert last_child < first_report, kinds
    finally:
        await bed.ctl.stop()


async def test_a_burst_costs_two_reconciles_per_resource() -> None:
    bed = Bed(replace(CFG, workers=8))
    bed.api.latency = 0.005  # writes overlap, as on a real API server
    bed.ctl.start()
    try:
        await bed.until("the caches filled", lambda: bed.ctl.synced)
        for i in range(40):
            bed.api.put(VDP, {"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND,
                              "metadata": {"name": f"r{i}", "generation": 1}, "spec": SPEC})
            bed.ctl.owner_event("ADDED",
                                copy.deepcopy(bed.api.objects[(VDP, "default", f"r{i}")]))
        await bed.until("80 children", lambda: len(bed.api.named(RAYCLUSTER))
                        + len(bed.api.named(SERVICE)) == 80, timeout=5)  # fmt: skip
        await bed.settle()
        # Each: the one that creates, and the one after it that finds its writes in the cache;
        # other workers' writes meanwhile are no reason to look again.
        assert bed.ctl.reconciles == 80
    finally:
        await bed.ctl.stop()


async def test_pending_pod_event_explains_itself_in_status(bed: Bed) -> None:
    bed.add_owner({**SPEC, "gpu": {"perPod": 8}})
    await bed.until("the RayCluster", lambda: bed.names(RAYCLUSTER))
    await bed.settle()
    cluster = bed.names(RAYCLUSTER)[0]
    bed.api.put(POD, {"metadata": {"name": "head", "labels": {
        c.LABEL_RAY_CLUSTER: cluster, c.LABEL_INSTANCE: "demo", c.LABEL_MANAGED_BY: c.MANAGER}},
        "status": {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]}})  # fmt: skip
    await bed.until("the pending explanation",
                    lambda: "cannot be scheduled" in (bed.status().get("message") or ""))


async def test_api_calls_per_reconcile_are_pinned_and_never_list() -> None:
    bed = Bed(replace(CFG, workers=0))  # the test runs each reconcile itself
    bed.ctl.start()
    try:
        await bed.until("the caches filled", lambda: bed.ctl.synced)
        bed.add_owner()

        async def one() -> dict[str, int]:
            await asyncio.sleep(0.02)  # let the watches deliver the last writes
            before = Counter(bed.api.calls)
            await bed.ctl.process(KEY)
            await bed.ctl.status.idle()  # status changes are written in the background
            return {k: v for k, v in (Counter(bed.api.calls) - before).items() if v}

        # The two NetworkPolicies, Service, the Ray token Secret (created, never read),
        # RayCluster, its EndpointSlice (no endpoint yet), status.
        assert await one() == {"create": 6, "patch_status": 1}
        assert await one() == {"patch_status": 1}  # the RayCluster is seen: a new message
        assert await one() == {}
        bed.cluster_ready()
        # The head job; before it, one GET: is the owner still there (kopf reports no
        # deletion it missed in a 410, and children for a dead owner would be orphans)?
        # The slice gets the head pod's address, not ready yet (the patch).
        assert await one() == {"create": 1, "get": 1, "patch": 1, "patch_status": 1}
        bed.api.set_status(RAYJOB, "default", "demo-j00001", {"jobStatus": "RUNNING"})
        bed.probe.ok = True
        probes = bed.probe.calls
        # The running head job is handed to the probe pool, which asks it at once; the
        # reconcile itself sends no probe (its status: the launch's new stage).
        assert await one() == {"patch_status": 1}
        await bed.until("the pool's probe", lambda: bed.probe.calls > probes)
        # The slice's endpoint turns ready (no pod is written); Serving.
        assert await one() == {"patch": 1, "patch_status": 1}
        probes = bed.probe.calls
        for _ in range(5):
            assert await one() == {}, "steady state: no API call at all"
        assert bed.probe.calls == probes, "a reconcile reads the pool's answer, never probes"
        assert bed.ctl.kube.api_reads == 0
        assert bed.api.calls["list"] == 0 and bed.api.calls["get"] == 1
        assert ("patch", "endpointslices", "demo-api") in bed.api.writes
        assert [w for w in bed.api.writes if w[1] == "pods"] == []  # no pod PATCH, ever
    finally:
        await bed.ctl.stop()


def _ready(bed: Bed) -> list[bool]:
    eps = bed.api.objects.get((ENDPOINTSLICE, "default", "demo-api"))
    return [e["conditions"]["ready"] for e in (eps or {}).get("endpoints") or []]


async def test_a_deleted_or_edited_slice_is_put_back_through_its_watch(bed: Bed) -> None:
    await bed.owner_with_cluster()
    bed.cluster_ready()
    await bed.until("the head job", lambda: bed.names(RAYJOB) == ["demo-j00001"])
    bed.probe.ok = True
    bed.api.set_status(RAYJOB, "default", "demo-j00001", {"jobStatus": "RUNNING"})
    await bed.settle()
    bed.ctl.probes.nudge(KEY)  # as the launcher's `serving` report does
    await bed.until("routed", lambda: _ready(bed) == [True])
    await bed.settle()
    await bed.api.delete(ENDPOINTSLICE, "default", "demo-api")  # someone deletes it
    await bed.until("the slice back, routed", lambda: _ready(bed) == [True])
    await bed.settle()
    await bed.api.patch(ENDPOINTSLICE, "default", "demo-api", {"endpoints": []})  # or edits it
    await bed.until("the slice repaired", lambda: _ready(bed) == [True])
    assert [w for w in bed.api.writes if w[1] == "pods"] == []  # never a pod write


async def test_a_burst_of_child_events_is_coalesced(bed: Bed) -> None:
    await bed.owner_with_cluster()
    labels = {c.LABEL_INSTANCE: "demo", c.LABEL_MANAGED_BY: c.MANAGER}
    bed.api.put(POD, {"metadata": {"name": "p", "labels": labels}, "status": {}})
    await bed.settle()
    before = bed.ctl.reconciles
    for i in range(100):
        bed.api.set_status(POD, "default", "p", {"phase": "Pending", "n": i})
    await bed.settle()
    assert 1 <= bed.ctl.reconciles - before <= 2


async def test_own_status_echo_wakes_nothing_but_a_spec_change_does(bed: Bed) -> None:
    await bed.owner_with_cluster()
    before = bed.ctl.reconciles
    bed.kopf_event("MODIFIED")  # the echo of our own status patch
    await bed.settle()
    assert bed.ctl.reconciles == before
    await bed.api.patch(VDP, "default", "demo", {"spec": {"suspend": True},
                                                 "metadata": {"generation": 2}})  # a user
    bed.kopf_event("MODIFIED")
    await bed.until("Suspended", lambda: bed.status().get("phase") == c.PHASE_SUSPENDED)
    bed.kopf_event("DELETED")
    assert bed.ctl.cache.peek(VDP, *KEY) is None and bed.ctl.queue.due_in(KEY) is None


async def test_a_restart_annotation_wakes_the_owner_other_annotations_do_not(bed: Bed) -> None:
    await bed.owner_with_cluster()
    before = bed.ctl.reconciles
    await bed.api.patch(VDP, "default", "demo", {"metadata": {"annotations": {"note": "x"}}})
    bed.kopf_event("MODIFIED")
    await bed.settle()
    assert bed.ctl.reconciles == before
    await bed.api.patch(VDP, "default", "demo", {"metadata": {"annotations": {
        c.ANNOTATION_RESTARTED_AT: "2026-12-06T10:00:00Z"}}})  # kubectl annotate: no generation
    bed.kopf_event("MODIFIED")
    await bed.settle()
    assert bed.ctl.reconciles > before


async def test_an_owner_deleted_unseen_is_forgotten_at_its_status_404(bed: Bed) -> None:
    await bed.owner_with_cluster()
    # Deleted while kopf's watch was away: no DELETED event ever reaches the controller.
    del bed.api.objects[(VDP, *KEY)]
    bed.cluster_ready()  # a child event wakes the stale owner; its status patch answers 404
    await bed.until("the stale owner forgotten", lambda: bed.ctl.cache.peek(VDP, *KEY) is None)
    await bed.settle()
    assert bed.ctl.queue.due_in(KEY) is None, "nothing scheduled for a deleted owner"


async def test_restart_refills_the_cache_and_makes_no_duplicates() -> None:
    first = Bed()
    first.ctl.start()
    first.add_owner()
    await first.until("the RayCluster", lambda: first.names(RAYCLUSTER))
    first.cluster_ready()
    await first.until("the head job", lambda: first.names(RAYJOB))
    await first.settle()
    await first.ctl.stop()  # as after a SIGKILL: nothing of it survives but the API's objects

    second = Bed(api=first.api)
    creates = second.api.calls["create"]
    second.ctl.start()
    try:
        second.kopf_event(None)  # kopf's initial listing
        await second.until("a reconcile", lambda: second.ctl.reconciles >= 1)
        await second.settle()
        assert second.api.calls["create"] == creates
        assert len(second.api.named(RAYJOB)) == 1 and len(second.api.named(RAYCLUSTER)) == 1
    finally:
        await second.ctl.stop()


class FlakyApi(FakeApi):
    """Answers the first create with a server error."""

    failed = False

    async def create(self, kind: Kind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        if not self.failed:
            self.failed = True
            raise ApiException(status=500, reason="etcd hiccup")
        return await super().create(kind, namespace, body)


async def test_a_failed_reconcile_is_retried_with_backoff() -> None:
    bed = Bed(api=FlakyApi())
    bed.ctl.start()
    try:
        bed.add_owner()
        await bed.until("children after a retry", lambda: bed.names(RAYCLUSTER)
                        and bed.names(SERVICE), timeout=3)  # fmt: skip
        assert bed.ctl.failures == 1
    finally:
        await bed.ctl.stop()


async def test_a_terminating_namespace_is_not_retried() -> None:
    bed = Bed()
    bed.api.terminating.add("default")  # every create there answers NamespaceTerminating
    bed.ctl.start()
    try:
        bed.add_owner()
        await bed.until("a refused create", lambda: bed.api.calls["create"] >= 1)
        await asyncio.sleep(1.0)  # a retry would come after 0.5 s
        assert bed.api.calls["create"] == 1 and bed.ctl.failures == 0
        assert bed.ctl.queue.due_in(KEY) is None and "retry" not in bed.ctl.wakes
    finally:
        await bed.ctl.stop()


class SlowStatusApi(FakeApi):
    """Holds every status patch until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()

    async def patch_status(
        self, kind: Kind, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        await self.gate.wait()
        return await super().patch_status(kind, namespace, name, status)


async def test_a_status_patch_in_flight_is_what_the_next_reconcile_reads() -> None:
    api = SlowStatusApi()
    bed = Bed(replace(CFG, backoff_base_seconds=HOUR, backoff_cap_seconds=HOUR), api=api)
    bed.ctl.start()
    try:
        bed.add_owner()
        await bed.until("the RayCluster", lambda: bed.names(RAYCLUSTER))
        bed.cluster_ready()
        await bed.until("the head job", lambda: bed.names(RAYJOB))
        await bed.settle()
        await bed.ctl.status.idle()
        api.gate.clear()  # the API server is slow to answer status patches from now on
        bed.api.set_status(RAYJOB, "default", "demo-j00001", {"jobStatus": "FAILED"})
        await bed.until("the failure counted", lambda: bed.ctl.reconciles and bed.ctl.status
                        .effective(KEY, bed.owner()["metadata"].get("uid") or "", bed.status())
                        .get("consecutiveFailures") == 1)
        before = bed.ctl.reconciles
        labels = {c.LABEL_INSTANCE: "demo", c.LABEL_MANAGED_BY: c.MANAGER}
        bed.api.put(POD, {"metadata": {"name": "p", "labels": labels}})  # another wake
        await bed.until("another reconcile", lambda: bed.ctl.reconciles > before)
        assert not any(e.reason == c.REASON_JOB_FAILED for e in bed.events)  # not written yet
        api.gate.set()
        await bed.ctl.status.idle()
        assert bed.status()["consecutiveFailures"] == 1
        assert [e.reason for e in bed.events].count(c.REASON_JOB_FAILED) == 1
    finally:
        await bed.ctl.stop()


class EchoFirstApi(FakeApi):
    """The API server under load, seen through kopf: a status patch's watch event reaches
    the controller before the patch's answer does, and kopf hands on only the last of a quick
    run of events (here, the echo of every status patch but the latest is never delivered)."""

    def __init__(self) -> None:
        super().__init__()
        self.kopf: Callable[[], None] | None = None

    async def patch_status(
        self, kind: Kind, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        answer = await super().patch_status(kind, namespace, name, status)
        if self.kopf is not None and kind == VDP:
            self.kopf()
        return answer


@pytest.mark.parametrize("phase", [c.PHASE_LAUNCHING, c.PHASE_SERVING])
async def test_at_rest_no_news_from_kuberay_makes_no_status_patch(phase: str) -> None:
    api = EchoFirstApi()
    bed = Bed(api=api)
    # Serving: the engine test double answers /health. Launching: it does not yet (were it
    # to answer, the first probe would take the resource on to Serving, and Launching would
    # be a moment this test may or may not see).
    bed.probe.ok = phase == c.PHASE_SERVING
    bed.ctl.start()
    try:
        await bed.owner_with_cluster()  # Provisioning: its echo never reaches the controller
        await bed.ctl.status.idle()
        api.kopf = lambda: bed.kopf_event("MODIFIED")  # from now on, echo before answer
        bed.cluster_ready()
        if phase == c.PHASE_SERVING:
            await bed.until("the head job", lambda: bed.names(RAYJOB))
            bed.ray.jobs["demo-j00001"] = "RUNNING"
            bed.api.set_status(RAYJOB, "default", "demo-j00001",
                               {"jobStatus": "RUNNING", "jobDeploymentStatus": "Running"})
            bed.ctl.probes.nudge(KEY)
        await bed.until(phase, lambda: bed.status().get("phase") == phase, timeout=5)
        await bed.settle()
        await bed.ctl.status.idle()
        (cluster,) = bed.names(RAYCLUSTER)
        ready = copy.deepcopy(bed.api.objects[(RAYCLUSTER, *KEY[:1], cluster)]["status"])
        before, reconciles = api.calls["patch_status"], bed.ctl.reconciles
        for i in range(3):  # KubeRay rewrites the cluster's status: a new stamp, no news
            bed.api.set_status(RAYCLUSTER, "default", cluster,
                               {**ready, "lastUpdateTime": f"2026-01-01T00:00:0{i}Z"})
            await bed.settle()
            await bed.ctl.status.idle()
        assert bed.ctl.reconciles - reconciles == 3, "each write woke the resource"
        assert api.calls["patch_status"] == before, "a wake with no news patched the status"
    finally:
        await bed.ctl.stop()


async def test_backoff_end_is_scheduled_not_polled() -> None:
    bed = Bed(replace(CFG, backoff_base_seconds=1.0, backoff_cap_seconds=1.0))
    bed.ctl.start()
    try:
        bed.add_owner()
        await bed.until("the RayCluster", lambda: bed.names(RAYCLUSTER))
        bed.cluster_ready()
        await bed.until("the head job", lambda: bed.names(RAYJOB))
        bed.api.set_status(RAYJOB, "default", "demo-j00001", {"jobStatus": "FAILED"})
        await bed.until("Backoff", lambda: bed.status().get("phase") == c.PHASE_BACKOFF)
        await bed.settle()
        due = bed.ctl.queue.due_in(KEY)
        assert due is not None and 0 < due <= 1.0
        reconciles = bed.ctl.reconciles
        await asyncio.sleep(max(0.0, due - 0.1))
        assert bed.ctl.reconciles == reconciles, "nothing runs while the backoff lasts"
        await bed.until("the relaunch at the backoff's end",
                        lambda: "demo-j00002" in bed.names(RAYJOB), timeout=0.5)  # fmt: skip
    finally:
        await bed.ctl.stop()


@pytest.mark.parametrize(("phase", "retry_after", "low", "high"), [
    (c.PHASE_LAUNCHING, None, 540, 660),
    (c.PHASE_SERVING, None, 540, 660),
    (c.PHASE_LAUNCHING, 30.0, 30, 30),
    (c.PHASE_BACKOFF, 7.5, 7.5, 7.5),
    (c.PHASE_PROVISIONING, None, 540, 660),
    (c.PHASE_SUSPENDED, None, 540, 660),
])  # fmt: skip
def test_next_wake_is_time_alone_probes_wake_from_their_pool(
    phase: str, retry_after: float | None, low: float, high: float
) -> None:
    cfg = Config()  # the shipped defaults
    for _ in range(50):
        assert low <= next_wake(cfg, Outcome({"phase": phase}, [], retry_after)) <= high
