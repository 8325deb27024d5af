"""Wait, before kopf scans the API, until the API server serves this operator its own kind.

kopf resolves the resources it watches once, at its start: discovery (`/api`, `/apis`), then
the kinds found there. An operator that starts while the API server is itself starting (it
lost its Lease while the API server was down, exited as designed, and the kubelet started it
again) can meet an API server that answers but has not loaded its RBAC roles yet: discovery
is refused (403, `clusterrole "system:public-info-viewer" not found`), kopf logs that
`vllmdataparallels` cannot be served and never watches them, and the operator reconciles
nothing for good while its liveness probe passes. Waiting here, in a startup activity (kopf
scans only after those), until discovery and a LIST of the kind itself answer makes that
window harmless.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from vllm_dp_operator.controller.kube import VDP, Kind

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0


class ServedApi(Protocol):
    async def get_path(self, path: str) -> dict[str, Any]: ...

    async def list_page(
        self, kind: Kind, namespace: str | None, selector: str, limit: int, cont: str | None
    ) -> dict[str, Any]: ...


async def wait_until_served(
    api: ServedApi,
    namespaces: Sequence[str] = (),
    retry: float = RETRY_SECONDS,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> int:
    """Return once discovery and a LIST of our kind (in each watched namespace, or all)
    answer; say each new cause of a refusal once. Returns the number of tries."""
    tries, said = 0, None
    scopes: Sequence[str | None] = tuple(namespaces) or (None,)
    while True:
        tries += 1
        try:
            await api.get_path("/api")
            await api.get_path("/apis")
            for ns in scopes:
                await api.list_page(VDP, ns, "", 1, None)
        except Exception as exc:  # any refusal or connection error: the API is not there yet
            status, reason = getattr(exc, "status", ""), getattr(exc, "reason", exc)
            cause = f"{type(exc).__name__}: {status} {reason}"
            if cause != said:
                log.warning("The API server does not serve %s to this operator yet (%s); "
                            "asking again every %gs before watching", VDP.plural, cause.strip(),
                            retry)  # fmt: skip
                said = cause
            await sleep(retry)
            continue
        if said is not None:
            log.info("The API server serves %s after %d tries; watching", VDP.plural, tries)
        return tries
