#!/usr/bin/env python3
"""Test double for vLLM's HTTP surface as a probe sees it: GET /health answers 200, and with
--ranks N, GET /metrics answers vLLM 0.33's per-engine series for DP ranks 0..N-1.

Run inside the test bed's pod network namespace (`ip netns exec <ns> ...`), where it answers
for every simulated pod IP on --port. Standard library only. Never shipped in an image.
"""

import argparse
import http.server
import json

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
    /metrics: the per-engine series of --ranks ranks (404 without)."""

    ranks = 0

    def do_GET(self) -> None:
        if self.path == "/health":
            body = b""
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
