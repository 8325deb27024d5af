#!/usr/bin/env python3
"""A client that sends completions without pause and counts what fails (runs in a pod).

    python3 traffic_client.py --url http://10.201.0.7:8000 --model double [--rate 10]

It POSTs /v1/completions (max_tokens 1) to --url at --rate requests a second, open loop
(each started on schedule, whatever the earlier ones do), each on a new connection, so every
request passes kube-proxy's choice of endpoint afresh; with --keep-alive, on connections kept
in a pool instead, as most clients send (a kept-alive connection stays on a pod the Service no
longer routes to: the case a drain must cover). $VLLMDP_API_KEY, when set, goes in
`Authorization: Bearer`; it is never logged.

What counts: every non-2xx answer and every connection error or timeout is a failure, kept with
its send and end times. Counting starts at the first 200 (the client's own start, before the
Service answers, is not a failure) and ends at GET /stop (its own stop neither: answers that land
after it are dropped). A failure's run ends at the next success; each run is an outage.

Port --port serves the counts: GET /ready (200 once the first 200 came back: the pod's
readiness probe), GET /counts (the tally so far), GET /stop (stop sending and counting; the
final tally). Each failure is also printed, so the pod's log tells the same story.

Test-only, standard library only.
"""

from __future__ import annotations

import argparse
import collections
import errno
import http.client
import http.server
import json
import os
import select
import socket
import sys
import threading
import time
import urllib.parse
from typing import Any

#: Failures kept in full, the first half and the latest half; the rest only counted (a long
#: outage at 10/s is thousands, and what fails after it matters as much as how it began).
KEEP_FAILURES = 200


class Tally:
    """Counts of one client run; thread-safe. Times are epoch seconds (the host's clock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started_at = time.time()
        self.first_ok_at: float | None = None
        self.stopped_at: float | None = None
        self.ok = 0
        self.failed = 0
        self.before_first_ok = 0  # failures before the first 200: the client's own start
        self.failures: list[dict[str, Any]] = []
        self._latest: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=KEEP_FAILURES - KEEP_FAILURES // 2)
        # Every counted request as (sent, done, good): outages are runs in the order requests
        # were *sent*. In an open loop answers come back out of order (a timeout lands seconds
        # after later successes), and grouping by answer would split one outage into many.
        self._requests: list[tuple[float, float, bool]] = []
        self.pool: Pool | None = None  # its connections' counts go in the snapshot
        self.go = threading.Event()  # set: sending (--wait-go holds it until GET /go)
        self.served_by: collections.Counter[str] = collections.Counter()  # answers per pod

    def record(self, sent: float, done: float, status: int | None, detail: str,
               served_by: str = "") -> bool:  # fmt: skip
        """Count one request (status None: no HTTP answer); False once stopped."""
        good = status is not None and 200 <= status < 300
        with self.lock:
            if self.stopped_at is not None:
                return False
            if self.first_ok_at is None:
                if not good:
                    self.before_first_ok += 1
                    return True
                self.first_ok_at = done
            elif not good and sent < self.first_ok_at:
                # Sent before any answer came, answered (a timeout) after: the client's own
                # start too, e.g. a new pod the NetworkPolicy enforcer does not know yet.
                self.before_first_ok += 1
                return True
            self._requests.append((sent, done, good))
            if good:
                self.ok += 1
                if served_by:
                    self.served_by[served_by] += 1
                return True
            self.failed += 1
            kept = self.failures if len(self.failures) < KEEP_FAILURES // 2 else self._latest
            kept.append({"sent": round(sent, 3), "done": round(done, 3), "status": status,
                         "detail": detail[:200]})  # fmt: skip
            return True

    def stop(self) -> None:
        with self.lock:
            if self.stopped_at is None:
                self.stopped_at = time.time()

    def snapshot(self) -> dict[str, Any]:
        """The tally as JSON-able data; `counting_s` runs from the first 200 to the stop (or
        now), `rate` is requests a second over it, an outage still open has `to` None."""
        with self.lock:
            end = self.stopped_at or time.time()
            span = end - self.first_ok_at if self.first_ok_at else 0.0
            total = self.ok + self.failed
            outages = _outages(self._requests)
            return {"started_at": self.started_at, "first_ok_at": self.first_ok_at,
                    "stopped_at": self.stopped_at, "counting_s": round(span, 3),
                    "total": total, "ok": self.ok, "failed": self.failed,
                    "rate": round(total / span, 2) if span > 0 else 0.0,
                    "before_first_ok": self.before_first_ok,
                    "failures": [*self.failures, *self._latest], "outages": outages,
                    "served_by": dict(self.served_by),
                    **({"connections": self.pool.stats()} if self.pool else {})}  # fmt: skip


def _outages(requests: list[tuple[float, float, bool]]) -> list[dict[str, Any]]:
    """Runs of failed requests in the order they were sent, each from its first failure's send
    to the answer of the next request sent that succeeded (None while none has)."""
    runs: list[dict[str, Any]] = []
    open_: dict[str, Any] | None = None
    for sent, done, good in sorted(requests):
        if good:
            if open_ is not None:
                open_["to"] = done
                runs.append(open_)
                open_ = None
        else:
            if open_ is None:
                open_ = {"from": sent, "to": None, "failed": 0}
            open_["failed"] += 1
    return runs + ([open_] if open_ is not None else [])


#: The engine double's answer header naming the pod that answered (vLLM sends none).
SERVED_BY = "X-Served-By"
#: status (None: no HTTP answer), detail, the pod that answered
Answer = tuple[int | None, str, str]


def send_one(url: str, body: bytes, headers: dict[str, str], timeout: float) -> Answer:
    """POST once on a new connection. The connection is made by hand so that a failure can
    name its local port (assigned when the connect starts), which names its flow in the
    node's conntrack."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=timeout)
    local = 0
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        conn.sock = sock
        sock.setblocking(False)
        if sock.connect_ex((parts.hostname or "", parts.port or 80)) not in (
                0, errno.EINPROGRESS):  # fmt: skip
            raise OSError(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR), "connect")
        local = sock.getsockname()[1]
        if not select.select([], [sock], [], timeout)[1]:
            raise TimeoutError("timed out")
        if err := sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            raise OSError(err, os.strerror(err))
        sock.setblocking(True)
        sock.settimeout(timeout)
        conn.request("POST", parts.path or "/", body=body, headers=headers)
        resp = conn.getresponse()
        text = resp.read(300).decode(errors="replace")
        by = resp.getheader(SERVED_BY) or ""
        return resp.status, "" if 200 <= resp.status < 300 else text, by
    except (OSError, http.client.HTTPException) as e:
        return None, f"{type(e).__name__} (local port {local or '?'}): {e}", ""
    finally:
        conn.close()


