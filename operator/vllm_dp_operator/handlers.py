"""kopf wiring: each handler delegates to the one reconcile and applies its outcome."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import kopf

from vllm_dp_operator import constants
from vllm_dp_operator.config import Config
from vllm_dp_operator.kube import ApiKube, NamespaceTerminating
from vllm_dp_operator.probe import TransportProbe
from vllm_dp_operator.ray_dashboard import DashboardJobs
from vllm_dp_operator.reconcile import Outcome, Resource, reconcile
from vllm_dp_operator.transport import make_transport

CONFIG = Config.from_env()
RESOURCE = (constants.GROUP, constants.VERSION, constants.PLURAL)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Connect once; keep kopf's bookkeeping in our own annotations, not in status."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=constants.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=constants.GROUP, key="last-handled-configuration"
    )
    # kopf holds this finalizer while the resync timer runs, so the timer stops cleanly.
    settings.persistence.finalizer = f"{constants.GROUP}/finalizer"
    kube = await ApiKube.connect()
    memo.kube = kube
    memo.transport = make_transport(CONFIG.health_probe, kube.api, CONFIG.health_timeout_seconds)
    memo.probe = TransportProbe(memo.transport)
    memo.ray_jobs = DashboardJobs(memo.transport)
    memo.locks = {}


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Close the HTTP sessions and the API client."""
    await memo.transport.close()
    await memo.kube.close()


def _apply(outcome: Outcome, body: kopf.Body, patch: kopf.Patch) -> None:
    # Only changed keys are written, so a steady resource costs no writes per resync.
    current = body.get("status") or {}
    for key, value in outcome.status.items():
        if current.get(key) != value:
            patch.status[key] = value
    for event in outcome.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)


async def _run(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any) -> None:
    res = Resource.from_body(body)
    lock = memo.locks.setdefault(res.uid, asyncio.Lock())
    async with lock:  # the timer and change handlers never reconcile one object at once
        try:
            outcome = await reconcile(
                res, memo.kube, memo.probe, memo.ray_jobs, CONFIG, datetime.now(UTC)
            )
        except NamespaceTerminating:
            # Everything in the namespace goes with it, this resource too: nothing to do.
            logger.info("Namespace %s is being deleted; nothing to reconcile", res.namespace)
            return
    _apply(outcome, body, patch)


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
async def on_change(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any
) -> None:
    """Create, resume and spec changes: reconcile now."""
    await _run(body, patch, memo, logger)


# The first tick waits one interval: the change handlers already reconcile a new object.
# Time-based steps (backoff, the launch deadline, a stop's drain) are checked on every tick.
@kopf.timer(*RESOURCE, interval=CONFIG.resync_seconds, initial_delay=CONFIG.resync_seconds)
async def resync(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any
) -> None:
    """Level-triggered resync: children's progress is read on every tick."""
    await _run(body, patch, memo, logger)


@kopf.on.delete(*RESOURCE, optional=True)
async def on_delete(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Children go by owner references; only forget the per-object lock."""
    memo.locks.pop(body["metadata"]["uid"], None)
