"""A whole launch through ``main``, with Ray replaced by fakes and a real child as the engine.

What this tier shows: the stage lines in order, an engine that ends on its own failing the
launch, GPUs held by a live job failing it at once, a stop before the engine starts, and the
network preflight running beside the engine's start (a failed one stopping it).
The same paths run against a real Ray cluster in tests/ray.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import pytest
from vllm_dp_launcher import cli, raycluster, stages
from vllm_dp_launcher.cluster import GpuNode
from vllm_dp_launcher.errors import PreflightError
from vllm_dp_launcher.holders import GpuHolder, HolderReport
from vllm_dp_launcher.plan import LaunchPlan, PodPlan, encode_plan

HEAD = GpuNode("a" * 56, "10.0.0.1", 2, free_gpus=2.0)
WORKER = GpuNode("b" * 56, "10.0.0.2", 2, free_gpus=2.0)
STALE = GpuHolder(
    job_id="02000000",
    gpus=4,
    node_ips=("10.0.0.1", "10.0.0.2"),
    placement_groups=("dp_rank_0", "dp_rank_1", "dp_rank_2", "dp_rank_3"),
    submission_id="old-launch-00001",
    driver_alive=True,
    driver="pid 4242 on 10.0.0.1",
    entrypoint="/usr/bin/vllm serve m --data-parallel-size 4",
)


def make_plan(code: str, **changes: Any) -> LaunchPlan:
    """Two pods of two GPUs; the engine is ``python -c code`` (extra arguments are ignored)."""
    return LaunchPlan(
        version=1, model="m", data_parallel_size=4, ranks_per_node=2, tensor_parallel_size=1,
        pack_strategy="strict", gpu_pods=2, gpus_per_pod=2, total_gpus=4,
        pods=(PodPlan(0, "head", (0, 1), 2), PodPlan(1, "worker", (2, 3), 2)),
        port=1, command=(sys.executable, "-c", code), wait_timeout_seconds=30, **changes,
    )  # fmt: skip


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replace the launcher's Ray calls; the test sets ``nodes`` and ``holders``."""
    state: dict[str, Any] = {"nodes": [HEAD, WORKER], "holders": HolderReport(), "preflight": 0}
    monkeypatch.setattr(raycluster, "connect", lambda address: None)
    monkeypatch.setattr(raycluster, "disconnect", lambda: None)
    monkeypatch.setattr(raycluster, "own_node_ip", lambda: HEAD.ip)
    monkeypatch.setattr(raycluster, "own_submission_id", lambda: "this-launch")
    monkeypatch.setattr(raycluster, "list_gpu_nodes", lambda: state["nodes"])
    monkeypatch.setattr(raycluster, "gpu_holders", lambda: state["holders"])

    def preflight(own_ip: str, nodes: list[GpuNode], timeout: float, cancelled: Any) -> None:
        state["preflight"] += 1

    monkeypatch.setattr(cli, "run_preflight", preflight)
    monkeypatch.delenv("RAY_JOB_STOP_WAIT_TIME_S", raising=False)
    return state


def stage_names(text: str) -> list[str]:
    """The stage names in a log, in order."""
    return [line.name for line in stages.parse_stage_lines(text)]


