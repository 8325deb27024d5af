"""The set of replicas: how many DP groups exist, which one leaves, and the resource's status
made from theirs. Pure: the reconcile (`converge.py`) does the I/O.

A resource is a set of identical DP groups, as a Deployment is a set of ReplicaSets: each
replica is what a resource was before replicas (its RayCluster, its head job, its endpoint in
the one EndpointSlice, its status entry), converged by the single-group reconcile. This module
decides the set: which indices run, which leave (scale-down), and what the resource says
about them all (`status.replicas`, `readyReplicas`, `Available`, `Degraded`, the phase).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_dp_operator import constants as c
from vllm_dp_operator.api.models import UpdateStrategy
from vllm_dp_operator.reconcile.update import HOLD_FOR_TURN

#: The keys of a replica's status entry (`api/models.ReplicaStatus`), besides `index`.
ENTRY_KEYS = (
    "phase", "message", "routed", "leaving", "updated", "conditions", "rayCluster", "headJob",
    "servedJob", "servedHeadPod", "launchAttempts", "consecutiveFailures", "lastFailedJob",
    "lastFailureTime", "lastFailureReason", "nextLaunchTime", "launchDeadline", "probeFailures",
    "probeFailingSince", "update", "failedUpdate", "load", "lora",
)  # fmt: skip
#: What the resource's own status shows of its first replica: the fields a single-group
#: resource had, so tools written for one keep working.
MIRRORED = (
    "rayCluster", "headJob", "servedJob", "servedHeadPod", "launchAttempts",
    "consecutiveFailures", "lastFailedJob", "lastFailureTime", "lastFailureReason",
    "nextLaunchTime", "launchDeadline", "probeFailures", "probeFailingSince", "update",
    "failedUpdate", "load",
)  # fmt: skip
#: A replica's own conditions that the resource shows for its first replica.
MIRRORED_CONDITIONS = (c.COND_CLUSTER_READY, c.COND_HEAD_JOB_RUNNING, c.COND_READY,
                       c.COND_UPDATED, c.COND_ENGINES_REPORTING)  # fmt: skip


def previous(status: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """Each replica's status entry as the last reconcile wrote it. A status written before
    replicas holds one group's state at its top level: that is replica 0's."""
    entries = status.get("replicaStatuses")
    if entries is None:
        if not status.get("phase"):
            return {}
        return {0: {k: status[k] for k in ENTRY_KEYS if k in status}}
    return {int(e["index"]): dict(e) for e in entries if "index" in e}


@dataclass(frozen=True)
class ReplicaView:
    """What the set decides on about one existing replica."""

    index: int
    routed: bool = False
    failing: bool = False
    #: When it was unrouted to leave, or None.
    leaving: str | None = None


@dataclass
class SetStep:
    """Which replicas run their own reconcile, and which leave."""

    run: list[int]
    leave: list[int]
    #: Replicas newly chosen to leave, and newly added: for the Scaled event.
    chosen: list[int] = field(default_factory=list)
    added: list[int] = field(default_factory=list)


def _leave_order(view: ReplicaView) -> tuple[bool, bool, int]:
    # Not serving first, then failing, then the highest index: the cheapest to lose first.
    return (view.routed, not view.failing, -view.index)


def decide(want: int, existing: Mapping[int, ReplicaView]) -> SetStep:
    """The replicas to run and to let leave, for `want` replicas; new ones take the lowest
    free indices. A replica that started leaving finishes leaving (its index is not reused
    until it is gone), so a scale-down is never undone halfway through a drain."""
    leaving = sorted(i for i, v in existing.items() if v.leaving)
    active = [v for i, v in existing.items() if not v.leaving]
    chosen: list[int] = []
    if len(active) > want:
        chosen = sorted(v.index for v in sorted(active, key=_leave_order)[: len(active) - want])
    run = sorted(v.index for v in active if v.index not in chosen)
    added: list[int] = []
    taken = set(existing)
    index = 0
    while len(run) + len(added) < want:
        if index not in taken:
            added.append(index)
        index += 1
    return SetStep(sorted(run + added), sorted(leaving + chosen), chosen, added)


def entry(index: int, doc: Mapping[str, Any], routed: bool, updated: bool,
          leaving: str | None = None) -> dict[str, Any]:  # fmt: skip
    """A replica's status entry from its reconcile's status document: only the entry's keys,
    and no None (the API server drops a null, which would look like a change every time)."""
    out: dict[str, Any] = {"index": index}
    values = {**doc, "routed": routed, "updated": updated, "leaving": leaving}
    for key in ENTRY_KEYS:
        if values.get(key) is not None:
            out[key] = values[key]
    # A replica's own conditions only (a status from before replicas had the resource's too).
    out["conditions"] = [cond for cond in out.get("conditions") or []
                         if cond.get("type") in MIRRORED_CONDITIONS]  # fmt: skip
    return out


def representative(entries: Iterable[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The replica the resource's single-group fields show: the first that serves, else the
    first that is routed, else the first one (for one replica, always that one)."""
    staying = [e for e in entries if not e.get("leaving")]
    for pick in (lambda e: e.get("phase") == c.PHASE_SERVING, lambda e: e.get("routed"),
                 lambda e: True):  # fmt: skip
        found = next((e for e in staying if pick(e)), None)
        if found is not None:
            return found
    return None


