"""Wait, before kopf scans the API, until the API server serves this operator its own kind.

kopf resolves the resources it watches once, at its start: discovery (`/api`, `/apis`), then
the kinds found there. An operator that starts while the API server is itself starting (it
lost its Lease while the API server was down, exited as designed, and the kubelet started it
again) can meet an API server that answers but has not loaded its RBAC roles yet: discovery
is refused (403, `clusterrole "system:public-info-viewer" not found`), kopf logs that
`vllmdataparallels` cannot be served and never watches them, and the operator reconciles
nothing for good while its liveness probe passes. Waiting here, in a startup activity (kopf
scans only after those), until a LIST of the kind itself answers makes that window harmless.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from vllm_dp_operator.controller.informer import WatchApi
from vllm_dp_operator.controller.kube import VDP
from vllm_dp_operator.controller.watch_health import diagnose

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0


async def wait_until_served(
    api: WatchApi,
    namespaces: Sequence[str] = (),
    retry: float = RETRY_SECONDS,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> int:
    """Return once a LIST of our kind answers (in each watched namespace, or in all); say each
    new cause of a refusal once. Returns the number of tries.

    The LIST is the test for discovery too: the API server loads every RBAC role at once
    (its bootstrap roles, which discovery needs, and the chart's), so the chart's role being
    loaded means the bootstrap ones are.
    """
    tries, said = 0, None
    scopes: Sequence[str | None] = tuple(namespaces) or (None,)
    while True:
        tries += 1
        try:
            for ns in scopes:
                await api.list_page(VDP, ns, "", 1, None)
        except Exception as exc:  # any refusal or connection error: the API is not there yet
            problem = diagnose(VDP, "list", ns, exc)
            if problem.cause != said:
                log.warning("%s; asking again every %gs before watching %s", problem.message,
                            retry, VDP.plural)  # fmt: skip
                said = problem.cause
            await sleep(retry)
            continue
        if said is not None:
            log.info("The API server serves %s after %d tries; watching", VDP.plural, tries)
        return tries