class Pool:
    """Kept-alive connections, as a pooled client keeps them (urllib3, httpx, aiohttp): one is
    taken per request and put back after a complete answer. One the server closed while idle
    is replaced before use, as those clients do, so only a request that was sent and then
    lost counts. kube-proxy keeps an established connection on its endpoint even after the
    endpoint leaves the slice: this is the client that sees a route that went away.

    It opens `size` connections before it reuses any, and reuses the one idle longest, so
    its connections spread over the Service's endpoints (kube-proxy picks one per
    connection) and each stays in use: with two replicas, all of 12 on one has odds of 1 in
    2,048. More are opened only while all are busy, and those beyond `size` are closed after
    their answer."""

    def __init__(self, url: str, timeout: float, size: int) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host, self.port, self.path = parts.hostname or "", parts.port or 80, parts.path
        self.timeout = timeout
        self.size = size
        self._open = 0  # connections made and not yet closed
        #: Idle connections: each with the answers it carried and since when it is idle.
        self._idle: list[tuple[http.client.HTTPConnection, int, float]] = []
        self._lock = threading.Lock()
        self.opened = 0  # connections made
        self.reused = 0  # requests sent on a connection that had answered before

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"opened": self.opened, "reused": self.reused}

    def _take(self) -> tuple[http.client.HTTPConnection, int, float]:
        """A connection, how many answers it carried before (0: new), and since when idle."""
        with self._lock:
            while self._open >= self.size and self._idle:
                conn, uses, since = self._idle.pop(0)
                sock = conn.sock
                if sock is not None and not select.select([sock], [], [], 0)[0]:
                    self.reused += 1
                    return conn, uses, since  # open, and nothing (no EOF) waiting on it
                conn.close()
                self._open -= 1
            self.opened += 1
            self._open += 1
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return conn, 0, time.monotonic()

    def _close(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        with self._lock:
            self._open -= 1

    def send(self, body: bytes, headers: dict[str, str]) -> Answer:
        """POST once on a kept connection. A failure's detail says whether the connection was
        new or reused (after how many answers, idle how long) and its local port, which names
        its flow in the node's conntrack."""
        conn, uses, since = self._take()
        idle, local = time.monotonic() - since, ""
        try:
            if conn.sock is None:
                conn.connect()
            local = str(conn.sock.getsockname()[1]) if conn.sock is not None else ""
            conn.request("POST", self.path or "/", body=body, headers=headers)
            resp = conn.getresponse()
            text = resp.read().decode(errors="replace")[:300]
        except (OSError, http.client.HTTPException) as e:
            self._close(conn)
            how = f"reused after {uses} answers, idle {idle:.2f}s" if uses else "new"
            where = f"kept-alive pool, {how} connection, local port {local or '?'}"
            return None, f"{type(e).__name__} ({where}): {e}", ""
        with self._lock:
            keep = not resp.will_close and len(self._idle) < self.size
            if keep:
                self._idle.append((conn, uses + 1, time.monotonic()))
        if not keep:
            self._close(conn)
        by = resp.getheader(SERVED_BY) or ""
        return resp.status, "" if 200 <= resp.status < 300 else text, by


def one_request(tally: Tally, url: str, body: bytes, headers: dict[str, str], timeout: float,
                slots: threading.Semaphore, pool: Pool | None = None) -> None:  # fmt: skip
    """Send one request, count it, print it if it failed, and free its slot."""
    try:
        sent = time.time()
        status, detail, by = (pool.send(body, headers) if pool is not None
                              else send_one(url, body, headers, timeout))  # fmt: skip
        done = time.time()
        if tally.record(sent, done, status, detail, by) and (status is None or status >= 300) \
                and tally.first_ok_at is not None:
            print(f"failure sent={sent:.3f} done={done:.3f} status={status} {detail[:200]}",
                  flush=True)  # fmt: skip
    finally:
        slots.release()


def pace(tally: Tally, url: str, body: bytes, headers: dict[str, str], rate: float,
         timeout: float, in_flight: int, pool: Pool | None = None) -> None:  # fmt: skip
    """Start a request every 1/rate seconds, each on its own thread, whatever the earlier ones
    are doing (open loop): a slow failure (a timeout, a refused connection after SYN retries)
    holds one of `in_flight` slots and does not lower the rate, as it would for a client that
    waits for each answer before the next."""
    slots = threading.Semaphore(in_flight)
    tally.go.wait()
    due = time.monotonic()
    while tally.stopped_at is None:
        slots.acquire()
        threading.Thread(target=one_request, args=(tally, url, body, headers, timeout, slots,
                                                   pool), daemon=True).start()  # fmt: skip
        due += 1.0 / rate
        time.sleep(max(0.0, due - time.monotonic()))
        due = max(due, time.monotonic() - 1.0 / rate)  # behind (slots full): no burst after


def serve(tally: Tally, port: int) -> http.server.ThreadingHTTPServer:
    """The tally's HTTP endpoint (/ready, /counts, /stop), on a thread."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/ready":  # waiting for /go, the server's start is enough
                code, body = ((200, b"ok") if tally.first_ok_at or not tally.go.is_set()
                              else (503, b"no 200 yet"))  # fmt: skip
            elif self.path == "/go":
                tally.go.set()
                code, body = 200, json.dumps(tally.snapshot()).encode()
            elif self.path in ("/counts", "/stop"):
                if self.path == "/stop":
                    tally.stop()
                code, body = 200, json.dumps(tally.snapshot()).encode()
            else:
                code, body = 404, b"not found"
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("0.0.0.0", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="the Service, e.g. http://10.201.0.7:8000")
    p.add_argument("--model", required=True)
    p.add_argument("--rate", type=float, default=10.0, help="requests a second")
    p.add_argument("--in-flight", type=int, default=64, help="most requests open at once")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per request")
    p.add_argument("--port", type=int, default=8089)
    p.add_argument("--keep-alive", action="store_true",
                   help="reuse connections from a pool instead of one per request")
    p.add_argument("--wait-go", action="store_true",
                   help="send nothing until GET /go (the pod is Ready meanwhile)")
    p.add_argument("--connections", type=int, default=12,
                   help="with --keep-alive: connections the pool opens and keeps")
    a = p.parse_args(argv)
    tally = Tally()
    serve(tally, a.port)
    headers = {"Content-Type": "application/json"}
    if key := os.environ.get("VLLMDP_API_KEY"):
        headers["Authorization"] = f"Bearer {key}"
    body = json.dumps({"model": a.model, "prompt": "hi", "max_tokens": 1}).encode()
    url = a.url.rstrip("/") + "/v1/completions"
    pool = Pool(url, a.timeout, a.connections) if a.keep_alive else None
    tally.pool = pool
    if not a.wait_go:
        tally.go.set()
    threading.Thread(target=pace, args=(tally, url, body, headers, a.rate, a.timeout,
                                        a.in_flight, pool), daemon=True).start()  # fmt: skip
    print(f"sending to {url} at {a.rate}/s, at most {a.in_flight} open"
          + (", on kept-alive connections" if pool else ", a new connection each"), flush=True)
    while tally.stopped_at is None:
        time.sleep(0.2)
    print("stopped: " + json.dumps({k: v for k, v in tally.snapshot().items()
                                    if k not in ("failures",)}), flush=True)  # fmt: skip
    while True:  # keep answering /counts until the pod is deleted
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
