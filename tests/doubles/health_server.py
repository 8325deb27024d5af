#!/usr/bin/env python3
"""Test double for vLLM's HTTP surface as a probe sees it: GET /health answers 200, and with
--ranks N, GET /metrics answers vLLM 0.33's per-engine series for DP ranks 0..N-1.

Run inside the test bed's pod network namespace (`ip netns exec <ns> ...`), where it answers
for every simulated pod IP on --port. Standard library only. Never shipped in an image.
"""

import argparse
import http.server
import json
import threading
import time
from typing import ClassVar

MODEL = 'model_name="double"'


def exposition(ranks: int) -> str:
    """What vLLM's API server reports for `ranks` engines, in its format and label names:
    rank r runs r + 1 requests, has r waiting and a KV cache (r + 1) / 10 full."""
    lines = []
    for name, kind, value in (
        ("vllm:num_requests_running", "gauge", lambda r: float(r + 1)),
        ("vllm:num_requests_waiting", "gauge", lambda r: float(r)),
        ("vllm:kv_cache_usage_perc", "gauge", lambda r: (r + 1) / 10),
        ("vllm:request_success_total", "counter", lambda r: float(10 * (r + 1))),
    ):
        lines += [f"# HELP {name} Test double.", f"# TYPE {name} {kind}"]
        lines += [f'{name}{{engine="{r}",{MODEL}}} {value(r)}' for r in range(ranks)]
    name = "vllm:time_to_first_token_seconds"
    lines += [f"# HELP {name} Test double.", f"# TYPE {name} histogram"]
    for r in range(ranks):
        for le, n in (("0.1", 4.0), ("1.0", 9.0), ("+Inf", 10.0)):
            lines.append(f'{name}_bucket{{engine="{r}",le="{le}",{MODEL}}} {n}')
        lines += [f'{name}_count{{engine="{r}",{MODEL}}} 10.0',
                  f'{name}_sum{{engine="{r}",{MODEL}}} 2.5']
    return "\n".join(lines) + "\n"


class Handler(http.server.BaseHTTPRequestHandler):
    """/health: 200 and empty, like vLLM once its engines are up; /v1/models: one model;
    /metrics: the per-engine series of --ranks ranks (404 without); POST /v1/completions and
    /v1/chat/completions: one token.

    For tests: POST /_double/only {"addresses": [...]} has only those pod IPs answer (the
    others' /health and completions 503, an engine still loading; null: all answer again), and
    GET /_double/log lists every completion asked, with the pod IP it reached and its time."""

    ranks = 0
    only: ClassVar[set[str] | None] = None
    asked: ClassVar[list[dict[str, object]]] = []
    lock = threading.Lock()

    def _address(self) -> str:
        return str(self.connection.getsockname()[0])

    def _serves(self) -> bool:
        return self.only is None or self._address() in self.only

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        size = int(self.headers.get("Content-Length") or 0)
        request = json.loads(self.rfile.read(size) or b"null")
        if self.path == "/_double/only":
            addresses = (request or {}).get("addresses")
            Handler.only = None if addresses is None else set(addresses)
            self._send(200, b"{}")
        elif self.path in ("/v1/completions", "/v1/chat/completions"):
            with self.lock:
                Handler.asked.append({"path": self.path, "address": self._address(),
                                      "time": time.time(), "request": request})
            if not self._serves():
                self._send(503, b"")
                return
            self._send(200, json.dumps({"object": "text_completion", "model": "double",
                                        "choices": [{"index": 0, "text": "."}]}).encode())
        else:
            self.send_error(404)

    def do_GET(self) -> None:
        if self.path == "/health":
            if not self._serves():
                self._send(503, b"")
                return
            body = b""
        elif self.path == "/_double/log":
            with self.lock:
                body = json.dumps(self.asked).encode()
        elif self.path == "/metrics" and self.ranks:
            body = exposition(self.ranks).encode()
        elif self.path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": "double"}]}).encode()
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--ranks", type=int, default=0, help="DP ranks /metrics reports")
    args = parser.parse_args()
    Handler.ranks = args.ranks
    http.server.ThreadingHTTPServer(("0.0.0.0", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