def availability(want: int, entries: Sequence[Mapping[str, Any]]
                 ) -> tuple[tuple[bool, str, str], tuple[bool, str, str]]:  # fmt: skip
    """The Available and Degraded conditions: (ok, reason, message) each."""
    staying = [e for e in entries if not e.get("leaving")]
    ready = sum(1 for e in staying if e.get("routed"))
    if want == 0:
        message = "spec.replicas is 0: no replica, the Service stays"
        return ((False, c.REASON_SCALED_TO_ZERO, message),
                (False, c.REASON_SCALED_TO_ZERO, message))  # fmt: skip
    count = f"{ready} of {want} replica(s) serve"
    available = ((True, c.REASON_REPLICAS_AVAILABLE, count) if ready
                 else (False, c.REASON_NO_REPLICA_AVAILABLE, count))  # fmt: skip
    troubled = [e for e in staying if not e.get("routed")]
    if not troubled and len(staying) >= want:
        return available, (False, c.REASON_ALL_REPLICAS_SERVE, count)
    named = "; ".join(f"replica {e['index']} ({e.get('rayCluster') or 'no RayCluster yet'}) "
                      f"{e.get('phase') or 'new'}: {e.get('message') or ''}".rstrip(": ")
                      for e in troubled[:3])  # fmt: skip
    more = f"; and {len(troubled) - 3} more" if len(troubled) > 3 else ""
    return available, (True, c.REASON_REPLICA_DEGRADED, f"{count}: {named}{more}")


def settled(entry: Mapping[str, Any]) -> bool:
    """Whether a replica's update is over, for the operator-wide update slot: it runs what
    the spec asks for and serves or has failed since, or its Surge failed (status.failedUpdate)
    and none runs."""
    if entry.get("update"):
        return False
    if entry.get("updated"):
        return bool(entry.get("routed") or int(entry.get("consecutiveFailures") or 0) > 0)
    return bool(entry.get("failedUpdate"))


@dataclass(frozen=True)
class Turn:
    """One running replica as a rolling update across replicas sees it."""

    index: int
    outdated: bool
    routed: bool
    #: A Surge of its own is under way (status.update of its entry).
    surging: bool = False


def rollout(want: int, turns: Sequence[Turn], max_unavailable: int, max_surge: int
            ) -> dict[int, str]:  # fmt: skip
    """The strategy each outdated replica updates by now (RollingUpdate across replicas), as a
    Deployment rolls its ReplicaSets: Recreate for one that is down anyway and for at most
    maxUnavailable serving ones, counting every replica that does not route now; Surge for
    at most maxSurge, counting those already surging; the rest hold (update.HOLD_FOR_TURN)
    and serve what they run. Lowest index first. Replicas that are up to date are left out.
    A new replica that does not come up keeps counting as unavailable: the rollout stops
    there, and the old replicas keep serving."""
    turns = sorted(turns, key=lambda t: t.index)
    unavailable = sum(1 for t in turns if not t.routed) + max(0, want - len(turns))
    surging = sum(1 for t in turns if t.surging)
    down_left = max(0, max_unavailable - unavailable)
    surge_left = max(0, max_surge - surging)
    out: dict[int, str] = {}
    for t in turns:
        if not t.outdated:
            continue
        if t.surging:
            out[t.index] = UpdateStrategy.SURGE
        elif not t.routed:
            out[t.index] = UpdateStrategy.RECREATE
        elif surge_left:
            surge_left -= 1
            out[t.index] = UpdateStrategy.SURGE
        elif down_left:
            down_left -= 1
            out[t.index] = UpdateStrategy.RECREATE
        else:
            out[t.index] = HOLD_FOR_TURN
    return out
