"""The event-driven controller: watches feed a cache, events wake owners, workers reconcile.

    kopf on.event (VLLMDataParallel) ──▶ owner cache ──┐ new object, new generation
    reflectors (RayCluster, RayJob,  ──▶ child cache ──┤ any change of a child, by its
                Service, Pod)                          │ app.kubernetes.io/instance label
                                                       ▼
    timers (probe cadence, backoff end, resync) ──▶ WorkQueue ──▶ K workers ──▶ reconcile()
                                                                   (reads the cache; writes
                                                                    go to the API and back
                                                                    into the cache)

Each key (namespace, name) is reconciled by one worker at a time; events that arrive during a
reconcile queue it once more, and so does the reconcile's own create or delete (the watch's
echo of it is no news to the cache). Status changes go to the background status writer.
After each reconcile the key is scheduled again only when time matters: the /health cadence
while Launching or Serving, the end of a relaunch backoff, and a rare safety resync. A
resource at rest costs no API request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Protocol

from kubernetes_asyncio.client.exceptions import ApiException

from vllm_dp_operator import constants as c
from vllm_dp_operator.config import Config
from vllm_dp_operator.controller.cache import (
    MANAGED_SELECTOR,
    CachedKube,
    CountingKube,
    Obj,
    ObjectCache,
    json_copy,
    owner_key,
)
from vllm_dp_operator.controller.events import EventPoster
from vllm_dp_operator.controller.informer import Reflector, WatchApi
from vllm_dp_operator.controller.kube import (
    POD,
    RAYCLUSTER,
    RAYJOB,
    SERVICE,
    VDP,
    Kind,
    Kube,
    NamespaceTerminating,
)
from vllm_dp_operator.controller.status_writer import StatusWriter
from vllm_dp_operator.controller.workqueue import ShutDown, WorkQueue
from vllm_dp_operator.engines.probe import HealthProbe
from vllm_dp_operator.engines.ray_dashboard import RayJobs
from vllm_dp_operator.observability.metrics import RESULT_ERROR, OperatorMetrics, result_of
from vllm_dp_operator.reconcile.converge import reconcile
from vllm_dp_operator.reconcile.outcome import Event, Outcome, Resource

log = logging.getLogger(__name__)

Key = tuple[str, str]
CHILD_KINDS = (RAYCLUSTER, RAYJOB, SERVICE, POD)
#: Longest a status patch or an Event waits for the reconciles to drain.
QUIET_WAIT = 2.0


class ControllerApi(Kube, WatchApi, Protocol):
    """The API the controller needs: the Kube seam, watches, and status patches."""

    async def patch_status(
        self, kind: Kind, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        """JSON merge-patch the status subresource."""
        ...


def jitter(seconds: float, spread: float = 0.1) -> float:
    """A period spread by +-10%, so resources created together do not wake together."""
    return seconds * random.uniform(1 - spread, 1 + spread)


def next_wake(cfg: Config, outcome: Outcome) -> float:
    """Seconds until a resource must be reconciled again with no event to wake it."""
    delays = [jitter(cfg.resync_seconds)]
    if outcome.retry_after is not None:
        delays.append(outcome.retry_after)
    phase = outcome.status.get("phase")
    if phase == c.PHASE_LAUNCHING:
        delays.append(cfg.probe_launching_seconds)
    elif phase == c.PHASE_SERVING:
        delays.append(jitter(cfg.probe_serving_seconds))
    return min(delays)


def _api_message(exc: ApiException) -> str:
    """The message of an API error's Status body, else its reason."""
    try:
        message = json.loads(exc.body or "{}").get("message")
    except (TypeError, ValueError, AttributeError):
        message = None
    return str(message or exc.reason)


def _event_target(owner: Obj) -> Obj:
    meta = owner["metadata"]
    return {
        "apiVersion": f"{c.GROUP}/{c.VERSION}",
        "kind": c.KIND,
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid") if k in meta},
    }


