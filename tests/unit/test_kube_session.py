"""The REST client's session reads no environment per request, and still goes through the
proxy the environment or the kubeconfig names for the API server: decided once, by
`resession`. Real aiohttp servers on 127.0.0.1 play the API server and an HTTP proxy, and
each counts what reaches it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from kubernetes_asyncio import client
from local_http import serving
from vllm_dp_operator.controller.kube import resession


class Hits:
    def __init__(self) -> None:
        self.paths: list[str] = []
        self.proxy_auth: list[str | None] = []

    async def any(self, req: web.Request) -> web.Response:
        self.paths.append(req.raw_path)
        self.proxy_auth.append(req.headers.get("Proxy-Authorization"))
        return web.json_response({"kind": "Status", "apiVersion": "v1", "code": 200})


def _app(hits: Hits) -> web.Application:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hits.any)
    return app


@pytest.fixture
async def beds() -> AsyncIterator[tuple[Hits, str, Hits, str]]:
    api, proxy = Hits(), Hits()
    async with serving(_app(api)) as api_port, serving(_app(proxy)) as proxy_port:
        yield api, f"http://127.0.0.1:{api_port}", proxy, f"http://127.0.0.1:{proxy_port}"


PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


def _env(mp: pytest.MonkeyPatch, http_proxy: str | None = None,
         no_proxy: str | None = None) -> None:  # fmt: skip
    """Only these proxy variables set, in both spellings (aiohttp reads either)."""
    for var in PROXY_VARS:
        for name in (var, var.lower()):
            mp.delenv(name, raising=False)
    for var, value in (("HTTP_PROXY", http_proxy), ("NO_PROXY", no_proxy)):
        if value is not None:
            mp.setenv(var, value)
            mp.setenv(var.lower(), value)


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
    _env(monkeypatch)
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
    _env(monkeypatch, http_proxy=proxy_url.replace("http://", "http://user:secret@"))
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
    _env(monkeypatch, http_proxy=proxy_url, no_proxy="127.0.0.1")
    api = await _get(api_url)
    try:
        assert api_hits.paths == ["/api/v1/namespaces"] and proxy_hits.paths == []
    finally:
        await api.close()


async def test_the_kubeconfigs_proxy_wins_over_the_environment(
    beds: tuple[Hits, str, Hits, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    api_hits, api_url, proxy_hits, proxy_url = beds
    _env(monkeypatch, http_proxy="http://127.0.0.1:9")  # nothing listens there: would fail
    api = await _get(api_url, proxy=proxy_url)
    try:
        assert api_hits.paths == [] and proxy_hits.paths == [f"{api_url}/api/v1/namespaces"]
    finally:
        await api.close()
