"""Fixtures for the ray tier: one real three-node Ray cluster per session, and launcher runs."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
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
    LauncherRun,
)
from ray_netblock import make_node_cgroup
from ray_testbed import HEAD_IP, RayTestbed, pick_port_base


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Cluster]:
    """Start head + two workers (127.0.0.4 inside its own cgroup when possible); stop them all."""
    root = Path(tempfile.mkdtemp(prefix="vdpray", dir="/tmp"))  # short: unix socket paths
    testbed = RayTestbed(root=root, port_base=pick_port_base(nodes=4))
    cgroup, why = make_node_cgroup(f"vllmdp-ray-{os.getpid()}")
    try:
        testbed.start_node(HEAD_IP, GPUS_PER_NODE, slot=0)
        testbed.wait_alive({HEAD_IP})
        for slot, ip in enumerate(WORKER_IPS, start=1):
            group = cgroup if ip == BLOCKABLE_IP else None
            testbed.start_node(ip, GPUS_PER_NODE, slot=slot, cgroup=group.path if group else None)
        testbed.wait_alive({HEAD_IP, *WORKER_IPS})
        yield Cluster(testbed, cgroup, why)
    finally:
        testbed.stop_all()
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def start_launcher(ray_cluster: Cluster, tmp_path: Path) -> Iterator[Callable[..., LauncherRun]]:
    """Start ``python -m vllm_dp_launcher --plan ...`` with the engine double first on PATH."""
    runs: list[LauncherRun] = []

    def start(plan: dict[str, Any], **env: str) -> LauncherRun:
        n = len(runs)
        log_path, record_path = tmp_path / f"launcher{n}.log", tmp_path / f"engine{n}.jsonl"
        path = os.pathsep.join([str(DOUBLES), str(Path(sys.executable).parent), os.environ["PATH"]])
        full_env = {
            **os.environ,
            "PATH": path,
            "RAY_ADDRESS": ray_cluster.testbed.gcs_address,
            "VLLMDP_DOUBLE_RECORD": str(record_path),
            **env,
        }
        args = [sys.executable, "-m", "vllm_dp_launcher", "--plan", json.dumps(plan)]
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
        events = {r["event"]: r for r in run.records()}
        if "start" in events and "exit" not in events:
            with contextlib.suppress(ProcessLookupError):  # a double a test left running
                os.kill(events["start"]["pid"], signal.SIGKILL)
