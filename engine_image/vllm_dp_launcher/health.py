"""Watching for vLLM to answer: the ``serving`` stage begins when ``/health`` returns 200.

vLLM binds its port early but only listens once the model is loaded and every engine is
placed, so a launch that never reaches this stage was stuck in placement or weight loading.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from vllm_dp_launcher import stages
from vllm_dp_launcher.plan import LaunchPlan

log = logging.getLogger(__name__)

WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def health_url(plan: LaunchPlan) -> str:
    """Return the URL of vLLM's ``/health`` as seen from this node (``--host``, ``port``)."""
    host = ""
    for i, arg in enumerate(plan.command):
        if arg == "--host" and i + 1 < len(plan.command):
            host = plan.command[i + 1]
        elif arg.startswith("--host="):
            host = arg.split("=", 1)[1]
    host = WILDCARDS.get(host, host)
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{plan.port}/health"


def answers(url: str, timeout: float = 2.0) -> bool:
    """True when ``url`` returns HTTP 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status) == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


def watch(
    url: str,
    alive: Callable[[], bool],
    interval: float = 0.25,
    probe: Callable[[str], bool] = answers,
) -> threading.Thread:
    """Start a thread that enters the ``serving`` stage once ``url`` answers, while ``alive()``."""

    def run() -> None:
        while alive():
            if probe(url):
                log.info("vllm serve answers %s", url)
                stages.enter(stages.SERVING, url=url)
                return
            time.sleep(interval)

    thread = threading.Thread(target=run, name="vllm-health", daemon=True)
    thread.start()
    return thread
