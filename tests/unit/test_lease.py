"""The Lease state machine, on a fake clock and a test double of the Lease API that keeps
resourceVersions and refuses a stale update with 409, as the API server does."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from vllm_dp_operator.controller.gate import GatedApi, GatedRayJobs
from vllm_dp_operator.controller.kube import SERVICE
from vllm_dp_operator.controller.lease import (
    Conflict,
    ElectionConfig,
    LeaderElector,
    NotLeading,
)
from vllm_dp_operator.engines.ray_dashboard import RayJobLookup, StopResult


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeLeases:
    """Test double of the Lease API: one store, resourceVersions, 409 on a stale update."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.rv = 0
        self.down = False
        self.writes = 0
        self.reads = 0

    def _bump(self, body: dict[str, Any]) -> dict[str, Any]:
        self.rv += 1
        self.writes += 1
        body = copy.deepcopy(body)
        body["metadata"]["resourceVersion"] = str(self.rv)
        self.lease = body
        return copy.deepcopy(body)

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        if self.down:
            raise OSError("connection refused")
        return copy.deepcopy(self.lease)

    async def create(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.down:
            raise OSError("connection refused")
        if self.lease is not None:
            raise Conflict("exists")
        return self._bump(body)

    async def replace(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.down:
            raise OSError("connection refused")
        assert self.lease is not None
        if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise Conflict("stale resourceVersion")
        return self._bump(body)

    @property
    def holder(self) -> str:
        assert self.lease is not None
        return str(self.lease["spec"]["holderIdentity"])


def elector(api: FakeLeases, clock: Clock, identity: str) -> LeaderElector:
    return LeaderElector(api, ElectionConfig("ops", "vdp", identity), clock=clock)


async def test_first_process_creates_the_lease_and_leads() -> None:
    api, clock = FakeLeases(), Clock()
    a = elector(api, clock, "a")
    assert not a.may_write()
    assert await a.try_acquire_or_renew()
    assert a.may_write() and api.holder == "a"
    spec = api.lease["spec"] if api.lease else {}
    assert spec["leaseDurationSeconds"] == 15 and spec["leaseTransitions"] == 0


async def test_renew_keeps_the_lease_and_a_standby_waits() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    assert await a.try_acquire_or_renew()
    for _ in range(20):  # 40 s of renewals every 2 s: b never gets it
        clock.advance(2)
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()
    assert a.may_write() and not b.may_write()
    assert api.holder == "a"


async def test_a_leader_renews_with_one_put_and_reads_nothing() -> None:
    api, clock = FakeLeases(), Clock()
    a = elector(api, clock, "a")
    assert await a.try_acquire_or_renew()
    reads, writes = api.reads, api.writes
    for _ in range(30):  # a minute of renewals
        clock.advance(2)
        assert await a.try_acquire_or_renew()
    assert (api.reads - reads, api.writes - writes) == (0, 30)
    spec = api.lease["spec"] if api.lease else {}
    assert spec["holderIdentity"] == "a" and spec["leaseTransitions"] == 0


async def test_a_renewal_whose_answer_was_lost_is_read_again_and_kept() -> None:
    api, clock = FakeLeases(), Clock()
    a = elector(api, clock, "a")
    assert await a.try_acquire_or_renew()
    real_replace = api.replace

    async def lands_unanswered(namespace: str, name: str, body: dict[str, Any]) -> Any:
        await real_replace(namespace, name, body)
        raise TimeoutError("the answer never came")

    api.replace = lands_unanswered  # type: ignore[method-assign]
    clock.advance(2)
    await a.try_acquire_or_renew()  # landed, but a does not know it
    api.replace = real_replace  # type: ignore[method-assign]
    clock.advance(2)
    reads = api.reads
    # The blind PUT meets a newer resourceVersion (409): the same attempt reads and renews.
    assert await a.try_acquire_or_renew()
    assert api.reads == reads + 1 and api.holder == "a" and a.may_write()
    clock.advance(2)
    assert await a.try_acquire_or_renew() and api.reads == reads + 1  # blind again


async def test_a_takeover_seen_by_a_blind_renewal_closes_the_gate() -> None:
    api, clock = FakeLeases(), Clock()
    a = elector(api, clock, "a")
    assert await a.try_acquire_or_renew()
    assert api.lease is not None
    taken = copy.deepcopy(api.lease)
    taken["spec"]["holderIdentity"] = "b"
    api._bump(taken)  # written by another process (say, after a's lease expired by its clock)
    clock.advance(2)
    assert not await a.try_acquire_or_renew()
    assert not a.leading and not a.may_write() and a.holder == "b" and api.holder == "b"


async def test_expiry_is_measured_from_when_the_standby_saw_the_record_change() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    assert await a.try_acquire_or_renew()
    clock.advance(100)  # a is gone; its renewTime is long past by the record's own stamps
    # b sees the record for the first time now: it trusts its own clock, not renewTime.
    assert not await b.try_acquire_or_renew()
    clock.advance(14.9)
    assert not await b.try_acquire_or_renew()
    clock.advance(0.1)
    assert await b.try_acquire_or_renew()
    assert api.holder == "b" and b.may_write()
    assert api.lease is not None and api.lease["spec"]["leaseTransitions"] == 1


async def test_a_record_that_keeps_changing_is_never_taken() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    for _ in range(10):
        clock.advance(10)  # a renews only every 10 s: never 15 s without a change
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()


async def test_the_gate_closes_at_the_renew_deadline_before_the_lease_expires() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    api.down = True  # a cannot renew
    clock.advance(9.9)
    assert not await a.try_acquire_or_renew() or a.may_write()
    assert a.may_write()
    clock.advance(0.1)
    assert not a.may_write()
    with pytest.raises(NotLeading):
        a.check()
    # The standby may take over only 5 s later: no moment when both may write.
    api.down = False
    clock.advance(4.9)
    assert not await b.try_acquire_or_renew()
    clock.advance(0.1)
    assert await b.try_acquire_or_renew()


async def test_the_gate_counts_from_when_the_renewal_was_sent() -> None:
    api, clock = FakeLeases(), Clock()
    a = elector(api, clock, "a")
    real_replace = api.replace
    assert await a.try_acquire_or_renew()

    async def slow_replace(namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        clock.advance(9)  # the answer comes 9 s after the request left
        return await real_replace(namespace, name, body)

    api.replace = slow_replace  # type: ignore[method-assign]
    clock.advance(2)
    assert await a.try_acquire_or_renew()
    clock.advance(1.5)  # 10.5 s since the renewal was sent, 1.5 s since its answer
    assert not a.may_write()


async def test_losing_the_lease_to_another_holder_closes_the_gate_at_once() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    assert await a.try_acquire_or_renew()
    # a froze: b took over after the lease expired by b's clock.
    assert not await b.try_acquire_or_renew()
    clock.advance(16)
    assert await b.try_acquire_or_renew()
    assert not a.may_write()  # past its own renew deadline already
    assert not await a.try_acquire_or_renew()
    assert not a.leading and api.holder == "b"


async def test_a_lost_race_is_a_conflict_not_a_takeover() -> None:
    api, clock = FakeLeases(), Clock()
    a, b, c = (elector(api, clock, n) for n in "abc")
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew() and not await c.try_acquire_or_renew()
    clock.advance(15)
    real_replace = api.replace

    async def c_first(namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        api.replace = real_replace  # type: ignore[method-assign]
        assert await c.try_acquire_or_renew()  # c's update lands between b's read and write
        return await real_replace(namespace, name, body)

    api.replace = c_first  # type: ignore[method-assign]
    assert not await b.try_acquire_or_renew()
    assert api.holder == "c" and c.may_write() and not b.may_write()


async def test_release_hands_over_at_once() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    await a.release()
    assert not a.may_write() and api.holder == ""
    assert await b.try_acquire_or_renew()  # no wait for the lease to expire
    assert api.holder == "b"


async def test_healthy_means_the_lease_api_answers() -> None:
    api, clock = FakeLeases(), Clock()
    a, b = elector(api, clock, "a"), elector(api, clock, "b")
    assert not b.healthy()[0]  # nothing asked yet
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    ok, why = b.healthy()
    assert ok and "standby (leader: a)" in why  # a standby that can ask is ready
    api.down = True
    assert not await b.try_acquire_or_renew()
    clock.advance(15.1)
    ok, why = b.healthy()
    assert not ok and "connection refused" in why


def test_timings_must_leave_room_between_renewal_and_expiry() -> None:
    with pytest.raises(ValueError, match="renew deadline < lease duration"):
        LeaderElector(FakeLeases(), ElectionConfig("ops", "vdp", "a", lease_duration=10,
                                                   renew_deadline=10))  # fmt: skip


async def test_run_renews_and_reports_a_loss() -> None:
    api = FakeLeases()
    cfg = ElectionConfig("ops", "vdp", "a", lease_duration=0.6, renew_deadline=0.4,
                         retry_period=0.05)  # fmt: skip
    a = LeaderElector(api, cfg)
    started, stopped = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(a.run(started.set, stopped.set))
    await asyncio.wait_for(started.wait(), 2)
    before = api.writes
    await asyncio.sleep(0.3)
    assert api.writes > before and a.may_write()  # renewing
    api.down = True
    await asyncio.wait_for(stopped.wait(), 2)
    assert not a.may_write()
    await task


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def get(self, *args: Any) -> None:
        self.calls.append("get")

    async def create(self, *args: Any) -> dict[str, Any]:
        self.calls.append("create")
        return {}

    async def patch(self, *args: Any) -> dict[str, Any]:
        self.calls.append("patch")
        return {}

    async def delete(self, *args: Any) -> None:
        self.calls.append("delete")

    async def patch_status(self, *args: Any) -> dict[str, Any]:
        self.calls.append("patch_status")
        return {}

    async def lookup(self, *args: Any) -> RayJobLookup:
        self.calls.append("lookup")
        return RayJobLookup("RUNNING", "")

    async def stop(self, *args: Any) -> StopResult:
        self.calls.append("stop")
        return StopResult(True, "")


async def test_the_gate_refuses_every_write_and_no_read_after_the_renew_deadline() -> None:
    api, clock = FakeLeases(), Clock()
    a = elector(api, clock, "a")
    assert await a.try_acquire_or_renew()
    inner = _Recorder()
    gated, jobs = GatedApi(inner, a), GatedRayJobs(inner, a)
    await gated.create(SERVICE, "ns", {})
    await jobs.stop("ns", "c", "j", None)
    clock.advance(10)
    await gated.get(SERVICE, "ns", "x")
    await jobs.lookup("ns", "c", "j", None)
    for write in (gated.create(SERVICE, "ns", {}), gated.patch(SERVICE, "ns", "x", {}),
                  gated.delete(SERVICE, "ns", "x"), gated.patch_status(SERVICE, "ns", "x", {}),
                  jobs.stop("ns", "c", "j", None)):  # fmt: skip
        with pytest.raises(NotLeading):
            await write
    assert inner.calls == ["create", "stop", "get", "lookup"]


async def test_a_renewal_that_conflicts_is_read_again_not_a_loss() -> None:
    api, clock = FakeLeases(), Clock()
    a = elector(api, clock, "a")
    assert await a.try_acquire_or_renew()
    real_replace = api.replace

    async def landed_late(namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        api.replace = real_replace  # type: ignore[method-assign]
        await real_replace(namespace, name, copy.deepcopy(body))  # an earlier renewal lands
        return await real_replace(namespace, name, body)  # so this one is stale: 409

    api.replace = landed_late  # type: ignore[method-assign]
    clock.advance(2)
    assert await a.try_acquire_or_renew()  # the gate's clock still allows writes
    clock.advance(2)
    assert await a.try_acquire_or_renew() and api.holder == "a"
    clock.advance(9.9)
    assert a.may_write()
