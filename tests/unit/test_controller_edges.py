"""The controller at its edges: failures that repeat, a relist, a resource deleted and created
again, a write answer ahead of kopf's event. Real reflectors, queue and workers over the
FakeApi double, as in test_controller.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fake_api import FakeApi
from test_controller import Bed
from vllm_dp_operator.controller.kube import RAYCLUSTER, RAYJOB, Kind


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


