"""kopf wiring: kopf watches VLLMDataParallel objects and hosts the controller.

kopf here only lists and watches the owner kind, runs startup and cleanup, and serves the
liveness endpoint. Its handler for the owner is a plain `on.event` that returns None,
so kopf writes nothing on its own: no finalizer, no last-handled-configuration annotation, no
progress annotations (a daemon, a timer or a changing handler would add each of those).
The reconcile runs in the controller's workers (`controller.py`), woken by watch events.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from vllm_dp_operator import constants
from vllm_dp_operator.config import Config
from vllm_dp_operator.controller.kube import ApiKube
from vllm_dp_operator.controller.manager import Controller
from vllm_dp_operator.engines.probe import TransportProbe
from vllm_dp_operator.engines.ray_dashboard import DashboardJobs
from vllm_dp_operator.engines.transport import make_transport
from vllm_dp_operator.observability.metrics_http import serve_metrics

CONFIG = Config.from_env()
RESOURCE = (constants.GROUP, constants.VERSION, constants.PLURAL)


class _NoDiffBase(kopf.AnnotationsDiffBaseStorage):
    """No changing handlers, so no diff base: skip kopf's deep copy of every event's body."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()


class _NoEventHandlerChatter(logging.Filter):
    """Drop kopf's INFO line after every owner event: one per event, at 1,000 resources noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO
                    and record.getMessage().startswith("Handler 'on_owner_event' succeeded"))


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Connect once, start the controller; keep kopf's bookkeeping out of the objects."""
    # Versions before the event-driven controller held this finalizer for their resync timer.
    # Naming it lets kopf remove it from such objects, as no handler needs it any more.
    settings.persistence.finalizer = f"{constants.GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=constants.GROUP)
    settings.persistence.diffbase_storage = _NoDiffBase(
        prefix=constants.GROUP, key="last-handled-configuration"
    )
    logging.getLogger("kopf.objects").addFilter(_NoEventHandlerChatter())
    kube = await ApiKube.connect()
    transport = make_transport(CONFIG.health_probe, kube.api, CONFIG.health_timeout_seconds,
                               CONFIG.cluster_domain)  # fmt: skip
    probe = TransportProbe(transport, CONFIG.engine_metrics_max_bytes)
    controller = Controller(kube, CONFIG, probe, DashboardJobs(transport),
                            namespace=CONFIG.watch_namespace or None)  # fmt: skip
    controller.start()
    memo.metrics_server = None
    if CONFIG.metrics_port:
        memo.metrics_server = await serve_metrics(
            controller.metrics.registry, CONFIG.metrics_host, CONFIG.metrics_port
        )
    memo.kube, memo.transport, memo.controller = kube, transport, controller


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Stop the controller, then close the HTTP sessions and the API client."""
    if memo.metrics_server is not None:
        await memo.metrics_server.cleanup()
    await memo.controller.stop()
    await memo.transport.close()
    await memo.kube.close()


@kopf.on.event(*RESOURCE)
async def on_owner_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """Hand every owner event to the controller; returning None makes kopf write nothing."""
    memo.controller.owner_event(event.get("type"), dict(event["object"]))


@kopf.on.probe(id="controller")
async def controller_health(memo: kopf.Memo, **_: Any) -> dict[str, Any]:
    """Liveness: fails when a reflector or worker task has died."""
    health: dict[str, Any] = memo.controller.health()
    return health
