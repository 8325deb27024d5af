"""The stage lines, also written to the head container's own log, for the operator to follow.

The Ray job's log is read through the Ray dashboard; the container's log through the API
server (``pods/log``), which a watchful operator can follow with no access to the pod's ports.
The head job names where (``VLLMDP_STAGE_REPORT``: ``container-stdout``, or a path) and which
head job this is (``VLLMDP_HEAD_JOB``), which each line then carries as ``job=<name>``, so that
a line is never taken for another launch's on the same head pod.

The container's stdout is its main process's: the launcher's oldest ancestor in the
container, the one whose parent lies outside it (parent 0). PID 1 is not it: KubeRay's pods
share one process namespace, whose PID 1 is the pod's pause process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

REPORT_ENV = "VLLMDP_STAGE_REPORT"
JOB_ENV = "VLLMDP_HEAD_JOB"
#: The REPORT_ENV value for the launcher's own container's stdout.
CONTAINER_STDOUT = "container-stdout"

log = logging.getLogger("vllm_dp_launcher")


def _parent(pid: int, proc: Path) -> int | None:
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after the last ')'
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def container_stdout(pid: int | None = None, proc: Path = Path("/proc")) -> Path | None:
    """The stdout of this container's main process: the oldest ancestor of `pid` (this
    process) whose parent is outside the process namespace (0) or cannot be seen."""
    current = pid if pid is not None else os.getpid()
    for _ in range(64):  # a chain of ancestors, never a loop
        parent = _parent(current, proc)
        if parent is None:
            return None
        if parent == 0 or _parent(parent, proc) is None:
            return proc / str(current) / "fd" / "1"
        current = parent
    return None


def report_handler(env: Mapping[str, str], fmt: str) -> logging.Handler | None:
    """A handler writing stage lines, each with ``job=<name>``, where the head job says; None
    when it says nowhere, or the place cannot be opened (the Ray job log still has them)."""
    where, job = env.get(REPORT_ENV), env.get(JOB_ENV)
    if not where or not job or any(ch.isspace() or ch == "=" for ch in job):
        return None
    path = container_stdout() if where == CONTAINER_STDOUT else Path(where)
    if path is None:
        log.warning("Cannot find this container's main process: stage lines go to the Ray "
                    "job log only")  # fmt: skip
        return None
    try:
        stream = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives on)
    except OSError as exc:
        log.warning("Cannot write stage lines to %s (%s): the operator learns of them later, "
                    "from its own probes", path, exc)  # fmt: skip
        return None
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(f"{fmt} job={job}"))
    return handler
