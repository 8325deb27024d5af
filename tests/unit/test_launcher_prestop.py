"""A Ray pod's preStop hook (vllm_dp_launcher.prestop) against the launcher's real drain gate:
it drains the head and holds the pod's stop until no client request came for a while."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from vllm_dp_launcher import prestop
from vllm_dp_launcher.drain_gate import DrainGate

TOKEN = "tok-123"


async def _inner(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
async def gate(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """The real DrainGate served over HTTP (a minimal ASGI bridge on aiohttp)."""
    flag = tmp_path / "draining"
    app_gate = DrainGate(_inner, token=TOKEN, flag=str(flag))
    seen: list[str | None] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.headers.get("x-ray-authorization"))
        scope = {"type": "http", "method": request.method, "path": request.path,
                 "headers": [(k.lower().encode(), v.encode()) for k, v in request.headers.items()]}
        out: dict[str, Any] = {"body": b""}

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                out["status"] = message["status"]
            else:
                out["body"] += message.get("body", b"")

        await app_gate(scope, receive, send)
        return web.Response(status=out["status"], body=out["body"])

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield {"port": port, "flag": flag, "seen": seen}
    finally:
        await runner.cleanup()


def _backdate(flag: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(flag, (then, then))


async def test_it_drains_the_head_and_returns_once_no_client_request_came(
        gate: dict[str, Any]) -> None:  # fmt: skip
    naps: list[float] = []

    def sleep(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 2:  # the clients have gone: the last request was 10 s ago
            _backdate(gate["flag"], 10)

    why = await asyncio.to_thread(prestop.wait_quiet, "127.0.0.1", gate["port"], TOKEN, 20,
                                  time.monotonic, sleep)  # fmt: skip
    assert why == "quiet" and naps == [prestop.POLL_SECONDS] * 2
    assert gate["flag"].exists()  # the head is draining: its answers close connections
    assert gate["seen"] == [f"Bearer {TOKEN}"] * 3


async def test_a_deadline_bounds_the_wait_while_clients_keep_coming(
        gate: dict[str, Any]) -> None:  # fmt: skip
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += 5
        gate["flag"].touch()  # a client request, each time

    why = await asyncio.to_thread(prestop.wait_quiet, "127.0.0.1", gate["port"], TOKEN, 20,
                                  lambda: now[0], sleep)  # fmt: skip
    assert why == "deadline" and now[0] == 20


async def test_a_refused_call_waits_for_the_endpoints_removal_only(
        gate: dict[str, Any]) -> None:  # fmt: skip
    naps: list[float] = []
    why = await asyncio.to_thread(prestop.wait_quiet, "127.0.0.1", gate["port"], "wrong", 20,
                                  time.monotonic, naps.append)  # fmt: skip
    assert why == "no-gate" and naps == [prestop.GRACE_SECONDS]
    assert not gate["flag"].exists()


def test_nothing_serving_returns_at_once() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    naps: list[float] = []
    assert prestop.wait_quiet("127.0.0.1", port, TOKEN, 20, time.monotonic,
                              naps.append) == "nothing-serving"  # fmt: skip
    assert naps == []


def test_a_worker_without_its_heads_address_returns_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.delenv("FQ_RAY_IP", raising=False)
    assert prestop.main(["--port", "8000", "--worker"]) == 0
