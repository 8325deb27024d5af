"""HTTP to a port of a Service: by cluster DNS in the cluster, or through the API server.

vLLM's /health and the Ray dashboard's job API both sit on the Ray head pod behind KubeRay's
head Service; the probe and the Ray job client share this one way of reaching them, and so
the same RBAC (`services/proxy` get and create in apiserver-proxy mode).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import aiohttp.abc
from kubernetes_asyncio import client

from vllm_dp_operator.api import names
from vllm_dp_operator.constants import DEFAULT_CLUSTER_DOMAIN
from vllm_dp_operator.controller.fence import fenced_session

log = logging.getLogger(__name__)


#: VLLMDP_HEALTH_PROBE (chart: healthProbe.mode) value for no access to the pods' ports.
PROBES_OFF = "off"
#: How long an idle connection to a Service is kept for the next request: longer than the
#: serving probe period (30 s, give or take a tenth), shorter than vLLM's own keep-alive as
#: the launcher sets it (75 s, vllm_dp_launcher.command), so the server never closes a
#: connection the client is about to reuse. A new TCP connection per probe was a fifth of
#: the probes' CPU at 1,000 resources (docs/benchmarks.md, P7b).
PROBE_KEEPALIVE_SECONDS = 60.0


@dataclass(frozen=True)
class Answer:
    """One HTTP exchange with the pod behind a Service."""

    status: int | None  # the pod's HTTP status; None when the pod was not reached
    body: str
    detail: str  # what happened, for status messages and events
    truncated: bool = False  # the body was cut at the request's byte limit

    @property
    def ok(self) -> bool:
        """The pod answered with a 2xx status."""
        return self.status is not None and 200 <= self.status < 300


class ServiceTransport(Protocol):
    """Sends one request to a port of a Service and says what came back."""

    async def request(
        self, method: str, namespace: str, service: str, port: int, path: str,
        limit: int | None = None, headers: Mapping[str, str] | None = None,
        json_body: Mapping[str, Any] | None = None,
    ) -> Answer:  # fmt: skip
        """Send `method path` to service:port in namespace, within the timeout, with extra
        `headers` (never logged: they may carry a token) and a JSON `json_body`; read at most
        `limit` bytes of the answer's body when given."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


