"""The API-server proxy transport, the /health probe and the Ray job client over it, against
a local HTTP stand-in for the API server (a test double serving only the proxy paths).

What must hold: the exact proxy paths; a pod's own answer (vLLM's 503, Ray's 404) told apart
from the API server answering for itself (a Status object: no endpoint, pod refused, RBAC).
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from kubernetes_asyncio import client
from vllm_dp_launcher.command import KEEP_ALIVE_SECONDS
from vllm_dp_operator.config import Config
from vllm_dp_operator.engines.probe import TransportProbe
from vllm_dp_operator.engines.ray_dashboard import NOT_FOUND, UNKNOWN, DashboardJobs
from vllm_dp_operator.engines.transport import (
    PROBE_KEEPALIVE_SECONDS,
    ApiServerProxyTransport,
    DisabledTransport,
    ServiceDnsTransport,
    make_transport,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "doubles"))
from loopback_dns import LoopbackDns

SVC = "/api/v1/namespaces/ns1/services"
HEALTH = f"{SVC}/demo-abcde-head-svc:8000/proxy/health"
METRICS = f"{SVC}/demo-abcde-head-svc:8000/proxy/metrics"
JOB = f"{SVC}/demo-abcde-head-svc:8265/proxy/api/jobs/demo-j00001"


def _status(code: int, message: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
            "code": code}  # fmt: skip
    return web.json_response(body, status=code)


@pytest.fixture
async def apiserver() -> AsyncIterator[dict[str, Any]]:
    state: dict[str, Any] = {"health": 200, "job": "RUNNING", "hits": [], "own": None}

    async def handle(request: web.Request) -> web.Response:
        state["hits"].append(f"{request.method} {request.path}")
        if state["own"] is not None:  # the API server answers for itself
            return _status(*state["own"])
        if request.path == HEALTH:
            return web.Response(status=state["health"], text="")
        if request.path == METRICS:
            return web.Response(status=200, text=state.get("metrics", ""))
        if request.path == JOB and request.method == "GET":
            if state["job"] is None:
                return web.Response(status=404, text="Job demo-j00001 does not exist")
            return web.json_response({"submission_id": "demo-j00001", "status": state["job"]})
        if request.path == f"{JOB}/stop" and request.method == "POST":
            state["job"] = "STOPPED"
            return web.json_response({"stopped": True})
        return _status(404, "services \"other\" not found")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    state["url"] = f"http://127.0.0.1:{port}"
    yield state
    await runner.cleanup()


def _api(url: str) -> client.ApiClient:
    return client.ApiClient(configuration=client.Configuration(host=url))


async def test_probe_healthy_on_200_through_the_head_service(apiserver: dict[str, Any]) -> None:
    async with _api(apiserver["url"]) as api:
        probe = TransportProbe(ApiServerProxyTransport(api, 2))
        result = await probe.check("ns1", "demo-abcde-head-svc", 8000)
    assert result.ok and apiserver["hits"] == [f"GET {HEALTH}"]


async def test_probe_not_healthy_on_the_pods_503(apiserver: dict[str, Any]) -> None:
    apiserver["health"] = 503
    async with _api(apiserver["url"]) as api:
        result = await TransportProbe(ApiServerProxyTransport(api, 2)).check(
            "ns1", "demo-abcde-head-svc", 8000)  # fmt: skip
    assert not result.ok and "503" in result.detail


async def test_api_server_status_is_not_the_pods_answer(apiserver: dict[str, Any]) -> None:
    apiserver["own"] = (503, "error trying to reach service: connect: connection refused")
    async with _api(apiserver["url"]) as api:
        answer = await ApiServerProxyTransport(api, 2).request(
            "GET", "ns1", "demo-abcde-head-svc", 8265, "/api/jobs/demo-j00001")  # fmt: skip
    assert answer.status is None and not answer.ok
    assert "connection refused" in answer.detail


async def test_ray_job_lookup_running_then_stop_then_stopped(apiserver: dict[str, Any]) -> None:
    async with _api(apiserver["url"]) as api:
        jobs = DashboardJobs(ApiServerProxyTransport(api, 2))
        first = await jobs.lookup("ns1", "demo-abcde", "demo-j00001", None)
        stop = await jobs.stop("ns1", "demo-abcde", "demo-j00001", None)
        after = await jobs.lookup("ns1", "demo-abcde", "demo-j00001", None)
    assert first.state == "RUNNING" and not first.ended
    assert stop.delivered
    assert after.state == "STOPPED" and after.ended
    assert apiserver["hits"] == [f"GET {JOB}", f"POST {JOB}/stop", f"GET {JOB}"]


async def test_ray_404_means_not_found_but_api_server_404_is_unknown(
    apiserver: dict[str, Any],
) -> None:
    apiserver["job"] = None
    async with _api(apiserver["url"]) as api:
        jobs = DashboardJobs(ApiServerProxyTransport(api, 2))
        missing = await jobs.lookup("ns1", "demo-abcde", "demo-j00001", None)
        apiserver["own"] = (404, 'services "demo-abcde-head-svc" not found')
        no_service = await jobs.lookup("ns1", "demo-abcde", "demo-j00001", None)
        stop = await jobs.stop("ns1", "demo-abcde", "demo-j00001", None)
    assert missing.state == NOT_FOUND and missing.ended
    assert no_service.state == UNKNOWN and not no_service.ended
    assert not stop.delivered


async def test_forbidden_proxy_is_unknown_and_logged(
    apiserver: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    apiserver["own"] = (403, 'services "demo-abcde-head-svc" is forbidden: cannot create '
                             "resource \"services/proxy\"")  # fmt: skip
    async with _api(apiserver["url"]) as api:
        stop = await DashboardJobs(ApiServerProxyTransport(api, 2)).stop(
            "ns1", "demo-abcde", "demo-j00001", None)  # fmt: skip
    assert not stop.delivered and "403" in stop.detail
    assert any("forbidden" in r.getMessage() for r in caplog.records)


async def test_unreachable_api_server_reads_as_unknown() -> None:
    async with _api("http://127.0.0.1:9") as api:
        lookup = await DashboardJobs(ApiServerProxyTransport(api, 1)).lookup(
            "ns1", "demo-abcde", "demo-j00001", None)  # fmt: skip
        health = await TransportProbe(ApiServerProxyTransport(api, 1)).check("ns1", "s", 8000)
    assert lookup.state == UNKNOWN and not health.ok


async def test_make_transport_modes() -> None:
    async with _api("http://127.0.0.1:9") as api:
        assert isinstance(make_transport("apiserver-proxy", api, 1), ApiServerProxyTransport)
        assert isinstance(make_transport("service-dns", api, 1), ServiceDnsTransport)
        off = make_transport("off", api, 1)
        assert isinstance(off, DisabledTransport)
        assert not (await TransportProbe(off).check("a", "b", 1)).ok
        assert (await DashboardJobs(off).lookup("a", "b", "c", None)).state == UNKNOWN
        with pytest.raises(ValueError, match="VLLMDP_HEALTH_PROBE"):
            make_transport("bogus", api, 1)


async def test_service_dns_transport_closes_its_session() -> None:
    transport = ServiceDnsTransport(0.5)
    answer = await transport.request("GET", "ns1", "nowhere.invalid", 1, "/health")
    assert answer.status is None
    await transport.close()
    assert transport._session is None
    json.dumps(answer.detail)  # a plain string for status messages


async def test_metrics_read_through_the_proxy_bounded_in_size(apiserver: dict[str, Any]) -> None:
    ranks = "".join(f'vllm:num_requests_running{{engine="{r}",model_name="m"}} {r}.0\n'
                    for r in range(4))
    apiserver["metrics"] = ranks + "# padding\n" * 100_000  # about 1 MB after the ranks
    async with _api(apiserver["url"]) as api:
        whole = await TransportProbe(ApiServerProxyTransport(api, 2)).engines(
            "ns1", "demo-abcde-head-svc", 8000)
        cut = await TransportProbe(ApiServerProxyTransport(api, 2), max_bytes=len(ranks) - 5
                                   ).engines("ns1", "demo-abcde-head-svc", 8000)
    assert whole.loads is not None and sorted(whole.loads) == [0, 1, 2, 3]
    assert cut.loads is not None and sorted(cut.loads) == [0, 1, 2]  # the cut line is dropped
    assert f"read the first {len(ranks) - 5} bytes only" in cut.detail
    assert apiserver["hits"][-1] == f"GET {METRICS}"


async def test_the_api_server_proxy_is_rate_limited() -> None:
    """A token bucket: a burst passes at once, then one request per 1/qps seconds."""
    from vllm_dp_operator.engines.transport import RateLimit

    now = [0.0]
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    limit = RateLimit(qps=10, burst=2, clock=lambda: now[0], sleep=sleep)
    for _ in range(5):
        await limit.take()
    assert slept == [pytest.approx(0.1)] * 3  # 2 at once, then 10 a second
    now[0] += 1.0  # a quiet second refills the bucket, up to its burst
    slept.clear()
    for _ in range(2):
        await limit.take()
    assert slept == []
    await RateLimit(qps=0, burst=1).take()  # 0: no limit


async def test_service_dns_probes_reuse_one_connection_per_service() -> None:
    """Probes of one Service go over one kept connection (no handshake, no DNS lookup per
    probe), and one the pod closed meanwhile is replaced without a failed probe."""
    peers: list[int] = []

    async def health(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, keepalive_timeout=KEEP_ALIVE_SECONDS)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    transport = ServiceDnsTransport(2, resolver=LoopbackDns())
    try:
        probe = TransportProbe(transport)
        for _ in range(3):
            assert (await probe.check("ns1", "demo-abcde-head-svc", port)).ok
        assert len(peers) == 3 and len(set(peers)) == 1
        await runner.shutdown()  # the server closes its idle connections
        await runner.cleanup()
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        assert (await probe.check("ns1", "demo-abcde-head-svc", port)).ok
        assert len(set(peers)) == 2
    finally:
        await transport.close()
        await runner.cleanup()


def test_kept_connections_outlive_the_probe_period_and_not_the_engines() -> None:
    """The client keeps an idle connection past the next serving probe (30 s, +10 %), and
    drops it before vLLM would (the launcher's VLLM_HTTP_TIMEOUT_KEEP_ALIVE)."""
    assert Config().probe_serving_seconds * 1.1 < PROBE_KEEPALIVE_SECONDS < KEEP_ALIVE_SECONDS
