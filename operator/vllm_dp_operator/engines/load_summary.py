"""status.load: a summary of the engines' load that moves only when something changed. Pure.

Per-rank numbers change on almost every probe; written to status they made a PATCH per
resource per probe (and a watch echo to every client). They go to metrics instead (the
operator's `vllmdp_engine_*` gauges, and vLLM's own series). Status keeps what a person or a
controller acts on:

- `level`: `Idle` (no request running or waiting on any rank), `Busy` (requests running,
  none waiting, every rank's KV cache below 90 %), `Saturated` (some rank has requests
  waiting, or a KV cache at 90 % or more: the engines take no more at once);
- `ranksReporting`: how many planned ranks report in vLLM's /metrics;
- `since`: when the level last changed (RFC 3339; `kubectl` shows its age).

A new level is written only once the last one has stood DWELL_SECONDS, so a load that
flickers across a threshold costs at most one status write a minute; until then the old
level stays (the next probe looks again). A change in which ranks report is written at once,
with the level it comes with: a rank that stops reporting is news.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from vllm_dp_operator.engines.engine_metrics import EngineLoad
from vllm_dp_operator.reconcile.status import parse_rfc3339, rfc3339

IDLE, BUSY, SATURATED = "Idle", "Busy", "Saturated"
LEVELS = (IDLE, BUSY, SATURATED)
#: KV-cache use (0..1) from which a rank counts as full.
KV_SATURATED = 0.9
#: How long a written level stands before a routine change replaces it.
DWELL_SECONDS = 60.0


def level_of(loads: Mapping[int, EngineLoad]) -> str:
    """The load level of one /metrics reading."""
    ranks = list(loads.values())
    if any(r.waiting > 0 or r.kv_cache_usage >= KV_SATURATED for r in ranks):
        return SATURATED
    if any(r.running > 0 for r in ranks):
        return BUSY
    return IDLE


def summarize(
    loads: Mapping[int, EngineLoad], previous: Mapping[str, Any] | None, now: datetime,
    dwell_seconds: float = DWELL_SECONDS,
) -> dict[str, Any]:  # fmt: skip
    """status.load for this reading, given the one status holds (None: none yet).

    Returns `previous` itself (no change to write) when neither the reporting ranks nor a
    level that has outlived the dwell time moved.
    """
    level, reporting = level_of(loads), len(loads)
    if not previous or previous.get("level") not in LEVELS:
        return {"level": level, "ranksReporting": reporting, "since": rfc3339(now)}
    since = parse_rfc3339(previous.get("since"))
    stood = since is None or (now - since).total_seconds() >= dwell_seconds
    ranks_moved = previous.get("ranksReporting") != reporting
    if level != previous["level"] and (stood or ranks_moved):
        return {"level": level, "ranksReporting": reporting, "since": rfc3339(now)}
    if ranks_moved:
        return {**previous, "ranksReporting": reporting}
    return dict(previous)
