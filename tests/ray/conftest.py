"""Fixtures for the ray tier: one real three-node Ray cluster per session, and launcher runs."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ray_harness import (
    BLOCKABLE_IP,
    DOUBLES,
    GPUS_PER_NODE,
    WORKER_IPS,
    Cluster,
    JobRun,
    LauncherRun,
)
from ray_netblock import make_node_cgroup
from ray_testbed import HEAD_IP, RayTestbed, pick_port_base
from vllm_dp_launcher.plan import encode_plan, head_job_entrypoint, parse_plan


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Cluster]:
    """Start head + two workers (127.0.0.4 inside its own cgroup when possible); stop them all.

    Without token auth, whatever this machine's ~/.ray holds: Ray 2.60 turns token auth on
    for a node or driver whose RAY_AUTH_MODE is unset when ~/.ray/auth_token exists (any
    local ``ray.init()`` writes one), and the tier's nodes and clients would then disagree.
    """
    root = Path(tempfile.mkdtemp(prefix="vdpray", dir="/tmp"))  # short: unix socket paths
    testbed = RayTestbed(root=root, port_base=pick_port_base(nodes=4))
    cgroup, why = make_node_cgroup(f"vllmdp-ray-{os.getpid()}")
    auth = pytest.MonkeyPatch()
    auth.setenv("RAY_AUTH_MODE", "disabled")  # inherited by every node, launcher and job
    try:
        testbed.start_node(HEAD_IP, GPUS_PER_NODE, slot=0)
        testbed.wait_alive({HEAD_IP})
        for slot, ip in enumerate(WORKER_IPS, start=1):
            group = cgroup if ip == BLOCKABLE_IP else None
            testbed.start_node(ip, GPUS_PER_NODE, slot=slot, cgroup=group.path if group else None)
        testbed.wait_alive({HEAD_IP, *WORKER_IPS})
        testbed.wait_dashboard()
        yield Cluster(testbed, cgroup, why)
    finally:
        testbed.stop_all()
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(root, ignore_errors=True)
        auth.undo()


def doubles_path() -> str:
    """PATH with the engine double first, then this interpreter's directory (``python``)."""
    return os.pathsep.join([str(DOUBLES), str(Path(sys.executable).parent), os.environ["PATH"]])


def kill_left_double(records: list[dict[str, Any]]) -> None:
    """Kill an engine double a test left running (it recorded a start and no exit)."""
    events = {r["event"]: r for r in records}
    if "start" in events and "exit" not in events:
        with contextlib.suppress(ProcessLookupError):
            os.kill(events["start"]["pid"], signal.SIGKILL)


@pytest.fixture
def submit_job(ray_cluster: Cluster, tmp_path: Path) -> Iterator[Callable[..., JobRun]]:
    """Submit the launcher as a real Ray job (the operator's entrypoint, /bin/sh -c, HTTPMode)."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(ray_cluster.testbed.dashboard_url)
    jobs: list[JobRun] = []

    def submit(plan: dict[str, Any], **env: str) -> JobRun:
        n = len(jobs)
        record_path = tmp_path / f"job{n}.jsonl"
        submission_id = f"vdp-test-{uuid.uuid4().hex[:10]}"
        entrypoint = head_job_entrypoint(parse_plan(plan)) + " --progress-interval 1"
        env_vars = {"PATH": doubles_path(), "VLLMDP_DOUBLE_RECORD": str(record_path), **env}
        client.submit_job(
            entrypoint=entrypoint,
            submission_id=submission_id,
            runtime_env={"env_vars": env_vars},
        )
        jobs.append(JobRun(client, submission_id, entrypoint, record_path))
        return jobs[-1]

    yield submit
    for job in jobs:
        if not job.status().is_terminal():
            client.stop_job(job.submission_id)
            with contextlib.suppress(Exception):
                job.wait_status({"STOPPED", "FAILED", "SUCCEEDED"}, timeout=30)
        kill_left_double(job.records())


@pytest.fixture
def start_launcher(ray_cluster: Cluster, tmp_path: Path) -> Iterator[Callable[..., LauncherRun]]:
    """Start ``python -m vllm_dp_launcher --plan-b64 ...`` with the engine double first on PATH."""
    runs: list[LauncherRun] = []

    def start(plan: dict[str, Any], **env: str) -> LauncherRun:
        n = len(runs)
        log_path, record_path = tmp_path / f"launcher{n}.log", tmp_path / f"engine{n}.jsonl"
        full_env = {
            **os.environ,
            "PATH": doubles_path(),
            "RAY_ADDRESS": ray_cluster.testbed.gcs_address,
            "VLLMDP_DOUBLE_RECORD": str(record_path),
            **env,
        }
        b64 = encode_plan(parse_plan(plan))
        args = [sys.executable, "-m", "vllm_dp_launcher", "--plan-b64", b64]
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [*args, "--progress-interval", "1"], env=full_env, stdout=log, stderr=log
            )
        runs.append(LauncherRun(process, log_path, record_path))
        return runs[-1]

    yield start
    for run in runs:
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait()
        kill_left_double(run.records())
