"""The one seam every write of the operator passes: no write without the Lease.

The controller is built on a `GatedApi` instead of the bare API client, so the reconcile's
creates, patches and deletes (through `CachedKube`), the status writer's patches and the Event
poster's creates all check the gate when they are called. The Ray job API's stop (a write to
the head's dashboard) goes through `GatedRayJobs`, and the adapter loads and unloads (writes to
the engines) through `GatedTransport`. Reads and watches are never gated: standbys
keep their caches warm. kopf itself writes nothing (handlers.py).

A check when the write is called is not enough. Between it and the request leaving, the write
may wait for a connection or a TLS handshake, and a process frozen there (SIGSTOP, a paused VM)
sends it after it wakes, when another replica may lead. So each write is sent through `fence.gated`,
which checks the gate again once the HTTP connection is in hand (fence.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Mapping
from typing import Any

from vllm_dp_operator.controller.fence import WriteGate, gated
from vllm_dp_operator.controller.kube import Kind
from vllm_dp_operator.engines.ray_dashboard import RayJobLookup, RayJobs, StopResult
from vllm_dp_operator.engines.transport import Answer, ServiceTransport


class GatedApi:
    """The controller's API with every write checked against the gate first."""

    def __init__(self, api: Any, gate: WriteGate) -> None:
        self._api, self._gate = api, gate

    async def list(self, kind: Kind, namespace: str, selector: str) -> list[dict[str, Any]]:
        """Objects of a kind in a namespace matching a label selector (not gated)."""
        items: list[dict[str, Any]] = await self._api.list(kind, namespace, selector)
        return items

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        """One object, or None (not gated)."""
        obj: dict[str, Any] | None = await self._api.get(kind, namespace, name)
        return obj

    async def list_page(
        self, kind: Kind, namespace: str | None, selector: str, limit: int, cont: str | None,
        fields: str = "",
    ) -> dict[str, Any]:  # fmt: skip
        """One page of a LIST (not gated)."""
        page: dict[str, Any] = await self._api.list_page(kind, namespace, selector, limit, cont,
                                                         fields=fields)  # fmt: skip
        return page

    def watch(
        self, kind: Kind, namespace: str | None, selector: str, resource_version: str,
        timeout_seconds: int, fields: str = "",
    ) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
        """Watch events (not gated)."""
        stream: AsyncIterator[dict[str, Any]] = self._api.watch(
            kind, namespace, selector, resource_version, timeout_seconds, fields=fields
        )
        return stream

    async def create(self, kind: Kind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create, if this process may write."""
        obj: dict[str, Any] = await gated(
            self._gate, lambda: self._api.create(kind, namespace, body)
        )
        return obj

    async def patch(
        self, kind: Kind, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """Merge-patch, if this process may write."""
        obj: dict[str, Any] = await gated(
            self._gate, lambda: self._api.patch(kind, namespace, name, body)
        )
        return obj

    async def delete(self, kind: Kind, namespace: str, name: str) -> None:
        """Delete, if this process may write."""
        await gated(self._gate, lambda: self._api.delete(kind, namespace, name))

    async def patch_status(
        self, kind: Kind, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        """Merge-patch the status subresource, if this process may write."""
        obj: dict[str, Any] = await gated(
            self._gate, lambda: self._api.patch_status(kind, namespace, name, status)
        )
        return obj


class GatedRayJobs:
    """The Ray job API with its one write (stop) behind the gate."""

    def __init__(self, jobs: RayJobs, gate: WriteGate) -> None:
        self._jobs, self._gate = jobs, gate

    async def lookup(
        self, namespace: str, cluster: str, submission_id: str, token: str | None
    ) -> RayJobLookup:
        """The status of one Ray job (not gated)."""
        return await self._jobs.lookup(namespace, cluster, submission_id, token)

    async def stop(
        self, namespace: str, cluster: str, submission_id: str, token: str | None
    ) -> StopResult:
        """Stop one Ray job, if this process may write."""
        return await gated(
            self._gate, lambda: self._jobs.stop(namespace, cluster, submission_id, token)
        )


class GatedTransport:
    """HTTP to the engines with its writes (the adapter loads and unloads) behind the gate."""

    def __init__(self, transport: ServiceTransport, gate: WriteGate) -> None:
        self._transport, self._gate = transport, gate

    async def request(
        self, method: str, namespace: str, service: str, port: int, path: str,
        limit: int | None = None, headers: Mapping[str, str] | None = None,
        json_body: Mapping[str, Any] | None = None,
    ) -> Answer:  # fmt: skip
        """A GET as it is; anything else if this process may write."""
        def send() -> Awaitable[Answer]:
            return self._transport.request(method, namespace, service, port, path, limit,
                                            headers, json_body)  # fmt: skip

        if method == "GET":
            return await send()
        answer: Answer = await gated(self._gate, send)
        return answer

    async def close(self) -> None:
        """Closed with the transport it wraps, by its owner."""


class _Open:
    def check(self) -> None:
        return None


#: The gate of a process without leader election: always open.
OPEN: WriteGate = _Open()
