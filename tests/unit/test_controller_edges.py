"""The controller at its edges: failures that repeat, a relist, a resource deleted and created
again, a write answer ahead of kopf's event. Real reflectors, queue and workers over the
FakeApi double, as in test_controller.py.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from fake_api import FakeApi
from kubernetes_asyncio.client.exceptions import ApiException
from test_controller import CFG, KEY, SPEC, Bed
from vllm_dp_operator import constants as c
from vllm_dp_operator.controller.cache import ObjectCache
from vllm_dp_operator.controller.kube import RAYCLUSTER, RAYJOB, SERVICE, VDP, Kind
from vllm_dp_operator.controller.status_writer import StatusWriter


@pytest.fixture
async def bed() -> AsyncIterator[Bed]:
    b = Bed()
    b.ctl.start()
    yield b
    await b.ctl.stop()


def _owner(name: str, uid: str | None = None, generation: int = 1) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "generation": generation}
    if uid:
        meta["uid"] = uid
    return {"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND, "metadata": meta,
            "spec": SPEC}  # fmt: skip


def _add(bed: Bed, name: str, uid: str | None = None) -> None:
    """A user creates a resource; kopf reports it."""
    bed.api.put(VDP, _owner(name, uid))
    bed.ctl.owner_event("ADDED", copy.deepcopy(bed.api.objects[(VDP, "default", name)]))


class QuotaApi(FakeApi):
    """Refuses every create for the resource `stuck`, as a quota forbidding LoadBalancers."""

    async def create(self, kind: Kind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        if (body["metadata"].get("labels") or {}).get(c.LABEL_INSTANCE) == "stuck":
            self.calls["refused"] += 1
            raise ApiException(status=403, reason="Forbidden: exceeded quota")
        return await super().create(kind, namespace, body)


async def test_a_resource_failing_its_first_reconcile_holds_no_other_status_back() -> None:
    bed = Bed(replace(CFG, workers=4), api=QuotaApi())
    bed.ctl.start()
    try:
        await bed.until("the caches filled", lambda: bed.ctl.synced)
        _add(bed, "stuck")
        await bed.until("a refused create", lambda: bed.api.calls["refused"] >= 1)
        names = ["demo", *(f"r{i}" for i in range(5))]
        for name in names:
            _add(bed, name)
        # Status waits up to 2 s per patch while a resource waits for its first try; six
        # patches on two writers would take 6 s if `stuck` counted as waiting for ever.
        took = await bed.until("six statuses", lambda: all(
            bed.api.objects[(VDP, "default", n)].get("status") for n in names), timeout=1.5)
        assert took < 1.5
        assert bed.ctl.failures >= 1, "the stuck resource kept failing meanwhile"
    finally:
        await bed.ctl.stop()


async def test_a_spec_edit_a_status_answer_brought_before_kopf_is_reconciled(bed: Bed) -> None:
    await bed.owner_with_cluster()
    await bed.ctl.status.idle()
    # A user suspends it; kopf's event for the edit is late.
    await bed.api.patch(VDP, "default", "demo", {"spec": {"suspend": True},
                                                 "metadata": {"generation": 2}})
    kopf_late = copy.deepcopy(bed.owner())
    # A child event makes a status change; the patch's answer carries the edit (generation 2).
    patches = bed.ctl.status.patches
    bed.cluster_ready()
    await bed.until("a status patch", lambda: bed.ctl.status.patches > patches)
    cached = bed.ctl.cache.peek(VDP, *KEY)
    assert cached is not None and cached["metadata"]["generation"] == 2
    await bed.settle()
    assert bed.status().get("phase") != c.PHASE_SUSPENDED
    bed.ctl.owner_event("MODIFIED", kopf_late)  # older than the cache's copy, yet news
    await bed.until("Suspended", lambda: bed.status().get("phase") == c.PHASE_SUSPENDED)


class StallingListApi(FakeApi):
    """Holds the answer to the next LIST of one kind until the test releases it, and the
    watch after it until the test lets it start (so nothing echoes before the test looks)."""

    def __init__(self) -> None:
        super().__init__()
        self.stall: Kind | None = None
        self.held: Kind | None = None
        self.stalled = asyncio.Event()
        self.release = asyncio.Event()
        self.watch_release = asyncio.Event()
        self.watch_release.set()

    async def list_page(self, kind: Kind, *args: Any, **kwargs: Any) -> dict[str, Any]:
        page = await super().list_page(kind, *args, **kwargs)
        if kind == self.stall:
            self.stall, self.held = None, kind
            self.stalled.set()
            self.watch_release.clear()
            await self.release.wait()  # what is written meanwhile is missing from this page
        return page

    async def watch(self, kind: Kind, *args: Any, **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        if kind == self.held:
            await self.watch_release.wait()
        async for event in super().watch(kind, *args, **kwargs):
            yield event


async def test_a_head_job_created_during_a_relist_is_not_made_twice() -> None:
    api = StallingListApi()
    bed = Bed(api=api)
    bed.ctl.start()
    try:
        bed.add_owner()
        await bed.until("the RayCluster", lambda: bed.names(RAYCLUSTER))
        await bed.settle()
        api.stall = RAYJOB
        api.compact()  # every watch answers 410: each reflector relists
        api.end_watches()
        await bed.until("the RayJob LIST taken", api.stalled.is_set)
        bed.cluster_ready()  # KubeRay; the reconcile makes the head job while the LIST hangs
        await bed.until("the head job", lambda: bed.names(RAYJOB) == ["demo-j00001"])
        await bed.settle()
        api.release.set()
        await bed.until("the relist done", lambda: bed.ctl.reflectors[1].lists == 2)
        await asyncio.sleep(0.05)
        await bed.settle()
        # Before the watch echoes the head job, the cache still holds it: nothing is made twice.
        assert bed.names(RAYJOB) == ["demo-j00001"], "no second head job"
        assert bed.ctl.cache.peek(RAYJOB, "default", "demo-j00001") is not None
        api.watch_release.set()
        await asyncio.sleep(0.05)
        await bed.settle()
        assert bed.names(RAYJOB) == ["demo-j00001"]
    finally:
        await bed.ctl.stop()


async def test_children_are_not_made_again_for_an_owner_deleted_unseen(bed: Bed) -> None:
    await bed.owner_with_cluster()
    await bed.ctl.status.idle()
    bed.kopf_event("MODIFIED")  # kopf relays the echo of our status patch: old news
    # Deleted during kopf's 410 gap: no DELETED event; the garbage collector takes the
    # children, and their DELETED events wake the stale owner.
    del bed.api.objects[(VDP, *KEY)]
    creates = bed.api.calls["create"]
    for kind in (RAYCLUSTER, SERVICE):
        for child in bed.names(kind):
            await bed.api.delete(kind, "default", child)
    await bed.until("the stale owner forgotten", lambda: bed.ctl.cache.peek(VDP, *KEY) is None)
    await bed.settle()
    assert bed.api.calls["create"] == creates, "no child made with a dead owner reference"
    assert bed.names(RAYCLUSTER) == [] and bed.names(SERVICE) == []


async def test_a_namesake_does_not_inherit_the_pending_status_of_the_deleted_one() -> None:
    bed = Bed(replace(CFG, backoff_base_seconds=3600.0, backoff_cap_seconds=3600.0))
    bed.ctl.start()
    try:
        bed.add_owner()
        await bed.until("the RayCluster", lambda: bed.names(RAYCLUSTER))
        bed.cluster_ready()
        await bed.until("the head job", lambda: bed.names(RAYJOB))
        await bed.settle()
        await asyncio.wait_for(bed.ctl.status.idle(), timeout=3)
        # Status waits from now on, as it does behind a burst's first reconciles.
        hold = asyncio.Event()
        bed.ctl.status._gate = hold.wait
        bed.api.set_status(RAYJOB, "default", "demo-j00001", {"jobStatus": "FAILED"})
        # (Its Event waits for the status it tells of, held here: the pending status shows it.)
        await bed.until("the failure concluded", lambda: any(
            s.get("consecutiveFailures") == 1 for _, s in bed.ctl.resource_states()))
        await bed.settle()
        # The user deletes it (kopf reports it) and creates it again under the same name.
        bed.kopf_event("DELETED")
        del bed.api.objects[(VDP, *KEY)]
        reconciles = bed.ctl.reconciles
        _add(bed, "demo", uid="uid-demo-2")
        await bed.until("the namesake reconciled", lambda: bed.ctl.reconciles > reconciles)
        await bed.settle()
        ((_, seen),) = bed.ctl.resource_states()
        assert not seen.get("consecutiveFailures"), seen
        hold.set()
        await bed.until("the namesake's status", lambda: bed.status().get("phase"))
        await asyncio.wait_for(bed.ctl.status.idle(), timeout=3)
        assert bed.owner()["metadata"]["uid"] == "uid-demo-2"
        assert not bed.status().get("consecutiveFailures"), bed.status()
        assert not bed.status().get("lastFailedJob"), bed.status()
    finally:
        await bed.ctl.stop()


class RecreatedAt404Api(FakeApi):
    """The first status patch answers 404, and the user recreates the resource right then."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.on_404: Any = None

    async def patch_status(
        self, kind: Kind, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        if self.armed:
            self.armed = False
            self.on_404()
            raise ApiException(status=404, reason="Not Found")
        return await super().patch_status(kind, namespace, name, status)


async def test_a_404_for_the_old_uid_does_not_forget_its_namesake() -> None:
    api = RecreatedAt404Api()
    bed = Bed(api=api)
    bed.ctl.start()
    try:
        bed.add_owner()
        await bed.until("the RayCluster", lambda: bed.names(RAYCLUSTER))
        await bed.settle()
        await asyncio.wait_for(bed.ctl.status.idle(), timeout=3)

        def recreate() -> None:  # deleted unseen; the namesake's ADDED beats the 404's answer
            del bed.api.objects[(VDP, *KEY)]
            _add(bed, "demo", uid="uid-demo-2")

        api.on_404, api.armed = recreate, True
        bed.cluster_ready()  # a status change for the old uid
        await bed.until("the 404", lambda: not api.armed)
        await asyncio.wait_for(bed.ctl.status.idle(), timeout=3)
        await bed.settle()
        cached = bed.ctl.cache.peek(VDP, *KEY)
        assert cached is not None and cached["metadata"]["uid"] == "uid-demo-2"
        await bed.until("the namesake's status", lambda: bed.status().get("phase"))
    finally:
        await bed.ctl.stop()


class InvalidStatusApi:
    """Refuses every status patch as invalid (422), as a schema the status breaks would."""

    def __init__(self) -> None:
        self.calls = 0

    async def patch_status(
        self, kind: Kind, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        self.calls += 1
        raise ApiException(status=422, reason="Unprocessable Entity")


async def test_a_status_patch_refused_with_422_is_said_once_and_not_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = InvalidStatusApi()
    cache = ObjectCache([VDP])
    cache.upsert(VDP, {"metadata": {"name": "demo", "namespace": "default", "uid": "u1",
                                    "resourceVersion": "1"}})  # fmt: skip
    writer = StatusWriter(api, cache, lambda key, uid: None, workers=1, retry_seconds=0.01)
    tasks = writer.start()
    try:
        with caplog.at_level(logging.WARNING):
            writer.submit(KEY, "u1", {"phase": "Nonsense"})
            await asyncio.wait_for(writer.idle(), timeout=1)
            await asyncio.sleep(0.2)  # twenty retry periods
        assert api.calls == 1 and writer.rejected == 1
        said = [r.getMessage() for r in caplog.records if "demo" in r.getMessage()]
        assert len(said) == 1 and "422" in said[0] and "Unprocessable" in said[0], said
        writer.submit(KEY, "u1", {"phase": "Provisioning"})  # a later change is sent anew
        await asyncio.wait_for(writer.idle(), timeout=1)
        assert api.calls == 2
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_report_gate_cancelled_as_it_opens_is_still_cancelled(bed: Bed) -> None:
    """stop() cancels the status writers and Event posters; one cancelled in the very turn
    its gate opens (Python 3.11's wait_for then returns as if nothing happened) must still
    end, or stop() waits on it for ever."""
    bed.ctl._no_new.clear()
    gate = asyncio.create_task(bed.ctl._quiet(5))
    await asyncio.sleep(0.01)
    bed.ctl._no_new.set()
    gate.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gate
