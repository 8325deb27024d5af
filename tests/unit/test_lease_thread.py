"""Renewals on the election's own thread: a busy controller loop never costs the Lease.

Short timings (lease 0.6 s, renew deadline 0.4 s, retry 0.05 s) on the real clock; the
controller's loop is blocked by a CPU-bound computation that holds it for twice the renew
deadline, as a burst of reconciles and LIST parsing did at 10,000 resources.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any

from aiohttp import web
from kubernetes_asyncio import client
from local_http import serving
from test_lease import FakeLeases
from vllm_dp_operator.controller.lease import ApiLeases, ElectionConfig, LeaderElector
from vllm_dp_operator.controller.lease_thread import ElectionThread

CFG = ElectionConfig("ops", "vdp", "a", lease_duration=0.6, renew_deadline=0.4,
                     retry_period=0.05)  # fmt: skip
BLOCK = 2 * CFG.renew_deadline
#: Over HTTP, a request and its server share the two cores with whatever else runs: a renew
#: deadline of seconds, not tenths, so the test judges the thread and not the machine's load.
HTTP_CFG = ElectionConfig("ops", "vdp", "a", lease_duration=3.0, renew_deadline=2.0,
                          retry_period=0.1)  # fmt: skip


class TimedLeases(FakeLeases):
    """The Lease API double, noting when each renewal was written (monotonic)."""

    def __init__(self) -> None:
        super().__init__()
        self.written_at: list[float] = []
        self.hang = False

    def _bump(self, body: dict[str, Any]) -> dict[str, Any]:
        self.written_at.append(time.monotonic())
        return super()._bump(body)

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        if self.hang:
            await asyncio.Event().wait()  # a request that never answers
        return await super().get(namespace, name)

    async def replace(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.hang:
            await asyncio.Event().wait()  # a leader's renewal is a PUT alone
        return await super().replace(namespace, name, body)


def _busy(seconds: float) -> None:
    """Hold the calling thread's loop with CPU work, never yielding to it."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


def _largest_gap(times: list[float], start: float, end: float) -> float:
    inside = [start, *(t for t in times if start <= t <= end), end]
    return max(b - a for a, b in itertools.pairwise(inside))


