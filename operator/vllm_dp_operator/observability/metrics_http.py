"""Serve the operator's metrics registry on GET /metrics, inside the operator's event loop,
and the controller's own counters (queue, caches, reflectors' requests) on
GET /debug/controller.

With a `MetricsAuth` (the chart's default) both need a bearer token the API server
authenticates and authorizes for `get` on `/metrics`: 401 without one the API server knows,
403 for one whose user may not, 503 while the API server cannot be asked. The counters say how
many objects of every watched namespace the operator holds, so they are not on the
unauthenticated liveness probe (/healthz), which says only whether the controller is alive.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from vllm_dp_operator.observability.metrics_auth import OK, MetricsAuth

log = logging.getLogger(__name__)


def metrics_app(
    registry: CollectorRegistry, auth: MetricsAuth | None = None,
    counters: Callable[[], dict[str, Any]] | None = None,
) -> web.Application:  # fmt: skip
    """An aiohttp app with GET /metrics for one registry and, given `counters`, GET
    /debug/controller with their answer as JSON; both behind `auth` when given."""

    async def refused(request: web.Request) -> web.Response | None:
        if auth is None:
            return None
        try:
            verdict = await auth.check(request.headers.get("Authorization"))
        except Exception as exc:  # the API server could not be asked: no verdict
            log.warning("Cannot review a %s token: %r", request.path, exc)
            return web.Response(status=503, text="cannot review the token now\n")
        if verdict.status != OK:
            log.debug("Refused %s (%d): %s", request.path, verdict.status, verdict.reason)
            return web.Response(status=verdict.status, text=f"{verdict.reason}\n")
        return None

    async def metrics(request: web.Request) -> web.Response:
        if (refusal := await refused(request)) is not None:
            return refusal
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def controller(request: web.Request) -> web.Response:
        if (refusal := await refused(request)) is not None:
            return refusal
        assert counters is not None
        return web.json_response(counters())

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    if counters is not None:
        app.router.add_get("/debug/controller", controller)
    return app


async def serve_metrics(
    registry: CollectorRegistry, host: str, port: int, auth: MetricsAuth | None = None,
    counters: Callable[[], dict[str, Any]] | None = None, tls: ssl.SSLContext | None = None,
) -> web.AppRunner:
    """Start serving (over TLS with `tls`); the caller stops it with `await
    runner.cleanup()`."""
    runner = web.AppRunner(metrics_app(registry, auth, counters), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=tls).start()
    log.info("Serving operator metrics on %s://%s:%d/metrics (%s)", "https" if tls else "http",
             host, port,
             "bearer token, TokenReview and SubjectAccessReview" if auth else "no auth")
    return runner
