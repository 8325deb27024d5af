"""Serve the operator's metrics registry on GET /metrics, inside the operator's event loop.

With a `MetricsAuth` (the chart's default) a scrape needs a bearer token the API server
authenticates and authorizes for `get` on `/metrics`: 401 without one the API server knows,
403 for one whose user may not, 503 while the API server cannot be asked.
"""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from vllm_dp_operator.observability.metrics_auth import OK, MetricsAuth

log = logging.getLogger(__name__)


def metrics_app(registry: CollectorRegistry, auth: MetricsAuth | None = None) -> web.Application:
    """An aiohttp app with GET /metrics for one registry, behind `auth` when given."""

    async def metrics(request: web.Request) -> web.Response:
        if auth is not None:
            try:
                verdict = await auth.check(request.headers.get("Authorization"))
            except Exception as exc:  # the API server could not be asked: no verdict
                log.warning("Cannot review a /metrics token: %r", exc)
                return web.Response(status=503, text="cannot review the token now\n")
            if verdict.status != OK:
                log.debug("Refused a /metrics scrape (%d): %s", verdict.status, verdict.reason)
                return web.Response(status=verdict.status, text=f"{verdict.reason}\n")
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


async def serve_metrics(
    registry: CollectorRegistry, host: str, port: int, auth: MetricsAuth | None = None
) -> web.AppRunner:
    """Start serving; the caller stops it with `await runner.cleanup()`."""
    runner = web.AppRunner(metrics_app(registry, auth), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("Serving operator metrics on http://%s:%d/metrics (%s)", host, port,
             "bearer token, TokenReview and SubjectAccessReview" if auth else "no auth")
    return runner
