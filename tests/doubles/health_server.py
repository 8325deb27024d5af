#!/usr/bin/env python3
"""Test double for vLLM's HTTP surface as a probe sees it: GET /health answers 200.

Run inside the test bed's pod network namespace (`ip netns exec <ns> ...`), where it answers
for every simulated pod IP on --port. Standard library only. Never shipped in an image.
"""

import argparse
import http.server
import json


class Handler(http.server.BaseHTTPRequestHandler):
    """/health: 200 and empty, like vLLM once its engines are up; /v1/models: one model."""

    def do_GET(self) -> None:
        if self.path == "/health":
            body = b""
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
    args = parser.parse_args()
    http.server.ThreadingHTTPServer(("0.0.0.0", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
