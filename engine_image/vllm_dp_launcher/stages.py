"""Machine-readable stage lines: where a launch is, for whoever reads the Ray job's log.

Each time the launcher enters a stage it prints one line to stderr (which the Ray job log
keeps), ``<time> vllm-dp-launcher stage=<name>`` followed by ``key=value`` fields, e.g.::

    2026-01-02 10:00:01,234 vllm-dp-launcher stage=waiting-for-cluster nodes=2/3 gpus=8/12

The operator reads the last one to say where a launch was stuck when its deadline passed.
``parse_stage_lines`` and ``last_stage`` are the reading side; like ``plan``, this module
imports only the standard library, so the operator can use it without Ray.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

CONNECTING = "connecting"
WAITING_FOR_CLUSTER = "waiting-for-cluster"
WAITING_FOR_FREE_GPUS = "waiting-for-free-gpus"
PREFLIGHT = "preflight"
ENGINE_STARTING = "engine-starting"
SERVING = "serving"
#: One completion of one token answered 200 in the pod (health.py): the engines generate.
ANSWERED = "answered"
DRAINING = "draining"
EXITED = "exited"

# In the order a launch passes them; DRAINING and EXITED can follow any of the others.
STAGES = (
    CONNECTING,
    WAITING_FOR_CLUSTER,
    WAITING_FOR_FREE_GPUS,
    PREFLIGHT,
    ENGINE_STARTING,
    SERVING,
    ANSWERED,
    DRAINING,
    EXITED,
)

# The causes on a ``stage=exited`` line, besides the launcher errors' own (errors.py).
CAUSE_STOPPED = "stopped"  # a stop signal was forwarded; the status is vLLM's
CAUSE_ENGINE_ENDED = "engine-ended"  # vllm serve ended with no stop signal: a failure

MARKER = "vllm-dp-launcher stage="
_LINE = re.compile(r"vllm-dp-launcher stage=(?P<name>[a-z-]+)(?P<fields>(?: [a-z_]+=\S*)*)\s*$")
_VALUE = re.compile(r"^[^\s=]+$")

log = logging.getLogger("vllm_dp_launcher.stage")


@dataclass(frozen=True)
class StageLine:
    """One parsed stage line: the stage's name and its fields."""

    name: str
    fields: dict[str, str]


def stage_text(name: str, **fields: object) -> str:
    """Return ``stage=<name> k=v ...``; values must be single tokens (no spaces, no '=')."""
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}")
    parts = [f"stage={name}"]
    for key, value in fields.items():
        text = str(value)
        if not _VALUE.match(text):
            raise ValueError(f"stage field {key}={text!r} must be one token without '='")
        parts.append(f"{key}={text}")
    return " ".join(parts)


def enter(name: str, **fields: object) -> None:
    """Print the stage line for ``name`` (the handler's format adds time and marker)."""
    log.info("%s", stage_text(name, **fields))


def parse_stage_lines(text: str) -> list[StageLine]:
    """Return every stage line in a log, oldest first."""
    found = []
    for line in text.splitlines():
        match = _LINE.search(line)
        if match:
            pairs = (item.split("=", 1) for item in match["fields"].split())
            found.append(StageLine(match["name"], {k: v for k, v in pairs}))
    return found


def last_stage(text: str) -> StageLine | None:
    """Return the last stage line in a log, or None when there is none."""
    lines = parse_stage_lines(text)
    return lines[-1] if lines else None
