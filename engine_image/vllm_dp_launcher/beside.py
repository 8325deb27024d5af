"""The network preflight run beside vLLM's start, stopping vLLM when it fails.

Run before ``vllm serve``, the preflight (a Ray task on every GPU node, each a fresh Ray worker
process) put about two seconds between the last node joining and the exec. vLLM takes far
longer than the preflight to reach the point where its engines dial the launcher's node (it
loads the model first), so the check loses nothing by running while vLLM starts: a node that
cannot be reached still ends the launch with ``preflight-failed`` naming the node, and vLLM,
which would hang there, is stopped.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from vllm_dp_launcher.errors import LauncherError

log = logging.getLogger("vllm_dp_launcher")

#: After a failed preflight's SIGTERM, how long vLLM's process group has before SIGKILL.
#: Nothing to drain: an engine that cannot be reached never served.
STOP_GRACE_SECONDS = 5.0
#: After a stop, how long a cancelled preflight has to end (its loop polls every 0.1 s).
CANCEL_WAIT_SECONDS = 2.0


class PreflightBeside:
    """One preflight in a thread; ``start`` it with the engine, read ``settle`` after it ends.

    ``check(cancelled)`` raises a ``LauncherError`` on failure, and returns soon once
    ``cancelled()``: after a stop, ``settle`` cancels it and waits for that. It runs on the
    launcher's Ray connection, which stays open while vLLM runs: Ray's shutdown puts the
    process's SIGTERM back to the default at the C level (Python's ``getsignal`` still names
    the old handler), so a disconnect beside the engine would let a stop kill the launcher
    instead of being forwarded. The caller disconnects once the engine has ended.
    """

    def __init__(
        self,
        check: Callable[[Callable[[], bool]], None],
        timeout: float,
        stop_grace: float = STOP_GRACE_SECONDS,
    ) -> None:
        self._check = check
        self._timeout = timeout
        self._stop_grace = stop_grace
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._error: LauncherError | None = None

    def start(self, child: subprocess.Popen[bytes], stopping: Callable[[], bool]) -> None:
        """Run the check beside ``child``; on failure, say so and stop the child's group."""

        def run() -> None:
            try:
                self._check(self._cancel.is_set)
            except LauncherError as exc:
                self._error = exc
                # Said at once: vLLM may log for a while yet before it is stopped.
                log.error("%s", exc)
                if not stopping():
                    log.error("stopping vllm serve (pid %d): it could not start", child.pid)
                    _stop_group(child, self._stop_grace)

        self._thread = threading.Thread(target=run, name="vllm-preflight", daemon=True)
        self._thread.start()

    @property
    def finished(self) -> bool:
        """Whether no check is running (none started, or it ended)."""
        return self._thread is None or not self._thread.is_alive()

    def settle(self, stopped: bool) -> LauncherError | None:
        """After the engine ended: the preflight's error, waiting for its verdict first when
        vLLM ended on its own (a cut-off node can make it fail fast, and the preflight names
        the node). After a stop the check is cancelled, and its end waited for: the launcher's
        exit shuts its Ray connection down, which a check still using it would die of."""
        if self._thread is not None:
            if stopped:
                self._cancel.set()
                self._thread.join(CANCEL_WAIT_SECONDS)
            else:
                self._thread.join(self._timeout + self._stop_grace)
        return self._error


def _stop_group(child: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM vLLM's process group, then SIGKILL what is left of it once ``grace`` passed.

    The group is asked, not the child: the main thread is in ``child.wait()``, which holds
    the lock that ``poll()`` needs, and vLLM's own processes share the group.
    """
    deadline = time.monotonic() + grace
    try:
        os.killpg(child.pid, signal.SIGTERM)
        while time.monotonic() < deadline:
            time.sleep(0.05)
            os.killpg(child.pid, 0)  # raises once the whole group is gone
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
