"""Running the engine as a child process: signals in, exit status out.

A stop signal (SIGTERM, SIGINT) is forwarded to ``vllm serve``, which then gets the drain
grace to exit; after it, its whole process group is killed. The result says whether a stop
was forwarded, so that the caller can tell a stop from an engine that ended on its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType

from vllm_dp_launcher import stages
from vllm_dp_launcher.errors import ENGINE_ENDED_STATUS, EngineNotFoundError
from vllm_dp_launcher.redact import redact_argv

log = logging.getLogger(__name__)

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class EngineRun:
    """How the engine ended: its exit status, and the stop signal forwarded to it, if any."""

    status: int
    stop_signal: str | None = None
    killed_after_grace: bool = False


def exit_status(returncode: int) -> int:
    """Map a Popen return code to a shell-style exit status (signal N becomes 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def run_engine(
    argv: Sequence[str],
    env: Mapping[str, str],
    drain_grace: float | None = None,
    on_start: Callable[[subprocess.Popen[bytes], Callable[[], bool]], object] | None = None,
) -> EngineRun:
    """Run ``argv`` with ``env``; forward SIGTERM/SIGINT; return how it ended.

    After the first forwarded signal the engine has ``drain_grace`` seconds (None: no limit
    here) before its process group is killed. ``on_start`` is called with the child and a
    function that says whether a stop signal has arrived.
    """
    children: list[subprocess.Popen[bytes]] = []
    stops: list[int] = []
    killed = threading.Event()
    timer: list[threading.Timer] = []

    def kill_group() -> None:
        child = children[0]
        if child.poll() is None:
            log.warning(
                "vllm serve did not exit within the drain grace of %gs; killing its process "
                "group (pid %d)",
                drain_grace,
                child.pid,
            )
            killed.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)

    def begin_drain(signum: int) -> None:
        name = signal.Signals(signum).name
        grace = "none" if drain_grace is None else f"{drain_grace:g}"
        stages.enter(stages.DRAINING, signal=name, grace=grace)
        if drain_grace is not None:
            timer.append(threading.Timer(drain_grace, kill_group))
            timer[0].daemon = True
            timer[0].start()

    def forward(signum: int, _frame: FrameType | None) -> None:
        stops.append(signum)
        if not children:
            return  # sent once the child exists
        name = signal.Signals(signum).name
        log.info("forwarding %s to the engine (pid %d)", name, children[0].pid)
        if len(stops) == 1:
            begin_drain(signum)
        children[0].send_signal(signum)

    # Installed before the child starts, so that a signal in between is not lost.
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        try:
            # Own process group: a Ctrl-C or a group-wide SIGTERM reaches the engine once,
            # through the launcher, and a kill after the drain grace reaches all of vLLM's
            # processes. The parent-death signal stops it outliving a SIGKILL.
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
        log.info("started engine (pid %d): %s", child.pid, shlex.join(redact_argv(argv)))
        stages.enter(stages.ENGINE_STARTING, pid=child.pid)
        if on_start is not None:
            on_start(child, lambda: bool(stops))
        if stops:
            log.info("forwarding %s to the engine (pid %d)", signal.Signals(stops[0]).name,
                     child.pid)  # fmt: skip
            begin_drain(stops[0])
            child.send_signal(stops[0])
        returncode = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for pending in timer:
            pending.cancel()
    status = exit_status(returncode)
    stop = signal.Signals(stops[0]).name if stops else None
    log.info("engine exited with status %d", status)
    return EngineRun(status, stop, killed.is_set())


def final_status(run: EngineRun) -> tuple[int, str]:
    """The launcher's exit status and cause: a stop gives vLLM's status, anything else fails.

    ``vllm serve`` only ends on its own when something broke: an engine died and vLLM shut
    down, exiting 0 (vllm#48966). Without a forwarded stop, status 0 becomes
    ENGINE_ENDED_STATUS; a non-zero status is kept.
    """
    if run.stop_signal is not None:
        return run.status, stages.CAUSE_STOPPED
    return run.status or ENGINE_ENDED_STATUS, stages.CAUSE_ENGINE_ENDED


def _pdeathsig_preexec() -> Callable[[], None] | None:
    """Return a pre-exec hook that sets the parent-death signal, or None off Linux."""
    if sys.platform != "linux":
        return None
    # Looked up before fork: the hook itself must only make the system call.
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def set_pdeathsig() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    return set_pdeathsig
