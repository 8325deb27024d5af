"""Helpers of the ray tier: the session cluster's shape, launch plans, and launcher runs."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ray_netblock import NodeCgroup
from ray_testbed import HEAD_IP, RayTestbed
from vllm_dp_launcher import stages

DOUBLES = Path(__file__).resolve().parents[1] / "doubles"
GPUS_PER_NODE = 4
WORKER_IPS = ("127.0.0.3", "127.0.0.4")
BLOCKABLE_IP = "127.0.0.4"
LATE_IP = "127.0.0.5"


@dataclass
class Cluster:
    """The session's Ray cluster: head 127.0.0.2 and workers 127.0.0.3/4, 4 logical GPUs each."""

    testbed: RayTestbed
    cgroup: NodeCgroup | None
    cgroup_unavailable: str

    @property
    def ips(self) -> set[str]:
        """The IPs of the session's nodes."""
        return {HEAD_IP, *WORKER_IPS}


def free_port() -> int:
    """Return a loopback TCP port that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_plan(
    pods: int,
    gpus_per_pod: int = GPUS_PER_NODE,
    wait: float = 30,
    preflight: float = 15,
) -> dict[str, Any]:
    """Return a strict, TP=1 launch plan as the operator renders it (one rank per GPU)."""
    port = free_port()
    dp = pods * gpus_per_pod
    return {
        "version": 1,
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "dataParallelSize": dp,
        "ranksPerNode": gpus_per_pod,
        "tensorParallelSize": 1,
        "packStrategy": "strict",
        "gpuPods": pods,
        "gpusPerPod": gpus_per_pod,
        "totalGpus": dp,
        "pods": [
            {
                "index": i,
                "role": "head" if i == 0 else "worker",
                "ranks": list(range(i * gpus_per_pod, (i + 1) * gpus_per_pod)),
                "gpus": gpus_per_pod,
            }
            for i in range(pods)
        ],
        "port": port,
        "command": [
            *("vllm", "serve", "Qwen/Qwen2.5-0.5B-Instruct", "--host", "0.0.0.0"),
            *("--port", str(port), "--data-parallel-backend", "ray"),
            *("--data-parallel-size", str(dp), "--data-parallel-size-local", str(gpus_per_pod)),
            *("--tensor-parallel-size", "1"),
        ],
        "env": {
            "VLLM_RAY_DP_PACK_STRATEGY": "strict",
            "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": "HF_,VLLM_",
        },
        "waitTimeoutSeconds": wait,
        "preflightTimeoutSeconds": preflight,
    }


@dataclass
class LauncherRun:
    """A launcher process started by a test, with its log and the engine double's record."""

    process: subprocess.Popen[bytes]
    log_path: Path
    record_path: Path

    def log(self) -> str:
        """The launcher's output so far."""
        return self.log_path.read_text(errors="replace")

    def records(self) -> list[dict[str, Any]]:
        """The engine double's events so far."""
        return read_records(self.record_path)

    def stages(self) -> list[str]:
        """The launcher's stage names in its log, in order."""
        return [line.name for line in stages.parse_stage_lines(self.log())]

    def wait_for(self, check: Callable[[], bool], what: str, timeout: float = 30) -> None:
        """Wait until ``check()`` holds; fail with the launcher's log otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            if self.process.poll() is not None and not check():
                break
            time.sleep(0.1)
        pytest.fail(f"never saw {what}; launcher rc={self.process.poll()}\n{self.log()}")

    def wait_for_record(self, event: str, timeout: float = 30) -> dict[str, Any]:
        """Wait for the engine double to record ``event``; return it."""
        self.wait_for(lambda: any(r["event"] == event for r in self.records()), event, timeout)
        return next(r for r in self.records() if r["event"] == event)

    def finish(self, timeout: float = 30) -> int:
        """Wait for the launcher to exit; return its exit status."""
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()


def read_records(path: Path) -> list[dict[str, Any]]:
    """The engine double's events recorded in ``path`` so far."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@dataclass
class JobRun:
    """A launcher submitted as a Ray job, and the engine double's record."""

    client: Any  # ray.job_submission.JobSubmissionClient
    submission_id: str
    entrypoint: str
    record_path: Path

    def status(self) -> Any:
        """The Ray job's status (a JobStatus)."""
        return self.client.get_job_status(self.submission_id)

    def logs(self) -> str:
        """The job's log: the entrypoint's output, launcher lines included."""
        return str(self.client.get_job_logs(self.submission_id))

    def stages(self) -> list[str]:
        """The launcher's stage names in the job log, in order."""
        return [line.name for line in stages.parse_stage_lines(self.logs())]

    def records(self) -> list[dict[str, Any]]:
        """The engine double's events so far."""
        return read_records(self.record_path)

    def wait_for(self, check: Callable[[], bool], what: str, timeout: float = 60) -> None:
        """Wait until ``check()`` holds; fail with the job's status and log otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.2)
        pytest.fail(f"never saw {what}; job {self.status()}\n{self.logs()}")

    def wait_for_record(self, event: str, timeout: float = 60) -> dict[str, Any]:
        """Wait for the engine double to record ``event``; return it."""
        self.wait_for(lambda: any(r["event"] == event for r in self.records()), event, timeout)
        return next(r for r in self.records() if r["event"] == event)

    def wait_status(self, statuses: set[str], timeout: float = 60) -> str:
        """Wait until the job's status is one of ``statuses``; return it."""
        self.wait_for(lambda: str(self.status().value) in statuses, f"status {statuses}", timeout)
        return str(self.status().value)
