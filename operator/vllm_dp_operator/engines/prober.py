"""Probes off the reconcile path: a bounded pool asks each head for /health and /metrics on its
own cadence, and wakes the resource only when what it learned changed.

/health is asked every period; /metrics (about 300 KiB for 8 ranks) with it only once
METRICS_DUE of `metrics_seconds` has passed since the last read, and always with the first
answer after a failure: once a minute with the defaults, which is as often as status.load may
move (engines/load_summary.py); half the /metrics reads of one per 30 s probe.

A reconcile reads the pool's latest answer for its head job and never waits on an engine: a
hung or unreachable engine holds one of the pool's slots for at most the transport's timeout,
and no reconcile worker at all. What the pool learns wakes the resource's reconcile only when
it matters to a decision: the first answer, /health turning ok or failing, one more failure in
a row, the set of ranks that report, or the load level. Per-rank numbers go straight to the
operator's metrics, with no reconcile and no status write.

Each resource has at most one target: the head job its last reconcile asked about; and while
a Surge brings up a new generation, a second one, that generation's (the one asked a
completion), so the old generation stays probed while it serves. A head that drains (a Surge's
old generation, a leaving replica) is probed every DRAIN_PROBE_SECONDS at most, and is told
first to close kept-alive connections (engines/drain.py). A new head job starts from
nothing (never probed, so not routable), and a resource that no longer launches or serves is
released; its second target once no update is starting.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import random
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from vllm_dp_operator import constants
from vllm_dp_operator.engines import drain, lora
from vllm_dp_operator.engines.launch_reports import Launch, LaunchReports
from vllm_dp_operator.engines.load_summary import level_of
from vllm_dp_operator.engines.lora import Adapter, LoraState
from vllm_dp_operator.engines.probe import EngineReading, HealthProbe, ProbeResult
from vllm_dp_operator.engines.transport import ServiceTransport

log = logging.getLogger(__name__)

Key = tuple[str, str]
#: A resource's key, the replica, and whether the target is a Surge's new generation.
#: (namespace, name, replica, kind): a replica's serving generation (SERVE), a Surge's new one
#: (CANDIDATE), and the one that drains (DRAIN: a leaving replica, a Surge's old generation).
Slot = tuple[str, str, int, str]
SERVE, CANDIDATE, DRAIN = "serve", "candidate", "drain"
#: Whose per-rank load a reading is: a resource's key and the replica.
LoadKey = tuple[str, str, int]
NOT_PROBED = ProbeResult(False, "not probed yet")
#: /metrics is read on the first probe at least this share of `metrics_seconds` after the last
#: read: the +-10 % jitter of the period never pushes a 60 s read to the third 30 s probe.
METRICS_DUE = 0.8


@dataclass(frozen=True)
class Target:
    """One head job's vLLM, behind KubeRay's head Service."""

    namespace: str
    owner: str
    service: str
    port: int
    job: str
    #: The model to ask one completion of once /health answers (a Surge's new generation),
    #: and whether the engines want an API key; None: no completion is asked.
    complete_model: str | None = None
    complete_keyed: bool = False
    #: The replica whose head it is.
    replica: int = 0
    #: Its replica leaves: a target of its own, so the first reading comes after the unroute.
    draining: bool = False
    #: Its DP size: /metrics series of ranks at or above it are dropped (0: none dropped),
    #: so a tenant's exposition cannot make the operator keep more than its planned ranks.
    ranks: int = 0
    #: The uid of the head pod it runs on: a replaced head pod (the same head job run again
    #: by KubeRay on a new Ray head) is a new target, unprobed, never routed on the dead pod's
    #: last answer.
    head: str = ""
    #: Which request proves it serves (vllm_dp_launcher/servecheck.py).
    complete_check: str = "Completion"
    #: The LoRA adapters it should serve (None: spec.lora unset), and the Ray token its
    #: adapter changes are sent with. Not part of its identity: another set of adapters is
    #: the same head job, probed on, and synced at once.
    adapters: tuple[Adapter, ...] | None = field(default=None, compare=False)
    token: str | None = field(default=None, compare=False, repr=False)

    @property
    def key(self) -> Key:
        """The owning resource's key (namespace, name)."""
        return (self.namespace, self.owner)

    @property
    def slot(self) -> Slot:
        """Where the pool keeps it: one per replica, and a Surge's new generation (asked a
        completion) and a draining one each have a slot of their own beside the serving
        generation's."""
        kind = CANDIDATE if self.complete_model is not None else DRAIN if self.draining \
            else SERVE  # fmt: skip
        return (self.namespace, self.owner, self.replica, kind)


