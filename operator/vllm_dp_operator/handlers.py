"""kopf wiring: kopf watches VLLMDataParallel objects and hosts the controller.

kopf here only lists and watches the owner kind, runs startup and cleanup, and serves the
liveness endpoint. Its handler for the owner is a plain `on.event` that returns None,
so kopf writes nothing on its own: no finalizer, no last-handled-configuration annotation, no
progress annotations (a daemon, a timer or a changing handler would add each of those), no
Events (posting is off), and it is not told of the legacy finalizer (the leader removes it,
`controller/legacy_finalizer.py`). Every write the operator makes passes the Lease's gate
(`controller/gate.py`); kopf runs `--standalone`, as its peering is not what decides who
writes. The reconcile runs in the controller's workers (`controller/manager.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import uuid
from typing import Any

import kopf

from vllm_dp_operator import __version__, constants
from vllm_dp_operator.config import Config
from vllm_dp_operator.controller.api_ready import wait_until_served
from vllm_dp_operator.controller.fence import WriteGate
from vllm_dp_operator.controller.gate import OPEN, GatedApi, GatedRayJobs, GatedTransport
from vllm_dp_operator.controller.kube import VDP, ApiKube
from vllm_dp_operator.controller.lease import ApiLeases, ElectionConfig, LeaderElector
from vllm_dp_operator.controller.lease_thread import ElectionThread
from vllm_dp_operator.controller.legacy_finalizer import LegacyFinalizer
from vllm_dp_operator.controller.manager import Controller
from vllm_dp_operator.engines.probe import TransportProbe
from vllm_dp_operator.engines.ray_dashboard import DashboardJobs
from vllm_dp_operator.engines.transport import make_transport
from vllm_dp_operator.observability.metrics_auth import ApiClientReviews, MetricsAuth
from vllm_dp_operator.observability.metrics_http import serve_metrics
from vllm_dp_operator.observability.metrics_tls import ServingCert
from vllm_dp_operator.observability.readiness_http import serve_readiness

CONFIG = Config.from_env()
RESOURCE = (constants.GROUP, constants.VERSION, constants.PLURAL)
#: The pod's name plus a per-process suffix: a restarted container is a new holder, as in
#: client-go's hostname_uuid.
IDENTITY = f"{CONFIG.election.pod_name}_{uuid.uuid4().hex[:12]}"
log = logging.getLogger(__name__)


class _NoDiffBase(kopf.AnnotationsDiffBaseStorage):
    """No changing handlers, so no diff base: skip kopf's deep copy of every event's body."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()


