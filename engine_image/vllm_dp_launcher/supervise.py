"""Running the engine as a child process: signals in, exit status out."""

from __future__ import annotations

import ctypes
import logging
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from types import FrameType

from vllm_dp_launcher.errors import EngineNotFoundError

log = logging.getLogger(__name__)

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1


def exit_status(returncode: int) -> int:
    """Map a Popen return code to a shell-style exit status (signal N becomes 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def run_engine(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``argv`` with ``env``, forward SIGTERM/SIGINT to it, and return its exit status."""
    children: list[subprocess.Popen[bytes]] = []
    early: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        if not children:
            early.append(signum)
            return
        name = signal.Signals(signum).name
        log.info("forwarding %s to the engine (pid %d)", name, children[0].pid)
        children[0].send_signal(signum)

    # Installed before the child starts, so that a signal in between is not lost.
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        try:
            # Own process group: a Ctrl-C or a group-wide SIGTERM reaches the engine once,
            # through the launcher. The parent-death signal stops it outliving a SIGKILL.
            children.append(
                subprocess.Popen(
                    list(argv), env=dict(env), process_group=0, preexec_fn=_pdeathsig_preexec()
                )
            )
        except FileNotFoundError as exc:
            raise EngineNotFoundError(
                f"engine executable {argv[0]!r} not found on PATH ({exc.strerror})"
            ) from exc
        child = children[0]
        log.info("started engine (pid %d): %s", child.pid, shlex.join(argv))
        for signum in early:
            child.send_signal(signum)
        returncode = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    status = exit_status(returncode)
    log.info("engine exited with status %d", status)
    return status


def _pdeathsig_preexec() -> Callable[[], None] | None:
    """Return a pre-exec hook that sets the parent-death signal, or None off Linux."""
    if sys.platform != "linux":
        return None
    # Looked up before fork: the hook itself must only make the system call.
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def set_pdeathsig() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return set_pdeathsig
