"""Kept-alive connections leave a head before its engines stop (`--middleware` of vllm serve).

When the operator takes a head out of its Service (a Surge's old generation after the
switch, a replica that leaves), new connections go elsewhere, but a client's kept-alive
connections stay on this head: kube-proxy keeps an established flow on a removed endpoint.
vLLM's own shutdown closes idle connections at once, and a client that sends on one just then
gets a reset. So the operator first calls `POST /vllmdp/drain` here; from then on every answer
carries `Connection: close`, and each kept connection leaves after its next answer, told by
the server rather than cut. The answer says how long no client request came
(`idleSeconds`): the operator stops the engines once no request runs and none came for a
while.

The mark is a file, shared by every API server process of the head (`--api-server-count`);
each client request while it is there touches it, so its age is the time since the last one.
The call needs the Ray cluster's token where there is one, in the header the operator sends
Ray (only the Ray pods, KubeRay and the operator hold it). The probes (`/health`, `/metrics`)
and the drain call itself are not client requests.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from vllm_dp_launcher.asgi import App, Message, Receive, Scope, Send, carries_token, normal_path

#: What vllm serve is given.
MIDDLEWARE = "vllm_dp_launcher.drain_gate.DrainGate"
#: The operator's call (vllm_dp_operator.engines.drain).
PATH = "/vllmdp/drain"
#: Where the mark is (every API server process of the head sees the same file).
FLAG_ENV = "VLLMDP_DRAIN_FLAG"
DEFAULT_FLAG = "/tmp/vllmdp-draining"
#: Not a client's request: they neither keep a drain going nor are told to close.
PROBES = ("/health", "/metrics", "/ping", "/load", "/version")


class DrainGate:
    """Answers the operator's drain call; once draining, closes each connection after its
    answer and marks the time of each client request."""

    def __init__(self, app: App, token: str | None = None, flag: str | None = None) -> None:
        self.app = app
        self._token = token if token is not None else os.environ.get("RAY_AUTH_TOKEN", "")
        self._flag = Path(flag or os.environ.get(FLAG_ENV) or DEFAULT_FLAG)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        path = normal_path(str(scope.get("path", "")))
        if path == PATH:
            await self._drain_call(scope, send)
            return
        if not self._flag.exists():
            await self.app(scope, receive, send)
            return
        if path not in PROBES:
            self._touch()
        await self.app(scope, receive, _closing(send))

    async def _drain_call(self, scope: Scope, send: Send) -> None:
        if scope.get("method") != "POST":
            await _answer(send, 405, {"error": "POST only"})
            return
        # With Ray auth off (no token in the pod) the call is open: it only closes connections.
        if self._token and not carries_token(scope.get("headers") or [], self._token):
            await _answer(send, 403, {"error": "the drain is the vllm-dp-operator's call"})
            return
        if not self._flag.exists():
            self._touch()  # the drain starts now: as if a request had just come
        idle = max(0.0, time.time() - self._flag.stat().st_mtime)
        await _answer(send, 200, {"draining": True, "idleSeconds": round(idle, 3)},
                      close=True)  # fmt: skip

    def _touch(self) -> None:
        self._flag.touch()  # creates it, or sets its time to now


def clear(flag: str | None = None) -> None:
    """Forget an earlier head job's drain on this pod (the launcher, before vllm serve)."""
    Path(flag or os.environ.get(FLAG_ENV) or DEFAULT_FLAG).unlink(missing_ok=True)


def _closing(send: Send) -> Send:
    """`send` with `Connection: close` on the answer's headers (uvicorn then closes the
    connection once the answer is written)."""

    async def wrapped(message: Message) -> None:
        if message.get("type") == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers") or []
                       if k.lower() != b"connection"]  # fmt: skip
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return wrapped


async def _answer(send: Send, status: int, body: dict[str, Any], close: bool = False) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode())]  # fmt: skip
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
