"""Remove the finalizer that versions before the event-driven controller added.

kopf used to remove it (it removes a finalizer it is told of when no handler needs one), but a
write kopf makes on its own would bypass the Lease: every kopf process, standbys included,
would patch. So kopf is not told of it, and the leader removes it here, through the gated API.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from vllm_dp_operator import constants
from vllm_dp_operator.controller.kube import VDP, Kube
from vllm_dp_operator.controller.lease import NotLeading

log = logging.getLogger(__name__)

LEGACY_FINALIZER = f"{constants.GROUP}/finalizer"


class LegacyFinalizer:
    """Drops LEGACY_FINALIZER from resources, one patch per resource at a time."""

    def __init__(self, api: Kube) -> None:
        self._api = api
        self._busy: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def release(self, obj: dict[str, Any]) -> None:
        """Start removing the legacy finalizer if `obj` carries it."""
        meta = obj.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        if LEGACY_FINALIZER not in (meta.get("finalizers") or []) or key in self._busy:
            return
        self._busy.add(key)
        task = asyncio.create_task(self._remove(key, meta), name=f"legacy-finalizer-{key[1]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _remove(self, key: tuple[str, str], meta: dict[str, Any]) -> None:
        # The resourceVersion makes the patch conditional: finalizers another controller
        # added meanwhile are never dropped (a 409 waits for the next event).
        keep = [f for f in meta.get("finalizers") or [] if f != LEGACY_FINALIZER]
        body = {"metadata": {"finalizers": keep, "resourceVersion": meta.get("resourceVersion")}}
        try:
            await self._api.patch(VDP, key[0], key[1], body)
            log.info("Removed the legacy finalizer %s from %s/%s", LEGACY_FINALIZER, *key)
        except NotLeading:
            pass  # the leader does it
        except ApiException as exc:
            if exc.status not in (404, 409):
                log.warning("Could not remove the legacy finalizer from %s/%s: HTTP %s", *key,
                            exc.status)  # fmt: skip
        finally:
            self._busy.discard(key)

    async def stop(self) -> None:
        """Cancel removals in flight."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
