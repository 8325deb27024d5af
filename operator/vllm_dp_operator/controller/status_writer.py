"""Status changes, written in the background: a few patches at a time, the latest value wins.

A reconcile hands over the status keys that changed and goes on; its children's writes are
not held up behind status patches, which matters in a burst of new resources, where children
are what users wait for. Until a change is confirmed by the API server, `effective()` lays it
over the cached status, so the next reconcile decides on what the last one concluded (a
failure is never counted twice because its patch is still in flight).

Pending changes belong to one uid: a resource deleted and created again under its name starts
from its own status, not from what was still on its way to the old one's. A patch the API
server refuses as invalid (422) is said once and dropped: sending it again cannot help.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from vllm_dp_operator.controller.cache import ObjectCache
from vllm_dp_operator.controller.kube import VDP, Kind

log = logging.getLogger(__name__)

Key = tuple[str, str]


def api_message(exc: ApiException) -> str:
    """The message of an API error's Status body, else its reason."""
    try:
        message = json.loads(exc.body or "{}").get("message")
    except (TypeError, ValueError, AttributeError):
        message = None
    return str(message or exc.reason)


class StatusApi(Protocol):
    """The one call the writer makes."""

    async def patch_status(
        self, kind: Kind, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        """JSON merge-patch the status subresource."""
        ...


class StatusWriter:
    """Pending status changes per resource, and the workers that patch them."""

    def __init__(self, api: StatusApi, cache: ObjectCache, on_gone: Callable[[Key, str], None],
                 workers: int = 4, retry_seconds: float = 1.0,
                 gate: Callable[[], Awaitable[None]] | None = None) -> None:  # fmt: skip
        self._api, self._cache, self._on_gone = api, cache, on_gone
        self._gate = gate
        self._workers, self._retry = workers, retry_seconds
        #: key -> (the uid the changes are for, the changes).
        self._pending: dict[Key, tuple[str, dict[str, Any]]] = {}
        #: What to do once a resource's pending changes are written (post their Events).
        self._after: dict[Key, list[Callable[[], None]]] = {}
        self._order: asyncio.Queue[Key] = asyncio.Queue()
        self._queued: set[Key] = set()
        self._busy: set[Key] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.patches = 0
        #: Patches the API server refused as invalid (422), dropped rather than retried.
        self.rejected = 0

    def effective(self, key: Key, uid: str, status: Mapping[str, Any]) -> dict[str, Any]:
        """The cached status with the changes not yet confirmed for this uid laid over it."""
        pending = self._pending.get(key)
        if pending is None or pending[0] != uid:
            return dict(status)
        return {**status, **pending[1]}

    def submit(self, key: Key, uid: str, changes: Mapping[str, Any],
               after: Callable[[], None] | None = None) -> None:  # fmt: skip
        """Queue changed status keys (later values of a key replace earlier ones); call
        `after` once a patch carrying them has been written."""
        pending = self._pending.get(key)
        if pending is None or pending[0] != uid:
            pending = self._pending[key] = (uid, {})
            self._after.pop(key, None)  # a namesake's Events tell of another resource
        pending[1].update(changes)
        if after is not None:
            self._after.setdefault(key, []).append(after)
        self._enqueue(key)

    def forget(self, key: Key, uid: str | None = None) -> None:
        """Drop what is pending for a resource that is gone (for this uid, or any)."""
        pending = self._pending.get(key)
        if pending is not None and uid in (None, pending[0]):
            del self._pending[key]
            self._after.pop(key, None)
        self._check_idle()

    @staticmethod
    def _run(then: list[Callable[[], None]]) -> None:
        for fn in then:
            fn()

    def _enqueue(self, key: Key) -> None:
        if key in self._queued or key in self._busy or key not in self._pending:
            return
        self._queued.add(key)
        self._idle.clear()
        self._order.put_nowait(key)

    def _check_idle(self) -> None:
        if not self._queued and not self._busy and not self._pending:
            self._idle.set()

    async def idle(self) -> None:
        """Wait until every change has been written (or dropped)."""
        await self._idle.wait()

    def start(self) -> list[asyncio.Task[None]]:
        """Start the patching workers; return their tasks."""
        return [asyncio.create_task(self._work(), name=f"status-writer-{i}")
                for i in range(self._workers)]  # fmt: skip

    def _settle(self, key: Key, uid: str, sent: Mapping[str, Any]) -> None:
        """Drop the sent values that nothing replaced meanwhile; queue the rest."""
        pending = self._pending.get(key)
        if pending is None:
            return
        if pending[0] != uid:
            self._enqueue(key)  # a namesake's changes, which waited behind this patch
            return
        left = pending[1]
        for name, value in sent.items():
            if name in left and left[name] == value:
                del left[name]
        if not left:
            del self._pending[key]
        else:
            self._enqueue(key)

    async def _work(self) -> None:
        while True:
            key = await self._order.get()
            if self._gate is not None:
                await self._gate()  # children before status, while reconciles are waiting
            self._queued.discard(key)
            uid, sent = self._pending.get(key) or ("", {})
            sent = dict(sent)
            then = self._after.pop(key, [])
            if not sent:
                self._run(then)
                self._check_idle()
                continue
            cached = self._cache.peek(VDP, *key)
            if cached is None or cached["metadata"].get("uid") != uid:
                # The resource these changes were for is gone; another may have its name.
                self.forget(key, uid)
                continue
            self._busy.add(key)
            retry = False
            try:
                obj = await self._api.patch_status(VDP, key[0], key[1], sent)
            except ApiException as exc:
                obj = None
                if exc.status == 404:
                    self.forget(key, uid)
                    self._on_gone(key, uid)
                elif exc.status == 422:
                    self.rejected += 1
                    log.error("Status of %s/%s refused as invalid, dropped: HTTP 422 %s",
                              *key, api_message(exc))  # fmt: skip
                    self._settle(key, uid, sent)
                    # What the reconcile decided stands; only its record was refused. Its
                    # Events still say it (a successor would meet the same 422).
                    self._run(then)
                else:
                    retry = True
                    log.warning("Status of %s/%s not written: HTTP %s %s; retrying", *key,
                                exc.status, api_message(exc))  # fmt: skip
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                obj, retry = None, True
                log.warning("Status of %s/%s not written: %r; retrying", *key, exc)
            finally:
                self._busy.discard(key)
            if obj is None:
                if retry and key in self._pending:
                    self._after[key] = then + self._after.get(key, [])
                    asyncio.get_running_loop().call_later(self._retry, self._enqueue, key)
                elif key in self._pending:
                    self._enqueue(key)  # changes submitted while the refused patch was out
                self._check_idle()
                continue
            self.patches += 1
            self._cache.wrote(VDP, obj)
            self._run(then)
            self._settle(key, uid, sent)
            self._check_idle()