def test_engine_ending_on_its_own_fails_the_launch(
    fake_ray: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """vllm serve exiting 0 with no stop forwarded ends the launch with status 6, said why."""
    status = cli.main(["--plan-b64", encode_plan(make_plan("pass"))])

    err = capsys.readouterr().err
    assert status == 6, err
    assert "vllm serve exited with status 0 although no stop signal was forwarded" in err
    assert "ended on its own" in err
    assert stage_names(err) == [
        "connecting", "waiting-for-cluster", "preflight", "engine-starting", "exited",
    ]  # fmt: skip
    assert stages.last_stage(err) == stages.StageLine(
        "exited", {"status": "6", "cause": "engine-ended", "engine_status": "0"}
    )


def test_engine_failing_on_its_own_keeps_its_status(
    fake_ray: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """A non-zero status of an engine that ended on its own is passed through."""
    assert cli.main(["--plan-b64", encode_plan(make_plan("raise SystemExit(3)"))]) == 3
    assert stages.last_stage(capsys.readouterr().err) == stages.StageLine(
        "exited", {"status": "3", "cause": "engine-ended", "engine_status": "3"}
    )


def test_gpus_held_by_a_live_job_fail_at_once(
    fake_ray: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """All nodes present but their GPUs held by a running job: status 5 naming the job."""
    fake_ray["nodes"] = [GpuNode(n.node_id, n.ip, 2, free_gpus=0.0) for n in (HEAD, WORKER)]
    fake_ray["holders"] = HolderReport((STALE,))

    status = cli.main(["--plan-b64", encode_plan(make_plan("raise SystemExit(99)"))])

    err = capsys.readouterr().err
    assert status == 5, err
    assert "4 of the cluster's 4 GPU(s) are in use" in err
    assert "Ray job 02000000 (submission 'old-launch-00001', driver running as pid 4242" in err
    assert "placement group(s) dp_rank_0, dp_rank_1, dp_rank_2, dp_rank_3" in err
    assert fake_ray["preflight"] == 0
    assert stages.last_stage(err) == stages.StageLine(
        "exited", {"status": "5", "cause": "gpus-held"}
    )


def test_stop_before_the_engine_starts_ends_the_launch(
    fake_ray: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM while waiting for the cluster: nothing started, status 143, cause stopped."""
    fake_ray["nodes"] = [HEAD]  # never complete
    threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGTERM)).start()
    before = signal.getsignal(signal.SIGTERM)

    status = cli.main(["--plan-b64", encode_plan(make_plan("raise SystemExit(99)"))])

    err = capsys.readouterr().err
    assert status == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM before vllm serve started" in err
    assert stages.last_stage(err) == stages.StageLine(
        "exited", {"status": "143", "cause": "stopped"}
    )
    assert signal.getsignal(signal.SIGTERM) == before, "the caller's handler is restored"


def test_stop_wait_shorter_than_the_drain_grace_is_warned(
    fake_ray: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray's 3 s default would SIGKILL vllm serve before a planned 30 s drain: say so."""
    cli.main(["--plan-b64", encode_plan(make_plan("pass", drain_grace_seconds=30))])
    err = capsys.readouterr().err
    assert "SIGKILLs vllm serve 3s after its SIGTERM (Ray's default" in err
    assert "the Ray pods need RAY_JOB_STOP_WAIT_TIME_S=30" in err

    monkeypatch.setenv("RAY_JOB_STOP_WAIT_TIME_S", "30")
    cli.main(["--plan-b64", encode_plan(make_plan("pass", drain_grace_seconds=30))])
    assert "a Ray job stop gives vllm serve 30s to exit (RAY_JOB_STOP_WAIT_TIME_S=30)" in (
        capsys.readouterr().err
    )


def test_stop_wait_that_ray_cannot_read_is_warned(
    fake_ray: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray reads the variable with int(): "30.5" would break the job's stop, so say so."""
    monkeypatch.setenv("RAY_JOB_STOP_WAIT_TIME_S", "30.5")
    cli.main(["--plan-b64", encode_plan(make_plan("pass", drain_grace_seconds=30))])
    assert "RAY_JOB_STOP_WAIT_TIME_S='30.5' is not an integer" in capsys.readouterr().err


def test_stop_is_not_swallowed_by_code_that_catches_exceptions(
    fake_ray: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM during a Ray call wrapped in ``except Exception`` still ends the launch."""
    fake_ray["nodes"] = [GpuNode(n.node_id, n.ip, 2, free_gpus=0.0) for n in (HEAD, WORKER)]

    def slow_holders() -> HolderReport:
        try:
            time.sleep(10)
        except Exception:
            return HolderReport(error="swallowed")
        return HolderReport()

    monkeypatch.setattr(raycluster, "gpu_holders", slow_holders)
    threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGTERM)).start()

    assert cli.main(["--plan-b64", encode_plan(make_plan("raise SystemExit(99)"))]) == 143
    assert "stage=exited status=143 cause=stopped" in capsys.readouterr().err


def test_vllm_starts_while_the_preflight_runs(
    fake_ray: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Any,
) -> None:
    """The exec does not wait for the preflight: the preflight sees the engine running, and
    the launcher's Ray connection is dropped only once the preflight is done."""
    marker = tmp_path / "engine-started"
    seen: list[str] = []

    def preflight(own_ip: str, nodes: list[GpuNode], timeout: float, cancelled: Any) -> None:
        deadline = time.monotonic() + 10
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        seen.append("engine running" if marker.exists() else "no engine")

    monkeypatch.setattr(cli, "run_preflight", preflight)
    monkeypatch.setattr(raycluster, "disconnect", lambda: seen.append("disconnected"))
    code = f"import pathlib, time; pathlib.Path({str(marker)!r}).touch(); time.sleep(1)"

    status = cli.main(["--plan-b64", encode_plan(make_plan(code))])

    err = capsys.readouterr().err
    assert status == 6, err  # the engine then ended on its own
    assert seen == ["engine running", "disconnected"]
    assert stage_names(err) == [
        "connecting", "waiting-for-cluster", "preflight", "engine-starting", "exited",
    ]  # fmt: skip


def test_failed_preflight_stops_the_starting_engine_and_names_the_node(
    fake_ray: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Any,
) -> None:
    """An engine that would hang (a node cannot reach it) is stopped once the preflight
    fails, and the launch ends with the preflight's status and cause, not the engine's."""
    marker = tmp_path / "engine-started"

    def preflight(own_ip: str, nodes: list[GpuNode], timeout: float, cancelled: Any) -> None:
        deadline = time.monotonic() + 10
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        raise PreflightError("network preflight failed: 1 of 2 GPU node(s) ... 10.0.0.2")

    monkeypatch.setattr(cli, "run_preflight", preflight)
    code = f"import pathlib, time; pathlib.Path({str(marker)!r}).touch(); time.sleep(60)"
    started = time.monotonic()

    status = cli.main(["--plan-b64", encode_plan(make_plan(code))])

    err = capsys.readouterr().err
    assert status == 4, err
    assert time.monotonic() - started < 30, "the hanging engine was stopped, not waited for"
    assert "network preflight failed: 1 of 2 GPU node(s) ... 10.0.0.2" in err
    assert "stopping vllm serve" in err
    assert "ended on its own" not in err
    assert stages.last_stage(err) == stages.StageLine(
        "exited", {"status": "4", "cause": "preflight-failed"}
    )


def test_engine_failing_fast_waits_for_the_preflight_to_name_the_node(
    fake_ray: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM ending on its own before the preflight's verdict: the verdict is waited for, and
    a failed preflight is what the launch ends with (it names the node; vLLM does not)."""

    def preflight(own_ip: str, nodes: list[GpuNode], timeout: float, cancelled: Any) -> None:
        time.sleep(0.5)
        raise PreflightError("network preflight failed: 10.0.0.2 unreachable")

    monkeypatch.setattr(cli, "run_preflight", preflight)

    status = cli.main(["--plan-b64", encode_plan(make_plan("raise SystemExit(1)"))])

    err = capsys.readouterr().err
    assert status == 4, err
    assert stages.last_stage(err) == stages.StageLine(
        "exited", {"status": "4", "cause": "preflight-failed"}
    )