class EngineProbes(Protocol):
    """What a reconcile asks of the probes: the latest answers, at once, with no I/O."""

    def health(self, target: Target) -> ProbeResult:
        """The latest /health answer for this head job (NOT_PROBED before the first one)."""
        ...

    def reading(self, target: Target) -> EngineReading | None:
        """The latest /metrics reading of this head job, None before the first one."""
        ...

    def completion(self, target: Target) -> ProbeResult | None:
        """The latest one-token completion's answer for this head job, None before any."""
        ...

    def adapters(self, target: Target) -> LoraState | None:
        """The latest LoRA sync of this head job, None before the first one."""
        ...

    def nudge(self, key: Key) -> None:
        """Probe the resource's head now rather than at its next turn."""
        ...

    def reported(self, launch: Launch) -> str | None:
        """The last stage the launcher reported for this head job, None before any (its log
        is followed from now on, while it launches)."""
        ...


@dataclass
class _Entry:
    target: Target
    health: ProbeResult = NOT_PROBED
    reading: EngineReading | None = None
    completion: ProbeResult | None = None
    #: Whether /health ever answered 200 for this head job: the slower cadence from then on.
    served: bool = False
    due: float = 0.0
    #: When /metrics was last read (loop time; None: read with the next ok /health).
    metrics_at: float | None = None
    busy: bool = False
    #: A nudge came while a probe was in flight: probe again as soon as it is back.
    again: bool = False
    #: What the last wake told the reconcile (see _signature).
    told: tuple[Any, ...] = field(default_factory=tuple)
    #: The last LoRA sync, and when (loop time) failed loads are next asked again.
    lora: LoraState | None = None
    lora_retry_at: float = 0.0


def _planned_only(reading: EngineReading, ranks: int) -> EngineReading:
    """The reading with ranks at or above the DP size dropped, and said so."""
    if not ranks or reading.loads is None or all(r < ranks for r in reading.loads):
        return reading
    kept = {r: load for r, load in reading.loads.items() if r < ranks}
    dropped = len(reading.loads) - len(kept)
    return replace(reading, loads=kept, detail=f"{reading.detail} ({dropped} series "
                               f"of ranks at or above the DP size {ranks} ignored)")


def _signature(entry: _Entry) -> tuple[Any, ...]:
    """What a reconcile decides on: a change here wakes it, anything else does not."""
    health, reading = entry.health, entry.reading
    loads = reading.loads if reading is not None else None
    done = None if entry.completion is None else entry.completion.ok
    adapters = None if entry.lora is None else (
        entry.lora.wanted, entry.lora.loaded, tuple(sorted(entry.lora.failed().items())),
        bool(entry.lora.detail))  # fmt: skip
    quiet = None if reading is None or not entry.target.draining else reading.quiet()
    return (health is NOT_PROBED, health.ok, health.failures,
            None if loads is None else (len(loads), level_of(loads)), done,
            adapters, quiet)  # fmt: skip


