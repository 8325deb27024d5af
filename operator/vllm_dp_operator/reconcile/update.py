"""Which generation of engines the reconcile converges, and a Surge update's steps: pure.

A generation is one RayCluster and the head job on it; its identity is the head job's hash
(`render/headjob.job_hash`: the launch plan and the cluster's name). A change that needs new
engines is one whose cluster shape or job hash differs from the generation that serves.

Under `Recreate` the reconcile converges the one generation the spec asks for (the serving
cluster when its shape still fits, so an engine-only change relaunches on the same pods).
Under `Surge`, while a generation serves, a change that needs new engines brings up a second
one beside it (`Starting`); the old one stays routed, untouched, until the new one answers
/health and one completion, then the API Service switches (`Draining`), and after
`spec.update.drainSeconds` the old cluster is deleted. A new generation that has not served
by `startedAt + spec.launch.timeoutSeconds` is deleted and its target remembered in
`status.failedUpdate`: it is not tried again until the spec asks for something else, so a
failing update never loops beside (or on) the user's traffic.

Only the user asks for new engines. A cluster carries the `<generation>/<restartedAt>` of the
resource it runs what was asked for (`vllmdp.io/accepted`). When the render differs from what
serves but the resource asks what that cluster was accepted for, the difference is the
operator's own (a new default image, NIC or fsGroup, a new release's pod template): nothing is
replaced. A spec change or a new `vllmdp.io/restartedAt` brings the new render.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from vllm_dp_operator.api.models import UpdateStrategy
from vllm_dp_operator.constants import DRAIN_QUIET_SECONDS
from vllm_dp_operator.reconcile.status import parse_rfc3339, rfc3339

STARTING, DRAINING = "Starting", "Draining"
#: The strategy a replica is given while a rolling update across replicas has not reached it.
HOLD_FOR_TURN = "HoldForTurn"
#: The strategy a replica is given while the operator's other resources hold every update
#: slot (VLLMDP_MAX_CONCURRENT_UPDATES).
HOLD_FOR_SLOT = "HoldForSlot"
_HOLDS = {
    HOLD_FOR_TURN: "Waits for its turn in the rolling update across replicas; serves what it "
                   "runs meanwhile",
    HOLD_FOR_SLOT: "Waits for one of the operator's update slots (other resources update now, "
                   "VLLMDP_MAX_CONCURRENT_UPDATES); serves what it runs meanwhile",
}


class Mode(StrEnum):
    """What the reconcile does with the target generation."""

    #: Converge the target as the one generation (today's flow: the route follows it).
    CONVERGE = "Converge"
    #: Bring the target up beside the serving generation, never routing to it here.
    CANDIDATE = "Candidate"
    #: Leave the serving generation as it is (routed on evidence only) and start nothing.
    HOLD = "Hold"


@dataclass(frozen=True)
class Generation:
    """The generation that serves now: its cluster, that cluster's shape, its job's hash, and
    the resource's `<generation>/<restartedAt>` the cluster was accepted for (or None)."""

    cluster: str
    shape: str
    job_hash: str
    accepted: str | None = None


@dataclass(frozen=True)
class Wanted:
    """What the spec asks for."""

    strategy: str
    shape: str
    #: The cluster name the renderer gives this shape (`<name>-<shape hash>`).
    cluster: str
    #: The name of a second cluster of the same shape, for an engine-only Surge.
    surge_cluster: str
    #: The job hash the spec's plan has on a given cluster.
    job_hash: Callable[[str], str]
    deadline_seconds: int
    drain_seconds: int
    #: The resource's `<generation>/<restartedAt>` now: what the user asks for.
    asked: str = ""

    def renders(self, gen: Generation) -> bool:
        """Whether the operator renders today what that generation runs."""
        return gen.shape == self.shape and gen.job_hash == self.job_hash(gen.cluster)

    def fits(self, gen: Generation) -> bool:
        """Whether that generation runs what the user asks for: rendered so today, or accepted
        for what the resource asks now (the operator's own changes replace nothing)."""
        return self.renders(gen) or (bool(self.asked) and gen.accepted == self.asked)


