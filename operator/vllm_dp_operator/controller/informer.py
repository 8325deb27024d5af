"""Reflectors: LIST then WATCH one kind into the cache, and report what changed.

One reflector per child kind (RayCluster, RayJob, Service, EndpointSlice, Pod), each
selecting the operator's label server-side, in the watched namespace or cluster-wide. Like
client-go's:
- the first LIST is paginated; `synced` is set once it is in the cache, and workers wait for
  every reflector's `synced` before the first reconcile (so a restart starts from a full cache);
- the WATCH resumes from the last resourceVersion, saved at every event and bookmark (so a
  stream that breaks mid-way resumes where it broke, not where it began), and is renewed
  every 5-10 minutes, when the server ends it;
- a 410 Gone relists and diffs the new list against the cache: objects that vanished while
  no watch ran are reported as deleted (client-go's DeletedFinalStateUnknown), so no owner
  misses a deletion;
- network errors retry the watch with a backoff capped at RETRY_CAP_SECONDS;
- a kind not served (404) or not readable (403) is retried the same way; each cause is logged
  once, not at every retry, and kept in `problem` for readiness, metrics and the resources'
  conditions (`watch_health.py`) until a LIST succeeds or a WATCH stays open;
- an optional kind that is not served waits, with no request, until a watch of its CRD says
  it is (`crd_presence.py`), instead of asking again every minute.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from vllm_dp_operator.controller.cache import Obj, ObjectCache, slim
from vllm_dp_operator.controller.kube import Kind
from vllm_dp_operator.controller.watch_health import WatchProblem, diagnose

log = logging.getLogger(__name__)

#: Longest wait between two attempts while the API server fails. A retry is one request per
#: kind, so a short cap costs little during an outage; a long one is paid after it: with a
#: 30 s cap, an API server back after a 10 s outage went unwatched for 16 s more (the
#: reliability tier's restart test), and so did every change it made meanwhile.
RETRY_CAP_SECONDS = 4.0
#: How long a 404 or 403 must last before it counts as the cluster's state (`refused`): an API
#: server that has just started answers 404 for custom resources until it has loaded their
#: CRDs, and a restart of it must not tell every resource that KubeRay is missing.
REFUSED_AFTER_SECONDS = 10.0
#: A watch open this long without an error is working: its problem is gone. Longer than the
#: watch's connect timeout (10 s), so a connection still being attempted is no proof.
WATCH_WORKS_SECONDS = 15.0
#: An optional kind (Kueue's Workloads) that is not readable (403), or not served where its CRD
#: cannot be watched, is looked for again this often. Not served, it waits on its CRD's watch
#: (`until_served`): Kueue installed later is seen at once, at no request while it is absent.
OPTIONAL_RETRY_SECONDS = 60.0


class WatchApi(Protocol):
    """What a reflector needs from the API: paginated lists and a watch stream."""

    async def list_page(
        self, kind: Kind, namespace: str | None, selector: str, limit: int, cont: str | None,
        fields: str = "",
    ) -> dict[str, Any]:  # fmt: skip
        """One page of a LIST (`fields`: a field selector)."""
        ...

    def watch(
        self, kind: Kind, namespace: str | None, selector: str, resource_version: str,
        timeout_seconds: int, fields: str = "",
    ) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
        """Watch events from a resourceVersion on."""
        ...


class Gone(Exception):
    """The watch's resourceVersion is too old (410): relist."""


