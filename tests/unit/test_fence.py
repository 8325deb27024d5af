"""A write that passed the gate, then waited for a connection while the Lease was lost, is not
sent: the fence checks the gate again once the connection is in hand. A real aiohttp server on
127.0.0.1 counts what reaches it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from local_http import serving
from vllm_dp_operator.controller.fence import fence_trace, fenced_session
from vllm_dp_operator.controller.gate import GatedApi
from vllm_dp_operator.controller.kube import SERVICE
from vllm_dp_operator.controller.lease import NotLeading


class Gate:
    """A write gate the test closes by hand (what a frozen leader's clock does on waking)."""

    def __init__(self) -> None:
        self.open = True

    def check(self) -> None:
        if not self.open:
            raise NotLeading("lost the Lease")


class Server:
    """A server whose GET /slow holds its connection until released; it counts POSTs."""

    def __init__(self) -> None:
        self.posts = 0
        self.slow_started = asyncio.Event()
        self.release = asyncio.Event()

    async def slow(self, _req: web.Request) -> web.Response:
        self.slow_started.set()
        await self.release.wait()
        return web.Response(text="slow")

    async def post(self, _req: web.Request) -> web.Response:
        self.posts += 1
        return web.json_response({"created": True}, status=201)


@pytest.fixture
async def server() -> AsyncIterator[tuple[Server, str]]:
    srv = Server()
    app = web.Application()
    app.router.add_get("/slow", srv.slow)
    app.router.add_post("/things", srv.post)
    async with serving(app) as port:
        yield srv, f"http://127.0.0.1:{port}"
        srv.release.set()


class HttpApi:
    """The inner API of GatedApi: create is a POST over one shared session."""

    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session, self.base = session, base

    async def create(self, _kind: Any, _namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(f"{self.base}/things", json=body) as resp:
            answer: dict[str, Any] = await resp.json()
            return answer


async def _write_while_waiting_for_the_connection(
    session: aiohttp.ClientSession, srv: Server, base: str
) -> BaseException | None:
    gate = Gate()
    api = GatedApi(HttpApi(session, base), gate)
    holder = asyncio.create_task(session.get(f"{base}/slow"))  # the pool's only connection
    await srv.slow_started.wait()
    write = asyncio.create_task(api.create(SERVICE, "ns", {"metadata": {"name": "x"}}))
    await asyncio.sleep(0.2)  # the write passed the gate and waits for the connection
    gate.open = False  # meanwhile the Lease is lost (or the process was frozen past it)
    srv.release.set()
    (await holder).release()
    try:
        await write
    except NotLeading as exc:
        return exc
    return None


async def test_a_write_that_waited_for_its_connection_is_checked_again(
    server: tuple[Server, str],
) -> None:
    srv, base = server
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector, trace_configs=[fence_trace()]) as s:
        refused = await _write_while_waiting_for_the_connection(s, srv, base)
    assert isinstance(refused, NotLeading)
    assert srv.posts == 0, "the write went out after the gate had closed"


async def test_reads_and_writes_with_an_open_gate_pass_the_fence(
    server: tuple[Server, str],
) -> None:
    srv, base = server
    async with aiohttp.ClientSession(trace_configs=[fence_trace()]) as s:
        api = GatedApi(HttpApi(s, base), Gate())
        assert await api.create(SERVICE, "ns", {"metadata": {"name": "x"}}) == {"created": True}
        srv.release.set()
        async with s.get(f"{base}/slow") as resp:  # not a gated write: never checked
            assert resp.status == 200
    assert srv.posts == 1


class ClosesAfter(Gate):
    """Open for the first `checks` checks, closed from then on: what a leader frozen between
    two of a write's checks finds when it wakes."""

    def __init__(self, checks: int) -> None:
        super().__init__()
        self.left = checks
        self.checks = 0

    def check(self) -> None:
        self.checks += 1
        self.open = self.left > 0
        self.left -= 1
        super().check()


async def test_a_write_frozen_after_its_connection_check_sends_no_byte(
    server: tuple[Server, str],
) -> None:
    # The call's check and the connection's pass; the leader freezes before the body task runs
    # (a loop turn later) and wakes without the Lease: the body write's check refuses it.
    srv, base = server
    async with fenced_session() as s:
        gate = ClosesAfter(2)
        with pytest.raises(NotLeading):
            await GatedApi(HttpApi(s, base), gate).create(SERVICE, "ns", {"metadata": {}})
        assert gate.checks == 3
        # The session goes on serving: a later write with the gate open goes out.
        assert await GatedApi(HttpApi(s, base), Gate()).create(SERVICE, "ns", {}) == {
            "created": True}
    assert srv.posts == 1, "the refused write reached the server"


async def test_without_the_body_check_that_write_went_out() -> None:
    # The gap the body check closes, shown on a session with the connection hooks alone.
    srv = Server()
    app = web.Application()
    app.router.add_post("/things", srv.post)
    async with serving(app) as port, aiohttp.ClientSession(trace_configs=[fence_trace()]) as s:
        gate = ClosesAfter(2)
        await GatedApi(HttpApi(s, f"http://127.0.0.1:{port}"), gate).create(SERVICE, "ns", {})
        assert gate.checks == 2
    assert srv.posts == 1
