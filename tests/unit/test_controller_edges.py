"""The controller at its edges: failures that repeat, a relist, a resource deleted and created
again, a write answer ahead of kopf's event. Real reflectors, queue and workers over the
FakeApi double, as in test_controller.py.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fake_api import FakeApi
from kubernetes_asyncio.client.exceptions import ApiException
from test_controller import CFG, SPEC, Bed
from vllm_dp_operator import constants as c
from vllm_dp_operator.controller.kube import RAYCLUSTER, RAYJOB, VDP, Kind


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


