"""Test double for cluster DNS: every name resolves to 127.0.0.1, and the names asked are kept.

The service-dns transport takes it as its aiohttp resolver, so probes of any Service name reach
a server on this host (a unit test's, or the engine double of `bench/probe_cost.py`).
"""

from __future__ import annotations

import socket

from aiohttp.abc import AbstractResolver, ResolveResult


class LoopbackDns(AbstractResolver):
    """Every name is 127.0.0.1; `asked` holds each name looked up, in order."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        self.asked.append(host)
        return [{"hostname": host, "host": "127.0.0.1", "port": port, "family": socket.AF_INET,
                 "proto": 0, "flags": socket.AI_NUMERICHOST}]  # fmt: skip

    async def close(self) -> None:
        """Nothing to release."""