@dataclass
class Decision:
    """One reconcile's step: which cluster, how, and what to delete or tell."""

    mode: Mode
    #: The cluster the flow converges (CONVERGE, CANDIDATE) or keeps serving (HOLD).
    cluster: str
    #: Clusters the flow must not delete (the serving one during a Surge).
    keep: frozenset[str] = frozenset()
    #: status.update to write (None clears it).
    record: dict[str, Any] | None = None
    #: status.failedUpdate to write.
    failed: str | None = None
    #: Clusters to delete now, with why.
    delete: list[tuple[str, str]] = field(default_factory=list)
    #: (event type, reason, message) to post.
    events: list[tuple[str, str, str]] = field(default_factory=list)
    #: The Updated condition: (ok, reason, message), or None to leave it.
    updated: tuple[bool, str, str] | None = None
    #: Seconds until a time-based step (the deadline, the end of a drain) is due.
    recheck: float | None = None
    #: A head job hash the flow keeps besides the plan's own: what serves, accepted for what
    #: the user asks although the operator renders it otherwise today.
    keep_job: str | None = None
    #: The serving cluster runs what the user asks now: say so on it (vllmdp.io/accepted).
    accept: bool = False
    #: A drained generation's cluster whose head jobs are to be stopped (Ray's job API).
    stop: str | None = None


def _at(record: Mapping[str, Any], key: str) -> datetime | None:
    return parse_rfc3339(record.get(key))


def decide(
    want: Wanted, serving: Generation | None, live_shapes: Mapping[str, str],
    record: Mapping[str, Any] | None, failed: str | None, now: datetime, last_seen: str = "",
    live_accepted: Mapping[str, str | None] | None = None, old_state: Draining | None = None,
) -> Decision:  # fmt: skip
    """The step for this reconcile; `live_shapes` maps each live cluster to its shape hash,
    `live_accepted` to what it was accepted for; `last_seen`, what the new generation last
    reported, goes into a failed update's why."""
    accepted = live_accepted or {}
    if record and record.get("phase") == DRAINING:
        return _draining(want, serving, record, failed, now, old_state or Draining())
    if serving is None:
        # Nothing serves: nothing to keep up, so any update is moot; converge what is asked,
        # on a live cluster of the wanted shape (or accepted for what is asked) where there
        # is one (no pods restarted).
        same = [n for n, s in live_shapes.items()
                if s == want.shape or (want.asked and accepted.get(n) == want.asked)]
        prefer = [n for n in ((record or {}).get("to"), want.cluster) if n in same]
        return Decision(Mode.CONVERGE, (prefer or same or [want.cluster])[0], failed=failed)
    if want.fits(serving):
        d = Decision(Mode.CONVERGE, serving.cluster, updated=_up_to_date(serving),
                     keep_job=None if want.renders(serving) else serving.job_hash,
                     accept=bool(want.asked))
        if record and record.get("to") not in (None, serving.cluster):
            d.delete.append((record["to"], "the spec asks again for what already serves"))
            d.events.append(("Normal", "UpdateWithdrawn", f"Update to {record['to']} withdrawn:"
                             f" the spec asks again for what {serving.cluster} serves"))
        return d
    if want.strategy in _HOLDS:
        # A rolling update across replicas (replicaset.rollout) that has not reached this
        # replica, or every operator-wide update slot taken: it serves what it runs.
        return Decision(Mode.HOLD, serving.cluster, keep=frozenset({serving.cluster}),
                        failed=failed, updated=(False, "UpdatePending", _HOLDS[want.strategy]))
    if want.strategy != UpdateStrategy.SURGE:
        # Recreate: the serving pods when the shape still fits (a new head job on them).
        target = serving.cluster if serving.shape == want.shape else want.cluster
        d = Decision(Mode.CONVERGE, target, failed=failed)
        if record:
            d.events.append(("Normal", "UpdateWithdrawn", f"Update to {record.get('to')} "
                             "withdrawn: spec.update.strategy is Recreate"))
        return d
    return _surge(want, serving, record, failed, now, last_seen, accepted)


