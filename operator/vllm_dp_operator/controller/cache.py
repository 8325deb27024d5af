"""The in-memory cache of watched objects, and the cache-backed Kube the reconcile reads.

The reflectors (`informer.py`) fill one `ObjectCache`; `CachedKube` answers the reconcile's
`list` and `get` from it, so a reconcile makes no read calls, and passes writes through to
the API, storing each answer, so the next reconcile sees its own writes before the watch
echoes them. Objects are slimmed on the way in (no managedFields, no pod templates): what the
reconcile and status read stays, the rest would only cost memory.

resourceVersions are opaque (the API promises no order), so the cache never compares two of
them except for equality. What it uses instead: a watch delivers one object's versions in
order, so while an answer to our own write waits for its echo, the events before the echo are
older than it. A relist keeps what we wrote after its LIST began: the LIST cannot hold it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from vllm_dp_operator import constants as c
from vllm_dp_operator.controller.kube import (
    CRD,
    ENDPOINTSLICE,
    PDB,
    POD,
    RAYCLUSTER,
    RAYJOB,
    SERVICE,
    VDP,
    WORKLOAD,
    Kind,
    Kube,
)
from vllm_dp_operator.reconcile.status import rfc3339

Obj = dict[str, Any]
#: Every child the operator makes carries this label; watches select on it server-side.
MANAGED_SELECTOR = f"{c.LABEL_MANAGED_BY}={c.MANAGER}"
#: Labels the cache indexes, so a selector on one of them reads one bucket, not a namespace.
#: Every selector a reconcile makes is on one of them: the Service's name is how routing
#: finds slices of other managers (unindexed, every reconcile sorted every cached slice), and
#: Kueue's job uid finds a queued cluster's Workload.
INDEXED_LABELS = (c.LABEL_INSTANCE, c.LABEL_RAY_CLUSTER, c.LABEL_SERVICE_NAME,
                  c.LABEL_KUEUE_JOB_UID)  # fmt: skip
_META_KEPT = ("name", "namespace", "uid", "resourceVersion", "generation", "labels",
              "ownerReferences", "deletionTimestamp", "creationTimestamp")  # fmt: skip
_DROPPED_ANNOTATIONS = ("kubectl.kubernetes.io/last-applied-configuration",)
#: Strings up to this long are interned as the cache stores them: keys, label values, reasons,
#: timestamps, uids (an owner's uid is in each child's owner reference) repeat across objects.
INTERN_MAX = 64
#: Versions remembered per object for a write's late answer (its echo is at most a few back).
RECENT_VERSIONS = 4


def _meta(obj: Obj) -> Obj:
    meta = obj.get("metadata") or {}
    out = {k: meta[k] for k in _META_KEPT if k in meta}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items()
                   if k not in _DROPPED_ANNOTATIONS}  # fmt: skip
    if annotations:
        out["annotations"] = annotations
    return out


def _slim_cluster(obj: Obj) -> Obj:
    spec = obj.get("spec") or {}
    groups = [{k: g[k] for k in ("groupName", "replicas", "minReplicas", "maxReplicas") if k in g}
              for g in spec.get("workerGroupSpecs") or []]  # fmt: skip
    # authOptions: its Secret says which key made the cluster's token (engines/ray_auth.py).
    kept = {k: spec[k] for k in ("suspend", "rayVersion", "authOptions") if k in spec}
    return {"spec": {**kept, "workerGroupSpecs": groups}, "status": obj.get("status") or {}}


def _slim_job(obj: Obj) -> Obj:
    spec = {k: v for k, v in (obj.get("spec") or {}).items()
            if k not in ("submitterPodTemplate", "rayClusterSpec")}  # fmt: skip
    return {"spec": spec, "status": obj.get("status") or {}}


def _slim_pod(obj: Obj) -> Obj:
    spec = obj.get("spec") or {}
    return {"spec": {"nodeName": spec["nodeName"]} if spec.get("nodeName") else {},
            "status": obj.get("status") or {}}  # fmt: skip


def _slim_workload(obj: Obj) -> Obj:
    # Its conditions say why Kueue holds a cluster; its pod sets (whole templates) say nothing.
    status = obj.get("status") or {}
    return {"spec": {}, "status": {"conditions": status.get("conditions") or []}}


def _slim_slice(obj: Obj) -> Obj:
    # An EndpointSlice has no spec or status: its body is these top-level fields.
    return {k: obj[k] for k in ("addressType", "endpoints", "ports") if k in obj}


def _slim_crd(obj: Obj) -> Obj:
    # Which versions it serves, and whether it is Established: not its (large) schema.
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    return {"spec": {"versions": [{"name": v.get("name"), "served": v.get("served")}
                                  for v in spec.get("versions") or []]},
            "status": {"conditions": status.get("conditions") or []}}  # fmt: skip


def _slim_spec(obj: Obj) -> Obj:
    # A PodDisruptionBudget's status is the disruption controller's running count.
    return {"spec": obj.get("spec") or {}}


def _slim_whole(obj: Obj) -> Obj:
    return {"spec": obj.get("spec") or {}, "status": obj.get("status") or {}}


_SLIM: dict[Kind, Callable[[Obj], Obj]] = {
    RAYCLUSTER: _slim_cluster, RAYJOB: _slim_job, POD: _slim_pod,
    SERVICE: _slim_whole, VDP: _slim_whole, WORKLOAD: _slim_workload,
    ENDPOINTSLICE: _slim_slice, CRD: _slim_crd, PDB: _slim_spec,
}  # fmt: skip


def compact(value: Any, seen: dict[str, str] | None = None) -> Any:
    """A copy of JSON-shaped data whose keys and short strings are interned.

    A JSON parse makes new strings for every document: at 10,000 resources the same keys
    ("metadata", "app.kubernetes.io/instance", "lastTransitionTime") and values ("True",
    reasons, label values) were held tens of thousands of times over, the largest part of the
    cache. Interned, each is held once; the values compare equal, so no reader can tell.
    A longer string is held once per object (`seen`): a resource's status repeats one message
    in `message` and in several conditions.
    """
    if seen is None:
        seen = {}
    if isinstance(value, dict):
        return {sys.intern(k) if type(k) is str else k: compact(v, seen)
                for k, v in value.items()}  # fmt: skip
    if isinstance(value, list):
        return [compact(v, seen) for v in value]
    if type(value) is str:
        return sys.intern(value) if len(value) <= INTERN_MAX else seen.setdefault(value, value)
    return value


def slim(kind: Kind, obj: Obj) -> Obj:
    """The parts of an object the operator reads, as a compact copy (`compact`): no
    managedFields, no pod templates, and nothing shared with the body it came from."""
    body = _SLIM.get(kind, _slim_whole)(obj)
    head: Obj = {k: obj[k] for k in ("apiVersion", "kind") if k in obj}
    slimmed: Obj = compact({**head, "metadata": _meta(obj), **body})
    return slimmed


def json_copy(value: Any) -> Any:
    """A deep copy of JSON-shaped data (dicts, lists, scalars), several times faster than
    copy.deepcopy, which spent most of a reconcile's CPU on copying cached objects."""
    if isinstance(value, dict):
        return {k: json_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_copy(v) for v in value]
    return value