async def _leading(elector: LeaderElector, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not elector.may_write():
        assert time.monotonic() < deadline, "never led"
        await asyncio.sleep(0.01)


async def test_on_the_controller_loop_a_busy_loop_loses_the_lease() -> None:
    """Why the thread: the same elector as a task of a loop held for 0.8 s stops leading."""
    api = TimedLeases()
    elector = LeaderElector(api, CFG)
    stopped = asyncio.Event()
    task = asyncio.create_task(elector.run(lambda: None, stopped.set))
    await _leading(elector)
    _busy(BLOCK)
    await asyncio.wait_for(stopped.wait(), 1)
    assert not elector.may_write()
    await task


async def test_on_its_own_thread_a_busy_loop_keeps_the_lease() -> None:
    api = TimedLeases()
    elector = LeaderElector(api, CFG)
    started, stopped = asyncio.Event(), threading.Event()
    election = ElectionThread(elector)
    election.start(started.set, stopped.set)
    try:
        await asyncio.wait_for(started.wait(), 2)  # on_started ran on this loop
        assert threading.current_thread() is threading.main_thread()
        begin = time.monotonic()
        gate_open_throughout = True
        end = begin + BLOCK
        while time.monotonic() < end:  # the controller's loop, held: it checks only the gate
            _busy(0.05)
            gate_open_throughout &= elector.may_write()
        assert not stopped.is_set(), "the Lease was lost while the controller's loop was busy"
        assert gate_open_throughout
        gap = _largest_gap(api.written_at, begin, end)
        # Renewed meanwhile: never a renew deadline without one (every retry period, when
        # the machine's cores are not busy elsewhere).
        assert gap < CFG.renew_deadline, f"{gap:.3f} s without a renewal"
    finally:
        await election.stop(release=True)
    assert not elector.may_write() and api.holder == ""  # released on stop


async def test_on_its_own_thread_the_gate_closes_at_the_renew_deadline_when_renewals_fail(
) -> None:  # fmt: skip
    api = TimedLeases()
    elector = LeaderElector(api, CFG)
    started, stopped = asyncio.Event(), threading.Event()
    election = ElectionThread(elector)
    election.start(started.set, stopped.set)
    try:
        await asyncio.wait_for(started.wait(), 2)
        api.hang = True  # every renewal from now on hangs
        await asyncio.sleep(0.02)  # one already past its request's start lands meanwhile
        last = api.written_at[-1]
        give_up = time.monotonic() + 10 * CFG.renew_deadline
        while elector.may_write():
            assert time.monotonic() < give_up, f"the gate never closed: {elector.healthy()}"
            await asyncio.sleep(0.005)
        closed = time.monotonic()
        # Closed by the clock, counted from when the last good renewal was sent (just before
        # its write), and no later than the deadline plus a scheduling slice.
        assert last - CFG.retry_period < closed - CFG.renew_deadline <= last + 0.05
        assert await asyncio.to_thread(stopped.wait, 2), "the loss was never reported"
        assert not elector.may_write()
    finally:
        await election.stop(release=False)


class LeaseServer:
    """A Lease API over real HTTP on 127.0.0.1, on a thread and loop of its own (so a blocked
    test loop does not stop it): one Lease, resourceVersions, the User-Agent of each call."""

    PATH = "/apis/coordination.k8s.io/v1/namespaces/ops/leases"

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.rv = 0
        self.agents: list[str] = []
        self.puts: list[float] = []
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._up = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    def _store(self, body: dict[str, Any]) -> web.Response:
        self.rv += 1
        body["metadata"]["resourceVersion"] = str(self.rv)
        self.lease = body
        return web.json_response(body)

    async def _handle(self, req: web.Request) -> web.Response:
        self.agents.append(req.headers.get("User-Agent", ""))
        if req.method == "GET" and self.lease is None:
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        if req.method == "GET":
            return web.json_response(self.lease)
        body = await req.json()
        if req.method == "POST":
            return self._store(body)
        assert self.lease is not None
        if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            return web.json_response({"kind": "Status", "code": 409}, status=409)
        self.puts.append(time.monotonic())
        return self._store(body)

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_route("*", self.PATH, self._handle)
        app.router.add_route("*", self.PATH + "/vdp", self._handle)
        async with serving(app) as self.port:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._up.set()
            await self._stop.wait()

    def __enter__(self) -> LeaseServer:
        self._thread.start()
        self._up.wait(5)
        return self

    def __exit__(self, *_: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)


async def test_over_http_its_own_client_renews_while_the_controller_loop_is_busy() -> None:
    previous = client.Configuration.get_default_copy()
    with LeaseServer() as server:
        conf = client.Configuration(host=f"http://127.0.0.1:{server.port}")
        client.Configuration.set_default(conf)  # what the operator's kubeconfig load does
        leases = ApiLeases(user_agent="vllm-dp-operator/test a_123")
        elector = LeaderElector(leases, HTTP_CFG)
        started = asyncio.Event()
        election = ElectionThread(elector, close=leases.close)
        try:
            election.start(started.set, lambda: None)
            await asyncio.wait_for(started.wait(), 5)
            begin = time.monotonic()
            _busy(2 * HTTP_CFG.renew_deadline)
            gap = _largest_gap(server.puts, begin, time.monotonic())
            assert elector.may_write() and gap < HTTP_CFG.renew_deadline, f"{gap:.3f} s"
        finally:
            await election.stop(release=True)
            client.Configuration.set_default(previous)
    assert server.lease is not None and server.lease["spec"]["holderIdentity"] == ""  # released
    assert set(server.agents) == {"vllm-dp-operator/test a_123"}
