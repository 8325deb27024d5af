"""The service-dns transport asks the resolver for an absolute name, in the configured domain.

With the pod default `ndots:5`, `<svc>.<ns>.svc` (two dots) is first tried under every search
domain, each a failed lookup; `<svc>.<ns>.svc.<domain>.` is looked up once, as it is. A
resolver double records what aiohttp asks for and points it at a local HTTP server.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult
from vllm_dp_operator.config import Config
from vllm_dp_operator.engines.transport import ServiceDnsTransport


class RecordingResolver(AbstractResolver):
    """Test double for cluster DNS: every name is 127.0.0.1; the names asked are kept."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        self.asked.append(host)
        return [{"hostname": host, "host": "127.0.0.1", "port": port, "family": socket.AF_INET,
                 "proto": 0, "flags": socket.AI_NUMERICHOST}]  # fmt: skip

    async def close(self) -> None:
        """Nothing to release."""


@pytest.fixture
async def server() -> AsyncIterator[dict[str, Any]]:
    seen: dict[str, Any] = {"hosts": []}

    async def health(request: web.Request) -> web.Response:
        seen["hosts"].append(request.host)
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    seen["port"] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield seen
    await runner.cleanup()


@pytest.mark.parametrize(("domain", "fqdn"), [
    ("cluster.local", "demo-head-svc.ns1.svc.cluster.local."),
    ("corp.example", "demo-head-svc.ns1.svc.corp.example."),
])  # fmt: skip
async def test_the_probe_looks_up_the_absolute_name_once(
    server: dict[str, Any], domain: str, fqdn: str
) -> None:
    resolver = RecordingResolver()
    transport = ServiceDnsTransport(2, domain, resolver=resolver)
    try:
        answer = await transport.request("GET", "ns1", "demo-head-svc", server["port"], "/health")
    finally:
        await transport.close()
    assert answer.ok, answer.detail
    assert resolver.asked == [fqdn]
    assert f"http://{fqdn}:{server['port']}/health" in answer.detail
    # The server sees the name it was called by (aiohttp may drop the root's dot there).
    assert server["hosts"][0].split(":")[0].rstrip(".") == fqdn.rstrip(".")


def test_cluster_domain_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLMDP_CLUSTER_DOMAIN", raising=False)
    assert Config.from_env().cluster_domain == "cluster.local" == Config().cluster_domain
    monkeypatch.setenv("VLLMDP_CLUSTER_DOMAIN", "corp.example.")
    assert Config.from_env().cluster_domain == "corp.example"


@pytest.mark.parametrize("bad", ["Cluster.Local", "-x.local", "a..b", "has space", "a_b.local"])
def test_a_bad_cluster_domain_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv("VLLMDP_CLUSTER_DOMAIN", bad)
    with pytest.raises(ValueError, match=r"VLLMDP_CLUSTER_DOMAIN=.*expected a DNS name"):
        Config.from_env()
