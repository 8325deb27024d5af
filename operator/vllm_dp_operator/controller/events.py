"""Kubernetes Events on resources, posted in the background by a few workers.

The reconcile's events (HeadJobFailed, RayClusterCreated, ...) are queued, not posted inline,
and at most `workers` posts run at once: in a burst of new resources, creating their children
comes before telling about it. kopf's own `kopf.event` cannot be used from the controller's
workers: it reads context variables kopf sets only inside its per-object tasks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from vllm_dp_operator import constants as c
from vllm_dp_operator.controller.kube import Kind, Kube, NamespaceTerminating

log = logging.getLogger(__name__)

EVENT = Kind("", "v1", "events")
MAX_MESSAGE = 1024


def event_body(target: dict[str, Any], type_: str, reason: str, message: str,
               now: datetime) -> dict[str, Any]:  # fmt: skip
    """A core/v1 Event about `target` (apiVersion, kind and metadata name/namespace/uid)."""
    meta = target["metadata"]
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE // 2 - 2] + "..." + message[-(MAX_MESSAGE // 2 - 1) :]
    stamp = now.astimezone(UTC).isoformat()
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": target["apiVersion"], "kind": target["kind"],
                           "name": meta["name"], "namespace": meta["namespace"],
                           "uid": meta.get("uid")},
        "type": type_, "reason": reason, "message": message, "action": reason,
        "source": {"component": c.MANAGER}, "reportingComponent": c.MANAGER,
        "reportingInstance": c.MANAGER,
        "firstTimestamp": stamp, "lastTimestamp": stamp, "eventTime": stamp, "count": 1,
    }  # fmt: skip


class EventPoster:
    """A bounded queue of Events and the few workers that post them."""

    def __init__(self, kube: Kube, workers: int = 2, backlog: int = 10_000,
                 gate: Callable[[], Awaitable[None]] | None = None) -> None:  # fmt: skip
        self._kube = kube
        self._gate = gate
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=backlog)
        self._workers = workers
        self._tasks: list[asyncio.Task[None]] = []
        self.posted = 0
        self.dropped = 0

    def post(self, target: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """Queue an Event; when the backlog is full, drop it (events are informational)."""
        try:
            self._queue.put_nowait(event_body(target, type_, reason, message, datetime.now(UTC)))
        except asyncio.QueueFull:
            self.dropped += 1
            log.warning("Event backlog full; dropped %s %s: %s", type_, reason, message[:200])

    def start(self) -> list[asyncio.Task[None]]:
        """Start the posting workers; return their tasks."""
        self._tasks = [asyncio.create_task(self._work(), name=f"event-poster-{i}")
                       for i in range(self._workers)]  # fmt: skip
        return self._tasks

    async def _work(self) -> None:
        while True:
            body = await self._queue.get()
            if self._gate is not None:
                await self._gate()
            try:
                await self._kube.create(EVENT, body["metadata"]["namespace"], body)
                self.posted += 1
            except NamespaceTerminating:
                # The resource goes with its namespace; so would the Event.
                log.debug("Event %s on %s not posted: its namespace is terminating",
                          body["reason"], body["involvedObject"]["name"])  # fmt: skip
            except (ApiException, aiohttp.ClientError, OSError, TimeoutError) as exc:
                log.warning("Could not post event %s on %s: %s", body["reason"],
                            body["involvedObject"]["name"], str(exc).splitlines()[0])  # fmt: skip
            except Exception:
                # A poster that died would silence every later Event of every resource.
                log.exception("Could not post event %s on %s", body["reason"],
                              body["involvedObject"]["name"])  # fmt: skip
