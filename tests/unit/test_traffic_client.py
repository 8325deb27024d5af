"""The cluster tier's traffic client (tests/cluster/traffic_client.py), run as its own process
against a local server that answers 503, 200, 500 or is gone, as the tier's scenarios make the
Service do: what it counts, from when, what an outage is, and that its stop counts nothing."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "cluster" / "traffic_client.py"
sys.path.insert(0, str(SCRIPT.parent))
from traffic_client import Tally  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Engine:
    """A completions endpoint whose answer the test sets: a status, or `down` (port closed)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.status = 503
        self.delay = 0.0  # seconds before each answer: a hung engine, a slow failure
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.server: http.server.ThreadingHTTPServer | None = None
        self.up()

    def up(self) -> None:
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                engine.bodies.append(json.loads(self.rfile.read(n)))
                engine.auth.append(self.headers.get("Authorization"))
                time.sleep(engine.delay)
                self.send_response(engine.status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def down(self) -> None:
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()
        self.server = None


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine()
    yield e
    if e.server is not None:
        e.down()


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_for(check: Any, timeout: float = 10) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if got := check():
                return got
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s")


@pytest.fixture
def client(engine: Engine) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--url", f"http://127.0.0.1:{engine.port}", "--model", "m",
         "--rate", "20", "--timeout", "1", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={"VLLMDP_API_KEY": "k-unit", "PATH": "/usr/bin:/bin"})  # fmt: skip
    try:
        yield port, proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_counts_from_the_first_200_and_outages_end_at_a_success(
        engine: Engine, client: tuple[int, subprocess.Popen[str]]) -> None:  # fmt: skip
    port, proc = client
    wait_for(lambda: len(engine.bodies) >= 5)  # its start: 503s, not ready, not counted
    assert get(port, "/ready")[0] == 503
    engine.status = 200
    wait_for(lambda: get(port, "/ready")[0] == 200)
    time.sleep(1.0)
    engine.status = 500
    time.sleep(0.5)
    engine.status = 200
    time.sleep(0.5)
    engine.down()  # connection refused, until it is back
    time.sleep(0.5)
    engine.up()
    engine.status = 200
    time.sleep(0.5)
    status, raw = get(port, "/stop")
    final = json.loads(raw)
    assert status == 200
    assert final["before_first_ok"] >= 5
    assert final["ok"] > 0 and final["failed"] == final["total"] - final["ok"] > 0
    assert final["rate"] >= 10, final  # 20/s asked; without pause even when answers fail
    statuses = {f["status"] for f in final["failures"]}
    assert statuses == {500, None}, statuses
    refused = [f for f in final["failures"] if f["status"] is None]
    assert refused and all("Connection" in f["detail"] or "refused" in f["detail"]
                           for f in refused), refused  # fmt: skip
    assert len(final["outages"]) == 2, final["outages"]
    for outage in final["outages"]:
        assert outage["to"] is not None and 0.2 < outage["to"] - outage["from"] < 2.0, outage
    assert sum(o["failed"] for o in final["outages"]) == final["failed"]
    # The request: a completion with max_tokens 1, the key from the environment.
    assert engine.bodies[-1] == {"model": "m", "prompt": "hi", "max_tokens": 1}
    assert set(engine.auth) == {"Bearer k-unit"}
    # Its own stop counts nothing: failures after /stop are dropped.
    engine.status = 500
    time.sleep(0.3)
    assert json.loads(get(port, "/counts")[1])["failed"] == final["failed"]
    assert proc.poll() is None  # still answering /counts until its pod goes


def test_slow_failures_do_not_lower_the_rate(
        engine: Engine, client: tuple[int, subprocess.Popen[str]]) -> None:  # fmt: skip
    # Open loop: answers that take the whole timeout (1 s here) still leave 20 a second.
    port, _ = client
    engine.status = 200
    wait_for(lambda: get(port, "/ready")[0] == 200)
    engine.delay = 2.0
    time.sleep(5.0)
    final = json.loads(get(port, "/stop")[1])
    # Counted as they end: the last second's, still open at the stop, are not (a closed loop
    # of two senders would manage 2 a second here).
    assert final["failed"] >= 60 and final["rate"] >= 12, final
    assert {f["detail"].split(" (")[0] for f in final["failures"]} == {"TimeoutError"}, final


