"""The REST client's session reads no environment per request, and still goes through the
proxy the environment or the kubeconfig names for the API server: decided once, by
`resession`. Real aiohttp servers on 127.0.0.1 play the API server and an HTTP proxy, and
each counts what reaches it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from kubernetes_asyncio import client
from vllm_dp_operator.controller.kube import resession


class Hits:
    def __init__(self) -> None:
        self.paths: list[str] = []
        self.proxy_auth: list[str | None] = []

    async def any(self, req: web.Request) -> web.Response:
        self.paths.append(req.raw_path)
        self.proxy_auth.append(req.headers.get("Proxy-Authorization"))
        return web.json_response({"kind": "Status", "apiVersion": "v1", "code": 200})


async def _serve(hits: Hits) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hits.any)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def beds() -> AsyncIterator[tuple[Hits, str, Hits, str]]:
    api, proxy = Hits(), Hits()
    api_runner, api_url = await _serve(api)
    proxy_runner, proxy_url = await _serve(proxy)
    yield api, api_url, proxy, proxy_url
    await api_runner.cleanup()
    await proxy_runner.cleanup()


async def _get(host: str, proxy: str | None = None) -> client.ApiClient:
    cfg = client.Configuration(host=host)
    cfg.proxy = proxy
    api = client.ApiClient(cfg)
    resession(api)
    await api.call_api("/api/v1/namespaces", "GET", _preload_content=False)
    return api


async def test_the_session_reads_no_environment_per_request(
    beds: tuple[Hits, str, Hits, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    api_hits, api_url, proxy_hits, _ = beds
    for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY",
                "all_proxy", "NO_PROXY", "no_proxy"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    api = await _get(api_url)
    try:
        assert api.rest_client.pool_manager.trust_env is False
        assert api.rest_client.proxy is None
        assert api_hits.paths == ["/api/v1/namespaces"] and proxy_hits.paths == []
    finally:
        await api.close()


async def test_a_proxy_in_the_environment_is_still_used(
    beds: tuple[Hits, str, Hits, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    api_hits, api_url, proxy_hits, proxy_url = beds
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    user_proxy = proxy_url.replace("http://", "http://user:secret@")
    monkeypatch.setenv("HTTP_PROXY", user_proxy)
    monkeypatch.setenv("http_proxy", user_proxy)
    api = await _get(api_url)
    try:
        assert api_hits.paths == []
        assert proxy_hits.paths == [f"{api_url}/api/v1/namespaces"]  # the absolute form
        assert proxy_hits.proxy_auth == ["Basic dXNlcjpzZWNyZXQ="]  # user:secret
    finally:
        await api.close()


async def test_no_proxy_bypasses_it(
    beds: tuple[Hits, str, Hits, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    api_hits, api_url, proxy_hits, proxy_url = beds
    monkeypatch.setenv("HTTP_PROXY", proxy_url)
    monkeypatch.setenv("http_proxy", proxy_url)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    api = await _get(api_url)
    try:
        assert api_hits.paths == ["/api/v1/namespaces"] and proxy_hits.paths == []
    finally:
        await api.close()


async def test_the_kubeconfigs_proxy_wins_over_the_environment(
    beds: tuple[Hits, str, Hits, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    api_hits, api_url, proxy_hits, proxy_url = beds
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens: would fail
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    api = await _get(api_url, proxy=proxy_url)
    try:
        assert api_hits.paths == [] and proxy_hits.paths == [f"{api_url}/api/v1/namespaces"]
    finally:
        await api.close()
