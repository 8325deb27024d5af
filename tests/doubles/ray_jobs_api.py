#!/usr/bin/env python3
"""Test double for the Ray dashboard's job API, as the operator and KubeRay's HTTPMode use it.

Run inside the test bed's pod network namespace (`ip netns exec <ns> ...`), where it answers on
--port for every simulated pod IP. Each head pod IP is its own Ray cluster: jobs are kept per
local address the request arrived on. Standard library only. Never shipped in an image.

    POST /api/jobs/                       submit {entrypoint, submission_id, runtime_env}
    GET  /api/jobs/<submission_id>        {"submission_id", "status", "message"}, or 404
    POST /api/jobs/<submission_id>/stop   {"stopped": true}; 404 for an unknown job
    GET  /_double/log                     every request, in order, with its time (for tests)

A stopped job behaves like a process that ignores SIGTERM: it stays RUNNING until Ray's
SIGKILL, RAY_JOB_STOP_WAIT_TIME_S seconds after the stop (Ray's default 3 when its runtime env
does not set it), then reads STOPPED.
"""

from __future__ import annotations

import argparse
import http.server
import json
import threading
import time
from typing import Any

DEFAULT_STOP_WAIT_S = 3.0
ENDED = ("STOPPED", "SUCCEEDED", "FAILED")


class Jobs:
    """Ray jobs per head address, and a log of every call."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.log: list[dict[str, Any]] = []

    def status(self, job: dict[str, Any]) -> str:
        stop_at = job.get("kill_at")
        if job["status"] == "RUNNING" and stop_at is not None and time.time() >= stop_at:
            job["status"] = "STOPPED"
            job["message"] = "Job was intentionally stopped."
        return str(job["status"])


JOBS = Jobs()


class Handler(http.server.BaseHTTPRequestHandler):
    """The job API routes above."""

    def _reply(self, status: int, body: Any) -> None:
        data = (json.dumps(body) if not isinstance(body, str) else body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if not isinstance(body, str)
                         else "text/plain")  # fmt: skip
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self, extra: dict[str, Any] | None = None) -> str:
        head = self.connection.getsockname()[0]  # the pod IP the request was sent to
        entry = {"time": time.time(), "method": self.command, "path": self.path, "head": head,
                 # Ray's token headers as they arrived (Ray reads Authorization first, then
                 # x-ray-authorization): what a caller sent, after any proxy on the way.
                 "authorization": self.headers.get("Authorization"),
                 "x_ray_authorization": self.headers.get("x-ray-authorization"),
                 **(extra or {})}  # fmt: skip
        with JOBS.lock:
            JOBS.log.append(entry)
        return str(head)

    def do_GET(self) -> None:
        if self.path == "/_double/log":
            with JOBS.lock:
                self._reply(200, JOBS.log)
            return
        head = self._record()
        sid = self.path.removeprefix("/api/jobs/").strip("/")
        with JOBS.lock:
            job = JOBS.jobs.get((head, sid))
            if job is None or not self.path.startswith("/api/jobs/"):
                self._reply(404, f"Job {sid} does not exist")
                return
            self._reply(200, {"submission_id": sid, "status": JOBS.status(job),
                              "message": job.get("message", "")})  # fmt: skip

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        head = self._record({"body": body})
        if self.path.rstrip("/") == "/api/jobs":
            sid = body["submission_id"]
            env = (body.get("runtime_env") or {}).get("env_vars") or {}
            with JOBS.lock:
                JOBS.jobs[(head, sid)] = {
                    "status": "RUNNING", "entrypoint": body.get("entrypoint"),
                    "stop_wait": float(env.get("RAY_JOB_STOP_WAIT_TIME_S", DEFAULT_STOP_WAIT_S)),
                }  # fmt: skip
            self._reply(200, {"submission_id": sid, "job_id": sid})
            return
        if self.path.startswith("/api/jobs/") and self.path.endswith("/stop"):
            sid = self.path.removeprefix("/api/jobs/").removesuffix("/stop")
            with JOBS.lock:
                job = JOBS.jobs.get((head, sid))
                if job is None:
                    self._reply(404, f"Job {sid} does not exist")
                    return
                running = JOBS.status(job) not in ENDED
                if running and job.get("kill_at") is None:
                    job["kill_at"] = time.time() + job["stop_wait"]
                self._reply(200, {"stopped": running})
            return
        self._reply(404, "not found")

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8265)
    args = parser.parse_args()
    http.server.ThreadingHTTPServer(("0.0.0.0", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
