"""Running the engine child: exit status, signal forwarding, a missing executable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from vllm_dp_launcher.errors import EngineNotFoundError
from vllm_dp_launcher.supervise import exit_status, run_engine


@pytest.mark.parametrize(("returncode", "status"), [(0, 0), (3, 3), (-15, 143), (-9, 137)])
def test_exit_status_follows_the_shell_convention(returncode: int, status: int) -> None:
    """Killed by signal N means status 128 + N."""
    assert exit_status(returncode) == status


def test_child_status_and_env_come_through() -> None:
    """The child runs with the given environment and its status is returned."""
    code = "import os, sys; sys.exit(int(os.environ['CODE']))"
    assert run_engine([sys.executable, "-c", code], {"CODE": "6"}) == 6


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
        sys.exit(run_engine([sys.executable, "-c", {child!r}], {{}}))
    """)
    proc = subprocess.Popen([sys.executable, "-c", supervisor], env=dict(os.environ))
    deadline = time.monotonic() + 10
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 9
