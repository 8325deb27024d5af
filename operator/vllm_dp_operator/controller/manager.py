"""The event-driven controller: watches feed a cache, events wake owners, workers reconcile.

    kopf on.event (VLLMDataParallel) ──▶ owner cache ──┐ new object, new generation
    reflectors (RayCluster, RayJob,  ──▶ child cache ──┤ any change of a child, by its
                Service, EndpointSlice, Pod,           │ app.kubernetes.io/instance label
                NetworkPolicy)                         │
                                                       ▼
    probe pool (a change in /health    ──▶ WorkQueue ──▶ K workers ──▶ reconcile()
      or load), timers (backoff end,                               (reads the cache and the
      launch deadline, resync)                                      pool's answers; writes
                                                                    go to the API and back
                                                                    into the cache)

Each key (namespace, name) is reconciled by one worker at a time; events that arrive during a
reconcile queue it once more, and so does the reconcile's own create or delete (the watch's
echo of it is no news to the cache). Status changes go to the background status writer.
Nothing is decided from a child cache that is not filled, or whose kind the API server does
not serve or let the operator read: such a resource is told why (a condition, from the
owner cache alone), and every resource is looked at again once the watches are healthy.
Probes run in their own bounded pool (engines/prober.py), never in a worker, and wake a
resource only when their answer changes. After each reconcile the key is scheduled again
only when time matters: the end of a relaunch backoff, a launch deadline, and a rare safety
resync. A resource at rest costs no API request.

Identity is the uid, not the name. An owner event wakes its key when the owner's uid,
generation or deletion differs from what was last woken for or reconciled: never by the
order of resourceVersions, which are opaque (a status patch's answer may carry a user's edit
before kopf's event for it does). kopf reports no deletion it missed during a 410, so a
reconcile about to create asks the API server once whether its owner still exists, unless a
kopf event about it woke this very reconcile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from kubernetes_asyncio.client.exceptions import ApiException
from vllm_dp_launcher.stages import SERVING

from vllm_dp_operator import constants as c
from vllm_dp_operator.config import Config
from vllm_dp_operator.controller.cache import (
    MANAGED_SELECTOR,
    CachedKube,
    Obj,
    ObjectCache,
    json_copy,
    owner_key,
)
from vllm_dp_operator.controller.crd_presence import CrdPresence
from vllm_dp_operator.controller.events import EventPoster
from vllm_dp_operator.controller.informer import Reflector, WatchApi
from vllm_dp_operator.controller.kube import (
    CRD,
    ENDPOINTSLICE,
    NETWORKPOLICY,
    PDB,
    POD,
    RAYCLUSTER,
    RAYJOB,
    SERVICE,
    VDP,
    WORKLOAD,
    Kind,
    Kube,
    NamespaceTerminating,
)
from vllm_dp_operator.controller.reconcile_view import CountingKube
from vllm_dp_operator.controller.status_writer import StatusWriter, api_message
from vllm_dp_operator.controller.update_slots import UpdateSlots
from vllm_dp_operator.controller.watch_health import (
    WatchProblem,
    kind_name,
    unserved_status,
    watched_again,
)
from vllm_dp_operator.controller.workqueue import ShutDown, WorkQueue
from vllm_dp_operator.engines.launch_reports import LaunchReports, LogSource
from vllm_dp_operator.engines.probe import HealthProbe
from vllm_dp_operator.engines.prober import CANDIDATE, DRAIN, ProbePool
from vllm_dp_operator.engines.ray_dashboard import RayJobs
from vllm_dp_operator.engines.transport import PROBES_OFF, ServiceTransport
from vllm_dp_operator.observability.metrics import (
    RESULT_ERROR,
    OperatorMetrics,
    WatchState,
    result_of,
)
from vllm_dp_operator.reconcile.converge import reconcile
from vllm_dp_operator.reconcile.outcome import Event, Outcome, Resource
from vllm_dp_operator.reconcile.update import DRAINING, STARTING

log = logging.getLogger(__name__)

Key = tuple[str, str]
CHILD_KINDS = (RAYCLUSTER, RAYJOB, SERVICE, ENDPOINTSLICE, POD, NETWORKPOLICY, PDB)
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


#: The phases in which a resource's head is probed.
PROBED_PHASES = frozenset({c.PHASE_LAUNCHING, c.PHASE_SERVING, c.PHASE_DRAINING})


def probed(status: dict[str, Any]) -> dict[int, frozenset[str]]:
    """The replicas the pool probes (those that launch, serve or drain), and for each which
    other generation is probed too: its Surge's new one (an update is starting), or the one
    that drains (a Surge's old one, or the replica itself as it leaves)."""
    if status.get("phase") == c.PHASE_INVALID:
        return {}
    out = {}
    for e in status.get("replicaStatuses") or []:
        if e.get("phase") not in PROBED_PHASES:
            continue
        phase = (e.get("update") or {}).get("phase")
        out[int(e["index"])] = frozenset(
            ({CANDIDATE} if phase == STARTING else set())
            | ({DRAIN} if phase == DRAINING or e.get("leaving") else set()))
    return out


def next_wake(cfg: Config, outcome: Outcome) -> float:
    """Seconds until a resource must be reconciled again with no event to wake it (a probe
    whose answer changed wakes it too, from the probe pool)."""
    delays = [jitter(cfg.resync_seconds)]
    if outcome.retry_after is not None:
        delays.append(outcome.retry_after)
    return min(delays)


class OwnerGone(Exception):
    """The resource a reconcile was about to create children for no longer exists."""


def _mark(meta: Obj) -> tuple[str, object, object, object]:
    """What makes an owner event news: its uid, its generation, its deletion, and its restart
    annotation (`kubectl annotate ... vllmdp.io/restartedAt=...` changes no generation)."""
    restart = (meta.get("annotations") or {}).get(c.ANNOTATION_RESTARTED_AT)
    return (str(meta.get("uid") or ""), meta.get("generation"), meta.get("deletionTimestamp"),
            restart)  # fmt: skip


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
        namespaces: Sequence[str] = (), post_event: Callable[[Obj, Event], None] | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        metrics: OperatorMetrics | None = None, leading: bool = True,
        logs: LogSource | None = None, engine_calls: ServiceTransport | None = None,
    ) -> None:  # fmt: skip
        self.api, self.cfg, self.probe, self.ray_jobs = api, cfg, probe, ray_jobs
        self.poster = EventPoster(api, gate=self._quiet) if post_event is None else None
        self.post_event = post_event or self._post
        self.clock = clock
        self.cache = ObjectCache((*CHILD_KINDS, WORKLOAD, VDP, CRD))
        self.kube = CachedKube(api, self.cache)
        self.queue: WorkQueue[Key] = WorkQueue()
        # One reflector per kind and watched namespace (a Role grants list/watch in its own
        # namespace only), or per kind across all namespaces when none is listed.
        self.reflectors = [
            Reflector(api, self.cache, kind, namespace, MANAGED_SELECTOR,
                      lambda obj, kind=kind: self._child_changed(kind, obj),  # type: ignore[misc]
                      on_health=self._watch_health_changed)
            for kind in CHILD_KINDS for namespace in (tuple(namespaces) or (None,))
        ]  # fmt: skip
        # Kueue's Workloads carry no label of ours (Kueue makes them): all of them are watched,
        # slimmed to their conditions, where Kueue is installed, and none where it is not;
        # there, one watch of Kueue's CRD says when it is installed, with no request meanwhile.
        self.kueue = CrdPresence(api, self.cache, WORKLOAD)
        self.reflectors += [
            Reflector(api, self.cache, WORKLOAD, namespace, "", self._workload_changed,
                      on_health=self._watch_health_changed, optional=True,
                      until_served=self.kueue.until_served)
            for namespace in (tuple(namespaces) or (None,))
        ]  # fmt: skip
        #: What the resources were last woken for: (synced, the blocking causes).
        self._watch_state: tuple[bool, tuple[str, ...]] = (False, ())
        #: What woke resources, by source: the owner, a child kind, a follow-up, a retry.
        self.wakes: Counter[str] = Counter()
        self.status = StatusWriter(api, self.cache, self._gone, workers=max(2, cfg.workers // 8),
                                   gate=self._quiet)
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        #: The operator-wide bound on resources that update at once.
        self.slots = UpdateSlots(cfg.max_concurrent_updates, self._updating,
                                 lambda: self.cache.count(VDP))  # fmt: skip
        #: Resources not tried yet since they appeared (or since the operator started).
        self._new: set[Key] = set()
        #: Per key, the owner's (uid, generation, deletion) last woken for or reconciled.
        self._marks: dict[Key, tuple[str, object, object, object]] = {}
        #: Keys a kopf event woke since their last reconcile: their owner surely exists.
        self._told: set[Key] = set()
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
        #: Prometheus metrics, on a registry of this controller's own (it reads the states
        #: above at once).
        self.metrics = metrics or OperatorMetrics(self.resource_states, self.watch_states)
        #: The launchers' reports, from the head pods' logs (none without a log source).
        self.reports = LaunchReports(logs, self._reported) if logs is not None else None
        #: The probes' own bounded pool; it feeds the per-rank gauges and wakes on a change.
        self.probes = ProbePool(probe, self._probe_changed, concurrency=cfg.probe_concurrency,
                                launching_seconds=cfg.probe_launching_seconds,
                                serving_seconds=cfg.probe_serving_seconds,
                                metrics_seconds=cfg.probe_metrics_seconds,
                                on_loads=self.metrics.set_engine_loads, reports=self.reports,
                                probing=cfg.health_probe != PROBES_OFF,
                                transport=engine_calls)  # fmt: skip

    # ------------------------------------------------------------------ lifecycle

    async def _quiet(self, most: float = QUIET_WAIT) -> None:
        # Status patches and Events wait, at most `most` seconds each, while new resources
        # wait for their first reconcile: in a burst the API server's capacity goes to
        # creating children first, and reporting trickles on meanwhile.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._no_new.wait(), timeout=most)
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # Python 3.11's wait_for swallows a cancellation that arrives as the wait ends: a
            # poster or writer cancelled by stop() would wait on its queue for ever.
            raise asyncio.CancelledError


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
        self._tasks += self.probes.start()
        self._tasks.append(asyncio.create_task(self.kueue.reflector.run(),
                                              name=repr(self.kueue.reflector)))
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
        if self.reports is not None:
            await self.reports.stop()

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

    def _blockers(self) -> list[WatchProblem]:
        return [r.refused for r in self.reflectors if r.refused is not None]

    def ready(self) -> tuple[bool, str]:
        """Readiness: synced and every watched kind served; else False and why."""
        blockers = self._blockers()
        if blockers:
            return False, "; ".join(p.message for p in blockers)
        waiting = [kind_name(r.kind) + (f" (last attempt: {r.problem.message})" if r.problem
                                        else "")
                   for r in self.reflectors if not r.synced.is_set()]  # fmt: skip
        if waiting:
            return False, f"waiting for the first LIST of {', '.join(waiting)}"
        return True, "synced; every watched kind is served"

    def watch_states(self) -> list[WatchState]:
        """Per child kind: listed and served now, and failed attempts by reason (metrics)."""
        # An optional kind (Kueue's) absent or unreadable is ready: nothing waits on it. Its
        # failed attempts still count by reason.
        states: dict[Kind, WatchState] = {}
        for r in self.reflectors:  # several namespaces of one kind make one state
            prior = states.get(r.kind, WatchState(kind_name(r.kind), True, {}))
            states[r.kind] = WatchState(prior.kind,
                                        prior.ready and r.synced.is_set() and r.refused is None,
                                        dict(Counter(prior.failures) + Counter(r.failures)))
        return list(states.values())

    def _watch_health_changed(self) -> None:
        # A cache was filled, or a kind became unserved or served again: look at every
        # resource again (the start's first reconciles come from here too).
        state = (self.synced, tuple(p.message for p in self._blockers()))
        if state == self._watch_state:
            return
        self._watch_state = state
        if not state[0] and not state[1]:
            return  # still filling: nothing to decide or to say yet
        for key, _ in self.cache.items(VDP):
            self.wakes["watches"] += 1
            self.queue.add(key, urgent=key in self._new)

    def health(self) -> dict[str, Any]:
        """Liveness: raise when a task died; else only that it is alive."""
        if (dead := self._dead_task()) is not None:
            raise RuntimeError(f"controller task {dead} has stopped")
        return {"alive": True}

    def _dead_task(self) -> str | None:
        """The name of a task that should run for ever and has ended, if any."""
        return next((t.get_name() for t in self._tasks
                     if t.done() and t.get_name() != "announce"), None)  # fmt: skip

    def counters(self) -> dict[str, Any]:
        """The queue's, caches' and reflectors' numbers, and readiness (for an authorized
        reader: /debug/controller)."""
        ready, why = self.ready()
        return {
            "alive": self._dead_task() is None,
            "synced": self.synced,
            "ready": ready,
            "readiness": why,
            "queued": len(self.queue),
            "in_flight": self.queue.in_flight,
            "scheduled": self.queue.scheduled,
            "reconciles": self.reconciles,
            "probed": len(self.probes),
            "wakes": {**self.wakes, "timer": self.queue.fired},
            "cached": {k.plural: self.cache.count(k) for k in (*CHILD_KINDS, VDP)},
            "reflectors": self._reflector_requests(),
        }

    def _reflector_requests(self) -> dict[str, dict[str, int]]:
        """Per kind (its namespaces summed): relists, LIST pages and watch requests so far,
        what the reflectors have cost the API server."""
        out: dict[str, dict[str, int]] = {}
        for r in self.reflectors:
            row = out.setdefault(r.kind.plural, {"lists": 0, "pages": 0, "watches": 0})
            row["lists"] += r.lists
            row["pages"] += r.pages
            row["watches"] += r.watches
        crd = self.kueue.reflector
        out["customresourcedefinitions"] = {"lists": crd.lists, "pages": crd.pages,
                                            "watches": crd.watches}  # fmt: skip
        return out

    def resource_states(self) -> list[tuple[Key, dict[str, Any]]]:
        """Every resource's status as the next reconcile will read it (pending changes laid
        over), for the metrics read at scrape time; none on a standby, so that two replicas
        scraped together count each resource once."""
        if not self.leading.is_set():
            return []
        return [(key, self.status.effective(key, obj["metadata"].get("uid") or "",
                                            obj.get("status") or {}))
                for key, obj in self.cache.items(VDP)]  # fmt: skip

    # ------------------------------------------------------------------ events

    def owner_event(self, event_type: str | None, body: Obj) -> None:
        """A VLLMDataParallel event from kopf: cache it; wake it when its spec moved."""
        meta = body.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        if event_type == "DELETED":
            self._forget(key, meta.get("uid") or None)
            return
        # Cached unless a status patch's answer already holds this or a newer version; either
        # way the cache's copy is at least as new as this event.
        self.cache.upsert(VDP, body)
        mark, seen = _mark(meta), self._marks.get(key)
        if mark == seen:
            return  # our own status patches echo back here: those alone wake nothing
        self._told.add(key)  # the reconcile this wakes knows its owner exists
        fresh = seen is None or seen[0] != mark[0]
        if fresh:
            self.status.forget(key)  # a new uid: what was pending was for the old one
            self._new.add(key)
            self._no_new.clear()
        self._marks[key] = mark
        self.wakes["owner"] += 1
        self.queue.add(key, urgent=fresh)

    def _child_changed(self, kind: Kind, obj: Obj) -> None:
        key = owner_key(obj)
        if key is not None:
            self.wakes[kind.plural] += 1
            self.queue.add(key)

    def _reported(self, key: Key, stage: str) -> None:
        # A launcher reported a new stage. `serving`: probe at once, and that probe's answer
        # wakes the resource; with probes off, the report itself does.
        if stage == SERVING and self.cfg.health_probe != PROBES_OFF:
            self.probes.nudge(key)
            return
        self.wakes["report"] += 1
        self.queue.add(key)

    def _probe_changed(self, key: Key) -> None:
        # The pool learned something a decision rests on (engines/prober.py).
        self.wakes["probe"] += 1
        self.queue.add(key)

    def _workload_changed(self, obj: Obj) -> None:
        # A Workload is its RayCluster's (Kueue's controller owner reference): wake that
        # cluster's owner.
        meta = obj.get("metadata") or {}
        for ref in meta.get("ownerReferences") or []:
            if ref.get("kind") == "RayCluster" and ref.get("controller"):
                cluster = self.cache.peek(RAYCLUSTER, meta.get("namespace") or "", ref["name"])
                if cluster is not None:
                    self._child_changed(WORKLOAD, cluster)

    # ------------------------------------------------------------------ workers

    async def _worker(self) -> None:
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
                            exc.status, api_message(exc), delay)  # fmt: skip
            except Exception:
                self.failures += 1
                self.wakes["retry"] += 1
                delay = self.queue.add_rate_limited(key)
                log.exception("Reconcile of %s/%s failed; retrying in %.1fs", *key, delay)
            else:
                self.queue.forget(key)
            finally:
                # Settled after its first try, failed or not: a resource whose reconcile keeps
                # failing must not hold every other resource's status and Events back.
                self._settled(key)
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
        blockers = self._blockers()
        if blockers:
            self._unserved(key, owner, blockers)
            return None
        if not self.synced:
            return None  # every resource is woken once the caches are filled
        owner = json_copy(owner)
        uid = owner["metadata"].get("uid") or ""
        self._marks[key] = _mark(owner["metadata"])
        current = self.status.effective(key, uid, owner.get("status") or {})
        owner["status"] = current
        told = key in self._told
        self._told.discard(key)
        kube = CountingKube(self.kube, None if told else lambda: self._owner_exists(key, uid))
        now = self.clock()
        try:
            outcome = await reconcile(Resource.from_body(owner), kube, self.probes,
                                      self.ray_jobs, self.cfg, now, self.slots)  # fmt: skip
        except OwnerGone:
            log.info("%s/%s (uid %s) was deleted while unwatched; forgetting it", *key, uid)
            self._gone(key, uid)
            return None
        self.reconciles += 1
        self.metrics.observe(current, outcome, owner["metadata"].get("creationTimestamp"), now)
        self.probes.keep(key, probed(outcome.status))
        self._settled(key)
        again = watched_again(outcome.status["conditions"], outcome.status["observedGeneration"],
                              now)  # fmt: skip
        if again is not None:
            outcome.status["conditions"] = again
        changes = {k: v for k, v in outcome.status.items() if current.get(k) != v}
        target, events = _event_target(owner), list(outcome.events)
        if changes:
            # An Event tells of a status that was written: a leader killed before its patch
            # landed leaves both to its successor, which then posts the Event once, not twice.
            self.status.submit(key, uid, changes, after=lambda: self._post_all(target, events))
        else:
            self._post_all(target, events)
        self.slots.written(key)  # status.rollout, held or given back, is the effective status
        if kube.creates_and_deletes:
            # The watch's echo of our own writes wakes nobody (the cache already holds them):
            # look once more, so the reconcile reaches a fixed point, as after an echo.
            self.wakes["follow-up"] += 1
            self.queue.add(key)
        self.queue.add_after(key, next_wake(self.cfg, outcome))
        return outcome

    def _updating(self) -> list[Key]:
        """The resources whose (effective) status holds an update slot."""
        return [key for key, obj in self.cache.items(VDP)
                if self.status.effective(key, obj["metadata"].get("uid") or "",
                                         obj.get("status") or {}).get("rollout")]  # fmt: skip

    def _post_all(self, target: Obj, events: list[Event]) -> None:
        for event in events:
            self.post_event(target, event)

    def _unserved(self, key: Key, owner: Obj, blockers: list[WatchProblem]) -> None:
        # Decided from the owner cache (fed by kopf) alone: no child cache is read here.
        uid = owner["metadata"].get("uid") or ""
        current = self.status.effective(key, uid, owner.get("status") or {})
        generation = int(owner["metadata"].get("generation") or 0)
        doc = unserved_status(current, blockers, generation, self.clock())
        changes = {k: v for k, v in doc.items() if current.get(k) != v}
        if changes:
            self.status.submit(key, uid, changes)
        # One Warning per new cause: not per wake, nor when one of several causes goes away.
        if any(p.message not in (current.get("message") or "") for p in blockers):
            self.post_event(_event_target(owner),
                            Event(c.EVENT_WARNING, blockers[0].reason, doc["message"]))
        self._settled(key)

    async def _owner_exists(self, key: Key, uid: str) -> None:
        # Before a create: children made for a deleted owner would carry a dead owner
        # reference. Creates are rare (a new resource, a launch), so this GET costs little.
        found = await self.api.get(VDP, *key)
        if found is None or (found.get("metadata") or {}).get("uid") != uid:
            raise OwnerGone(f"{key[0]}/{key[1]}")

    def _gone(self, key: Key, uid: str) -> None:
        # A status patch answered 404, or a create found the owner gone: it was deleted
        # without a DELETED event reaching us (kopf relists after a 410 without reporting
        # deletions). Forget that uid; the garbage collector takes whatever it owned.
        self._forget(key, uid)

    def _forget(self, key: Key, uid: str | None) -> None:
        """Drop a deleted owner (this uid, or whichever when None) and all that is kept on it."""
        cached = self.cache.peek(VDP, *key)
        self.cache.remove(VDP, {"metadata": {"namespace": key[0], "name": key[1], "uid": uid}})
        self.status.forget(key, uid)
        self.metrics.forget(key)
        self.probes.release(key)
        if cached is not None and uid and cached["metadata"].get("uid") != uid:
            return  # another resource of the same name lives on in the cache
        self.queue.drop(key)
        self._marks.pop(key, None)
        self._told.discard(key)
        self._settled(key)
