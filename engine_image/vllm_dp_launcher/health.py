"""Watching for vLLM to answer: the ``serving`` stage begins when ``/health`` returns 200,
the ``answered`` stage once one completion of one token has answered 200 from inside the pod.

vLLM binds its port early but only listens once the model is loaded and every engine is
placed, so a launch that never reaches ``serving`` was stuck in placement or weight loading.
``answered`` is the proof that the engines generate: the launcher sends that completion with
the engines' API key (``VLLM_API_KEY``, from ``spec.apiKeySecretRef``), which the operator
never holds. The key is sent in a header and never written anywhere.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping

from vllm_dp_launcher import servecheck, stages
from vllm_dp_launcher.plan import LaunchPlan

log = logging.getLogger(__name__)

WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}
#: The engines' API key, as vLLM reads it (the head pod's env, from spec.apiKeySecretRef).
API_KEY_ENV = "VLLM_API_KEY"
#: Seconds one completion may take (a first forward pass on CPUs is slow), and between tries.
COMPLETION_TIMEOUT_SECONDS = 30.0
COMPLETION_RETRY_SECONDS = 1.0


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


def completion_request(
    plan: LaunchPlan, env: Mapping[str, str] = os.environ
) -> urllib.request.Request:
    """The serving check (servecheck.py: one completion of one token, one embedding, or the
    model list), for the served model's name, with the key if there is one."""
    model = servecheck.flag(plan.command, "--served-model-name") or plan.model
    check = servecheck.resolve(plan.serving_check, plan.command)
    method, path, doc = servecheck.request(check, model)
    body = json.dumps(doc).encode() if doc is not None else None
    headers = {"Content-Type": "application/json"} if doc is not None else {}
    if key := env.get(API_KEY_ENV):
        headers["Authorization"] = f"Bearer {key}"
    url = health_url(plan).removesuffix("/health") + path
    return urllib.request.Request(url, data=body, headers=headers, method=method)


def complete(request: urllib.request.Request,
             timeout: float = COMPLETION_TIMEOUT_SECONDS) -> int | None:  # fmt: skip
    """The completion's HTTP status; None when no answer came (refused, reset, timed out)."""
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, urllib.error.URLError, ValueError):
        return None


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
    completion: Callable[[], int | None] | None = None,
    retry: float = COMPLETION_RETRY_SECONDS,
) -> threading.Thread:
    """Start a thread that enters the ``serving`` stage once ``url`` answers, then (given a
    ``completion`` to send) the ``answered`` stage once it returns 200, while ``alive()``."""

    def run() -> None:
        while alive():
            if probe(url):
                log.info("vllm serve answers %s", url)
                stages.enter(stages.SERVING, url=url)
                break
            time.sleep(interval)
        tries = 0
        while completion is not None and alive():
            tries += 1
            status = completion()
            if status == 200:
                stages.enter(stages.ANSWERED, status=status, tries=tries)
                return
            if tries == 1 or tries % 30 == 0:  # one line, then one every 30 tries
                log.warning("One completion of one token answered %s (try %d); trying again "
                            "every %.0fs", status or "nothing", tries, retry)  # fmt: skip
            time.sleep(retry)

    thread = threading.Thread(target=run, name="vllm-health", daemon=True)
    thread.start()
    return thread
