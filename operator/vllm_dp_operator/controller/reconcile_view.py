"""One reconcile's view of the Kube seam: counts its creates and deletes, checks before one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from vllm_dp_operator.controller.kube import Kind, Kube

Obj = dict[str, Any]


class CountingKube:
    """One reconcile's view of a Kube: passes every call on, counts its creates and deletes.

    Per reconcile, not shared: with several workers, a shared counter would move with the
    other workers' writes too. `before_create`, when given, runs once, before the first
    create (the controller checks there that the owner still exists).
    """

    def __init__(self, kube: Kube,
                 before_create: Callable[[], Awaitable[None]] | None = None) -> None:  # fmt: skip
        self._kube = kube
        self._before_create = before_create
        self.creates_and_deletes = 0

    async def list(self, kind: Kind, namespace: str, selector: str) -> list[Obj]:
        """Objects of a kind in a namespace matching a label selector."""
        return await self._kube.list(kind, namespace, selector)

    async def get(self, kind: Kind, namespace: str, name: str) -> Obj | None:
        """One object, or None when it does not exist."""
        return await self._kube.get(kind, namespace, name)

    async def create(self, kind: Kind, namespace: str, body: Obj) -> Obj:
        """Create an object; raise AlreadyExists on 409."""
        if self._before_create is not None:
            check, self._before_create = self._before_create, None
            await check()
        obj = await self._kube.create(kind, namespace, body)
        self.creates_and_deletes += 1
        return obj

    async def patch(self, kind: Kind, namespace: str, name: str, body: Obj) -> Obj:
        """JSON merge-patch an object."""
        return await self._kube.patch(kind, namespace, name, body)

    async def delete(self, kind: Kind, namespace: str, name: str) -> None:
        """Delete an object in the background; a missing object is not an error."""
        await self._kube.delete(kind, namespace, name)
        self.creates_and_deletes += 1
