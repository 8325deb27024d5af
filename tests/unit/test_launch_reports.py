"""The launcher's report, followed in the head pod's log: a new stage wakes, old ones do not."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime

from vllm_dp_launcher import report, stages
from vllm_dp_launcher.cli import STAGE_FORMAT
from vllm_dp_operator.engines.launch_reports import Launch, LaunchReports

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class LogDouble:
    """Test double for `pods/log` with follow: lines fed by the test, a stream that can break."""

    def __init__(self) -> None:
        self.lines: asyncio.Queue[str | None] = asyncio.Queue()
        self.follows: list[tuple[str, int]] = []

    async def __call__(self, namespace: str, pod: str, container: str,
                       since_seconds: int) -> AsyncIterator[str]:  # fmt: skip
        self.follows.append((pod, since_seconds))
        while (line := await self.lines.get()) is not None:
            yield line


def line(stage: str, job: str) -> str:
    return f"2026-01-01 00:00:05,000 vllm-dp-launcher {stages.stage_text(stage)} job={job}\n"


async def until(check: object, timeout: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not check():  # type: ignore[operator]
        assert loop.time() - start < timeout
        await asyncio.sleep(0.002)


async def test_serving_reported_for_this_job_wakes_once_and_ends_the_follow() -> None:
    logs, woken = LogDouble(), []
    reports = LaunchReports(logs, lambda key, stage: woken.append((key, stage)),
                            clock=lambda: T0)  # fmt: skip
    launch = Launch("ns", "demo", "demo-head", "ray-head", "demo-j00002", T0)
    assert reports.stage(launch) is None
    await until(lambda: logs.follows)
    logs.lines.put_nowait("ray start: some unrelated output\n")
    logs.lines.put_nowait(line(stages.SERVING, "demo-j00001"))  # the previous launch's line
    logs.lines.put_nowait(line(stages.ENGINE_STARTING, "demo-j00002"))
    await until(lambda: woken)
    assert woken == [(("ns", "demo"), stages.ENGINE_STARTING)]
    logs.lines.put_nowait(line(stages.SERVING, "demo-j00002"))
    await until(lambda: len(woken) == 2)
    assert reports.stage(launch) == stages.SERVING
    await until(lambda: not reports._follows)  # nothing is followed once it serves
    assert len(logs.follows) == 1
    await reports.stop()


async def test_a_broken_stream_is_followed_again_and_a_new_job_replaces_the_old(
    monkeypatch: object,
) -> None:
    import vllm_dp_operator.engines.launch_reports as lr

    lr.REFOLLOW_SECONDS = 0.01  # type: ignore[misc]
    logs, woken = LogDouble(), []
    reports = LaunchReports(logs, lambda key, stage: woken.append(stage), clock=lambda: T0)
    first = Launch("ns", "demo", "demo-head", "ray-head", "demo-j00001", T0)
    reports.stage(first)
    await until(lambda: logs.follows)
    logs.lines.put_nowait(None)  # the API server closed the stream
    await until(lambda: len(logs.follows) == 2)
    second = Launch("ns", "demo", "demo-head", "ray-head", "demo-j00002", T0)
    assert reports.stage(second) is None
    await until(lambda: len(logs.follows) == 3)
    logs.lines.put_nowait(line(stages.SERVING, "demo-j00001"))
    logs.lines.put_nowait(line(stages.SERVING, "demo-j00002"))
    await until(lambda: woken)
    assert woken == [stages.SERVING] and reports.stage(second) == stages.SERVING
    reports.release(("ns", "demo"))
    assert reports.stage(second) is None  # forgotten: followed again if asked
    await reports.stop()
    lr.REFOLLOW_SECONDS = 2.0  # type: ignore[misc]


def test_the_launcher_writes_stage_lines_with_its_job_where_the_head_job_says(tmp_path) -> None:
    path = tmp_path / "container-stdout"
    env = {report.REPORT_ENV: str(path), report.JOB_ENV: "demo-j00003"}
    handler = report.report_handler(env, STAGE_FORMAT)
    assert handler is not None
    stages.log.addHandler(handler)
    level = stages.log.level
    stages.log.setLevel(logging.INFO)
    try:
        stages.enter(stages.SERVING, url="http://10.0.0.9:8000/health")
    finally:
        stages.log.removeHandler(handler)
        stages.log.setLevel(level)
        handler.close()
    (parsed,) = stages.parse_stage_lines(path.read_text())
    assert parsed.name == stages.SERVING and parsed.fields["job"] == "demo-j00003"
    # Nowhere to write, or no job to name: no handler (the Ray job log keeps the lines).
    assert report.report_handler({report.JOB_ENV: "j"}, "%(message)s") is None
    assert report.report_handler({report.REPORT_ENV: str(path)}, "%(message)s") is None
    assert report.report_handler({**env, report.REPORT_ENV: str(tmp_path / "no" / "x")},
                                 "%(message)s") is None  # fmt: skip


def test_the_containers_stdout_is_its_main_process_not_pid_1(tmp_path) -> None:
    """KubeRay's pods share one process namespace: PID 1 is the pause process; the launcher's
    oldest ancestor with parent 0 is the container's main process."""
    for pid, comm, ppid in ((1, "pause", 0), (13, "bash", 0), (50, "ray (start) x", 13),
                            (77, "raylet", 50), (90, "python", 77)):  # fmt: skip
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0 -1\n")
    assert report.container_stdout(90, tmp_path) == tmp_path / "13" / "fd" / "1"
    # An ancestor that cannot be read ends the walk there (its child is the oldest seen).
    (tmp_path / "13" / "stat").unlink()
    assert report.container_stdout(90, tmp_path) == tmp_path / "50" / "fd" / "1"
    assert report.container_stdout(4242, tmp_path) is None
