"""vLLM's /health and /metrics on the Ray head pod, reached through KubeRay's head Service."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from vllm_dp_launcher import servecheck

from vllm_dp_operator import constants
from vllm_dp_operator.engines.engine_metrics import (
    EngineLoad,
    ExpositionError,
    complete_lines,
    parse_engine_loads,
)
from vllm_dp_operator.engines.transport import ServiceTransport

#: Default cap on the bytes of /metrics read per probe (VLLMDP_ENGINE_METRICS_MAX_BYTES).
METRICS_MAX_BYTES = 4 * 1024 * 1024
#: A one-token completion's answer is small; more is not read.
COMPLETION_MAX_BYTES = 64 * 1024


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of the latest probe, with the failures in a row that led to it."""

    ok: bool
    detail: str
    #: Failed probes in a row, this one included (0 when it answered), and the first's time.
    failures: int = 0
    failing_since: datetime | None = None


@dataclass(frozen=True)
class EngineReading:
    """Per-rank load read from /metrics; `loads` is None when nothing could be read."""

    loads: dict[int, EngineLoad] | None
    detail: str
    #: For a head that drains: seconds since its last client request, as its drain gate
    #: says (engines/drain.py); None where it cannot say.
    idle: float | None = None

    def in_flight(self) -> int | None:
        """Requests running or waiting on all its ranks; None when no rank reported."""
        if not self.loads:
            return None
        return sum(load.running + load.waiting for load in self.loads.values())

    def quiet(self) -> bool:
        """For a head that drains: no client request came for DRAIN_QUIET_SECONDS (a head
        without the gate cannot say, and counts as quiet)."""
        return self.idle is None or self.idle >= constants.DRAIN_QUIET_SECONDS


class HealthProbe(Protocol):
    """Answers whether vLLM behind a Service answers GET /health with 200, and how loaded
    each of its DP ranks is (GET /metrics)."""

    async def check(self, namespace: str, service: str, port: int) -> ProbeResult:
        """Probe once, within the probe's timeout."""
        ...

    async def engines(self, namespace: str, service: str, port: int, ranks: int = 0
                      ) -> EngineReading:  # fmt: skip
        """Read the per-rank gauges from /metrics once, within the timeout and size cap;
        with `ranks` (the DP size), only the ranks below it."""
        ...

    async def complete(
        self, namespace: str, service: str, port: int, model: str, keyed: bool,
        check: str = servecheck.COMPLETION,
    ) -> ProbeResult:  # fmt: skip
        """Send the serving check (one completion of one token by default), within the
        timeout."""
        ...


class TransportProbe:
    """GET /health and /metrics over a Service transport (cluster DNS or the API server's
    proxy): the same path, so the same RBAC and the same timeout."""

    def __init__(self, transport: ServiceTransport, max_bytes: int = METRICS_MAX_BYTES) -> None:
        self._transport = transport
        self._max_bytes = max_bytes

    async def check(self, namespace: str, service: str, port: int) -> ProbeResult:
        """Probe once, within the transport's timeout."""
        answer = await self._transport.request("GET", namespace, service, port, "/health")
        return ProbeResult(answer.status == 200, answer.detail)

    async def complete(
        self, namespace: str, service: str, port: int, model: str, keyed: bool,
        check: str = servecheck.COMPLETION,
    ) -> ProbeResult:  # fmt: skip
        """The serving check (one completion of one token, one embedding, or the model list:
        servecheck.py): proof that the engines serve, not only that the API server is up.
        Sent without a key: the operator holds none (its RBAC reads no Secret), so where the
        engines want a key (`keyed`: spec.apiKeySecretRef) vLLM's 401 is taken as its API
        server's answer through the head Service, and the proof is the launcher's own check
        in the pod, with the key (its `answered` stage)."""
        method, path, body = servecheck.request(check, model)
        answer = await self._transport.request(
            method, namespace, service, port, path, limit=COMPLETION_MAX_BYTES, json_body=body,
        )  # fmt: skip
        ok = answer.ok or (keyed and answer.status == 401)
        return ProbeResult(ok, answer.detail, 0 if ok else 1)

    async def engines(self, namespace: str, service: str, port: int, ranks: int = 0
                      ) -> EngineReading:  # fmt: skip
        """Read the per-rank gauges, at most max_bytes of the exposition; with `ranks`, only
        the ranks below it (the others are skipped before their labels are parsed)."""
        answer = await self._transport.request(
            "GET", namespace, service, port, "/metrics", limit=self._max_bytes
        )
        if answer.status != 200:
            return EngineReading(None, answer.detail)
        text, detail = answer.body, answer.detail
        if answer.truncated:
            text = complete_lines(text)
            detail += f" (read the first {self._max_bytes} bytes only)"
        try:
            # Off the event loop: an exposition of a few MiB takes seconds of CPU to parse,
            # and the loop serves every other resource meanwhile.
            return EngineReading(await asyncio.to_thread(parse_engine_loads, text, ranks),
                                 detail)  # fmt: skip
        except ExpositionError as exc:
            return EngineReading(None, f"{detail}: {exc}")
