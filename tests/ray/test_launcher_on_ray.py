"""The launcher against a real three-node Ray cluster, with a test double as the engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from ray_harness import (
    BLOCKABLE_IP,
    GPUS_PER_NODE,
    LATE_IP,
    WORKER_IPS,
    Cluster,
    JobRun,
    LauncherRun,
    make_plan,
)
from ray_testbed import HEAD_IP, STOP_WAIT_S, ephemeral_port_range

pytest.importorskip("ray")
pytest.importorskip("zmq")
pytestmark = pytest.mark.ray

StartLauncher = Callable[..., LauncherRun]
SubmitJob = Callable[..., JobRun]


def _http(port: int, method: str, path: str) -> int:
    """Send one request to the engine double; return the HTTP status."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    with urllib.request.urlopen(request, timeout=5) as response:
        return int(response.status)


def _engine_started(run: LauncherRun) -> dict[str, Any]:
    """Wait until the engine double listens; return its start record."""
    run.wait_for_record("listening")
    return run.wait_for_record("start")


def test_engine_gets_plan_command_and_own_node_ip(start_launcher: StartLauncher) -> None:
    """The launcher on the head runs the plan's command with -dpa = the head's Ray node IP."""
    plan = make_plan(pods=3)
    run = start_launcher(plan)
    start = _engine_started(run)
    run.wait_for(lambda: "stage=serving" in run.log(), "stage=serving")

    assert start["argv"] == [*plan["command"][1:], "--data-parallel-address", HEAD_IP]
    env = start["env"]
    assert env["VLLM_HOST_IP"] == HEAD_IP
    assert env["VLLM_RAY_DP_PACK_STRATEGY"] == "strict"
    assert env["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "HF_,VLLM_,GLOO_,NCCL_"
    assert _http(plan["port"], "GET", "/health") == 200
    log = run.log()
    assert "Ray cluster ready: 3/3 GPU nodes, 12/12 GPUs" in log
    run.wait_for(lambda: "network preflight passed: 3 GPU node(s)" in run.log(),
                 "the preflight, beside the engine's start, passed")  # fmt: skip

    assert _http(plan["port"], "POST", "/exit?code=5") == 200
    assert run.finish() == 5
    assert run.stages() == [
        "connecting", "waiting-for-cluster", "preflight", "engine-starting", "serving", "exited",
    ]  # fmt: skip


def test_engine_exit_status_is_the_launchers(start_launcher: StartLauncher) -> None:
    """An engine that exits 3 makes the launcher exit 3; one killed by SIGKILL gives 137."""
    failing = start_launcher(make_plan(pods=3), VLLMDP_DOUBLE_EXIT_CODE="3")
    assert failing.finish() == 3
    assert "stage=exited status=3 cause=engine-ended engine_status=3" in failing.log()

    killed = start_launcher(make_plan(pods=3))
    pid = _engine_started(killed)["pid"]
    os.kill(pid, signal.SIGKILL)
    assert killed.finish() == 128 + signal.SIGKILL


def test_engine_ending_on_its_own_with_status_0_fails_the_launch(
    start_launcher: StartLauncher,
) -> None:
    """vLLM exits 0 after an engine died (vllm#48966): with no stop forwarded, that is 6."""
    plan = make_plan(pods=3)
    run = start_launcher(plan)
    _engine_started(run)

    assert _http(plan["port"], "POST", "/exit?code=0") == 200

    assert run.finish() == 6
    log = run.log()
    assert "vllm serve exited with status 0 although no stop signal was forwarded" in log
    assert "stage=exited status=6 cause=engine-ended engine_status=0" in log


def test_sigterm_to_launcher_reaches_engine(start_launcher: StartLauncher) -> None:
    """SIGTERM sent to the launcher alone is forwarded; the engine's exit status comes back."""
    run = start_launcher(make_plan(pods=3), VLLMDP_DOUBLE_TERM_EXIT_CODE="7")
    start = _engine_started(run)
    # The engine has its own process group, so only forwarding can deliver the signal.
    assert start["pgid"] != os.getpgid(run.process.pid)

    run.process.send_signal(signal.SIGTERM)

    assert run.finish() == 7
    assert [r["signal"] for r in run.records() if r["event"] == "signal"] == ["SIGTERM"]
    log = run.log()
    assert "forwarding SIGTERM to the engine" in log
    assert "stage=draining signal=SIGTERM grace=none" in log
    assert "stage=exited status=7 cause=stopped engine_status=7" in log


def test_too_few_gpu_nodes_fails_within_deadline(start_launcher: StartLauncher) -> None:
    """A plan for 4 GPU pods on a 3-node cluster fails after waitTimeoutSeconds, saying why."""
    started = time.monotonic()
    run = start_launcher(make_plan(pods=4, wait=4))

    assert run.finish(timeout=30) == 3
    elapsed = time.monotonic() - started
    log = run.log()
    assert elapsed < 4 + 10, log  # the deadline plus connecting to Ray
    assert "waiting for the Ray cluster: 3/4 GPU nodes, 12/16 GPUs" in log
    assert "timed out after 4s" in log
    assert "missing 1 GPU node(s) and 4 GPU(s)" in log
    assert "1 of 3 worker GPU pod(s) (4 GPUs each) have not joined" in log
    assert all(ip in log for ip in (HEAD_IP, *WORKER_IPS))
    assert run.records() == []


def test_too_few_gpus_per_node_fails(start_launcher: StartLauncher) -> None:
    """Enough nodes but not enough GPUs (3 pods x 8 planned, 3 x 4 present) fails the same way."""
    run = start_launcher(make_plan(pods=3, gpus_per_pod=8, wait=2))

    assert run.finish(timeout=30) == 3
    assert "3/3 GPU nodes, 12/24 GPUs" in run.log()
    assert "missing 0 GPU node(s) and 12 GPU(s)" in run.log()


def test_worker_joining_late_is_waited_for(
    start_launcher: StartLauncher, ray_cluster: Cluster
) -> None:
    """The launcher waits (printing progress) until a fourth GPU node joins, then starts vLLM."""
    plan = make_plan(pods=4, wait=90)
    run = start_launcher(plan)
    run.wait_for(lambda: "3/4 GPU nodes, 12/16 GPUs" in run.log(), "progress line")
    time.sleep(1.5)
    assert run.records() == [], "the engine must not start before the fourth node joins"
    assert run.log().count("waiting for the Ray cluster: 3/4 GPU nodes") >= 2

    testbed = ray_cluster.testbed
    late = testbed.start_node(LATE_IP, GPUS_PER_NODE, slot=3)
    try:
        start = _engine_started(run)
        assert start["argv"][-2:] == ["--data-parallel-address", HEAD_IP]
        assert "--data-parallel-size" in start["argv"]
        log = run.log()
        assert "Ray cluster ready: 4/4 GPU nodes, 16/16 GPUs" in log
        # Beside the engine's start, not before it: it may still be running here.
        run.wait_for(lambda: "network preflight passed: 4 GPU node(s)" in run.log(),
                     "the preflight passed")  # fmt: skip
        _http(plan["port"], "POST", "/exit?code=5")
        assert run.finish() == 5
    finally:
        testbed.stop_node(late)
        testbed.wait_alive(ray_cluster.ips)  # later tests see the three session nodes again


def test_preflight_names_the_node_that_cannot_connect(
    start_launcher: StartLauncher, ray_cluster: Cluster
) -> None:
    """A node whose TCP to the launcher's ephemeral port is rejected fails the launch, by name,
    and stops the engine that started beside the preflight.

    How the node is cut off, for real: node 127.0.0.4 was started inside its own cgroup v2
    group, and for this test an iptables OUTPUT rule rejects (TCP reset) that group's
    connections to 127.0.0.2 on the kernel's ephemeral port range, where the launcher binds
    its preflight ZMQ ROUTER. Ray's own ports sit below that range, so the node stays a
    healthy Ray member: the probe task runs there and reports back, but its DEALER never
    reaches the launcher. Loopback addresses alone cannot do this (every local address
    reaches every other, and the kernel sends from 127.0.0.1), hence the cgroup match.
    """
    if ray_cluster.cgroup is None:
        pytest.skip(f"cannot cut a node off on this machine: {ray_cluster.cgroup_unavailable}")
    with ray_cluster.cgroup.blocked(HEAD_IP, ephemeral_port_range()):
        started = time.monotonic()
        run = start_launcher(make_plan(pods=3, preflight=10))
        status = run.finish(timeout=40)
        elapsed = time.monotonic() - started

    log = run.log()
    assert status == 4, log
    assert elapsed < 10 + 10, log
    assert "network preflight failed: 1 of 3 GPU node(s)" in log
    failure = log[log.index("network preflight failed") :]
    assert f"{BLOCKABLE_IP} (node " in failure, log
    assert "127.0.0.3 (node " not in failure, log
    assert "Connection refused" in failure, log
    # The engine started beside the preflight and was stopped when it failed.
    assert "stopping vllm serve" in log, log
    assert "stage=engine-starting" in log, log
    assert "stage=exited status=4 cause=preflight-failed" in log, log


def test_dry_run_takes_the_address_from_ray(ray_cluster: Cluster) -> None:
    """--dry-run with a reachable cluster shows this Ray node's IP and starts nothing."""
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.testbed.gcs_address}
    env.pop("VLLM_HOST_IP", None)
    plan = make_plan(pods=3)
    result = subprocess.run(
        [sys.executable, "-m", "vllm_dp_launcher", "--plan", json.dumps(plan), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["dataParallelAddress"] == HEAD_IP
    assert report["dataParallelAddressSource"] == "ray"
    assert report["command"] == [*plan["command"], "--data-parallel-address", HEAD_IP]
    assert report["env"]["VLLM_HOST_IP"] == HEAD_IP


def test_stale_driver_holding_gpus_fails_a_new_launch_at_once(
    submit_job: SubmitJob, start_launcher: StartLauncher
) -> None:
    """An old head job never stopped keeps vLLM's placement groups: a new launch fails at once.

    The old job is a real Ray job (submitted through the head's job API, as KubeRay's
    HTTPMode does) whose engine double places one GPU placement group per DP rank, as vLLM's
    Ray backend does, and keeps them. Without the free-GPU gate the new launch would pass the
    total-GPU gate and its engine would wait in placement forever.
    """
    plan = make_plan(pods=3)
    stale = submit_job(plan, VLLMDP_DOUBLE_PLACE="1")
    placed = stale.wait_for_record("placed", timeout=90)
    assert placed["gpus"] == 12

    started = time.monotonic()
    run = start_launcher(make_plan(pods=3, wait=120), VLLMDP_DOUBLE_PLACE="1")
    status = run.finish(timeout=60)
    elapsed = time.monotonic() - started

    log = run.log()
    assert status == 5, log
    assert elapsed < 30, f"took {elapsed:.0f}s, not at once; {log}"
    assert "12 of the cluster's 12 GPU(s) are in use" in log
    assert f"(submission '{stale.submission_id}', driver running as pid " in log
    assert "holds 12 GPU(s) on 127.0.0.2, 127.0.0.3, 127.0.0.4" in log
    assert "placement group(s) dp_rank_0, dp_rank_1, dp_rank_2, dp_rank_3 and 8 more" in log
    assert "stage=exited status=5 cause=gpus-held" in log
    assert run.records() == [], "the new engine must not start"

    # Stopping the old job for real (and confirming it) frees the GPUs for the next launch.
    stale.client.stop_job(stale.submission_id)
    assert stale.wait_status({"STOPPED"}, timeout=30) == "STOPPED"
    again = start_launcher(make_plan(pods=3, wait=60), VLLMDP_DOUBLE_PLACE="1")
    assert again.wait_for_record("placed", timeout=90)["gpus"] == 12
    again.wait_for_record("listening")  # its own SIGTERM handler is back (ray.init took it)
    again.process.send_signal(signal.SIGTERM)
    assert again.finish() == 0


def test_engine_dying_with_its_node_ends_vllm_serve_and_fails_the_launch(
    start_launcher: StartLauncher, ray_cluster: Cluster
) -> None:
    """A node going away kills the engine actors on it; vLLM then exits 0, and so does the
    double (one actor per rank in its placement group, watched as vLLM's monitor does): the
    launcher, which forwarded no stop, turns that into 6, a failure the operator counts.

    The plan uses every GPU, so every node holds ranks; 127.0.0.3 is stopped, then started
    again for the tests after this one.
    """
    victim_ip = WORKER_IPS[0]
    run = start_launcher(make_plan(pods=3), VLLMDP_DOUBLE_PLACE="1")
    nodes = run.wait_for_record("engines-alive", timeout=90)["nodes"]
    assert len(nodes) == 12 and set(nodes) == ray_cluster.ips, nodes
    testbed = ray_cluster.testbed
    started = time.monotonic()
    try:
        testbed.stop_node(next(n for n in testbed.nodes if n.ip == victim_ip))
        status = run.finish(timeout=60)
        elapsed = time.monotonic() - started
    finally:
        testbed.start_node(victim_ip, GPUS_PER_NODE, slot=1)
        testbed.wait_alive(ray_cluster.ips)

    log = run.log()
    assert status == 6, log
    assert elapsed < 30, f"took {elapsed:.0f}s to notice; {log}"
    events = {r["event"]: r for r in run.records()}
    assert nodes[events["engine-dead"]["rank"]] == victim_ip, events["engine-dead"]
    assert events["exit"]["code"] == 0
    assert "EngineDeadError" in log
    assert "stage=exited status=6 cause=engine-ended engine_status=0" in log


def test_ray_job_stop_gives_the_engine_its_drain_and_the_plan_arrives_intact(
    submit_job: SubmitJob,
) -> None:
    """The operator's entrypoint as a real Ray job: shell-hostile values arrive byte for byte,
    the stages are printed, and a job stop lets the engine drain past Ray's 3 s default.

    Ray's job supervisor runs the entrypoint with /bin/sh -c and, on stop, SIGTERMs the
    launcher and the engine, then SIGKILLs them RAY_JOB_STOP_WAIT_TIME_S later (the head
    was started with it set, as the operator sets it on the Ray pods).
    """
    hostile = "$HOME;`id`(é模型) && echo 'x' \"y\""
    plan = make_plan(pods=3)
    plan["command"] += ["--served-model-name", hostile]
    plan["env"]["VDP_ODD_VALUE"] = hostile
    plan["drainGraceSeconds"] = STOP_WAIT_S
    job = submit_job(plan, VLLMDP_DOUBLE_TERM_DELAY="4")

    start = job.wait_for_record("start")
    assert start["argv"] == [*plan["command"][1:], "--data-parallel-address", HEAD_IP]
    assert start["env"]["VDP_ODD_VALUE"] == hostile
    job.wait_for(lambda: "stage=serving" in job.logs(), "stage=serving")

    job.client.stop_job(job.submission_id)
    assert job.wait_status({"STOPPED", "FAILED", "SUCCEEDED"}, timeout=30) == "STOPPED"

    records = job.records()
    signals = [r for r in records if r["event"] == "signal"]
    exits = [r for r in records if r["event"] == "exit"]
    assert signals and signals[0]["signal"] == "SIGTERM", records
    assert exits == [{"event": "exit", "t": exits[0]["t"], "code": 0}], "not SIGKILLed"
    drained = exits[0]["t"] - signals[0]["t"]
    assert 3.5 < drained < STOP_WAIT_S, drained
    log = job.logs()
    assert f"a Ray job stop gives vllm serve {STOP_WAIT_S}s to exit" in log
    assert f"stage=draining signal=SIGTERM grace={STOP_WAIT_S}" in log
    assert "stage=exited status=0 cause=stopped engine_status=0" in log
    assert job.stages() == [
        "connecting", "waiting-for-cluster", "preflight", "engine-starting", "serving",
        "draining", "exited",
    ]  # fmt: skip
