"""Test double for the API the controller needs: FakeKube plus resourceVersions and watches.

Every write bumps one resourceVersion counter and appends an event to a log (a status patch
that changes nothing writes nothing, as on the API server); a watch replays
the log from the resourceVersion it is given, then follows new events, like the API server's
watch cache. `compact()` forgets the log, so older resourceVersions answer 410 Gone, and
`end_watches()` ends every open stream, as the server does at a watch's timeout.
"""

from __future__ import annotations

import asyncio
import copy
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from fake_kube import FakeKube, _matches
from kubernetes_asyncio.client.exceptions import ApiException
from vllm_dp_operator.controller.kube import Kind


def _named(obj: dict[str, Any], fields: str) -> bool:
    """The one field selector the operator sends: `metadata.name=<name>` (or none)."""
    if not fields:
        return True
    key, _, value = fields.partition("=")
    assert key == "metadata.name", f"field selector {fields!r} is not one this double knows"
    return bool(obj["metadata"].get("name") == value)


class FakeApi(FakeKube):
    """FakeKube with resourceVersions, paginated lists, watches and status patches."""

    def __init__(self) -> None:
        super().__init__(clock=lambda: datetime.now(UTC))  # the controller runs on real time
        self.rv = 0
        self.oldest = 0
        self.log: list[tuple[int, Kind, str, dict[str, Any]]] = []
        self.streams: Counter[Kind] = Counter()
        self._changed = asyncio.Event()
        self._epoch = 0
        #: Seconds each write takes, as a real API server's round trip would.
        self.latency = 0.0

    def _emit(self, kind: Kind, type_: str, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.log.append((self.rv, kind, type_, copy.deepcopy(obj)))
        self._changed.set()
        self._changed = asyncio.Event()

    def put(self, kind: Kind, body: dict[str, Any], namespace: str = "default") -> None:
        """Play a user or a controller: store an object as if created, with an ADDED event."""
        obj = copy.deepcopy(body)
        obj["metadata"].setdefault("namespace", namespace)
        obj["metadata"].setdefault("uid", f"uid-{obj['metadata']['name']}")
        self.objects[(kind, namespace, obj["metadata"]["name"])] = obj
        self._emit(kind, "ADDED", obj)

    def set_status(self, kind: Kind, namespace: str, name: str, status: dict[str, Any]) -> None:
        super().set_status(kind, namespace, name, status)
        self._emit(kind, "MODIFIED", self.objects[(kind, namespace, name)])

    def compact(self) -> None:
        """Forget the event log: watches from an older resourceVersion get 410 Gone."""
        self.log.clear()
        self.oldest = self.rv

    def end_watches(self) -> None:
        """End every open watch stream, as the server does at its timeout."""
        self._epoch += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def create(self, kind: Kind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(self.latency)  # a real call yields to other tasks while it waits
        if "name" not in body["metadata"]:  # generateName, as Events use
            body = copy.deepcopy(body)
            body["metadata"]["name"] = f"{body['metadata']['generateName']}{self.rv + 1}"
        await super().create(kind, namespace, body)
        obj = self.objects[(kind, namespace, body["metadata"]["name"])]
        obj["metadata"].setdefault("namespace", namespace)
        self._emit(kind, "ADDED", obj)
        return copy.deepcopy(obj)

    async def patch(
        self, kind: Kind, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        await asyncio.sleep(self.latency)
        await super().patch(kind, namespace, name, body)
        obj = self.objects[(kind, namespace, name)]
        self._emit(kind, "MODIFIED", obj)
        return copy.deepcopy(obj)

    async def delete(self, kind: Kind, namespace: str, name: str) -> None:
        obj = self.objects.get((kind, namespace, name))
        await super().delete(kind, namespace, name)
        if obj is not None:
            self._emit(kind, "DELETED", obj)

    async def patch_status(
        self, kind: Kind, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any]:
        self.calls["patch_status"] += 1
        await asyncio.sleep(self.latency)
        obj = self.objects.get((kind, namespace, name))
        if obj is None:
            raise ApiException(status=404, reason="Not Found")
        merged = {**(obj.get("status") or {}), **status}
        merged = {k: v for k, v in merged.items() if v is not None}
        if merged == (obj.get("status") or {}):
            # As the API server: a patch that changes nothing writes nothing, so it has no new
            # resourceVersion and no watch event.
            return copy.deepcopy(obj)
        obj["status"] = merged
        self._emit(kind, "MODIFIED", obj)
        return copy.deepcopy(obj)

    async def list_page(
        self, kind: Kind, namespace: str | None, selector: str, limit: int, cont: str | None,
        fields: str = "",
    ) -> dict[str, Any]:  # fmt: skip
        self.calls["list_page"] += 1
        found = [copy.deepcopy(o) for (k, ns, _), o in sorted(self.objects.items(),
                                                              key=lambda kv: kv[0][1:])
                 if k == kind and (namespace in (None, ns)) and _matches(o, selector)
                 and _named(o, fields)]  # fmt: skip
        start = int(cont or 0)
        page = found[start : start + limit]
        more = start + limit < len(found)
        meta = {"resourceVersion": str(self.rv), "continue": str(start + limit) if more else ""}
        return {"items": page, "metadata": meta}

    async def watch(
        self, kind: Kind, namespace: str | None, selector: str, resource_version: str,
        timeout_seconds: int, fields: str = "",
    ) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
        self.calls["watch"] += 1
        since = int(resource_version or 0)
        if since < self.oldest:
            yield {"type": "ERROR", "object": {"code": 410, "message": "too old"}}
            return
        epoch = self._epoch
        self.streams[kind] += 1
        try:
            while epoch == self._epoch:
                for rv, k, type_, obj in list(self.log):
                    if rv <= since or k != kind:
                        continue
                    since = rv
                    if namespace in (None, obj["metadata"].get("namespace")) and _matches(
                        obj, selector
                    ) and _named(obj, fields):
                        yield {"type": type_, "object": copy.deepcopy(obj)}
                await self._changed.wait()
        finally:
            self.streams[kind] -= 1