class Controller:
    """Owns the cache, the reflectors, the work queue and the workers."""

    def __init__(
        self, api: ControllerApi, cfg: Config, probe: HealthProbe, ray_jobs: RayJobs,
        namespace: str | None = None, post_event: Callable[[Obj, Event], None] | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        metrics: OperatorMetrics | None = None, leading: bool = True,
    ) -> None:  # fmt: skip
        self.api, self.cfg, self.probe, self.ray_jobs = api, cfg, probe, ray_jobs
        self.poster = EventPoster(api, gate=self._quiet) if post_event is None else None
        self.post_event = post_event or self._post
        self.clock = clock
        self.cache = ObjectCache((*CHILD_KINDS, VDP))
        self.kube = CachedKube(api, self.cache)
        self.queue: WorkQueue[Key] = WorkQueue()
        self.reflectors = [
            Reflector(api, self.cache, kind, namespace, MANAGED_SELECTOR,
                      lambda obj, kind=kind: self._child_changed(kind, obj))  # type: ignore[misc]
            for kind in CHILD_KINDS
        ]  # fmt: skip
        #: What woke resources, by source: the owner, a child kind, a follow-up, a retry.
        self.wakes: Counter[str] = Counter()
        self.status = StatusWriter(api, self.cache, self._gone, workers=max(2, cfg.workers // 8),
                                   gate=self._quiet)
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        #: Resources not reconciled yet since they appeared (or since the operator started).
        self._new: set[Key] = set()
        self._no_new = asyncio.Event()
        self._no_new.set()
        #: Counters for the liveness probe, logs and tests.
        self.reconciles = 0
        self.failures = 0
        #: Set while this process holds the Lease (always, without leader election): a
        #: standby's workers wait here, its caches filled by the reflectors and kopf's watch.
        self.leading = asyncio.Event()
        if leading:
            self.leading.set()
        #: Prometheus metrics, on a registry of this controller's own.
        self.metrics = metrics or OperatorMetrics(self.resource_states)

    # ------------------------------------------------------------------ lifecycle

    async def _quiet(self, most: float = QUIET_WAIT) -> None:
        # Status patches and Events wait, at most `most` seconds each, while new resources
        # wait for their first reconcile: in a burst the API server's capacity goes to
        # creating children first, and reporting trickles on meanwhile.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._no_new.wait(), timeout=most)

    def _settled(self, key: Key) -> None:
        self._new.discard(key)
        if not self._new:
            self._no_new.set()

    def _post(self, target: Obj, event: Event) -> None:
        assert self.poster is not None
        self.poster.post(target, event.type, event.reason, event.message)

    def start(self) -> None:
        """Start the reflectors, and the workers (which wait until every cache is filled)."""
        if self.poster is not None:
            self._tasks += self.poster.start()
        self._tasks += self.status.start()
        for reflector in self.reflectors:
            self._tasks.append(asyncio.create_task(reflector.run(), name=repr(reflector)))
        for i in range(self.cfg.workers):
            self._tasks.append(asyncio.create_task(self._worker(), name=f"worker-{i}"))
        self._tasks.append(asyncio.create_task(self._announce(), name="announce"))
        for task in self._tasks:
            task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        # A task of ours never ends on its own: say loudly why it did (the liveness probe
        # fails from now on, so the operator is restarted).
        if self._stopping or task.cancelled() or task.get_name() == "announce":
            return
        log.error("Controller task %s stopped: %r", task.get_name(), task.exception())

    async def _announce(self) -> None:
        start = asyncio.get_running_loop().time()
        await asyncio.gather(*(r.synced.wait() for r in self.reflectors))
        counts = ", ".join(f"{self.cache.count(k)} {k.plural}" for k in CHILD_KINDS)
        log.info("Caches filled in %.1fs (%s); reconciling",
                 asyncio.get_running_loop().time() - start, counts)  # fmt: skip

    async def stop(self) -> None:
        """Stop handing out keys, then cancel every task."""
        self._stopping = True
        self.queue.shutdown(self.cfg.workers)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.status.idle(), timeout=5)  # what is concluded is said
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def lead(self) -> None:
        """This process now holds the Lease: start reconciling, every cached resource first."""
        self.leading.set()
        for key, _ in self.cache.items(VDP):
            self.wakes["leader"] += 1
            self.queue.add(key)

    @property
    def synced(self) -> bool:
        """Whether every reflector has loaded its first LIST."""
        return all(r.synced.is_set() for r in self.reflectors)

    def ready(self) -> tuple[bool, str]:
        """Readiness: whether every cache is filled, and what is missing when not."""
        waiting = [r.kind.plural for r in self.reflectors if not r.synced.is_set()]
        if waiting:
            return False, f"waiting for the first LIST of {', '.join(waiting)}"
        return True, "caches synced"

    def health(self) -> dict[str, Any]:
        """Liveness: raise when a task died; else the queue's and caches' numbers."""
        for task in self._tasks:
            if task.done() and task.get_name() != "announce":
                raise RuntimeError(f"controller task {task.get_name()} has stopped")
        return {
            "synced": self.synced,
            "queued": len(self.queue),
            "in_flight": self.queue.in_flight,
            "scheduled": self.queue.scheduled,
            "reconciles": self.reconciles,
            "wakes": {**self.wakes, "timer": self.queue.fired},
            "cached": {k.plural: self.cache.count(k) for k in (*CHILD_KINDS, VDP)},
        }

    def resource_states(self) -> list[tuple[Key, dict[str, Any]]]:
        """Every resource's status as the next reconcile will read it (pending changes laid
        over), for the metrics read at scrape time; none on a standby, so that two replicas
        scraped together count each resource once."""
        if not self.leading.is_set():
            return []
        return [(key, self.status.effective(key, obj.get("status") or {}))
                for key, obj in self.cache.items(VDP)]  # fmt: skip

    # ------------------------------------------------------------------ events

    def owner_event(self, event_type: str | None, body: Obj) -> None:
        """A VLLMDataParallel event from kopf: cache it; wake it when its spec moved."""
        meta = body.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        if event_type == "DELETED":
            self.cache.remove(VDP, body)
            self.queue.drop(key)
            self._settled(key)
            return
        old = self.cache.peek(VDP, *key)
        old_meta = dict(old["metadata"]) if old is not None else None
        if not self.cache.upsert(VDP, body):
            return  # older than what a status patch already told us
        if old_meta is None:
            self._new.add(key)
            self._no_new.clear()
        # Our own status patches echo back here: those alone wake nothing.
        if (
            old_meta is None
            or old_meta.get("generation") != meta.get("generation")
            or old_meta.get("uid") != meta.get("uid")
            or old_meta.get("deletionTimestamp") != meta.get("deletionTimestamp")
        ):
            self.wakes["owner"] += 1
            self.queue.add(key, urgent=old_meta is None)

    def _child_changed(self, kind: Kind, obj: Obj) -> None:
        key = owner_key(obj)
        if key is not None:
            self.wakes[kind.plural] += 1
            self.queue.add(key)

    # ------------------------------------------------------------------ workers

    async def _worker(self) -> None:
        await asyncio.gather(*(r.synced.wait() for r in self.reflectors))
        while True:
            await self.leading.wait()
            try:
                key = await self.queue.get()
            except ShutDown:
                return
            started = asyncio.get_running_loop().time()
            result: str | None = RESULT_ERROR
            try:
                result = result_of(await self.process(key))
            except asyncio.CancelledError:
                result = None  # shutting down: not a reconcile that ended
                raise
            except NamespaceTerminating:
                # Its namespace is being deleted, and the resource with it: nothing to do.
                result = result_of(None)
                log.info("Namespace %s is terminating; not reconciling %s", *key)
                self.queue.drop(key)
                self._settled(key)
            except ApiException as exc:
                self.failures += 1
                self.wakes["retry"] += 1
                delay = self.queue.add_rate_limited(key)
                log.warning("Reconcile of %s/%s failed: HTTP %s %s; retrying in %.1fs", *key,
                            exc.status, _api_message(exc), delay)  # fmt: skip
            except Exception:
                self.failures += 1
                self.wakes["retry"] += 1
                delay = self.queue.add_rate_limited(key)
                log.exception("Reconcile of %s/%s failed; retrying in %.1fs", *key, delay)
            else:
                self.queue.forget(key)
            finally:
                self.queue.done(key)
                if result is not None:
                    self.metrics.reconciled(result, asyncio.get_running_loop().time() - started)

    async def process(self, key: Key) -> Outcome | None:
        """Reconcile one resource from the cache, write what changed, schedule its next wake."""
        owner = self.cache.peek(VDP, *key)
        if owner is None or owner["metadata"].get("deletionTimestamp"):
            # Gone, or going: owner references make the garbage collector take the children.
            if owner is None:
                self.queue.drop(key)
            self._settled(key)
            return None
        owner = json_copy(owner)
        current = self.status.effective(key, owner.get("status") or {})
        owner["status"] = current
        kube = CountingKube(self.kube)
        now = self.clock()
        outcome = await reconcile(Resource.from_body(owner), kube, self.probe, self.ray_jobs,
                                  self.cfg, now)  # fmt: skip
        self.reconciles += 1
        self.metrics.observe(current, outcome, owner["metadata"].get("creationTimestamp"), now)
        self._settled(key)
        changes = {k: v for k, v in outcome.status.items() if current.get(k) != v}
        target, events = _event_target(owner), list(outcome.events)
        if changes:
            # An Event tells of a status that was written: a leader killed before its patch
            # landed leaves both to its successor, which then posts the Event once, not twice.
            self.status.submit(key, changes, after=lambda: self._post_all(target, events))
        else:
            self._post_all(target, events)
        if kube.creates_and_deletes:
            # The watch's echo of our own writes wakes nobody (the cache already holds them):
            # look once more, so the reconcile reaches a fixed point, as after an echo.
            self.wakes["follow-up"] += 1
            self.queue.add(key)
        self.queue.add_after(key, next_wake(self.cfg, outcome))
        return outcome

    def _post_all(self, target: Obj, events: list[Event]) -> None:
        for event in events:
            self.post_event(target, event)

    def _gone(self, key: Key) -> None:
        # A status patch answered 404: the resource was deleted without a DELETED event
        # reaching us (kopf relists after a 410 without reporting deletions). Forget it; the
        # garbage collector takes whatever it owned.
        self.cache.remove(VDP, {"metadata": {"namespace": key[0], "name": key[1]}})
        self.queue.drop(key)
        self._settled(key)
