"""The service-dns transport asks the resolver for an absolute name, in the configured domain.

With the pod default `ndots:5`, `<svc>.<ns>.svc` (two dots) is first tried under every search
domain, each a failed lookup; `<svc>.<ns>.svc.<domain>.` is looked up once, as it is. A
resolver double records what aiohttp asks for and points it at a local HTTP server.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from local_http import serving
from vllm_dp_operator.config import Config
from vllm_dp_operator.engines.transport import ServiceDnsTransport

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "doubles"))
from loopback_dns import LoopbackDns


@pytest.fixture
async def server() -> AsyncIterator[dict[str, Any]]:
    seen: dict[str, Any] = {"hosts": []}

    async def health(request: web.Request) -> web.Response:
        seen["hosts"].append(request.host)
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/health", health)
    async with serving(app) as seen["port"]:
        yield seen


@pytest.mark.parametrize(("domain", "fqdn"), [
    ("cluster.local", "demo-head-svc.ns1.svc.cluster.local."),
    ("corp.example", "demo-head-svc.ns1.svc.corp.example."),
])  # fmt: skip
async def test_the_probe_looks_up_the_absolute_name_once(
    server: dict[str, Any], domain: str, fqdn: str
) -> None:
    resolver = LoopbackDns()
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
