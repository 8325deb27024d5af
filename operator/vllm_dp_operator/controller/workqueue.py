"""A deduplicating work queue of resource keys, shaped like client-go's workqueue.

- A key waits in the queue at most once: a burst of events for one resource is one reconcile.
- Urgent keys (resources not reconciled yet) go first: in a burst of new resources, their
  children are made before anything is looked at again.
- A key is never handed to two workers at once; an add while it is processed marks it dirty,
  and it is queued again once the worker is done (so no event is lost).
- `add_after` schedules a key on the event loop's clock (`call_at`), keeping only the earliest
  deadline per key: waits are scheduled, never polled.
- `add_rate_limited` backs a failing key off exponentially; `forget` resets it after a success.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class ShutDown(Exception):
    """The queue was shut down while a worker waited on it."""


class WorkQueue(Generic[K]):
    """Keys to reconcile, each at most once queued and at most once in flight."""

    def __init__(self, backoff_base: float = 0.5, backoff_cap: float = 300.0) -> None:
        self._order: asyncio.Queue[K] = asyncio.Queue()
        self._urgent: deque[K] = deque()
        self._queued: set[K] = set()
        self._processing: set[K] = set()
        self._dirty: set[K] = set()
        self._timers: dict[K, tuple[float, asyncio.TimerHandle]] = {}
        self._failures: dict[K, int] = {}
        self._backoff_base = backoff_base
        self._backoff_cap = backoff_cap
        self._shut = False
        #: Set while no key waits and none is in flight (scheduled adds do not count).
        self.idle = asyncio.Event()
        self.idle.set()
        #: Keys handed to workers, and scheduled adds that fired, since start.
        self.handed_out = 0
        self.fired = 0

    def __len__(self) -> int:
        return len(self._queued)

    @property
    def in_flight(self) -> int:
        """Keys a worker holds right now."""
        return len(self._processing)

    @property
    def scheduled(self) -> int:
        """Keys with a pending delayed add."""
        return len(self._timers)

    def add(self, key: K, urgent: bool = False) -> None:
        """Queue a key now, unless it already waits; mark it dirty if it is in flight.

        An urgent key (a resource never reconciled yet) is handed out before the others.
        """
        if self._shut:
            return
        if key in self._processing:
            self._dirty.add(key)
            return
        if urgent:
            self._urgent.append(key)  # its entry in the FIFO below is skipped when reached
        if key in self._queued:
            return
        self._queued.add(key)
        self.idle.clear()
        self._order.put_nowait(key)  # also wakes a waiting worker for an urgent key

    def add_after(self, key: K, delay: float) -> None:
        """Queue a key after `delay` seconds; an earlier pending deadline wins."""
        if self._shut:
            return
        if delay <= 0:
            self.add(key)
            return
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        pending = self._timers.get(key)
        if pending is not None:
            if pending[0] <= due:
                return
            pending[1].cancel()
        self._timers[key] = (due, loop.call_at(due, self._fire, key))

    def due_in(self, key: K) -> float | None:
        """Seconds until a key's scheduled add, or None when none is pending."""
        pending = self._timers.get(key)
        if pending is None:
            return None
        return max(0.0, pending[0] - asyncio.get_running_loop().time())

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self.fired += 1
        self.add(key)

    def add_rate_limited(self, key: K) -> float:
        """Queue a failing key after its backoff (base x 2^failures, capped); return it."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        delay = min(self._backoff_base * 2.0**failures, self._backoff_cap)
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        """Reset a key's failure count (after a successful reconcile)."""
        self._failures.pop(key, None)

    def drop(self, key: K) -> None:
        """Forget everything about a key whose resource is gone: timers, failures, dirt."""
        pending = self._timers.pop(key, None)
        if pending is not None:
            pending[1].cancel()
        self._failures.pop(key, None)
        self._dirty.discard(key)

    async def get(self) -> K:
        """Wait for the next key and mark it in flight; raise ShutDown once shut down."""
        while True:
            if self._shut:
                raise ShutDown
            key = self._urgent.popleft() if self._urgent else await self._order.get()
            if self._shut:
                raise ShutDown
            if key not in self._queued:  # handed out already, or a sentinel from shutdown
                continue
            self._queued.discard(key)
            self._processing.add(key)
            self.handed_out += 1
            return key

    def done(self, key: K) -> None:
        """A worker finished a key; queue it again if it was added meanwhile."""
        self._processing.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)
        if not self._queued and not self._processing:
            self.idle.set()

    def shutdown(self, workers: int = 1) -> None:
        """Stop handing out keys and wake every waiting worker."""
        self._shut = True
        for _, handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        for _ in range(workers):
            self._order.put_nowait(None)  # type: ignore[arg-type]