def test_tally_keeps_an_open_outage_and_caps_kept_failures() -> None:
    t = Tally()
    t.record(1.0, 1.1, None, "refused")
    assert t.snapshot()["before_first_ok"] == 1 and t.snapshot()["total"] == 0
    t.record(2.0, 2.1, 200, "")
    for i in range(250):
        t.record(3.0 + i, 3.1 + i, 502, "bad gateway")
    snap = t.snapshot()
    assert (snap["ok"], snap["failed"], len(snap["failures"])) == (1, 250, 200)
    sent = [f["sent"] for f in snap["failures"]]  # the first 100 and the latest 100
    assert sent == [3.0 + i for i in range(100)] + [3.0 + i for i in range(150, 250)]
    assert snap["outages"] == [{"from": 3.0, "to": None, "failed": 250}]
    t.stop()
    assert t.record(999.0, 999.1, 500, "") is False
    assert t.snapshot()["failed"] == 250


def test_a_failure_sent_before_the_first_200_is_the_start_even_if_answered_after() -> None:
    # A new client pod's first requests time out until the NetworkPolicy enforcer knows its
    # address; one sent before the first 200 and timed out after it is that start, not an
    # outage of what the test measures. One sent after the first 200 counts.
    t = Tally()
    t.record(1.0, 6.0, None, "timed out")
    t.record(5.0, 5.1, 200, "")
    t.record(1.1, 6.1, None, "timed out")
    assert (t.snapshot()["before_first_ok"], t.snapshot()["failed"]) == (2, 0)
    t.record(5.2, 10.2, None, "timed out")
    snap = t.snapshot()
    assert (snap["ok"], snap["failed"]) == (1, 1)
    assert snap["outages"] == [{"from": 5.2, "to": None, "failed": 1}]


def test_a_timeout_answered_after_later_successes_stays_in_its_outage() -> None:
    t = Tally()
    t.record(0.0, 0.1, 200, "")
    for i in range(5):  # the outage: refused at once
        t.record(1.0 + i * 0.1, 1.0 + i * 0.1, None, "refused")
    t.record(1.5, 6.5, None, "timed out")  # sent in the outage, answered 5 s later
    for i in range(10):  # routed again from 1.6 on
        t.record(1.6 + i * 0.1, 1.7 + i * 0.1, 200, "")
    outages = t.snapshot()["outages"]
    assert outages == [{"from": 1.0, "to": 1.7, "failed": 6}], outages


def test_the_kept_alive_pool_reuses_a_connection_and_replaces_one_the_server_closed() -> None:
    from traffic_client import Pool

    peers: list[Any] = []

    class KeepAlive(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            peers.append(self.client_address)
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), KeepAlive)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pool = Pool(f"http://127.0.0.1:{server.server_port}/v1/completions", 5.0, size=1)
        for _ in range(3):
            assert pool.send(b"{}", {"Content-Type": "application/json"})[:2] == (200, "")
        assert len(set(peers)) == 1  # one connection, kept
        for conn, _, _ in pool._idle:
            conn.sock.shutdown(socket.SHUT_RDWR)  # as if the server closed it while idle
        time.sleep(0.1)
        assert pool.send(b"{}", {"Content-Type": "application/json"})[:2] == (200, "")
        assert len(set(peers)) == 2 and pool.stats() == {"opened": 2, "reused": 2}
        # A pool of three opens three before it reuses any, then takes the one idle longest.
        peers.clear()
        wide = Pool(f"http://127.0.0.1:{server.server_port}/v1/completions", 5.0, size=3)
        for _ in range(6):
            wide.send(b"{}", {})
        assert len(set(peers)) == 3 and peers[3:] == peers[:3], peers
        assert wide.stats() == {"opened": 3, "reused": 3}
    finally:
        server.shutdown()


def test_answers_are_counted_by_the_pod_that_gave_them() -> None:
    t = Tally()
    t.record(1.0, 6.0, None, "TimeoutError (local port 40001): timed out")
    t.record(7.0, 7.1, 200, "", served_by="head-a")
    t.record(7.5, 7.6, 200, "", served_by="head-b")
    t.record(8.0, 8.1, 200, "", served_by="head-a")
    t.record(9.0, 14.0, None, "TimeoutError (local port 40002): timed out")
    snap = t.snapshot()
    assert (snap["before_first_ok"], snap["failed"]) == (1, 1)
    assert snap["served_by"] == {"head-a": 2, "head-b": 1}


def test_wait_go_sends_nothing_until_go(engine: Engine) -> None:
    engine.status = 200
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--url", f"http://127.0.0.1:{engine.port}", "--model", "m",
         "--rate", "20", "--port", str(port), "--wait-go"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        assert wait_for(lambda: get(port, "/ready")[0] == 200)  # Ready while it waits
        time.sleep(0.5)
        assert json.loads(get(port, "/counts")[1])["total"] == 0 and engine.bodies == []
        assert get(port, "/go")[0] == 200
        wait_for(lambda: json.loads(get(port, "/counts")[1])["ok"] >= 3)
    finally:
        proc.kill()
        proc.wait(timeout=10)
