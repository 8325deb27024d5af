"""Health probes of vLLM's /health through the Service: pluggable by where the operator runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of one probe."""

    ok: bool
    detail: str


class HealthProbe(Protocol):
    """Answers whether vLLM behind a Service answers GET /health with 200."""

    async def check(self, namespace: str, service: str, port: int) -> ProbeResult:
        """Probe once, within the probe's timeout."""
        ...


class ServiceDnsProbe:
    """In-cluster: GET http://<service>.<namespace>.svc:<port>/health."""

    def __init__(self, timeout: float) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout)

    async def check(self, namespace: str, service: str, port: int) -> ProbeResult:
        """Probe once, within the probe's timeout."""
        url = f"http://{service}.{namespace}.svc:{port}/health"
        try:
            async with (
                aiohttp.ClientSession(timeout=self._timeout) as session,
                session.get(url) as resp,
            ):
                return ProbeResult(resp.status == 200, f"GET {url}: HTTP {resp.status}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            return ProbeResult(False, f"GET {url}: {type(exc).__name__} {exc}".strip())


class ApiServerProxyProbe:
    """Outside the cluster: the API server's service proxy to <service>:<port>/health."""

    def __init__(self, api: client.ApiClient, timeout: float) -> None:
        self._api = api
        self._timeout = timeout

    async def check(self, namespace: str, service: str, port: int) -> ProbeResult:
        """Probe once, within the probe's timeout."""
        path = f"/api/v1/namespaces/{namespace}/services/{service}:{port}/proxy/health"
        try:
            await self._api.call_api(
                path, "GET",
                header_params={"Accept": "*/*"},
                response_types_map={200: "str"},
                auth_settings=["BearerToken"],
                _return_http_data_only=True,
                _request_timeout=self._timeout,
            )  # fmt: skip
        except ApiException as exc:
            return ProbeResult(False, f"GET {path}: HTTP {exc.status} {exc.reason}")
        except (TimeoutError, aiohttp.ClientError) as exc:
            return ProbeResult(False, f"GET {path}: {type(exc).__name__}")
        return ProbeResult(True, f"GET {path}: HTTP 200")


class DisabledProbe:
    """No probe: a running head job never becomes Serving."""

    async def check(self, namespace: str, service: str, port: int) -> ProbeResult:
        """Always not healthy, saying why."""
        return ProbeResult(False, "health probe disabled (VLLMDP_HEALTH_PROBE=off)")


def make_probe(mode: str, api: client.ApiClient, timeout: float) -> HealthProbe:
    """The probe for a VLLMDP_HEALTH_PROBE setting."""
    if mode == "service-dns":
        return ServiceDnsProbe(timeout)
    if mode == "apiserver-proxy":
        return ApiServerProxyProbe(api, timeout)
    if mode == "off":
        return DisabledProbe()
    raise ValueError(
        f"VLLMDP_HEALTH_PROBE={mode!r}: expected service-dns, apiserver-proxy or off"
    )
