#!/usr/bin/env python3
"""`vllm` for the kind e2e engine-double image: tests/doubles/vllm behind an OpenAI-style front.

tests/doubles/vllm records its argv/env/signals and serves /health on loopback only. This
wrapper runs it unchanged on a private loopback port and serves, on the --host/--port the
launcher asked for (reachable through the Service):

- GET /health: the double's own /health (503 once it is gone);
- GET /v1/models, POST /v1/completions, POST /v1/chat/completions: canned OpenAI-shaped
  answers naming the served model;
- GET /metrics: the double's own per-engine series (vLLM's names and labels, idle ranks);
- GET /double/argv: the argv it was started with (what the e2e test asserts on);
- POST /vllmdp/drain: the launcher's drain gate (vllm_dp_launcher/drain_gate.py): from then
  on every answer carries `Connection: close`, and the call answers how long no client
  request came.

A model given as an absolute path that does not exist ends it at once with exit code 1, as
`vllm serve` ends when it finds no model there: a generation that never serves.

Connections are handled as vLLM's API server (uvicorn) handles them: HTTP/1.1, kept alive until
idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds, a listen backlog of 2048. The first
SIGTERM/SIGINT stops it as uvicorn stops: no new connection is accepted, idle ones are closed
at once, a request being answered finishes with `Connection: close`; then the signal goes to
the double, and the wrapper exits with the double's exit code. Later signals go to the double
at once. When the double ends by itself (a dead engine), the wrapper ends with it. Test-only,
standard library only; never published.
"""

import contextlib
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
#: What vLLM's API server does: an idle connection closed after VLLM_HTTP_TIMEOUT_KEEP_ALIVE
#: seconds (5 unless set; the launcher sets 75), uvicorn's listen backlog of 2048. With
#: http.server's own (HTTP/1.0, a connection closed after each answer, a backlog of 5), a
#: kept-alive client was a new-connection client here, and new connections lost SYNs whenever
#: the process stalled for a quarter of a second on a busy host.
KEEP_ALIVE_S = float(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE") or 5)
BACKLOG = 2048
#: Named in every answer's X-Served-By (the pod's name in a pod), so a test's client can tell
#: which replica or generation answered it.
HOSTNAME = socket.gethostname()
#: Longest a stop waits for the requests being answered.
STOP_WAIT_S = 5.0


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


class Connections:
    """The open connections, and which are inside a request, so a stop closes the idle ones
    and lets the busy ones finish (uvicorn's shutdown)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.busy = {}  # handler -> inside a request
        self.stopping = False

    def mark(self, handler, busy):
        with self.lock:
            self.busy[handler] = busy

    def forget(self, handler):
        with self.lock:
            self.busy.pop(handler, None)

    def stop(self):
        """Close every idle connection; later answers carry `Connection: close`."""
        with self.lock:
            self.stopping = True
            idle = [h for h, busy in self.busy.items() if not busy]
        for h in idle:
            with contextlib.suppress(OSError):  # already closed by its client
                h.connection.shutdown(socket.SHUT_RDWR)

    def wait_busy(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if not any(self.busy.values()):
                    return
            time.sleep(0.02)


CONNS = Connections()


class Drain:
    """The launcher's drain gate (vllm_dp_launcher/drain_gate.py), as the double serves it:
    once the operator has called POST /vllmdp/drain, every answer carries `Connection: close`,
    and the call says how long no client request came."""

    PROBES = ("/health", "/metrics", "/ping", "/load", "/version")

    def __init__(self):
        self.lock = threading.Lock()
        self.since = None  # monotonic time of the last client request, once draining

    def start(self):
        with self.lock:
            if self.since is None:
                self.since = time.monotonic()
            return max(0.0, time.monotonic() - self.since)

    def request(self, path):
        """Whether answers close their connection; a client request is marked."""
        with self.lock:
            if self.since is not None and path not in self.PROBES:
                self.since = time.monotonic()
            return self.since is not None


DRAIN = Drain()


class Server(http.server.ThreadingHTTPServer):
    request_queue_size = BACKLOG


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = KEEP_ALIVE_S  # an idle kept connection is closed after this

    def setup(self):
        super().setup()
        CONNS.mark(self, False)

    def finish(self):
        CONNS.forget(self)
        super().finish()

    def parse_request(self):
        CONNS.mark(self, True)  # a request line came: busy until its answer is written
        return super().parse_request()

    def handle_one_request(self):
        self.closing = False
        try:
            super().handle_one_request()
        finally:
            CONNS.mark(self, False)

    def end_headers(self):
        self.send_header("X-Served-By", HOSTNAME)  # what the traffic client counts by
        if CONNS.stopping or getattr(self, "closing", False):
            self.send_header("Connection", "close")
            self.close_connection = True
        super().end_headers()

    def _json(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.closing = DRAIN.request(self.path)
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
        if self.path == "/vllmdp/drain":
            idle = DRAIN.start()
            self.closing = True
            self._json(200, {"draining": True, "idleSeconds": round(idle, 3)})
            return
        self.closing = DRAIN.request(self.path)
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
    server = Server((HOST, PORT), Handler)
    # A short poll, so a stop closes the listening socket within 50 ms, as uvicorn does at once.
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    asked = []  # the first stop signal

    def on_signal(signum, _frame):
        if asked:
            child.send_signal(signum)
        else:
            asked.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while child.poll() is None and not asked:
        time.sleep(0.05)
    if asked:
        server.shutdown()
        server.server_close()  # no new connection: the listening socket goes
        CONNS.stop()
        CONNS.wait_busy(STOP_WAIT_S)
        child.send_signal(asked[0])
    code = child.wait()
    sys.exit(code)


if __name__ == "__main__":
    main()