class _NoEventHandlerChatter(logging.Filter):
    """Drop kopf's INFO line after every owner event: one per event, at 1,000 resources noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.INFO
                    and record.getMessage().startswith("Handler 'on_owner_event' succeeded"))


def _lost_lease() -> None:
    # Like controller-runtime's manager: exit, and let the restart make a clean standby. Its
    # caches, queue and pending status were built as the leader; dropping them all at once
    # is simpler to trust than handing each back. The gate already refuses every write.
    log.critical("Leader election lost; exiting")
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    os._exit(1)


def _lead(memo: kopf.Memo) -> None:
    memo.controller.lead()
    for _, obj in memo.controller.cache.items(VDP):
        memo.legacy.release(obj)


#: Owners per page of kopf's LIST of the resource kind (at start and after a 410), as our
#: reflectors page the children: kopf's default is one unpaginated LIST, which at 10,000
#: resources parsed every body at once (managedFields and all) and left its peak in the RSS.
OWNER_LIST_PAGE = 500
#: Seconds kopf's per-object worker waits for the next event before it exits (kopf's default
#: is 5). An idle worker still holds the object's last body as the API sent it: at a start
#: with 10,000 resources, 5 s of them at once was the RSS's peak, which Python keeps.
#: Our handler only hands the body over, so a new worker per event costs little.
OWNER_WORKER_IDLE_SECONDS = 0.5


def configure(settings: kopf.OperatorSettings) -> None:
    """kopf's settings: it writes nothing of its own, keeps no diff base, lists in pages and
    holds no body longer than it must."""
    # kopf's own writes would bypass the Lease: no Events from kopf, and kopf is not told of
    # the legacy finalizer (its default marker is on no object); the leader removes it.
    settings.posting.enabled = False
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=constants.GROUP)
    settings.persistence.diffbase_storage = _NoDiffBase(
        prefix=constants.GROUP, key="last-handled-configuration"
    )
    settings.watching.chunk_size = OWNER_LIST_PAGE
    settings.queueing.idle_timeout = OWNER_WORKER_IDLE_SECONDS


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Connect once, start the controller and the election; keep kopf from writing."""
    configure(settings)
    logging.getLogger("kopf.objects").addFilter(_NoEventHandlerChatter())
    kube = await ApiKube.connect(user_agent=f"vllm-dp-operator/{__version__} {IDENTITY}")
    # kopf resolves what it watches once, after this: not while RBAC is still loading.
    await wait_until_served(kube, CONFIG.watch_namespaces)
    transport = make_transport(CONFIG.health_probe, kube.api, CONFIG.health_timeout_seconds,
                               CONFIG.cluster_domain, CONFIG.proxy_qps)  # fmt: skip
    probe = TransportProbe(transport, CONFIG.engine_metrics_max_bytes)
    election = CONFIG.election
    elector: LeaderElector | None = None
    gate: WriteGate = OPEN
    if election.enabled:
        # Its own HTTP client, on its own thread (lease_thread.py): no reconcile delays it.
        leases = ApiLeases(user_agent=kube.api.user_agent)
        elector = LeaderElector(leases, ElectionConfig(
            namespace=election.lease_namespace, name=election.lease_name, identity=IDENTITY,
            lease_duration=election.lease_duration_seconds,
            renew_deadline=election.renew_deadline_seconds,
            retry_period=election.retry_period_seconds))  # fmt: skip
        gate = elector
    api = GatedApi(kube, gate)
    controller = Controller(api, CONFIG, probe, GatedRayJobs(DashboardJobs(transport), gate),
                            namespaces=CONFIG.watch_namespaces,
                            leading=elector is None, logs=kube.follow_log,
                            engine_calls=GatedTransport(transport, gate))  # fmt: skip
    memo.kube, memo.transport, memo.controller, memo.elector = kube, transport, controller, elector
    memo.legacy = LegacyFinalizer(api)
    controller.start()
    memo.election = None
    if elector is not None:
        log.info("Leader election on Lease %s/%s as %s", election.lease_namespace,
                 election.lease_name, IDENTITY)  # fmt: skip
        memo.election = ElectionThread(elector, close=leases.close)
        memo.election.start(on_started=lambda: _lead(memo), on_stopped=_lost_lease)
    memo.metrics_server = memo.cert_reload = None
    if CONFIG.metrics_port:
        # Reviews go straight to the API (not through the write gate): they store nothing,
        # and a standby's /metrics is as protected as the leader's.
        auth = (MetricsAuth(ApiClientReviews(kube.api), audiences=CONFIG.metrics_audiences)
                if CONFIG.metrics_auth == "kubernetes" else None)  # fmt: skip
        cert = None
        if CONFIG.metrics_tls_cert_file:
            cert = ServingCert(CONFIG.metrics_tls_cert_file, CONFIG.metrics_tls_key_file)
            memo.cert_reload = asyncio.create_task(cert.keep_fresh(), name="metrics-cert")
        memo.metrics_server = await serve_metrics(
            controller.metrics.registry, CONFIG.metrics_host, CONFIG.metrics_port, auth,
            counters=controller.counters, tls=cert.context if cert else None,
        )
    memo.readiness_server = None
    if CONFIG.readiness_port:
        checks = [("controller", controller.ready)]
        if elector is not None:
            checks.append(("lease", elector.healthy))
        memo.readiness_server = await serve_readiness(
            checks, CONFIG.readiness_host, CONFIG.readiness_port
        )


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """Stop the controller, release the Lease, then close the HTTP sessions and the client."""
    if memo.cert_reload is not None:
        memo.cert_reload.cancel()
    for server in (memo.metrics_server, memo.readiness_server):
        if server is not None:
            await server.cleanup()
    # Stop writing first (pending status is written while the Lease is still held), then
    # stop renewing and clear the holder, so a standby leads at once on a rolling update.
    await memo.controller.stop()
    await memo.legacy.stop()
    if memo.election is not None:
        await memo.election.stop(release=True)
    await memo.transport.close()
    await memo.kube.close()


@kopf.on.event(*RESOURCE)
async def on_owner_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """Hand every owner event to the controller; returning None makes kopf write nothing."""
    body = dict(event["object"])
    memo.controller.owner_event(event.get("type"), body)
    if event.get("type") != "DELETED" and memo.controller.leading.is_set():
        memo.legacy.release(body)


@kopf.on.probe(id="controller")
async def controller_health(memo: kopf.Memo, **_: Any) -> dict[str, Any]:
    """Liveness: fails when a reflector or worker task has died. It says nothing more: the
    probe answers anyone who reaches the pod, and the counters (how many objects of each
    namespace) are on the metrics server's /debug/controller, behind its auth."""
    health: dict[str, Any] = memo.controller.health()
    return health
