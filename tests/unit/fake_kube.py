"""Test double for the Kube seam: an in-memory API server, no admission, no controllers.

It stands in for the real API server in pure unit tests of the reconcile only; the
controlplane tier runs the same reconcile against a real kube-apiserver and KubeRay.
"""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from vllm_dp_operator.controller.cache import slim
from vllm_dp_operator.controller.kube import AlreadyExists, Kind, NamespaceTerminating
from vllm_dp_operator.reconcile.status import rfc3339

_uids = itertools.count(1)


def _matches(obj: dict[str, Any], selector: str) -> bool:
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class FakeKube:
    """Implements the Kube protocol over a dict; counts every call by verb."""

    def __init__(self, clock: Callable[[], datetime] | None = None) -> None:
        self.objects: dict[tuple[Kind, str, str], dict[str, Any]] = {}
        self.calls: Counter[str] = Counter()
        #: Every write, in order: (verb, kind plural, name).
        self.writes: list[tuple[str, str, str]] = []
        self.clock = clock or (lambda: datetime(2026, 1, 1, tzinfo=UTC))
        #: Namespaces the API server treats as being deleted: creates there are refused.
        self.terminating: set[str] = set()
        #: Reads answer as the operator's cache does (controller/cache.py `slim`: no pod
        #: templates, no managedFields), so nothing can read what the cache drops.
        self.slimmed = False

    def named(self, kind: Kind, namespace: str = "default") -> list[dict[str, Any]]:
        """Every stored object of a kind, by name order."""
        return sorted(
            (o for (k, ns, _), o in self.objects.items() if k == kind and ns == namespace),
            key=lambda o: o["metadata"]["name"],
        )

    def set_status(self, kind: Kind, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Play a controller: write an object's status."""
        self.objects[(kind, namespace, name)]["status"] = copy.deepcopy(status)

    async def list(self, kind: Kind, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.calls["list"] += 1
        return [self._read(kind, o) for o in self.named(kind, namespace) if _matches(o, selector)]

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls["get"] += 1
        obj = self.objects.get((kind, namespace, name))
        return self._read(kind, obj) if obj else None

    def _read(self, kind: Kind, obj: dict[str, Any]) -> dict[str, Any]:
        return slim(kind, obj) if self.slimmed else copy.deepcopy(obj)

    async def create(self, kind: Kind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls["create"] += 1
        if namespace in self.terminating:
            raise NamespaceTerminating(namespace)
        key = (kind, namespace, body["metadata"]["name"])
        if key in self.objects:
            raise AlreadyExists(key[2])
        obj = copy.deepcopy(body)
        obj["metadata"]["uid"] = f"uid-{next(_uids)}"
        obj["metadata"]["creationTimestamp"] = rfc3339(self.clock())
        self.objects[key] = obj
        self.writes.append(("create", kind.plural, key[2]))
        return copy.deepcopy(obj)

    async def patch(
        self, kind: Kind, namespace: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        self.calls["patch"] += 1
        obj = self.objects[(kind, namespace, name)]
        _merge(obj, body)
        self.writes.append(("patch", kind.plural, name))
        return copy.deepcopy(obj)

    async def delete(self, kind: Kind, namespace: str, name: str) -> None:
        self.calls["delete"] += 1
        if self.objects.pop((kind, namespace, name), None) is not None:
            self.writes.append(("delete", kind.plural, name))