def parse_selector(selector: str) -> dict[str, str] | None:
    """An equality-only label selector as a dict; None for anything else (sets, !=, exists)."""
    terms: dict[str, str] = {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, sep, value = term.partition("=")
        if not sep or key.endswith("!") or value.startswith("=") or " " in key:
            return None
        terms[key] = value
    return terms


def _rv(obj: Obj) -> str | None:
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return str(rv) if rv else None


def _key(obj: Obj) -> tuple[str, str]:
    meta = obj["metadata"]
    return (meta.get("namespace") or "", meta["name"])


def _moved_on(event: Obj, held: Obj) -> bool:
    """Whether a watch event is news past the write answer the cache holds: a newer spec
    (generation is a counter, unlike resourceVersion) or a deletion our answer predates.

    kopf hands on only the last of a quick run of events, so the echo of our write may never
    come; a user's edit after it must still land.
    """
    new_meta, old_meta = event["metadata"], held["metadata"]
    gen_new, gen_old = new_meta.get("generation"), old_meta.get("generation")
    if isinstance(gen_new, int) and isinstance(gen_old, int) and gen_new > gen_old:
        return True
    return bool(new_meta.get("deletionTimestamp")) and not old_meta.get("deletionTimestamp")


def controller_uid(obj: Obj) -> str | None:
    """The uid in an object's controller owner reference, or None when it has none."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid") or "") or None
    return None


def owner_key(obj: Obj) -> tuple[str, str] | None:
    """(namespace, VLLMDataParallel name) an object belongs to, by its instance label."""
    meta = obj.get("metadata") or {}
    instance = (meta.get("labels") or {}).get(c.LABEL_INSTANCE)
    return (meta.get("namespace") or "", instance) if instance else None


class ObjectCache:
    """Slimmed objects of the watched kinds by (namespace, name), indexed by label."""

    def __init__(self, kinds: Iterable[Kind]) -> None:
        self._objects: dict[Kind, dict[tuple[str, str], Obj]] = {k: {} for k in kinds}
        #: Names per (namespace, label, value). Tuples, not sets: a bucket holds one name
        #: (two during a shape change), and an empty set alone costs four times a 1-tuple.
        self._index: dict[Kind, dict[tuple[str, str, str], tuple[str, ...]]] = {
            k: {} for k in self._objects
        }
        #: Answers to our own writes the watch has not echoed yet: key -> (version, write no.).
        self._held: dict[Kind, dict[tuple[str, str], tuple[str | None, int]]] = {
            k: {} for k in self._objects
        }
        #: The last few versions the watch delivered per object: a write's answer that comes
        #: after its own echo (two connections, no order between them) is no news then.
        self._recent: dict[Kind, dict[tuple[str, str], tuple[str, ...]]] = {
            k: {} for k in self._objects
        }
        #: The last event set aside while a write of ours waited for its echo (`upsert`): if
        #: that echo never comes, it may be newer than the answer the cache holds (`wrote`).
        self._parked: dict[Kind, dict[tuple[str, str], Obj]] = {k: {} for k in self._objects}
        self._writes = 0

    def holds(self, kind: Kind) -> bool:
        """Whether this kind is cached (others go to the API)."""
        return kind in self._objects

    def count(self, kind: Kind) -> int:
        """How many objects of a kind are cached."""
        return len(self._objects[kind])

    def items(self, kind: Kind) -> list[tuple[tuple[str, str], Obj]]:
        """Every cached object of a kind by key, not copies: read them, never change them."""
        return list(self._objects[kind].items())

    def peek(self, kind: Kind, namespace: str, name: str) -> Obj | None:
        """The cached object itself, not a copy: read it, never change it."""
        return self._objects[kind].get((namespace, name))

    def get(self, kind: Kind, namespace: str, name: str) -> Obj | None:
        """A copy of one cached object, or None."""
        obj = self.peek(kind, namespace, name)
        return json_copy(obj) if obj is not None else None

    def select(self, kind: Kind, namespace: str, terms: dict[str, str]) -> list[Obj]:
        """Copies of the objects of a kind in a namespace whose labels match every term."""
        objects = self._objects[kind]
        indexed = next((k for k in INDEXED_LABELS if k in terms), None)
        if indexed is not None:
            names = self._index[kind].get((namespace, indexed, terms[indexed]), ())
            candidates = [objects[(namespace, n)] for n in sorted(names)]
        else:
            candidates = [o for (ns, _), o in sorted(objects.items()) if ns == namespace]
        return [
            json_copy(o) for o in candidates
            if all((o["metadata"].get("labels") or {}).get(k) == v for k, v in terms.items())
        ]  # fmt: skip

    def _index_update(self, kind: Kind, obj: Obj, add: bool) -> None:
        meta = obj["metadata"]
        labels = meta.get("labels") or {}
        for key in INDEXED_LABELS:
            if key not in labels:
                continue
            slot = (meta.get("namespace") or "", key, labels[key])
            names = self._index[kind].get(slot, ())
            if add:
                if meta["name"] not in names:
                    self._index[kind][slot] = (*names, meta["name"])
                continue
            left = tuple(n for n in names if n != meta["name"])
            if left:
                self._index[kind][slot] = left
            else:
                self._index[kind].pop(slot, None)

    @property
    def writes(self) -> int:
        """How many write answers were stored so far; a relist notes it before its LIST."""
        return self._writes

    def _put(self, kind: Kind, key: tuple[str, str], obj: Obj) -> None:
        old = self._objects[kind].get(key)
        if old is not None:
            self._index_update(kind, old, add=False)
        self._objects[kind][key] = obj
        self._index_update(kind, obj, add=True)

    def wrote(self, kind: Kind, raw: Obj) -> None:
        """Store the API's answer to our own write, held until the watch echoes its version."""
        obj = slim(kind, raw)
        key = _key(obj)
        self._writes += 1
        rv, recent = _rv(obj), self._recent[kind].get(key, ())
        if rv not in recent:
            self._put(kind, key, obj)
            self._held[kind][key] = (rv, self._writes)
            return
        # The watch was here first, with this version (two connections, no order between
        # them). No news if the cache holds it or a version the watch delivered after it.
        since = recent[recent.index(rv):]
        old = self._objects[kind].get(key)
        if old is not None and _rv(old) in since:
            return
        # The cache holds an earlier answer of ours, and set this very version aside as older
        # than it: kopf hands on only the last of a quick run of events, so that answer's echo
        # never came. Left so, the cache would keep the older status for good (a status patch
        # that changes nothing has no new version, and no event follows it), and every wake
        # would patch the same status again. Take the newest the watch delivered.
        parked = self._parked[kind].pop(key, None)
        newest = parked if parked is not None and _rv(parked) in since[1:] else obj
        self._held[kind].pop(key, None)
        self._put(kind, key, newest)

    def _saw(self, kind: Kind, key: tuple[str, str], obj: Obj) -> None:
        rv = _rv(obj)
        if rv is not None:
            self._recent[kind][key] = (*self._recent[kind].get(key, ()), rv)[-RECENT_VERSIONS:]

    def upsert(self, kind: Kind, raw: Obj) -> bool:
        """Store a watch event's object; False when it is no news.

        No news: the version the cache holds (so the watch's echo of the operator's own
        write, stored from the write's answer, wakes nobody), or a version from before a
        write of ours whose echo has not come yet.
        """
        obj = slim(kind, raw)
        key = _key(obj)
        self._saw(kind, key, obj)
        old = self._objects[kind].get(key)
        held = self._held[kind].get(key)
        if old is not None and old["metadata"].get("uid") == obj["metadata"].get("uid"):
            if held is not None:
                if _rv(obj) == held[0]:
                    del self._held[kind][key]
                    self._parked[kind].pop(key, None)  # what was set aside came before it
                    return False
                if not _moved_on(obj, old):
                    self._parked[kind][key] = obj
                    return False
            elif _rv(obj) is not None and _rv(obj) == _rv(old):
                return False
        self._held[kind].pop(key, None)
        self._parked[kind].pop(key, None)
        self._put(kind, key, obj)
        return True

    def remove(self, kind: Kind, raw: Obj) -> Obj | None:
        """Drop an object that was deleted; keep a same-name object of another uid."""
        meta = raw.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        old = self._objects[kind].get(key)
        if old is None:
            return None
        uid = meta.get("uid")
        if uid and old["metadata"].get("uid") and old["metadata"]["uid"] != uid:
            return None
        del self._objects[kind][key]
        self._held[kind].pop(key, None)
        self._recent[kind].pop(key, None)
        self._parked[kind].pop(key, None)
        self._index_update(kind, old, add=False)
        return old

    def mark_deleting(self, kind: Kind, namespace: str, name: str) -> None:
        """Note a delete we sent, so reconciles skip the object until the watch confirms it."""
        obj = self._objects[kind].get((namespace, name))
        if obj is not None and not obj["metadata"].get("deletionTimestamp"):
            obj["metadata"]["deletionTimestamp"] = rfc3339(datetime.now(UTC))

    def replace(self, kind: Kind, raws: Iterable[Obj], namespace: str | None,
                since: int = 0, slimmed: bool = False) -> list[Obj]:  # fmt: skip
        """Swap in a fresh LIST's objects; return those added, changed or gone (to wake owners).

        Like client-go's DeltaFIFO.Replace: objects missing from the new list were deleted
        while no watch ran (after a 410), and their owners must hear about it. But an answer
        to a write of ours stored after the LIST began (`since`, this cache's `writes` then)
        is newer than the list, or missing from it: it stays, held for the watch to echo.
        `slimmed`: the objects were slimmed already (a reflector slims each page as it comes).
        """
        fresh: dict[tuple[str, str], Obj] = {}
        for raw in raws:
            obj = raw if slimmed else slim(kind, raw)
            fresh[_key(obj)] = obj
        touched: list[Obj] = []
        objects, held = self._objects[kind], self._held[kind]
        for key, old in list(objects.items()):
            if namespace and key[0] != namespace:
                continue
            new = fresh.get(key)
            ours = held.get(key)
            self._parked[kind].pop(key, None)  # from the watch before the LIST: not newer
            if ours is not None and ours[1] > since:
                if new is not None and _rv(new) == ours[0]:
                    del held[key]  # the list holds our write: the watch will not echo it
                fresh.pop(key, None)
                continue
            held.pop(key, None)  # written before the LIST began: the list is as new
            self._recent[kind].pop(key, None)
            if new is None or new["metadata"].get("uid") != old["metadata"].get("uid"):
                del objects[key]
                self._index_update(kind, old, add=False)
                touched.append(old)
        for key, obj in fresh.items():
            prior = objects.get(key)
            if prior is not None and _rv(prior) == _rv(obj):
                continue
            self._put(kind, key, obj)
            touched.append(obj)
        return touched


class CachedKube:
    """Kube whose reads of cached kinds come from the cache; writes go to the API.

    A selector the cache cannot answer (not equality-only) or an uncached kind falls
    through to the API; `api_reads` counts those, and tests pin it at zero.
    """

    def __init__(self, api: Kube, cache: ObjectCache) -> None:
        self._api = api
        self._cache = cache
        self.api_reads = 0

    async def list(self, kind: Kind, namespace: str, selector: str) -> list[Obj]:
        """Objects of a kind in a namespace matching a label selector."""
        terms = parse_selector(selector)
        if self._cache.holds(kind) and terms is not None:
            return self._cache.select(kind, namespace, terms)
        self.api_reads += 1
        return await self._api.list(kind, namespace, selector)

    async def get(self, kind: Kind, namespace: str, name: str) -> Obj | None:
        """One object, or None when it does not exist."""
        if self._cache.holds(kind):
            return self._cache.get(kind, namespace, name)
        self.api_reads += 1
        return await self._api.get(kind, namespace, name)

    async def create(self, kind: Kind, namespace: str, body: Obj) -> Obj:
        """Create an object; raise AlreadyExists on 409."""
        obj = await self._api.create(kind, namespace, body)
        if self._cache.holds(kind):
            self._cache.wrote(kind, obj)
        return obj

    async def patch(self, kind: Kind, namespace: str, name: str, body: Obj) -> Obj:
        """JSON merge-patch an object."""
        obj = await self._api.patch(kind, namespace, name, body)
        if self._cache.holds(kind):
            self._cache.wrote(kind, obj)
        return obj

    async def delete(self, kind: Kind, namespace: str, name: str) -> None:
        """Delete an object in the background; a missing object is not an error."""
        await self._api.delete(kind, namespace, name)
        if self._cache.holds(kind):
            self._cache.mark_deleting(kind, namespace, name)
