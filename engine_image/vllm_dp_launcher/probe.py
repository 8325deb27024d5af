"""The probe that runs as a Ray task on each GPU node and dials the launcher over ZMQ.

This module is shipped to the nodes by value (see ``preflight``), so it must only import
what every Ray node has: the standard library, Ray and pyzmq.
"""

from __future__ import annotations

import socket
import time
from typing import Any


def _tcp_error(host: str, port: int, timeout: float) -> str | None:
    """Return why a plain TCP connection to host:port fails, or None when it opens."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def probe_launcher(
    host: str, port: int, token: str, reply_timeout: float, deadline: float | None = None
) -> dict[str, Any]:
    """Connect a DEALER to the launcher's ROUTER, say hello, and wait for its answer.

    ``deadline`` (seconds since the epoch) is when the launcher stops waiting for this
    result, less the time to send it back: the first task on a node waits for a Ray worker
    to start (seconds, on a busy node), so the wait here shrinks to still report in time.
    """
    import ray
    import zmq

    if deadline is not None:
        reply_timeout = max(0.2, min(reply_timeout, deadline - time.time()))
    node_ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    node_id = ray.get_runtime_context().get_node_id()
    host_part = f"[{host}]" if ":" in host else host
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    started = time.monotonic()
    try:
        sock.connect(f"tcp://{host_part}:{port}")
        sock.send_multipart([token.encode(), node_id.encode(), node_ip.encode()])
        if sock.poll(int(reply_timeout * 1000), zmq.POLLIN):
            answer = sock.recv_multipart()
            ok = answer[:1] == [token.encode()]
            return {"ok": ok, "nodeId": node_id, "ip": node_ip, "detail": "" if ok else "bad reply"}
        tcp = _tcp_error(host, port, timeout=min(2.0, reply_timeout))
        detail = f"no reply within {time.monotonic() - started:.1f}s"
        detail += f"; a plain TCP connect fails too ({tcp})" if tcp else "; plain TCP connects"
        return {"ok": False, "nodeId": node_id, "ip": node_ip, "detail": detail}
    finally:
        sock.close()
        ctx.term()
