"""Serve the operator's metrics registry on GET /metrics, inside the operator's event loop."""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)


def metrics_app(registry: CollectorRegistry) -> web.Application:
    """An aiohttp app with GET /metrics for one registry."""

    async def metrics(_request: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


async def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> web.AppRunner:
    """Start serving; the caller stops it with `await runner.cleanup()`."""
    runner = web.AppRunner(metrics_app(registry), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("Serving operator metrics on http://%s:%d/metrics", host, port)
    return runner
