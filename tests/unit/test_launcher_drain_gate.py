"""The launcher's drain gate in front of vLLM (vllm_dp_launcher.drain_gate): the operator's
call turns it on, then every answer closes its connection and client requests are timed."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from vllm_dp_launcher.drain_gate import PATH, DrainGate, clear

TOKEN = "tok-123"
OPERATOR = [(b"x-ray-authorization", f"Bearer {TOKEN}".encode())]


class Inner:
    """Stands in for vLLM's app behind the middleware: answers 200, kept alive."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.paths.append(scope["path"])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"),
                                (b"connection", b"keep-alive")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"ok"})


async def call(gate: DrainGate, path: str, method: str = "GET",
               headers: list[tuple[bytes, bytes]] | None = None
               ) -> tuple[int, dict[bytes, bytes], bytes]:  # fmt: skip
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await gate({"type": "http", "method": method, "path": path, "headers": headers or []},
               receive, send)  # fmt: skip
    start = sent[0]
    return (start["status"], {k.lower(): v for k, v in start["headers"]},
            b"".join(m.get("body", b"") for m in sent[1:]))


async def test_before_the_drain_answers_keep_their_connection(tmp_path: Path) -> None:
    inner = Inner()
    gate = DrainGate(inner, token=TOKEN, flag=str(tmp_path / "flag"))
    status, headers, _ = await call(gate, "/v1/completions", "POST")
    assert status == 200 and headers[b"connection"] == b"keep-alive"
    assert not (tmp_path / "flag").exists()


async def test_the_drain_is_the_operators_call(tmp_path: Path) -> None:
    inner = Inner()
    gate = DrainGate(inner, token=TOKEN, flag=str(tmp_path / "flag"))
    for headers in ([], [(b"x-ray-authorization", b"Bearer wrong")],
                    [(b"authorization", f"Bearer {TOKEN}".encode())]):
        status, _, _ = await call(gate, PATH, "POST", headers)
        assert status == 403, headers
    assert (await call(gate, PATH, "GET", OPERATOR))[0] == 405
    assert not (tmp_path / "flag").exists() and inner.paths == []
    # Ray auth off (no token in the pod): the call is open; it only closes connections.
    status, _, body = await call(DrainGate(inner, token="", flag=str(tmp_path / "f2")), PATH,
                                 "POST")  # fmt: skip
    assert status == 200 and json.loads(body)["draining"] is True


async def test_once_draining_every_answer_closes_and_client_requests_are_timed(
    tmp_path: Path,
) -> None:
    flag = tmp_path / "flag"
    inner = Inner()
    gate = DrainGate(inner, token=TOKEN, flag=str(flag))
    status, headers, body = await call(gate, PATH, "POST", OPERATOR)
    assert status == 200 and headers[b"connection"] == b"close"
    answer = json.loads(body)
    assert answer["draining"] is True and 0 <= answer["idleSeconds"] < 1, answer
    # Another API server process of the same head sees the same mark.
    other = DrainGate(Inner(), token=TOKEN, flag=str(flag))
    for g in (gate, other):
        status, headers, _ = await call(g, "/v1/completions", "POST")
        assert status == 200 and headers[b"connection"] == b"close"
        assert list(headers).count(b"connection") == 1
    # A client request resets the quiet time; the probes do not.
    past = time.time() - 30
    os.utime(flag, (past, past))
    for probe in ("/health", "/metrics"):
        status, headers, _ = await call(gate, probe)
        assert status == 200 and headers[b"connection"] == b"close"
    idle = json.loads((await call(gate, PATH, "POST", OPERATOR))[2])["idleSeconds"]
    assert 29 < idle < 40, idle
    await call(gate, "/v1/chat/completions", "POST")
    idle = json.loads((await call(gate, PATH, "POST", OPERATOR))[2])["idleSeconds"]
    assert idle < 5, idle


async def test_a_new_head_job_forgets_an_earlier_drain(tmp_path: Path) -> None:
    flag = tmp_path / "flag"
    gate = DrainGate(Inner(), token=TOKEN, flag=str(flag))
    await call(gate, PATH, "POST", OPERATOR)
    clear(str(flag))
    clear(str(flag))  # nothing there: no error
    status, headers, _ = await call(gate, "/v1/completions", "POST")
    assert status == 200 and headers[b"connection"] == b"keep-alive"


async def test_websockets_and_lifespan_pass_untouched(tmp_path: Path) -> None:
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    gate = DrainGate(app, token=TOKEN, flag=str(tmp_path / "flag"))
    await gate({"type": "lifespan"}, None, None)  # type: ignore[arg-type]
    assert seen == ["lifespan"]