class ServiceDnsTransport:
    """In the cluster: http://<service>.<namespace>.svc.<cluster domain>.:<port><path>.

    The name is absolute (see `names.service_fqdn`): no search-path lookups before each probe.
    One idle connection per Service is kept between probes (PROBE_KEEPALIVE_SECONDS), so a
    probe costs neither a DNS lookup nor a TCP handshake; a GET on a kept connection the pod
    has closed meanwhile is sent again on a new one (aiohttp retries idempotent requests).
    """

    def __init__(
        self, timeout: float, cluster_domain: str = DEFAULT_CLUSTER_DOMAIN,
        resolver: aiohttp.abc.AbstractResolver | None = None,
        keepalive: float = PROBE_KEEPALIVE_SECONDS,
    ) -> None:  # fmt: skip
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._domain = cluster_domain
        self._resolver = resolver  # None: aiohttp's default; tests pass a double
        self._keepalive = keepalive
        self._session: aiohttp.ClientSession | None = None

    async def request(
        self, method: str, namespace: str, service: str, port: int, path: str,
        limit: int | None = None, headers: Mapping[str, str] | None = None,
        json_body: Mapping[str, Any] | None = None,
    ) -> Answer:  # fmt: skip
        """Send `method path` to service:port in namespace, within the timeout."""
        url = f"http://{names.service_fqdn(service, namespace, self._domain)}:{port}{path}"
        if self._session is None:
            connector = aiohttp.TCPConnector(resolver=self._resolver,
                                             keepalive_timeout=self._keepalive)
            # The Ray job stop is a gated write; the fence checks it at the connection.
            self._session = fenced_session(timeout=self._timeout, connector=connector)
        try:
            async with self._session.request(method, url, headers=headers, json=json_body) as resp:
                body, cut = await _read(resp, limit)
                return Answer(resp.status, body, f"{method} {url}: HTTP {resp.status}", cut)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return Answer(None, "", f"{method} {url}: {type(exc).__name__} {exc}".strip())

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _read(resp: aiohttp.ClientResponse, limit: int | None) -> tuple[str, bool]:
    """The body as text, at most `limit` bytes of it; and whether it was cut there."""
    if limit is None:
        return (await resp.read()).decode("utf-8", "replace"), False
    chunks: list[bytes] = []
    size = 0
    while size <= limit:  # read() returns what is buffered, maybe less than asked
        chunk = await resp.content.read(limit + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    data = b"".join(chunks)
    return data[:limit].decode("utf-8", "replace"), size > limit


def _api_server_status(body: str) -> str | None:
    """The message of a Status object the API server wrote itself, else None (pod's answer)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if isinstance(doc, dict) and doc.get("kind") == "Status" and doc.get("apiVersion") == "v1":
        return str(doc.get("message") or doc.get("reason") or "")
    return None


class RateLimit:
    """A token bucket: at most `qps` requests a second on average, `burst` at once."""

    def __init__(self, qps: float, burst: int, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:  # fmt: skip
        self._qps, self._burst = qps, float(burst)
        self._tokens, self._clock, self._sleep = float(burst), clock, sleep
        self._at = clock()
        self._lock = asyncio.Lock()

    async def take(self) -> None:
        """Wait for a token (requests wait in turn, first come first served)."""
        if self._qps <= 0:
            return
        async with self._lock:
            now = self._clock()
            self._tokens = min(self._burst, self._tokens + (now - self._at) * self._qps)
            self._at = now
            if self._tokens < 1:
                await self._sleep((1 - self._tokens) / self._qps)
                self._tokens, self._at = 1.0, self._clock()
            self._tokens -= 1


class ApiServerProxyTransport:
    """Outside the pod network: the API server's services/<service>:<port>/proxy<path>.

    Every probe and Ray job call is then an API request the API server forwards, so they are
    rate-limited (VLLMDP_PROXY_QPS) on top of the probe pool's concurrency bound.
    """

    def __init__(self, api: client.ApiClient, timeout: float,
                 limit: RateLimit | None = None) -> None:  # fmt: skip
        self._api = api
        self._timeout = timeout
        self._limit = limit

    async def request(
        self, method: str, namespace: str, service: str, port: int, path: str,
        limit: int | None = None, headers: Mapping[str, str] | None = None,
        json_body: Mapping[str, Any] | None = None,
    ) -> Answer:  # fmt: skip
        """Send `method path` to service:port in namespace, within the timeout."""
        url = f"/api/v1/namespaces/{namespace}/services/{service}:{port}/proxy{path}"
        if self._limit is not None:
            await self._limit.take()
        try:
            resp = await self._api.call_api(
                url, method,
                # The API server consumes `Authorization` (the operator's own credential) and
                # passes other headers on to the pod.
                header_params={"Accept": "*/*", **(headers or {}),
                               **({"Content-Type": "application/json"} if json_body else {})},
                body=dict(json_body) if json_body is not None else None,
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=self._timeout,
            )  # fmt: skip
            try:
                status, (body, cut) = resp.status, await _read(resp, limit)
            finally:
                resp.release()
        except (TimeoutError, aiohttp.ClientError) as exc:
            return Answer(None, "", f"{method} {url}: {type(exc).__name__}")
        own = _api_server_status(body) if status >= 400 else None
        if own is not None:
            # The API server answered for itself (no endpoint, pod refused, RBAC): not the pod.
            log.warning("%s %s: the API server answered HTTP %s: %s", method, url, status, own)
            return Answer(None, body, f"{method} {url}: HTTP {status} {own}".strip())
        return Answer(status, body, f"{method} {url}: HTTP {status}", cut)

    async def close(self) -> None:
        """Nothing to release: the API client belongs to the Kube seam."""


class DisabledTransport:
    """No access to the pods' HTTP ports (VLLMDP_HEALTH_PROBE=off)."""

    async def request(
        self, method: str, namespace: str, service: str, port: int, path: str,
        limit: int | None = None, headers: Mapping[str, str] | None = None,
        json_body: Mapping[str, Any] | None = None,
    ) -> Answer:  # fmt: skip
        """Never reaches the pod, saying why."""
        return Answer(None, "", "pod HTTP access disabled (VLLMDP_HEALTH_PROBE=off)")

    async def close(self) -> None:
        """Nothing to release."""


def make_transport(
    mode: str, api: client.ApiClient, timeout: float,
    cluster_domain: str = DEFAULT_CLUSTER_DOMAIN, proxy_qps: float = 0.0,
) -> ServiceTransport:  # fmt: skip
    """The transport for a VLLMDP_HEALTH_PROBE setting."""
    if mode == "service-dns":
        return ServiceDnsTransport(timeout, cluster_domain)
    if mode == "apiserver-proxy":
        limit = RateLimit(proxy_qps, max(1, int(proxy_qps * 2))) if proxy_qps > 0 else None
        return ApiServerProxyTransport(api, timeout, limit)
    if mode == PROBES_OFF:
        return DisabledTransport()
    raise ValueError(
        f"VLLMDP_HEALTH_PROBE={mode!r}: expected service-dns, apiserver-proxy or off"
    )
