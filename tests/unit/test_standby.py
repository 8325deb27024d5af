"""A standby: its caches fill and stay warm, but it reconciles nothing and writes nothing
until it leads; then every cached resource is reconciled. A failover posts each Event once:
an Event goes out only after the status it tells of is written (real reflectors, queue and
workers over the FakeApi double)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

from fake_api import FakeApi
from vllm_dp_operator import constants as c
from vllm_dp_operator.config import Config
from vllm_dp_operator.controller.kube import RAYCLUSTER, VDP, Kind
from vllm_dp_operator.controller.manager import Controller
from vllm_dp_operator.engines.probe import EngineReading, ProbeResult
from vllm_dp_operator.reconcile.outcome import Event
from world import FakeRayJobs

HOUR = 3600.0
CFG = Config(resync_seconds=HOUR, probe_launching_seconds=HOUR, probe_serving_seconds=HOUR,
             workers=4)  # fmt: skip
SPEC = {"model": "m", "dataParallel": {"size": 4, "ranksPerNode": 2}}


class _Probe:
    """Test double for the health probe: never healthy."""

    async def check(self, namespace: str, service: str, port: int) -> ProbeResult:
        return ProbeResult(False, "double")

    async def engines(self, namespace: str, service: str, port: int,
                      ranks: int = 0) -> EngineReading:
        return EngineReading({}, "double")


async def _until(what: str, check: Callable[[], Any], timeout: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not check():
        if loop.time() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout}s")
        await asyncio.sleep(0.005)


async def test_a_standby_keeps_warm_and_writes_nothing_until_it_leads() -> None:
    api = FakeApi()
    ctl = Controller(api, CFG, _Probe(), FakeRayJobs(), post_event=lambda _t, _e: None,
                     leading=False)  # fmt: skip
    ctl.start()
    try:
        for name in ("a", "b"):
            api.put(VDP, {"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND,
                          "metadata": {"name": name, "generation": 1}, "spec": SPEC})
            ctl.owner_event("ADDED", copy.deepcopy(api.objects[(VDP, "default", name)]))
        await _until("the caches synced", lambda: ctl.synced)
        assert ctl.ready() == (True, "synced; every watched kind is served")
        await asyncio.sleep(0.2)
        assert ctl.reconciles == 0 and api.calls["create"] == 0
        assert not api.named(RAYCLUSTER)

        ctl.lead()
        await _until("both resources reconciled", lambda: len(api.named(RAYCLUSTER)) == 2)
        assert ctl.wakes["leader"] == 2
    finally:
        await ctl.stop()


class _HeldStatusApi(FakeApi):
    """Holds every status patch until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def patch_status(
        self, kind: Kind, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        await self.gate.wait()
        return await super().patch_status(kind, namespace, name, status)


async def test_a_leader_killed_before_its_status_landed_leaves_no_duplicate_event() -> None:
    api = _HeldStatusApi()
    posted: list[Event] = []
    api.put(VDP, {"apiVersion": f"{c.GROUP}/{c.VERSION}", "kind": c.KIND,
                  "metadata": {"name": "a", "generation": 1}, "spec": SPEC})  # fmt: skip
    first = Controller(api, CFG, _Probe(), FakeRayJobs(),
                       post_event=lambda _t, e: posted.append(e))  # fmt: skip
    first.start()
    first.owner_event("ADDED", copy.deepcopy(api.objects[(VDP, "default", "a")]))
    await _until("the RayCluster", lambda: api.named(RAYCLUSTER))
    await _until("a status pending", lambda: first.status.effective(
        ("default", "a"), api.objects[(VDP, "default", "a")]["metadata"].get("uid") or "", {}))
    await first.stop()  # killed: its status patch never landed
    assert not posted, "an Event went out for a status that was never written"

    api.gate.set()
    second = Controller(api, CFG, _Probe(), FakeRayJobs(),
                        post_event=lambda _t, e: posted.append(e))  # fmt: skip
    second.start()
    try:
        second.owner_event(None, copy.deepcopy(api.objects[(VDP, "default", "a")]))
        await _until("the status written", lambda: (api.objects[(VDP, "default", "a")]
                                                    .get("status") or {}).get("phase"))
        await _until("the phase Event", lambda: any(
            e.reason == c.REASON_PHASE_CHANGED for e in posted))  # fmt: skip
        await asyncio.sleep(0.1)
        reasons = [(e.reason, e.message) for e in posted]
        assert len(reasons) == len(set(reasons)), reasons
    finally:
        await second.stop()
