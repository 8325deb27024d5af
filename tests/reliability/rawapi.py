"""A small, thread-safe HTTPS client for the test bed's API server, for many quick requests.

kubectl costs about 100 ms a call; the fuzzed-spec test sends thousands of dry-run creates,
so it speaks HTTP itself: one keep-alive connection per thread, the admin token, the bed's CA.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import urllib.parse
from pathlib import Path
from typing import Any


class RawApi:
    """POST/GET JSON to one API server; answers (status code, decoded body)."""

    def __init__(self, server: str, token: str, ca: Path) -> None:
        url = urllib.parse.urlsplit(server)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 443
        self.token = token
        self.ctx = ssl.create_default_context(cafile=str(ca))
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPSConnection:
        conn: http.client.HTTPSConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=30)
            self._local.conn = conn
        return conn

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json",
                   "Content-Type": "application/json"}  # fmt: skip
        for attempt in (1, 2):  # a keep-alive connection the server closed: reconnect once
            conn = self._conn()
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
        return resp.status, json.loads(raw) if raw else None

    def dry_run_create(self, collection: str, body: dict[str, Any]) -> tuple[int, Any]:
        """Create with dryRun=All and strict field validation (as kubectl does)."""
        return self.request("POST", f"{collection}?dryRun=All&fieldValidation=Strict", body)
