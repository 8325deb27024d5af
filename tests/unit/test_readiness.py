"""GET /readyz: 200 only when every check passes, each check's answer in the body."""

from __future__ import annotations

from aiohttp.test_utils import TestClient, TestServer
from vllm_dp_operator.observability.readiness_http import Check, readiness_app


async def _get(checks: list[tuple[str, Check]]) -> tuple[int, str]:
    async with TestClient(TestServer(readiness_app(checks))) as client:
        resp = await client.get("/readyz")
        return resp.status, await resp.text()


async def test_ready_only_when_synced_and_the_lease_api_answers() -> None:
    synced = ("controller", lambda: (True, "caches synced"))
    standby = ("lease", lambda: (True, "Lease API answers; standby (leader: op-0_x)"))
    unreachable = ("lease", lambda: (False, "Lease API not answering: HTTP 403"))
    waiting = ("controller", lambda: (False, "waiting for the first LIST of rayclusters"))
    body = "[+]controller: caches synced\n[+]lease: Lease API answers; standby (leader: op-0_x)\n"
    assert await _get([synced, standby]) == (200, body)
    code, body = await _get([synced, unreachable])
    assert code == 503 and "[-]lease: Lease API not answering: HTTP 403" in body
    code, body = await _get([waiting, standby])
    assert code == 503 and "rayclusters" in body
