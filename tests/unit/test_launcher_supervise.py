"""Running the engine child: exit status, signal forwarding, drain grace, a missing executable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from vllm_dp_launcher.errors import ENGINE_ENDED_STATUS, EngineNotFoundError
from vllm_dp_launcher.supervise import EngineRun, exit_status, final_status, run_engine


@pytest.mark.parametrize(("returncode", "status"), [(0, 0), (3, 3), (-15, 143), (-9, 137)])
def test_exit_status_follows_the_shell_convention(returncode: int, status: int) -> None:
    """Killed by signal N means status 128 + N."""
    assert exit_status(returncode) == status


def test_child_status_and_env_come_through() -> None:
    """The child runs with the given environment and its status is returned."""
    code = "import os, sys; sys.exit(int(os.environ['CODE']))"
    assert run_engine([sys.executable, "-c", code], {"CODE": "6"}) == EngineRun(6)


def test_missing_executable_is_reported() -> None:
    """command[0] not on PATH is an error naming it, status 127."""
    with pytest.raises(EngineNotFoundError, match="'no-such-vllm' not found on PATH") as err:
        run_engine(["no-such-vllm", "serve"], {"PATH": "/nonexistent"})
    assert err.value.exit_status == 127


def test_sigterm_is_forwarded_to_the_child(tmp_path: Path) -> None:
    """SIGTERM to the supervising process reaches the child, whose status is returned."""
    ready = tmp_path / "ready"
    child = textwrap.dedent(f"""
        import pathlib, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(9))
        pathlib.Path({str(ready)!r}).write_text("x")
        time.sleep(30)
    """)
    supervisor = textwrap.dedent(f"""
        import sys
        from vllm_dp_launcher.supervise import run_engine
        sys.exit(run_engine([sys.executable, "-c", {child!r}], {{}}).status)
    """)
    proc = subprocess.Popen([sys.executable, "-c", supervisor], env=dict(os.environ))
    deadline = time.monotonic() + 10
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 9


@pytest.mark.parametrize(
    ("run", "expected"),
    [
        (EngineRun(0), (ENGINE_ENDED_STATUS, "engine-ended")),
        (EngineRun(1), (1, "engine-ended")),
        (EngineRun(137), (137, "engine-ended")),
        (EngineRun(0, "SIGTERM"), (0, "stopped")),
        (EngineRun(134, "SIGTERM"), (134, "stopped")),
        (EngineRun(137, "SIGTERM", killed_after_grace=True), (137, "stopped")),
    ],
)
def test_an_engine_ending_unasked_is_a_failure(run: EngineRun, expected: tuple[int, str]) -> None:
    """vLLM exits 0 after an engine died (vllm#48966): without a stop that is not success."""
    assert final_status(run) == expected
    assert ENGINE_ENDED_STATUS != 0


def _supervise(tmp_path: Path, child: str, drain_grace: float | None) -> subprocess.Popen[str]:
    """Start a process that runs ``child`` under run_engine and prints the EngineRun as JSON."""
    supervisor = textwrap.dedent(f"""
        import dataclasses, json, logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        from vllm_dp_launcher.supervise import run_engine
        run = run_engine([sys.executable, "-c", {child!r}], {{}}, drain_grace={drain_grace!r})
        print(json.dumps(dataclasses.asdict(run)))
    """)
    return subprocess.Popen(
        [sys.executable, "-c", supervisor], env=dict(os.environ), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def _wait_for(path: Path, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"{path} never appeared"


def test_a_stop_is_recorded_and_the_drain_stage_logged(tmp_path: Path) -> None:
    """A forwarded SIGTERM is in the result, with a stage=draining line naming the grace."""
    ready = tmp_path / "ready"
    child = textwrap.dedent(f"""
        import pathlib, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        pathlib.Path({str(ready)!r}).write_text("x")
        time.sleep(30)
    """)
    proc = _supervise(tmp_path, child, drain_grace=20.0)
    _wait_for(ready)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert json.loads(out) == {"status": 0, "stop_signal": "SIGTERM", "killed_after_grace": False}
    assert "stage=draining signal=SIGTERM grace=20" in err


def test_an_engine_ignoring_the_stop_is_killed_after_the_drain_grace(tmp_path: Path) -> None:
    """Past the grace the engine's whole process group is killed, grandchildren included."""
    ready, grandchild_pid = tmp_path / "ready", tmp_path / "grandchild"
    child = textwrap.dedent(f"""
        import pathlib, signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        g = subprocess.Popen([sys.executable, "-c",
                              "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                              " time.sleep(60)"])
        pathlib.Path({str(grandchild_pid)!r}).write_text(str(g.pid))
        pathlib.Path({str(ready)!r}).write_text("x")
        time.sleep(60)
    """)
    proc = _supervise(tmp_path, child, drain_grace=1.0)
    _wait_for(ready)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    elapsed = time.monotonic() - started

    assert json.loads(out) == {"status": 137, "stop_signal": "SIGTERM", "killed_after_grace": True}
    assert 1.0 <= elapsed < 10, err
    assert "did not exit within the drain grace of 1s" in err
    pid = int(grandchild_pid.read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the engine's own children are killed with it"


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"
