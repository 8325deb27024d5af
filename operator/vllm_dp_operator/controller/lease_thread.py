"""The elector's loop on a thread of its own, so renewals never wait for the reconciles.

On the controller's event loop a renewal is one more task: during a burst of creates at scale
that loop was busy long enough (parsing, reconciling, kopf's own work) for the renewals to miss
the 10 s renew deadline, and the leader exited. client-go renews from a goroutine of its own;
here the elector runs on a thread with its own event loop and its own HTTP client
(`ApiLeases` with no client given), so what the controller's loop does cannot delay it. Python
hands the interpreter to another thread every few milliseconds even while one computes, so a
renewal waits at most that long for the CPU.

The gate stays a matter of the clock: `may_write()` (read by the controller's thread on every
write) is true only while the last renewal was sent within the renew deadline, whichever thread
asks. Of the elector's two callbacks, `on_started` runs on the controller's loop (it starts the
workers); `on_stopped` runs on the election thread at once, so a lost Lease is acted on even
while the controller's loop is busy: it must be safe to call from any thread (the operator's
exits the process).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable

from vllm_dp_operator.controller.lease import LeaderElector

log = logging.getLogger(__name__)


class ElectionThread:
    """Runs one LeaderElector's acquire-and-renew loop on a thread and event loop of its own."""

    def __init__(self, elector: LeaderElector,
                 close: Callable[[], Awaitable[None]] | None = None) -> None:  # fmt: skip
        #: `close`: what to close on the election loop once it is done (its HTTP client).
        self.elector, self._close = elector, close
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._release = False
        self._running = threading.Event()

    def start(self, on_started: Callable[[], None], on_stopped: Callable[[], None]) -> None:
        """Start electing; `on_started` is called on the calling loop once this leads,
        `on_stopped` on the election thread once leadership is lost."""
        main = asyncio.get_running_loop()

        def started() -> None:
            with contextlib.suppress(RuntimeError):  # the controller's loop closed meanwhile
                main.call_soon_threadsafe(on_started)

        self._thread = threading.Thread(target=self._main, args=(started, on_stopped),
                                        name="lease-election", daemon=True)  # fmt: skip
        self._thread.start()
        self._running.wait()

    def _main(self, on_started: Callable[[], None], on_stopped: Callable[[], None]) -> None:
        asyncio.run(self._run(on_started, on_stopped))

    async def _run(self, on_started: Callable[[], None], on_stopped: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self.elector.run(on_started, on_stopped),
                                         name="election")  # fmt: skip
        self._running.set()
        try:
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:
                # A bug, not a lost Lease; but a leader that no longer renews must not stay.
                log.exception("Leader election stopped by an error")
                on_stopped()
            if self._release:
                await self.elector.release()
        finally:
            if self._close is not None:
                await self._close()

    async def stop(self, release: bool = True) -> None:
        """Stop renewing and, with `release`, clear the holder; wait for the thread to end."""
        if self._thread is None or self._loop is None or self._task is None:
            return
        self._release = release
        with contextlib.suppress(RuntimeError):  # its loop ended already (leadership lost)
            self._loop.call_soon_threadsafe(self._task.cancel)
        await asyncio.to_thread(self._thread.join)
