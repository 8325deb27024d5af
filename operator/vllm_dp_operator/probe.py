"""vLLM's /health on the Ray head pod, reached through KubeRay's head Service."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from vllm_dp_operator.transport import ServiceTransport


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of one probe."""

    ok: bool
    detail: str


class HealthProbe(Protocol):
    """Answers whether vLLM behind a Service answers GET /health with 200."""

    async def check(self, namespace: str, service: str, port: int) -> ProbeResult:
        """Probe once, within the probe's timeout."""
        ...


class TransportProbe:
    """GET /health over a Service transport (cluster DNS or the API server's proxy)."""

    def __init__(self, transport: ServiceTransport) -> None:
        self._transport = transport

    async def check(self, namespace: str, service: str, port: int) -> ProbeResult:
        """Probe once, within the transport's timeout."""
        answer = await self._transport.request("GET", namespace, service, port, "/health")
        return ProbeResult(answer.status == 200, answer.detail)
