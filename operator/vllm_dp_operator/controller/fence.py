"""The last checks of a gated write: once its HTTP connection is in hand, and as its bytes go.

`GatedApi` checks the gate when a write is called. Between that check and the request leaving,
the write may wait for a connection or a TLS handshake, and a process frozen there (SIGSTOP, a
paused VM) would send it after it wakes, when another replica may lead. So a gated write runs
with its gate marked on its task (`_WRITING`), and every HTTP session that carries writes
(`fenced_session`) checks it again:
- after the connection is made or reused (the hooks of `fence_trace()`): a request without a
  body is written right after, with no await between;
- as a body is written (`FencedRequest`): aiohttp writes the headers and a body from a task of
  their own, which on this Python runs a loop turn later, and a busy loop's turn is
  milliseconds. A leader frozen in that turn while posting Events sent one after its wake
  (the control-plane failover test, CI of 2026-12-05).
What is left is a few synchronous lines before the socket's send; the API server offers no
fencing token for a create that would close that gap.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from types import SimpleNamespace
from typing import Any, Protocol, TypeVar

import aiohttp
from aiohttp.abc import AbstractStreamWriter
from aiohttp.connector import Connection

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


class FencedRequest(aiohttp.ClientRequest):
    """A request whose body, when it has one, is written only while its write gate holds: the
    task that writes it carries the gated write's context, so the mark is seen there."""

    async def write_bytes(
        self, writer: AbstractStreamWriter, conn: Connection, content_length: int | None = None,
    ) -> None:  # fmt: skip
        gate = _WRITING.get()
        if gate is not None and conn.protocol is not None:
            try:
                gate.check()
            except Exception as exc:
                # Nothing was sent (the headers wait for the body): the caller's wait for the
                # answer raises this, and the connection is not reused.
                conn.protocol.set_exception(exc)
                conn.close()
                return
        await super().write_bytes(writer, conn, content_length)


def fenced_session(**kwargs: Any) -> aiohttp.ClientSession:
    """A session for gated writes: both checks of this module, beside the caller's settings."""
    return aiohttp.ClientSession(trace_configs=[fence_trace()], request_class=FencedRequest,
                                 **kwargs)  # fmt: skip


def fence_trace() -> aiohttp.TraceConfig:
    """Hooks that check a gated write's gate again once its connection is in hand."""
    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(_check_marked_gate)
    trace.on_connection_reuseconn.append(_check_marked_gate)
    return trace
