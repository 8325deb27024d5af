"""The one seam between the reconcile and the Kubernetes API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from aiohttp.helpers import get_env_proxy_for_url
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from yarl import URL

from vllm_dp_operator import constants
from vllm_dp_operator.controller.fence import fenced_session


@dataclass(frozen=True)
class Kind:
    """A namespaced API resource the operator reads or writes."""

    group: str  # "" for the core group
    version: str
    plural: str

    def path(self, namespace: str, name: str | None = None) -> str:
        """The REST path of the collection, or of one object."""
        base = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        path = f"{base}/namespaces/{namespace}/{self.plural}"
        return f"{path}/{name}" if name else path

    def collection(self, namespace: str | None) -> str:
        """The collection in one namespace, or across all of them (None)."""
        if namespace:
            return self.path(namespace)
        base = f"/api/{self.version}" if not self.group else f"/apis/{self.group}/{self.version}"
        return f"{base}/{self.plural}"


#: Seconds one non-watch API request may take.
REQUEST_TIMEOUT = 60.0
#: Longest one log follow lasts before it is started again (a launch rarely takes longer).
LOG_FOLLOW_SECONDS = 900.0

VDP = Kind(constants.GROUP, constants.VERSION, constants.PLURAL)
RAYCLUSTER = Kind(constants.RAY_GROUP, constants.RAY_VERSION_API, "rayclusters")
RAYJOB = Kind(constants.RAY_GROUP, constants.RAY_VERSION_API, "rayjobs")
SERVICE = Kind("", "v1", "services")
POD = Kind("", "v1", "pods")
#: Created only (each resource's Ray token Secret), never read, listed or watched.
SECRET = Kind("", "v1", "secrets")
#: Kueue's Workloads (one per RayCluster in a LocalQueue); watched only where Kueue is installed.
WORKLOAD = Kind(constants.KUEUE_GROUP, constants.KUEUE_VERSION, "workloads")
ENDPOINTSLICE = Kind("discovery.k8s.io", "v1", "endpointslices")
#: Cluster-scoped: only Kueue's one CRD is watched (by name), to see Workloads become served.
CRD = Kind("apiextensions.k8s.io", "v1", "customresourcedefinitions")
#: Only deleted, once, when a Service of an earlier version loses its selector: the endpoints
#: controller leaves its last Endpoints behind, which the mirroring controller would copy.
ENDPOINTS = Kind("", "v1", "endpoints")
NETWORKPOLICY = Kind("networking.k8s.io", "v1", "networkpolicies")
PDB = Kind("policy", "v1", "poddisruptionbudgets")


class AlreadyExists(Exception):
    """Create answered 409: the object is already there."""


class NamespaceTerminating(Exception):
    """Create answered 403 because the namespace is being deleted: nothing left to do there."""


def _namespace_terminating(exc: ApiException) -> bool:
    # The API server refuses creates in a terminating namespace with 403 and this cause.
    if exc.status != 403:
        return False
    try:
        causes = (json.loads(exc.body or "{}").get("details") or {}).get("causes") or []
    except (ValueError, AttributeError):
        return False
    return any(c.get("reason") == "NamespaceTerminating" for c in causes)


class Kube(Protocol):
    """What the reconcile needs from the API server; tests replace it with a double."""

    async def list(self, kind: Kind, namespace: str, selector: str) -> list[dict[str, Any]]:
        """Objects of a kind in a namespace matching a label selector."""
        ...

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        """One object, or None when it does not exist."""
        ...

    async def create(self, kind: Kind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create an object; raise AlreadyExists on 409, NamespaceTerminating as it says."""
        ...

    async def patch(
        self, kind: Kind, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """JSON merge-patch an object."""
        ...

    async def delete(self, kind: Kind, namespace: str, name: str) -> None:
        """Delete an object in the background; a missing object is not an error."""
        ...


def resession(api: client.ApiClient, fenced: bool = False) -> None:
    """Move the REST client's connections to a session of the operator's own.

    The client's session trusts the environment, and aiohttp then looks up the proxy
    variables and ~/.netrc on every request, in a thread of the default executor: two thread
    hops per API call, about half a millisecond of CPU each time. The proxy for the API
    server is decided here once instead, the way aiohttp would (`HTTPS_PROXY`, `NO_PROXY`),
    unless the kubeconfig names one (`proxy-url`). A session's trace hooks and request class
    are fixed when it is made: `fenced` makes it one for gated writes (`fence.py`).
    """
    rest = api.rest_client
    if not rest.proxy:
        with contextlib.suppress(LookupError):
            proxy, auth = get_env_proxy_for_url(URL(api.configuration.host or ""))
            if auth is not None:  # aiohttp sends a proxy URL's user as Proxy-Authorization
                proxy = proxy.with_user(auth.login).with_password(auth.password)
            rest.proxy = str(proxy)
    old = rest.pool_manager
    settings: dict[str, Any] = {"connector": old.connector, "trust_env": False,
                                "read_bufsize": 2**21}  # fmt: skip
    rest.pool_manager = fenced_session(**settings) if fenced else aiohttp.ClientSession(
        **settings)
    old.detach()


#: TCP keepalive on a watch's connection: the first probe after this many idle seconds, then
#: one every KEEPALIVE_INTERVAL; KEEPALIVE_COUNT unanswered ones end the connection, so a
#: half-open watch (the API server's host gone, a NAT entry dropped) ends within about 90 s.
KEEPALIVE_IDLE = 60
KEEPALIVE_INTERVAL = 10
KEEPALIVE_COUNT = 3


def keep_alive(transport: asyncio.BaseTransport) -> None:
    """Turn on TCP keepalive probes for the connection under `transport`, where the platform
    has them; they are packets, not requests, and cost the API server nothing."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)


class ApiKube:
    """Kube over kubernetes_asyncio's REST client, with kubeconfig or in-cluster credentials."""

    def __init__(self, api: client.ApiClient) -> None:
        self._api = api

    @classmethod
    async def connect(cls, user_agent: str | None = None) -> ApiKube:
        """Load in-cluster credentials, else the kubeconfig, and build a client.

        `user_agent` names this process in the API server's audit log (two replicas share
        one ServiceAccount, so the user alone does not tell them apart).
        """
        try:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
        except config.ConfigException:
            await config.load_kube_config()
        api = client.ApiClient()
        if user_agent:
            api.user_agent = user_agent
        # The write fence (fence.py) rides on the session's trace hooks.
        resession(api, fenced=True)
        return cls(api)

    @property
    def api(self) -> client.ApiClient:
        """The underlying REST client, shared with the API-server proxy probe."""
        return self._api

    async def close(self) -> None:
        """Release the HTTP session."""
        await self._api.close()

    async def follow_log(
        self, namespace: str, pod: str, container: str, since_seconds: int
    ) -> AsyncIterator[str]:
        """Follow one container's log from `since_seconds` back (`pods/log`, through the API
        server and the kubelet): its lines as they are written, until the stream ends."""
        core = client.CoreV1Api(self._api)
        response: aiohttp.ClientResponse = await core.read_namespaced_pod_log(
            pod, namespace, container=container, follow=True, since_seconds=since_seconds,
            _preload_content=False, _request_timeout=LOG_FOLLOW_SECONDS,
        )  # type: ignore[assignment]  # an aiohttp response when not preloaded
        try:
            async for raw in response.content:
                yield raw.decode("utf-8", errors="replace")
        finally:
            response.release()

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        return await self._api.call_api(
            path,
            method,
            query_params=query or [],
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            response_types_map={200: "object", 201: "object", 202: "object"},
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
            # Without a bound, one stalled connection would hold a worker for ever.
            _request_timeout=REQUEST_TIMEOUT,
        )

    async def list(self, kind: Kind, namespace: str, selector: str) -> list[dict[str, Any]]:
        """Objects of a kind in a namespace matching a label selector."""
        result = await self._call("GET", kind.path(namespace), query=[("labelSelector", selector)])
        items: list[dict[str, Any]] = result.get("items", [])
        return items

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        """One object, or None when it does not exist."""
        try:
            obj: dict[str, Any] = await self._call("GET", kind.path(namespace, name))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return obj

    async def create(self, kind: Kind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create an object; raise AlreadyExists on 409, NamespaceTerminating as it says."""
        try:
            obj: dict[str, Any] = await self._call("POST", kind.path(namespace), body=body)
        except ApiException as exc:
            if exc.status == 409:
                raise AlreadyExists(body["metadata"]["name"]) from exc
            if _namespace_terminating(exc):
                raise NamespaceTerminating(namespace) from None
            raise
        return obj

    async def patch(
        self, kind: Kind, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """JSON merge-patch an object."""
        obj: dict[str, Any] = await self._call(
            "PATCH", kind.path(namespace, name), body=body,
            content_type="application/merge-patch+json",
        )  # fmt: skip
        return obj

    async def delete(self, kind: Kind, namespace: str, name: str) -> None:
        """Delete an object in the background; a missing object is not an error."""
        try:
            await self._call(
                "DELETE", kind.path(namespace, name),
                body={"propagationPolicy": "Background"},
            )  # fmt: skip
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def patch_status(
        self, kind: Kind, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        """JSON merge-patch the status subresource of an object."""
        obj: dict[str, Any] = await self._call(
            "PATCH", kind.path(namespace, name) + "/status", body={"status": status},
            content_type="application/merge-patch+json",
        )  # fmt: skip
        return obj

    async def list_page(
        self, kind: Kind, namespace: str | None, selector: str, limit: int, cont: str | None,
        fields: str = "",
    ) -> dict[str, Any]:  # fmt: skip
        """One page of a LIST (the whole list document: items, metadata.continue, RV)."""
        query = [("labelSelector", selector), ("limit", str(limit))]
        if fields:
            query.append(("fieldSelector", fields))
        if cont:
            query.append(("continue", cont))
        page: dict[str, Any] = await self._call("GET", kind.collection(namespace), query=query)
        return page

    async def watch(
        self, kind: Kind, namespace: str | None, selector: str, resource_version: str,
        timeout_seconds: int, fields: str = "",
    ) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
        """Watch events from a resourceVersion on, as dicts, until the server ends the stream.

        A quiet stream is no dead one: the watch cache sends a bookmark only once its kind's
        resourceVersion has moved, so a kind nobody changes stays silent until the server ends
        the watch at `timeout_seconds` (a 130 s silence cut-off renewed every quiet watch every
        130 s, the operator's requests at rest). The read waits that long, plus a margin; TCP
        keepalive probes (`keep_alive`, no API request) find a half-open connection sooner, and
        the caller resumes. Lines are split here, not by aiohttp's readline, which refuses lines
        over 128 KiB.
        """
        query = [
            ("watch", "true"), ("labelSelector", selector),
            ("resourceVersion", resource_version), ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(timeout_seconds)),
        ]  # fmt: skip
        if fields:
            query.append(("fieldSelector", fields))
        timeout = aiohttp.ClientTimeout(sock_connect=10, sock_read=timeout_seconds + 60)
        resp = await self._api.call_api(
            kind.collection(namespace), "GET",
            query_params=query,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=timeout,
        )  # fmt: skip
        try:
            if resp.status != 200:
                raise ApiException(status=resp.status, reason=(await resp.text())[:500])
            if resp.connection is not None and resp.connection.transport is not None:
                keep_alive(resp.connection.transport)
            pending = bytearray()
            chunks = resp.content.iter_any()
            while True:
                try:
                    chunk = await anext(chunks)
                except (StopAsyncIteration, aiohttp.ServerTimeoutError):
                    return  # the server's timeout, or a silent stream: the caller resumes
                pending += chunk
                while (end := pending.find(b"\n")) >= 0:
                    line = bytes(pending[:end])
                    del pending[: end + 1]
                    if line.strip():
                        event: dict[str, Any] = json.loads(line)
                        yield event
        finally:
            resp.release()