def _up_to_date(serving: Generation) -> tuple[bool, str, str]:
    return True, "Updated", f"RayCluster {serving.cluster} runs what the spec asks for"


def _surge(
    want: Wanted, serving: Generation, record: Mapping[str, Any] | None, failed: str | None,
    now: datetime, last_seen: str, accepted: Mapping[str, str | None],
) -> Decision:  # fmt: skip
    to = want.cluster if want.cluster != serving.cluster else want.surge_cluster
    target = want.job_hash(to)
    keep = frozenset({serving.cluster})
    started = (record or {}).get("to")
    if started and want.asked and accepted.get(started) == want.asked:
        # An update under way when the operator changed its own render goes on as it started.
        to, target = started, str((record or {}).get("target"))
    if failed == target:
        # This very target failed: the old generation keeps serving; a new spec retries.
        return Decision(Mode.HOLD, serving.cluster, keep=keep, failed=failed)
    same = record is not None and record.get("phase") == STARTING and record.get("to") == to \
        and record.get("target") == target and record.get("from") == serving.cluster  # fmt: skip
    if same and record is not None:
        started = _at(record, "startedAt") or now
        deadline = started + timedelta(seconds=want.deadline_seconds)
        if now >= deadline:
            why = (f"it did not serve (/health and one completion) by {rfc3339(deadline)}, "
                   f"spec.launch.timeoutSeconds ({want.deadline_seconds}s) after the update "
                   f"started; {serving.cluster} keeps serving, and this target is not tried "
                   "again until the spec changes")  # fmt: skip
            if last_seen:
                why += f". Last seen of it: {last_seen}"
            return Decision(
                Mode.HOLD, serving.cluster, keep=keep, failed=target,
                delete=[(to, "its update did not serve by its deadline")],
                events=[("Warning", "UpdateFailed", f"Update to RayCluster {to} failed: {why}")],
                updated=(False, "UpdateFailed", f"Update to RayCluster {to} failed: {why}"),
            )  # fmt: skip
        return Decision(Mode.CANDIDATE, to, keep=keep, record=dict(record),
                        recheck=(deadline - now).total_seconds() + 1,
                        updated=_starting(serving, to, record),
                        keep_job=None if target == want.job_hash(to) else target)  # fmt: skip
    d = Decision(Mode.CANDIDATE, to, keep=keep)
    old_to = (record or {}).get("to")
    if old_to and old_to not in (to, serving.cluster):
        d.delete.append((old_to, "a newer spec change superseded its update"))
    deadline = now + timedelta(seconds=want.deadline_seconds)
    d.record = {"phase": STARTING, "from": serving.cluster, "to": to, "target": target,
                "startedAt": rfc3339(now), "deadline": rfc3339(deadline), "drainingSince": None}
    d.recheck = want.deadline_seconds + 1.0
    d.events.append(("Normal", "UpdateStarted", f"Surge update: starting RayCluster {to} beside "
                     f"{serving.cluster}, which serves until {to} answers /health and one "
                     f"completion (deadline {rfc3339(deadline)})"))  # fmt: skip
    d.updated = _starting(serving, to, d.record)
    return d


def _starting(serving: Generation, to: str, record: Mapping[str, Any]) -> tuple[bool, str, str]:
    return (False, "UpdateInProgress", f"Surge update from {serving.cluster} to {to} started "
            f"at {record.get('startedAt')}; {serving.cluster} serves until {to} answers "
            f"/health and one completion (deadline {record.get('deadline')})")  # fmt: skip


