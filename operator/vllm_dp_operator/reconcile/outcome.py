"""What one reconcile reads (the resource) and writes (status, events)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from vllm_dp_operator import constants as c
from vllm_dp_operator.reconcile.status import condition_status, set_condition


@dataclass(frozen=True)
class Resource:
    """The parts of a VLLMDataParallel object the reconcile reads."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: Mapping[str, Any]
    status: Mapping[str, Any]
    #: The replica one member reconcile works on (its status is that replica's entry);
    #: children are named after it (api/names.py).
    replica: int = 0
    #: metadata.annotations[vllmdp.io/restartedAt]: a new value asks for new engines.
    restarted_at: str = ""
    #: The resource's status.observedGeneration: the generation the last reconcile saw.
    seen_generation: int = 0

    @property
    def asked(self) -> str:
        """What the user asks for now, as a cluster's vllmdp.io/accepted annotation says it."""
        return f"{self.generation}/{self.restarted_at}"

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Resource:
        """Build from a raw object as kopf or the API hands it over."""
        meta = body["metadata"]
        return cls(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            generation=int(meta.get("generation") or 0),
            spec=body.get("spec") or {},
            status=body.get("status") or {},
            restarted_at=str((meta.get("annotations") or {}).get(c.ANNOTATION_RESTARTED_AT)
                             or ""),
            seen_generation=int((body.get("status") or {}).get("observedGeneration") or 0),
        )


@dataclass(frozen=True)
class Event:
    """An event to post on the resource."""

    type: str
    reason: str
    message: str


@dataclass
class Outcome:
    """The status to write and the events to post after one reconcile."""

    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    #: Seconds until a time-based step is due (a backoff's end, a stop's next check, the
    #: launch deadline), else None: the controller schedules a reconcile for then.
    retry_after: float | None = None


# Status keys carried over from one reconcile to the next (the rest is recomputed).
_CARRIED = ("lastFailedJob", "lastFailureTime", "lastFailureReason", "headJob", "servedJob",
            "servedHeadPod", "probeFailures", "probeFailingSince")
# Status keys only a Serving reconcile fills (from vLLM's /metrics); None removes them.
ENGINE_KEYS = ("load",)
#: Per-rank load and totals, which earlier versions wrote on every probe: removed from a status
#: that still holds them (the numbers are metrics now, engines/load_summary.py).
_RETIRED_KEYS = ("engines", "requestsRunning", "requestsWaiting")
#: Set by the step they belong to, else removed (a merge patch of None).
_STEP_KEYS = ("nextLaunchTime", "launchDeadline")


class StatusDoc:
    """Accumulates the status document; conditions flip through one helper."""

    def __init__(self, res: Resource, now: datetime) -> None:
        self.now = now
        self.generation = res.generation
        prev = res.status
        self.prev = prev
        self.doc: dict[str, Any] = {
            "observedGeneration": res.generation,
            "conditions": list(prev.get("conditions") or []),
            "launchAttempts": int(prev.get("launchAttempts") or 0),
            "consecutiveFailures": int(prev.get("consecutiveFailures") or 0),
            **{key: prev.get(key) for key in _CARRIED},
            **{key: None for key in (*ENGINE_KEYS, *_STEP_KEYS, *_RETIRED_KEYS)},
        }
        self.events: list[Event] = []
        self.retry_after: float | None = None

    def cond(self, type_: str, ok: bool | None, reason: str, message: str) -> None:
        """Set one condition; its transition time moves only when its status flips."""
        self.doc["conditions"] = set_condition(
            self.doc["conditions"], type_, ok, reason, message, self.generation, self.now
        )

    def phase(self, phase: str, message: str) -> None:
        """Set the phase and the message that explains it."""
        self.doc["phase"] = phase
        self.doc["message"] = message

    def event(self, type_: str, reason: str, message: str) -> None:
        """Queue an event to post on the resource."""
        self.events.append(Event(type_, reason, message))

    def recheck(self, seconds: float) -> None:
        """Ask for another reconcile within `seconds`, for a step that depends on time."""
        seconds = max(0.1, seconds)
        self.retry_after = seconds if self.retry_after is None else min(self.retry_after, seconds)

    def outcome(self) -> Outcome:
        """The status and events of this reconcile, with one PhaseChanged event when the
        phase moved (the previous phase is what the last reconcile concluded, so a re-run
        or a restart posts none)."""
        old, new = self.prev.get("phase"), self.doc.get("phase")
        if new and new != old:
            # Normal: what went wrong has its own Warning (HeadJobFailed, InvalidSpec, ...).
            self.event(c.EVENT_NORMAL, c.REASON_PHASE_CHANGED,
                       f"{old or 'New'} -> {new}: {self.doc.get('message') or ''}".rstrip(": "))
        self.settle_engines()
        return Outcome(self.doc, self.events, self.retry_after)

    def settle_engines(self) -> None:
        """EnginesReporting says Unknown unless Serving: engines report load only then."""
        new = self.doc.get("phase")
        conds = self.doc["conditions"]
        if new != c.PHASE_SERVING and condition_status(conds, c.COND_ENGINES_REPORTING) not in (
            None, "Unknown"
        ):  # fmt: skip
            self.cond(c.COND_ENGINES_REPORTING, None, c.REASON_NOT_SERVING,
                      f"Engines report load only while Serving; the phase is {new}")

    def merge(self, member: StatusDoc) -> None:
        """Take on a member reconcile's events and time-based steps (a replica's)."""
        self.events.extend(member.events)
        if member.retry_after is not None:
            self.recheck(member.retry_after)