class Reflector:
    """Keeps one kind of the cache in step with the API server, reporting each change."""

    def __init__(
        self, api: WatchApi, cache: ObjectCache, kind: Kind, namespace: str | None,
        selector: str, on_change: Callable[[Obj], None], page_size: int = 500,
        watch_seconds: tuple[int, int] = (300, 600),
        on_health: Callable[[], None] = lambda: None, optional: bool = False,
        until_served: Callable[[], Awaitable[bool]] | None = None, fields: str = "",
    ) -> None:  # fmt: skip
        self.api, self.cache, self.kind = api, cache, kind
        #: A kind some clusters lack (Kueue's): absent or unreadable, it is an empty cache, not
        #: a reason to serve no resource.
        self.optional = optional
        #: For an optional kind: returns once the kind may be served again (True), or at once
        #: with False when that cannot be known (then it is asked every OPTIONAL_RETRY_SECONDS).
        self.until_served = until_served
        self.namespace, self.selector = namespace, selector
        #: A field selector beside the label selector (`metadata.name=...`), or "".
        self.fields = fields
        self.on_change = on_change
        self.page_size = page_size
        self.watch_seconds = watch_seconds
        self.synced = asyncio.Event()
        #: Where the watch resumes; None means list first.
        self.resource_version: str | None = None
        #: Counters for the liveness probe and tests.
        self.lists = 0
        self.pages = 0  # LIST requests: a list of more than one page takes several
        self.watches = 0
        self.events = 0
        #: Why the latest attempt failed; None once a LIST succeeded after it.
        self.problem: WatchProblem | None = None
        #: Failed attempts by reason, for the metrics.
        self.failures: Counter[str] = Counter()
        #: Called after each LIST, when `problem` changes, and when a refusal starts to count.
        self.on_health = on_health
        self._problem_since = 0.0
        self._refusal_told = False

    def __repr__(self) -> str:
        return f"Reflector({self.kind.plural}, {self.namespace or 'all namespaces'})"

    async def run(self) -> None:
        """List, then watch for ever; relist on 410; retry network errors with backoff.

        A second run resumes from the resourceVersion the first one reached.
        """
        delay = 0.0
        while True:
            if delay:
                await asyncio.sleep(delay)
            verb = "list"  # what failed, for the diagnosis
            try:
                if self.resource_version is None:
                    self.resource_version = await self._relist()
                    self._listed()
                verb = "watch"
                await self._watch_reporting(self.resource_version)
                delay = 0.0
            except Gone:
                log.info("%r: resourceVersion expired; relisting", self)
                self.resource_version, delay = None, 0.0
            except (ApiException, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                if isinstance(exc, ApiException) and exc.status == 410:
                    self.resource_version = None
                delay = min(max(delay * 2, 0.5), RETRY_CAP_SECONDS)
                problem = diagnose(self.kind, verb, self.namespace, exc)
                self._failed(problem)
                if self.optional and problem.blocks:
                    self._absent()
                    # Absent, it costs no request until its CRD serves it; then the backoff
                    # covers an API server that serves the CRD a moment before the kind.
                    if not (problem.not_served and self.until_served is not None
                            and await self.until_served()):  # fmt: skip
                        delay = OPTIONAL_RETRY_SECONDS

    def _absent(self) -> None:
        # What was cached is gone with the kind (a deleted CRD takes its objects along).
        for obj in self.cache.replace(self.kind, [], self.namespace, self.cache.writes):
            self.on_change(obj)
        if not self.synced.is_set():
            self.synced.set()
            self.on_health()

    @property
    def refused(self) -> WatchProblem | None:
        """The problem, when it is a 404 or 403 that has lasted REFUSED_AFTER_SECONDS."""
        problem = self.problem
        if problem is None or not problem.blocks or self.optional:
            return None
        if time.monotonic() - self._problem_since < REFUSED_AFTER_SECONDS:
            return None
        return problem

    def _listed(self) -> None:
        self._recovered("listed again")
        self.synced.set()
        self.on_health()

    def _recovered(self, how: str) -> None:
        if self.problem is not None:
            log.info("%r: %s; the cause is gone (%s)", self, how, self.problem.message)
            self.problem = None
            self.on_health()

    async def _watch_reporting(self, rv: str) -> None:
        # The stream says nothing until an event or a bookmark (about a minute): a watch that
        # has stayed open WATCH_WORKS_SECONDS is the proof that a watch's problem is gone.
        task = asyncio.ensure_future(self._watch(rv))
        try:
            done, _ = await asyncio.wait({task}, timeout=WATCH_WORKS_SECONDS)
            if not done:
                self._recovered("watching again")
            await task  # it saves where it got to, event by event
        finally:
            task.cancel()  # only when this coroutine is cancelled: the stream goes with it
        self._recovered("watched")

    def _failed(self, problem: WatchProblem) -> None:
        self.failures[problem.reason] += 1
        if problem.not_served:
            # The next attempt is a LIST: its success proves the kind served again, and it
            # reports whatever vanished meanwhile (a deleted CRD takes its objects with it).
            # A 403 retries what was refused: relisting after a refused watch would succeed
            # and clear the problem each time, and the refusal would never count.
            self.resource_version = None
        # Once per cause, not at every retry: a missing kind would log a line every 4 s for
        # ever. A cause is told again only when it came back after it was gone.
        if self.problem is None or self.problem.cause != problem.cause:
            self.problem = problem
            self._problem_since, self._refusal_told = time.monotonic(), False
            level = logging.INFO if self.optional else logging.WARNING  # Kueue is no must
            cap = OPTIONAL_RETRY_SECONDS if self.optional else RETRY_CAP_SECONDS
            log.log(level, "%r: %s; retrying every %.0fs at most (logged again when the cause "
                    "changes)", self, problem.message, cap)  # fmt: skip
            self.on_health()
        if not self._refusal_told and self.refused is not None:
            self._refusal_told = True  # the retry that finds it lasting says so, once
            self.on_health()

    async def _relist(self) -> str:
        since = self.cache.writes  # what we write from here on may be missing from the LIST
        items: list[Obj] = []
        cont: str | None = None
        while True:
            page = await self.api.list_page(self.kind, self.namespace, self.selector,
                                            self.page_size, cont, fields=self.fields)  # fmt: skip
            self.pages += 1
            # Slimmed page by page: a relist holds at most one page as the API sent it (pod
            # templates, managedFields), never the whole unslimmed list.
            items += [slim(self.kind, raw) for raw in page.get("items") or []]
            meta = page.get("metadata") or {}
            cont = meta.get("continue")
            del page
            if not cont:
                break
        self.lists += 1
        for obj in self.cache.replace(self.kind, items, self.namespace, since, slimmed=True):
            self.on_change(obj)
        return str(meta.get("resourceVersion") or "")

    async def _watch(self, rv: str) -> None:
        self.watches += 1
        timeout = random.randint(*self.watch_seconds)
        async for event in self.api.watch(self.kind, self.namespace, self.selector, rv, timeout,
                                          fields=self.fields):  # fmt: skip
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise Gone(obj.get("message"))
                raise ApiException(status=obj.get("code") or 0, reason=obj.get("message"))
            if kind != "BOOKMARK":
                self.events += 1
                if kind == "DELETED":
                    gone = self.cache.remove(self.kind, obj)
                    if gone is not None:
                        self.on_change(gone)
                elif self.cache.upsert(self.kind, obj):
                    self.on_change(obj)
            # Saved per event, not when the stream ends: a stream that breaks resumes here.
            at = (obj.get("metadata") or {}).get("resourceVersion")
            self.resource_version = str(at) if at else self.resource_version
