"""A log of watch events as a client sees them, with the moment each arrived.

Used by the control-plane tier and by the benchmark (bench/controlplane.py) to time what the
operator and KubeRay do: both ends of an interval are taken on the same kind of watch, so the
watch's own delivery delay appears on both sides.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_dp_operator.controller.kube import ApiKube, Kind


@dataclass(frozen=True)
class Seen:
    """One watch event and when this process received it (time.perf_counter())."""

    t: float
    kind: Kind
    type: str
    obj: dict[str, Any]

    @property
    def name(self) -> str:
        name: str = self.obj["metadata"]["name"]
        return name


class WatchLog:
    """Follows some kinds in one namespace from now on, keeping every event in order."""

    def __init__(self, api: ApiKube, namespace: str, kinds: Sequence[Kind], selector: str = ""):
        self.api, self.namespace, self.kinds, self.selector = api, namespace, kinds, selector
        self.seen: list[Seen] = []
        self._new = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> WatchLog:
        for kind in self.kinds:
            page = await self.api.list_page(kind, self.namespace, self.selector, 1, None)
            rv = page["metadata"]["resourceVersion"]
            self._tasks.append(asyncio.create_task(self._follow(kind, rv)))
        return self

    async def __aexit__(self, *_: object) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _follow(self, kind: Kind, rv: str) -> None:
        while True:
            async for event in self.api.watch(kind, self.namespace, self.selector, rv, 600):
                obj = event.get("object") or {}
                rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                    self.seen.append(Seen(time.perf_counter(), kind, event["type"], obj))
                    self._new.set()

    async def wait_until(self, what: str, done: Callable[[], bool], timeout: float) -> None:
        """Re-check `done` after each new event until it holds; fail naming `what`."""
        if not done():
            await self.wait_for(what, lambda _: done(), timeout, since=len(self.seen))

    async def wait_for(
        self, what: str, match: Callable[[Seen], bool], timeout: float, since: int = 0
    ) -> Seen:
        """The first event from index `since` on that matches; fail naming `what` after timeout."""
        deadline = time.monotonic() + timeout
        checked = since
        while True:
            for seen in self.seen[checked:]:
                if match(seen):
                    return seen
            checked = len(self.seen)
            left = deadline - time.monotonic()
            if left <= 0:
                tail = [(s.kind.plural, s.type, s.name) for s in self.seen[-10:]]
                raise AssertionError(f"timed out after {timeout}s waiting for {what}; "
                                     f"last events: {tail}")  # fmt: skip
            self._new.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new.wait(), timeout=left)