def switched(record: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """The record once the API Service routes to the new generation: it drains the old."""
    return {**record, "phase": DRAINING, "deadline": None, "drainingSince": rfc3339(now)}


def drain_over(since: str | None, drain_seconds: int, running: int | None,
               now: datetime, idle: float | None = None) -> tuple[bool, str]:  # fmt: skip
    """Whether a drain is over, and why: the engines report no request running or waiting
    (read after they left the slice) and, where the head's drain gate says (`idle`: seconds
    since its last client request), none came for DRAIN_QUIET_SECONDS, so its kept-alive
    connections have left; or spec.update.drainSeconds passed since `since`."""
    start = parse_rfc3339(since) or now
    quiet = idle is None or idle >= DRAIN_QUIET_SECONDS
    if running == 0 and quiet:
        return True, "its engines report no request running or waiting" + (
            "" if idle is None else f", and no request came for {idle:.0f}s")
    if now >= start + timedelta(seconds=drain_seconds):
        return True, f"its drain of {drain_seconds}s (spec.update.drainSeconds) ended"
    detail = "running requests unknown" if running is None else f"{running} request(s) running"
    if idle is not None:
        detail += f", the last request {idle:.1f}s ago"
    return False, f"draining since {since} ({detail}; at most {drain_seconds}s)"


@dataclass(frozen=True)
class Draining:
    """A Surge's old generation after the switch: what its engines last reported running or
    waiting in a /metrics read taken after it left the slice (None: no such read yet), whether
    a head job of it still runs, and the seconds since its last client request (None: its
    head cannot say)."""

    running: int | None = None
    jobs_left: bool = True
    idle: float | None = None


#: How soon a stopping head job is looked at again.
STOP_RECHECK_SECONDS = 2.0


def _draining(
    want: Wanted, serving: Generation | None, record: Mapping[str, Any], failed: str | None,
    now: datetime, old_state: Draining,
) -> Decision:  # fmt: skip
    old, new = record["from"], record["to"]
    over, why = drain_over(record.get("drainingSince"), want.drain_seconds, old_state.running,
                           now, old_state.idle)  # fmt: skip
    if not old_state.jobs_left:
        # Drained and its head job stopped (or ended): nothing runs there to drain. The old
        # cluster goes, and the next reconcile
        # starts afresh (a change that came meanwhile is decided then, against what serves).
        done = Decision(Mode.CONVERGE, new, keep=frozenset({new}), failed=failed,
                        delete=[(old, "drained after the switch, its head job stopped")])
        done.events.append(("Normal", "UpdateDone", f"Update done: RayCluster {new} serves; "
                            f"deleted {old} once drained and its head job stopped"))
        done.recheck = 0.1
        return done
    keep = frozenset({old, new})
    unchanged = serving is not None and serving.cluster == new and want.fits(serving)
    # A further change waits for the drain to end: the old generation still runs, and a third
    # cluster beside two would hold GPUs a third time.
    mode = Mode.CONVERGE if unchanged or serving is None else Mode.HOLD
    pinned = serving.job_hash if serving is not None and unchanged \
        and not want.renders(serving) else None  # fmt: skip
    d = Decision(mode, new, keep=keep, record=dict(record), failed=failed, keep_job=pinned)
    if over:
        # Its requests are done (or out of time): vLLM's own shutdown through the Ray job API,
        # confirmed, before its pods go.
        d.stop = old
        d.recheck = STOP_RECHECK_SECONDS
        d.updated = (True, "Draining", f"RayCluster {new} serves since "
                     f"{record.get('drainingSince')}; {old} drained ({why}): its head job "
                     "stops, then it is deleted")  # fmt: skip
        return d
    ends = (parse_rfc3339(record.get("drainingSince")) or now) + timedelta(
        seconds=want.drain_seconds)
    d.recheck = (ends - now).total_seconds() + 1  # or sooner: the probe pool wakes it
    d.updated = (True, "Draining", f"RayCluster {new} serves since "
                 f"{record.get('drainingSince')}; {old} drains ({why}), then its head job "
                 f"stops and it is deleted")  # fmt: skip
    return d
