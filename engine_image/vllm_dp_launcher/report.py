"""The stage lines, also written to the head container's own log, for the operator to follow.

The Ray job's log is read through the Ray dashboard; the container's log through the API
server (``pods/log``), which a watchful operator can follow with no access to the pod's ports.
The head job names where (``VLLMDP_STAGE_REPORT``: the container's stdout, ``/proc/1/fd/1``)
and which head job this is (``VLLMDP_HEAD_JOB``), which each line then carries as
``job=<name>``, so that a line is never taken for another launch's on the same head pod.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

REPORT_ENV = "VLLMDP_STAGE_REPORT"
JOB_ENV = "VLLMDP_HEAD_JOB"

log = logging.getLogger("vllm_dp_launcher")


def report_handler(env: Mapping[str, str], fmt: str) -> logging.Handler | None:
    """A handler writing stage lines, each with ``job=<name>``, where the head job says; None
    when it says nowhere, or the place cannot be opened (the Ray job log still has them)."""
    path, job = env.get(REPORT_ENV), env.get(JOB_ENV)
    if not path or not job or any(ch.isspace() or ch == "=" for ch in job):
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
