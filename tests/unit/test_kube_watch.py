"""A watch's connection: quiet is not dead. A real aiohttp server on 127.0.0.1 plays the API
server's watch; the client waits out the watch's own timeout (the watch cache sends no
bookmark while its kind does not change, so a shorter silence cut-off renewed every quiet
watch, a request at rest each time), and asks TCP keepalive to find a half-open connection."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from kubernetes_asyncio import client
from local_http import serving
from vllm_dp_operator.controller import kube
from vllm_dp_operator.controller.kube import CRD, SERVICE, ApiKube


class WatchServer:
    """Streams two events, then stays open until told to end, recording each query."""

    def __init__(self) -> None:
        self.queries: list[dict[str, str]] = []
        self.end = asyncio.Event()

    async def watch(self, req: web.Request) -> web.StreamResponse:
        self.queries.append(dict(req.query))
        resp = web.StreamResponse()
        await resp.prepare(req)
        for n in (1, 2):
            event = {"type": "ADDED", "object": {"metadata": {"name": f"s{n}",
                                                              "resourceVersion": str(n)}}}
            await resp.write(json.dumps(event).encode() + b"\n")
        await self.end.wait()
        await resp.write_eof()
        return resp


@pytest.fixture
async def served() -> AsyncIterator[tuple[WatchServer, ApiKube]]:
    server = WatchServer()
    app = web.Application()
    app.router.add_get("/{tail:.*}", server.watch)
    async with serving(app) as port:
        api = ApiKube(client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}")))
        yield server, api
        server.end.set()
        await api.close()


async def test_a_quiet_watch_waits_out_its_own_timeout_with_keepalive_on(
    served: tuple[WatchServer, ApiKube], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, api = served
    timeouts: list[Any] = []
    call_api = api.api.call_api

    async def recording(*args: Any, **kwargs: Any) -> Any:
        timeouts.append(kwargs.get("_request_timeout"))
        return await call_api(*args, **kwargs)

    monkeypatch.setattr(api.api, "call_api", recording)
    transports: list[asyncio.BaseTransport] = []
    original = kube.keep_alive
    monkeypatch.setattr(kube, "keep_alive", lambda t: (transports.append(t), original(t)))
    stream = api.watch(CRD, None, "", "7", 450, fields="metadata.name=workloads.kueue.x-k8s.io")
    names = [(await anext(stream))["object"]["metadata"]["name"] for _ in range(2)]
    assert names == ["s1", "s2"]
    # The read waits for the server's own end of the watch, not a 130 s silence.
    assert timeouts[0].sock_read == 450 + 60
    assert server.queries[0]["timeoutSeconds"] == "450"
    assert server.queries[0]["fieldSelector"] == "metadata.name=workloads.kueue.x-k8s.io"
    sock = transports[0].get_extra_info("socket")
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == kube.KEEPALIVE_IDLE
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == kube.KEEPALIVE_COUNT
    server.end.set()
    assert [e async for e in stream] == []  # the server's end ends the stream, no error


async def test_a_label_selected_watch_sends_no_field_selector(
    served: tuple[WatchServer, ApiKube],
) -> None:
    server, api = served
    stream = api.watch(SERVICE, "ns1", "app=x", "3", 300)
    assert (await anext(stream))["type"] == "ADDED"
    assert "fieldSelector" not in server.queries[0]
    assert server.queries[0]["labelSelector"] == "app=x"
    server.end.set()
    assert len([e async for e in stream]) == 1
