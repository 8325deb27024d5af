"""Stage lines: their format, the reading helpers, the README's list, and /health watching."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

import pytest
from vllm_dp_launcher import health, stages
from vllm_dp_launcher.cli import setup_logging
from vllm_dp_launcher.plan import LaunchPlan, PodPlan

README = Path(__file__).resolve().parents[2] / "engine_image" / "README.md"


def test_stage_lines_have_the_documented_shape(capsys: pytest.CaptureFixture[str]) -> None:
    """``<time> vllm-dp-launcher stage=<name> k=v``, as the launcher's logging prints it."""
    restore = setup_logging()
    try:
        stages.enter(stages.WAITING_FOR_CLUSTER, nodes="2/3", gpus="8/12")
    finally:
        restore()
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} vllm-dp-launcher stage=waiting-for-cluster "
        r"nodes=2/3 gpus=8/12",
        line,
    ), line


def test_parse_and_last_stage_read_a_ray_job_log() -> None:
    """Other lines (vLLM's, the launcher's own) are skipped; fields come back as strings."""
    log = "\n".join([
        "Running entrypoint for job raysubmit_x: python -m vllm_dp_launcher --plan-b64 e30=",
        "2026-01-02 10:00:00,000 vllm-dp-launcher stage=connecting",
        "2026-01-02 10:00:01,000 vllm-dp-launcher INFO waiting for the Ray cluster: 2/3 ...",
        "2026-01-02 10:00:01,000 vllm-dp-launcher stage=waiting-for-cluster nodes=3 gpus=12",
        "INFO 01-02 10:00:05 [api_server.py:1] vLLM API server version 0.33.0",
        "2026-01-02 10:00:09,000 vllm-dp-launcher stage=engine-starting pid=321",
    ])  # fmt: skip
    assert [s.name for s in stages.parse_stage_lines(log)] == [
        "connecting", "waiting-for-cluster", "engine-starting",
    ]  # fmt: skip
    assert stages.last_stage(log) == stages.StageLine("engine-starting", {"pid": "321"})
    assert stages.last_stage("no stage here") is None


def test_stage_names_and_values_are_checked() -> None:
    """Unknown stages and values that would break the line are programming errors."""
    with pytest.raises(ValueError, match="unknown stage"):
        stages.stage_text("loading")
    with pytest.raises(ValueError, match="must be one token"):
        stages.stage_text(stages.EXITED, cause="two words")


def test_every_stage_and_cause_is_documented() -> None:
    """engine_image/README.md lists each stage name and exit cause the launcher prints."""
    text = README.read_text()
    for name in stages.STAGES:
        assert f"`{name}`" in text, name
    for cause in ("stopped", "engine-ended", "gpus-held", "cluster-not-ready", "bad-plan",
                  "preflight-failed", "ray-unreachable", "engine-not-found"):  # fmt: skip
        assert f"`{cause}`" in text, cause


def plan(command: tuple[str, ...]) -> LaunchPlan:
    """A one-pod plan with ``command`` on port 8123."""
    return LaunchPlan(
        version=1, model="m", data_parallel_size=1, ranks_per_node=1, tensor_parallel_size=1,
        pack_strategy="strict", gpu_pods=1, gpus_per_pod=1, total_gpus=1,
        pods=(PodPlan(0, "head", (0,), 1),), port=8123, command=command,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "url"),
    [
        ((), "http://127.0.0.1:8123/health"),
        (("--host", "0.0.0.0"), "http://127.0.0.1:8123/health"),
        (("--host=10.1.2.3",), "http://10.1.2.3:8123/health"),
        (("--host", "::"), "http://[::1]:8123/health"),
        (("--host", "fd00::5"), "http://[fd00::5]:8123/health"),
    ],
)
def test_health_url_follows_the_host_flag(args: tuple[str, ...], url: str) -> None:
    """A wildcard bind is reached on loopback; a specific address on itself."""
    assert health.health_url(plan(("vllm", "serve", "m", *args))) == url


def test_serving_stage_is_entered_once_health_answers(caplog: pytest.LogCaptureFixture) -> None:
    """The watcher polls until the probe passes, then prints stage=serving and stops."""
    answers = iter([False, False, True])
    calls: list[str] = []

    def probe(url: str) -> bool:
        calls.append(url)
        return next(answers)

    with caplog.at_level(logging.INFO):
        health.watch("http://x/health", alive=lambda: True, interval=0.01, probe=probe).join(5)
    assert len(calls) == 3
    assert "stage=serving url=http://x/health" in [r.getMessage() for r in caplog.records]


def test_watcher_stops_when_the_engine_is_gone() -> None:
    """No serving stage for an engine that exited."""
    gone = threading.Event()
    gone.set()
    thread = health.watch("http://x/health", alive=lambda: not gone.is_set(), probe=lambda u: True)
    thread.join(5)
    assert not thread.is_alive()
