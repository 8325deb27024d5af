"""The launcher's own report of a launch, followed in the head pod's log as it is written.

The launcher writes its stage lines, each marked with its head job's name, to the head
container's log (vllm_dp_launcher.report). While a head job launches, the operator follows
that log through the API server (`pods/log`, read-only; no access to the pod's ports), so the
moment vLLM first answers /health, which the launcher watches from inside the pod, reaches
the operator as an event and not at its next probe. With healthProbe.mode off, that report is
the only sign of serving there is.

One follow per launching head job, at most; it ends once the job reports the stage it is
followed until (`serving`; for a Surge's new generation `answered`, the launcher's own
completion) or ends, so a fleet at rest holds no stream. A stream that breaks is followed
again after a pause, from the job's start, and a line already seen is no news.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from vllm_dp_launcher.stages import EXITED, MARKER, SERVING, parse_stage_lines

log = logging.getLogger(__name__)

Key = tuple[str, str]
Slot = tuple[str, str, int]
#: Pause before a stream that ended is followed again; it doubles while streams bring no
#: line of the launch (a kubelet that serves no log, a pod without the launcher's report),
#: up to REFOLLOW_MAX_SECONDS.
REFOLLOW_SECONDS = 2.0
REFOLLOW_MAX_SECONDS = 60.0


class LogSource(Protocol):
    """Follows one container's log from some seconds back: its lines as they come."""

    def __call__(
        self, namespace: str, pod: str, container: str, since_seconds: int
    ) -> AsyncIterator[str]:
        """Yield the log's lines, following it, until the stream ends."""
        ...


@dataclass(frozen=True)
class Launch:
    """A head job launching on a head pod: whose log to follow, for which job's lines."""

    namespace: str
    owner: str
    pod: str
    container: str
    job: str
    started: datetime
    #: The stage after which nothing more is waited for from its log (besides `exited`).
    until: str = SERVING
    #: The replica it launches for: each replica's launch is followed on its own.
    replica: int = 0

    @property
    def key(self) -> Key:
        """The owning resource's key."""
        return (self.namespace, self.owner)

    @property
    def slot(self) -> Slot:
        """Where it is kept: one launch per replica of a resource."""
        return (self.namespace, self.owner, self.replica)

    def final(self, stage: str | None) -> bool:
        """Whether nothing more is waited for after this stage."""
        return stage in (self.until, EXITED)


class LaunchReports:
    """The latest stage each launching head job reported; a new stage wakes its resource."""

    def __init__(
        self, source: LogSource, changed: Callable[[Key, str], None],
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:  # fmt: skip
        self._source, self._changed, self._clock = source, changed, clock
        self._follows: dict[Slot, tuple[Launch, asyncio.Task[None]]] = {}
        self._stages: dict[Slot, tuple[Launch, str]] = {}

    def stage(self, launch: Launch) -> str | None:
        """The last stage this head job reported; starts following its log if need be."""
        seen = self._stages.get(launch.slot)
        stage = seen[1] if seen is not None and seen[0] == launch else None
        if not launch.final(stage):
            self._follow(launch)
        return stage

    def release(self, key: Key, replica: int | None = None) -> None:
        """Forget a resource's launches (or one replica's): it neither launches nor serves,
        or is gone."""
        for slot in [s for s in (*self._stages, *self._follows) if s[:2] == key
                     and replica in (None, s[2])]:  # fmt: skip
            self._stages.pop(slot, None)
            self._stop(slot)

    def slots(self, key: Key) -> list[Slot]:
        """The replicas of a resource whose launches are kept."""
        return [s for s in {*self._stages, *self._follows} if s[:2] == key]

    def _follow(self, launch: Launch) -> None:
        current = self._follows.get(launch.slot)
        if current is not None and current[0] == launch:
            return
        self._stop(launch.slot)
        task = asyncio.create_task(self._run(launch), name=f"log {launch.namespace}/{launch.pod}")
        self._follows[launch.slot] = (launch, task)

    def _stop(self, slot: Slot) -> None:
        current = self._follows.pop(slot, None)
        if current is not None:
            current[1].cancel()

    async def stop(self) -> None:
        """End every follow."""
        tasks = [task for _, task in self._follows.values()]
        self._follows.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, launch: Launch) -> None:
        pause = REFOLLOW_SECONDS
        try:
            while not await self._read(launch):
                await asyncio.sleep(pause)
                pause = min(REFOLLOW_MAX_SECONDS, pause * 2)
        finally:
            current = self._follows.get(launch.slot)
            if current is not None and current[1] is asyncio.current_task():
                del self._follows[launch.slot]

    async def _read(self, launch: Launch) -> bool:
        """Follow the log once; True once the launch reported a final stage."""
        since = max(1, int((self._clock() - launch.started).total_seconds()) + 2)
        try:
            async for line in self._source(launch.namespace, launch.pod, launch.container, since):
                if MARKER not in line:
                    continue
                for parsed in parse_stage_lines(line):
                    if parsed.fields.get("job") == launch.job and self._record(launch, parsed.name):
                        return True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the API server or kubelet broke the stream: follow again
            log.debug("Following %s/%s's log: %r", launch.namespace, launch.pod, exc)
        return False

    def _record(self, launch: Launch, stage: str) -> bool:
        seen = self._stages.get(launch.slot)
        if seen is None or seen[0] != launch or seen[1] != stage:
            self._stages[launch.slot] = (launch, stage)
            self._changed(launch.key, stage)
        return launch.final(stage)
