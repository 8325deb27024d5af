#!/usr/bin/env python3
"""`vllm` for the kind e2e engine-double image: tests/doubles/vllm behind an OpenAI-style front.

tests/doubles/vllm records its argv/env/signals and serves /health on loopback only. This
wrapper runs it unchanged on a private loopback port and serves, on the --host/--port the
launcher asked for (reachable through the Service):

- GET /health: the double's own /health (503 once it is gone);
- GET /v1/models, POST /v1/completions, POST /v1/chat/completions: canned OpenAI-shaped
  answers naming the served model;
- GET /metrics: the double's own per-engine series (vLLM's names and labels, idle ranks);
- GET /double/argv: the argv it was started with (what the e2e test asserts on).

A model given as an absolute path that does not exist ends it at once with exit code 1, as
`vllm serve` ends when it finds no model there: a generation that never serves.

SIGTERM/SIGINT go to the double; the wrapper exits with the double's exit code. Test-only,
standard library only; never published.
"""

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

RECORDER = os.environ.get("VLLMDP_DOUBLE_RECORDER", "/opt/vllm-double/vllm-recorder")


def flag_values(argv, name):
    """Values of --name (space or = form; several values for nargs='+' flags)."""
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith(name + "="):
            out.append(arg.split("=", 1)[1])
        elif arg == name:
            for value in argv[i + 1:]:
                if value.startswith("-"):
                    break
                out.append(value)
    return out


def replace_flag(argv, name, value):
    """argv with --name's value replaced (or appended)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == name:
            skip = True
            continue
        if arg.startswith(name + "="):
            continue
        out.append(arg)
    return [*out, name, value]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ARGV = sys.argv[1:]
MODEL = ARGV[1] if len(ARGV) > 1 and ARGV[0] == "serve" else "unknown"
SERVED = flag_values(ARGV, "--served-model-name") or [MODEL]
HOST = (flag_values(ARGV, "--host") or ["0.0.0.0"])[0]
PORT = int((flag_values(ARGV, "--port") or ["8000"])[0])
if MODEL.startswith("/") and not os.path.exists(MODEL):
    print(f"ValueError: no model at {MODEL!r}: not a directory, and not a model id",
          file=sys.stderr, flush=True)
    sys.exit(1)
INNER = free_port()
os.environ.setdefault("VLLMDP_DOUBLE_RECORD", "/tmp/vllm-double.jsonl")
child = subprocess.Popen([sys.executable, RECORDER, *replace_flag(ARGV, "--port", str(INNER))])


def inner_healthy():
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{INNER}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class Handler(http.server.BaseHTTPRequestHandler):
    def _json(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._json(200 if inner_healthy() else 503, {})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [
                {"id": m, "object": "model", "owned_by": "vllm-dp-double", "root": MODEL}
                for m in SERVED]})
        elif self.path == "/metrics":
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{INNER}/metrics", timeout=2) as r:
                    data = r.read()
            except OSError:
                self._json(503, {})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/double/argv":
            self._json(200, {"argv": ARGV})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        try:
            req = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            self._json(400, {"error": {"message": "body is not JSON"}})
            return
        if req.get("model") not in SERVED:
            self._json(404, {"error": {"message": f"model {req.get('model')!r} not served"}})
            return
        now = int(time.time())
        usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
        if self.path == "/v1/completions":
            self._json(200, {"id": "cmpl-double", "object": "text_completion", "created": now,
                             "model": req["model"], "usage": usage, "choices": [
                                 {"index": 0, "text": " double", "finish_reason": "length"}]})
        elif self.path == "/v1/chat/completions":
            self._json(200, {"id": "chatcmpl-double", "object": "chat.completion",
                             "created": now, "model": req["model"], "usage": usage, "choices": [
                                 {"index": 0, "finish_reason": "stop", "message": {
                                     "role": "assistant", "content": "double"}}]})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def log_message(self, format, *args):
        pass


def main():
    print("vllm-double argv: " + json.dumps(ARGV), flush=True)
    deadline = time.monotonic() + 30
    while not inner_healthy():
        if child.poll() is not None or time.monotonic() > deadline:
            child.kill()
            sys.exit(child.wait() or 1)
        time.sleep(0.1)
    server = http.server.ThreadingHTTPServer((HOST, PORT), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def forward(signum, _frame):
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = child.wait()
    server.shutdown()
    sys.exit(code)


if __name__ == "__main__":
    main()
