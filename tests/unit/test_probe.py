"""Health probes: the API-server proxy probe against a local HTTP stand-in for the API server.

The stand-in (a test double) serves only the proxy path the probe must use; a wrong path,
a 503 from vLLM, or a dead server must each read as not healthy.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from kubernetes_asyncio import client
from vllm_dp_operator.probe import ApiServerProxyProbe, DisabledProbe, make_probe

PATH = "/api/v1/namespaces/ns1/services/demo-api:8000/proxy/health"


@pytest.fixture
async def apiserver() -> AsyncIterator[dict[str, object]]:
    state: dict[str, object] = {"status": 200, "hits": 0}

    async def health(request: web.Request) -> web.Response:
        state["hits"] = int(state["hits"]) + 1  # type: ignore[call-overload]
        return web.Response(status=int(state["status"]), text="")  # type: ignore[call-overload]

    app = web.Application()
    app.router.add_get(PATH, health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    state["url"] = f"http://127.0.0.1:{port}"
    yield state
    await runner.cleanup()


def _api(url: str) -> client.ApiClient:
    conf = client.Configuration(host=url)
    return client.ApiClient(configuration=conf)


async def test_proxy_probe_healthy_on_200(apiserver: dict[str, object]) -> None:
    async with _api(str(apiserver["url"])) as api:
        result = await ApiServerProxyProbe(api, 2).check("ns1", "demo-api", 8000)
    assert result.ok and apiserver["hits"] == 1


async def test_proxy_probe_not_healthy_on_503(apiserver: dict[str, object]) -> None:
    apiserver["status"] = 503
    async with _api(str(apiserver["url"])) as api:
        result = await ApiServerProxyProbe(api, 2).check("ns1", "demo-api", 8000)
    assert not result.ok and "503" in result.detail


async def test_proxy_probe_uses_the_service_proxy_path(apiserver: dict[str, object]) -> None:
    async with _api(str(apiserver["url"])) as api:
        result = await ApiServerProxyProbe(api, 2).check("ns1", "other", 8000)
    assert not result.ok and apiserver["hits"] == 0


async def test_proxy_probe_not_healthy_when_unreachable() -> None:
    async with _api("http://127.0.0.1:9") as api:
        result = await ApiServerProxyProbe(api, 1).check("ns1", "demo-api", 8000)
    assert not result.ok


async def test_make_probe_modes() -> None:
    async with _api("http://127.0.0.1:9") as api:
        assert isinstance(make_probe("apiserver-proxy", api, 1), ApiServerProxyProbe)
        assert isinstance(make_probe("off", api, 1), DisabledProbe)
        assert not (await make_probe("off", api, 1).check("a", "b", 1)).ok
        with pytest.raises(ValueError, match="VLLMDP_HEALTH_PROBE"):
            make_probe("bogus", api, 1)
