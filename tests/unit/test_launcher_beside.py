"""The preflight's stop of a starting vLLM: its whole process group, SIGKILL after the grace."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

from vllm_dp_launcher.beside import PreflightBeside
from vllm_dp_launcher.errors import PreflightError

# A parent that ignores SIGTERM with a child in its group: both must end.
STUBBORN = (
    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']); time.sleep(60)"
)


def group_gone(pgid: int) -> bool:
    """Whether the group has no process left (a killed orphan waits a moment to be reaped)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def fail(cancelled: object) -> None:
    raise PreflightError("network preflight failed")


def test_an_engine_ignoring_sigterm_is_killed_with_its_group_after_the_grace() -> None:
    child = subprocess.Popen([sys.executable, "-c", STUBBORN], process_group=0)
    time.sleep(0.5)  # its own child started
    beside = PreflightBeside(fail, timeout=1, stop_grace=0.5)
    started = time.monotonic()

    beside.start(child, stopping=lambda: False)
    child.wait(timeout=10)

    assert time.monotonic() - started < 5
    assert isinstance(beside.settle(stopped=False), PreflightError)
    assert beside.finished
    assert group_gone(child.pid), "vLLM's other processes went with it"


def test_a_stop_already_forwarded_is_left_to_run_its_course() -> None:
    """A failed preflight after a stop signal: the drain in progress is not cut short."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"],
                             process_group=0)  # fmt: skip
    beside = PreflightBeside(fail, timeout=1, stop_grace=0.1)

    beside.start(child, stopping=lambda: True)
    started = time.monotonic()
    assert child.wait(timeout=10) == 0, "not signalled"
    assert time.monotonic() - started > 0.5
    assert isinstance(beside.settle(stopped=True), PreflightError)


def test_a_passing_preflight_leaves_the_engine_alone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"],
                             process_group=0)  # fmt: skip
    beside = PreflightBeside(lambda cancelled: None, timeout=1)

    beside.start(child, stopping=lambda: False)
    assert child.wait(timeout=10) == 0
    assert beside.settle(stopped=False) is None


def test_a_stop_cancels_a_running_preflight_and_waits_for_its_end() -> None:
    """The launcher's exit shuts Ray down: a preflight still on it would die of that."""
    child = subprocess.Popen([sys.executable, "-c", "pass"], process_group=0)
    ended: list[str] = []

    def slow(cancelled: Any) -> None:
        deadline = time.monotonic() + 30
        while not cancelled() and time.monotonic() < deadline:
            time.sleep(0.02)
        ended.append("cancelled" if cancelled() else "timed out")

    beside = PreflightBeside(slow, timeout=30)
    beside.start(child, stopping=lambda: True)
    child.wait(timeout=10)
    started = time.monotonic()

    assert beside.settle(stopped=True) is None
    assert time.monotonic() - started < 2
    assert ended == ["cancelled"] and beside.finished
