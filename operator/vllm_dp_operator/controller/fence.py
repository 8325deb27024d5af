"""The last check of a gated write: once its HTTP connection is in hand.

`GatedApi` checks the gate when a write is called. Between that check and the request leaving,
the write may wait for a connection or a TLS handshake, and a process frozen there (SIGSTOP, a
paused VM) would send it after it wakes, when another replica may lead. So a gated write runs
with its gate marked on its task (`_WRITING`), and the hooks of `fence_trace()`, installed on
every HTTP session that carries writes, check it again after the connection is made or reused:
the last await before aiohttp writes the request. What is left is a few synchronous lines; the
API server offers no fencing token for a create that would close that gap.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from types import SimpleNamespace
from typing import Protocol, TypeVar

import aiohttp

T = TypeVar("T")


class WriteGate(Protocol):
    """Raises when this process must not write (lease.LeaderElector)."""

    def check(self) -> None:
        """Raise NotLeading unless writes are allowed now."""
        ...


#: The gate of the write this task is sending, for the check at the connection.
_WRITING: ContextVar[WriteGate | None] = ContextVar("vllmdp_writing", default=None)


async def gated(gate: WriteGate, send: Callable[[], Awaitable[T]]) -> T:
    """Check the gate, then send with the gate marked for the check at the connection."""
    gate.check()
    token = _WRITING.set(gate)
    try:
        return await send()
    finally:
        _WRITING.reset(token)


async def _check_marked_gate(_session: aiohttp.ClientSession, _ctx: SimpleNamespace,
                             _params: object) -> None:  # fmt: skip
    gate = _WRITING.get()
    if gate is not None:
        gate.check()  # raised here, it aborts the request before a byte of it is sent


def fence_trace() -> aiohttp.TraceConfig:
    """Hooks that check a gated write's gate again once its connection is in hand."""
    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(_check_marked_gate)
    trace.on_connection_reuseconn.append(_check_marked_gate)
    return trace
