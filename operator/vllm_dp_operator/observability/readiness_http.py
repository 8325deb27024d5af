"""Serve GET /readyz inside the operator's event loop: "synced and able to lead".

200 when every check passes; 503 otherwise, each check's answer in the body either way. A
standby whose caches are filled and whose Lease API answers is ready: it could take over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from aiohttp import web

log = logging.getLogger(__name__)

Check = Callable[[], tuple[bool, str]]


def readiness_app(checks: Sequence[tuple[str, Check]]) -> web.Application:
    """An aiohttp app with GET /readyz over named checks."""

    async def readyz(_request: web.Request) -> web.Response:
        results = [(name, *check()) for name, check in checks]
        ok = all(passed for _, passed, _ in results)
        text = "".join(f"[{'+' if passed else '-'}]{name}: {why}\n"
                       for name, passed, why in results)  # fmt: skip
        return web.Response(status=200 if ok else 503, text=text)

    app = web.Application()
    app.router.add_get("/readyz", readyz)
    return app


async def serve_readiness(checks: Sequence[tuple[str, Check]], host: str,
                          port: int) -> web.AppRunner:  # fmt: skip
    """Start serving; the caller stops it with `await runner.cleanup()`."""
    runner = web.AppRunner(readiness_app(checks), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("Serving readiness on http://%s:%d/readyz", host, port)
    return runner