class ProbePool:
    """Probes the targets the reconciles ask about, at most `concurrency` at a time."""

    def __init__(
        self, probe: HealthProbe, wake: Callable[[Key], None], *, concurrency: int,
        launching_seconds: float, serving_seconds: float, metrics_seconds: float = 0.0,
        on_loads: Callable[[LoadKey, Mapping[int, Any] | None], None] | None = None,
        reports: LaunchReports | None = None, probing: bool = True,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        transport: ServiceTransport | None = None, lora_retry_seconds: float = 300.0,
    ) -> None:  # fmt: skip
        self._probe, self._wake, self._on_loads = probe, wake, on_loads
        #: Where adapter changes and drain calls are sent (None: LoRA is never synced and no
        #: head is told to drain), and how long a failed load waits before it is asked again.
        self._transport, self._lora_retry = transport, lora_retry_seconds
        #: The launchers' reports; and whether engines are probed at all (healthProbe.mode
        #: off: never, and the reports alone tell of serving).
        self._reports, self._probing = reports, probing
        self._launching, self._serving = launching_seconds, serving_seconds
        #: At most how often /metrics is read per target (0: with every ok /health).
        self.metrics_seconds = metrics_seconds
        self._slots = asyncio.Semaphore(concurrency)
        self._clock = clock
        self._entries: dict[Slot, _Entry] = {}
        #: Each resource's slots, so a reconcile's keep() costs its own slots, not all.
        self._keyed: dict[Key, set[Slot]] = {}
        self._heap: list[tuple[float, int, Slot]] = []
        self._seq = 0
        self._changed = asyncio.Event()
        self._running: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ the reconcile's side

    def health(self, target: Target) -> ProbeResult:
        """The latest /health answer; a new head job is registered and probed at once."""
        return self._entry(target).health

    def completion(self, target: Target) -> ProbeResult | None:
        """The latest completion's answer for the target (None before one was asked)."""
        return self._entry(target).completion

    def reading(self, target: Target) -> EngineReading | None:
        """The latest /metrics reading of this head job."""
        return self._entry(target).reading

    def adapters(self, target: Target) -> LoraState | None:
        """The latest LoRA sync of this head job."""
        return self._entry(target).lora

    def nudge(self, key: Key) -> None:
        """Probe now (the launcher reported that vLLM answers)."""
        for slot in self._slots_of(key):
            entry = self._entries.get(slot)
            if entry is None or not self._probing:
                continue
            if entry.busy:
                entry.again = True  # the probe in flight may have left before vLLM answered
            else:
                self._schedule(slot, entry, 0.0)

    def reported(self, launch: Launch) -> str | None:
        """The launcher's last reported stage for this head job."""
        return self._reports.stage(launch) if self._reports is not None else None

    def release(self, key: Key) -> None:
        """Stop probing a resource that is gone."""
        self.keep(key, {})

    def keep(self, key: Key, wanted: Mapping[int, Collection[str]]) -> None:
        """Probe on only the replicas in `wanted` (the others neither launch nor serve): each
        one's serving generation, and the other slots its value names (CANDIDATE while an
        update starts, DRAIN while a generation drains)."""
        for slot in self._slots_of(key):
            replica, kind = slot[2], slot[3]
            if replica in wanted and (kind == SERVE or kind in wanted[replica]):
                continue
            self._pop(slot)
            if kind == SERVE and self._on_loads is not None:
                self._on_loads((*key, replica), None)
        if self._reports is not None:
            for replica in {slot[2] for slot in self._reported_slots(key)} - set(wanted):
                self._reports.release(key, replica)

    def _slots_of(self, key: Key) -> list[Slot]:
        return sorted(self._keyed.get(key, ()))

    def _pop(self, slot: Slot) -> None:
        self._entries.pop(slot, None)
        key = (slot[0], slot[1])
        slots = self._keyed.get(key)
        if slots is not None:
            slots.discard(slot)
            if not slots:
                del self._keyed[key]

    def _reported_slots(self, key: Key) -> list[tuple[str, str, int]]:
        return self._reports.slots(key) if self._reports is not None else []

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, target: Target) -> _Entry:
        entry = self._entries.get(target.slot)
        if entry is not None and entry.target == target \
                and entry.target.adapters != target.adapters:
            entry.target = target  # the same head job asked for other adapters: sync now
            if entry.busy:
                entry.again = True
            elif self._probing:
                self._schedule(target.slot, entry, 0.0)
        if entry is None or entry.target != target:
            entry = _Entry(target)
            entry.told = _signature(entry)
            self._entries[target.slot] = entry
            self._keyed.setdefault(target.key, set()).add(target.slot)
            if self._probing:
                self._schedule(target.slot, entry, 0.0)
        return entry

    # ------------------------------------------------------------------ the pool's side

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _metrics_due(self, entry: _Entry) -> bool:
        if entry.target.draining:
            return True  # a drain ends on the first read that shows no request
        last = entry.metrics_at
        return last is None or self._now() - last >= METRICS_DUE * self.metrics_seconds

    def _schedule(self, slot: Slot, entry: _Entry, delay: float) -> None:
        entry.due = self._now() + delay
        self._seq += 1
        heapq.heappush(self._heap, (entry.due, self._seq, slot))
        self._changed.set()

    def start(self) -> list[asyncio.Task[None]]:
        """The scheduler task (it starts the probes)."""
        return [asyncio.create_task(self._run(), name="probe-pool")]

    async def _run(self) -> None:
        try:
            while True:
                await self._next_due()
                due, _, slot = heapq.heappop(self._heap)
                entry = self._entries.get(slot)
                if entry is None or entry.due != due or entry.busy:
                    continue  # released, rescheduled since, or already being probed
                await self._slots.acquire()  # at most `concurrency` engines asked at once
                entry.busy = True
                task = asyncio.create_task(self._probe_one(slot, entry), name=f"probe {slot}")
                self._running.add(task)
                task.add_done_callback(self._running.discard)
        finally:
            for task in list(self._running):
                task.cancel()

    async def _next_due(self) -> None:
        while True:
            self._changed.clear()
            if self._heap:
                wait = self._heap[0][0] - self._now()
                if wait <= 0:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout=wait)
            else:
                await self._changed.wait()

    async def _probe_one(self, slot: Slot, entry: _Entry) -> None:
        t = entry.target
        try:
            answer = await self._probe.check(t.namespace, t.service, t.port)
            reading, completion = None, entry.completion
            if answer.ok:
                if not entry.health.ok or self._metrics_due(entry):
                    entry.metrics_at = self._now()
                    # A head that drains is told to close kept connections first, so the
                    # requests this read counts are the last that came on them.
                    idle = await drain.mark_draining(self._transport, t.namespace, t.service,
                                                     t.port, t.token) \
                        if t.draining and self._transport is not None else None  # fmt: skip
                    reading = await self._probe.engines(t.namespace, t.service, t.port,
                                                        t.ranks)  # fmt: skip
                    reading = replace(reading, idle=idle)
                if t.complete_model is not None and not (completion and completion.ok):
                    completion = await self._probe.complete(
                        t.namespace, t.service, t.port, t.complete_model, t.complete_keyed,
                        t.complete_check)  # fmt: skip
                if self._lora_due(entry, reading is not None):
                    await self._sync_adapters(entry)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a probe never kills the pool: count it as failed
            log.exception("Probe of %s/%s failed", t.namespace, t.service)
            answer, reading = ProbeResult(False, f"probe error: {exc!r}"), None
            completion = entry.completion
        finally:
            entry.busy = False
            self._slots.release()
        if self._entries.get(slot) is not entry:
            return  # released, or a newer head job took its place, while it was asked
        entry.completion = completion
        self._record(slot, entry, answer, reading)

    def _lora_due(self, entry: _Entry, metrics_read: bool) -> bool:
        """Whether this probe syncs the adapters: LoRA on and a token to send, and the first
        time, another set asked for, the last read failed, a failed load's retry is due, or
        (checked with each /metrics read) on the /metrics cadence."""
        t, last = entry.target, entry.lora
        if t.adapters is None or t.token is None or self._transport is None or t.draining:
            return False
        if last is None or last.wanted != t.adapters or last.detail or metrics_read:
            return True
        return bool(last.failed()) and self._now() >= entry.lora_retry_at

    async def _sync_adapters(self, entry: _Entry) -> None:
        t, last = entry.target, entry.lora
        assert t.adapters is not None and t.token is not None and self._transport is not None
        retry = self._now() >= entry.lora_retry_at
        try:
            state = await lora.sync(self._transport, t.namespace, t.service, t.port, t.token,
                                    t.adapters, last, retry)  # fmt: skip
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never a failed probe: /health answered
            log.warning("LoRA sync of %s/%s failed: %r", t.namespace, t.service, exc)
            state = LoraState(t.adapters, last.loaded if last else frozenset(),
                              last.errors if last else {}, f"sync error: {exc!r}")  # fmt: skip
        if retry and state.failed():
            entry.lora_retry_at = self._now() + self._lora_retry
        entry.lora = state

    def _record(
        self, slot: Slot, entry: _Entry, answer: ProbeResult, reading: EngineReading | None
    ) -> None:
        key, replica, kind = (slot[0], slot[1]), slot[2], slot[3]
        previous = entry.health
        if answer.ok:
            entry.health = ProbeResult(True, answer.detail)
            entry.served = True
        else:
            failures = previous.failures + 1  # NOT_PROBED and an ok answer count 0
            since = previous.failing_since if failures > 1 else self._clock()
            entry.health = ProbeResult(False, answer.detail, failures, since)
        if reading is not None:
            reading = _planned_only(reading, entry.target.ranks)
            entry.reading = reading
            if reading.loads is None:
                entry.metrics_at = None  # not read: try again with the next probe
            # The resource's load is its serving generation's: not a new one's, nor a drain's.
            if self._on_loads is not None and reading.loads is not None and kind == SERVE:
                self._on_loads((*key, replica), reading.loads)
        period = self._serving if entry.served else self._launching
        if kind == DRAIN:
            period = min(period, constants.DRAIN_PROBE_SECONDS)
        self._schedule(slot, entry, 0.0 if entry.again else period * random.uniform(0.9, 1.1))
        entry.again = False
        signature = _signature(entry)
        if signature != entry.told:
            entry.told = signature
            self._wake(key)
