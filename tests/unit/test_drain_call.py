"""The operator's side of a drain (engines/drain.py): a head that leaves its Service is told
to close kept-alive connections, and its last client request's age reaches the decision."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from test_prober import EngineDouble
from vllm_dp_operator.engines.drain import mark_draining
from vllm_dp_operator.engines.prober import ProbePool, Target
from vllm_dp_operator.engines.transport import Answer

TOKEN = "tok-1"


class GateDouble:
    """Test double for the launcher's drain gate on one head (`status` 404: a head launched
    by an earlier release, with no gate)."""

    def __init__(self, idle: float = 0.0, status: int = 200) -> None:
        self.idle, self.status = idle, status
        self.calls: list[tuple[str, str, Mapping[str, str]]] = []

    async def request(self, method: str, namespace: str, service: str, port: int, path: str,
                      limit: int | None = None, headers: Mapping[str, str] | None = None,
                      json_body: Mapping[str, Any] | None = None) -> Answer:  # fmt: skip
        self.calls.append((method, path, dict(headers or {})))
        if self.status != 200:
            return Answer(self.status, "{}", f"HTTP {self.status}")
        if (headers or {}).get("x-ray-authorization") != f"Bearer {TOKEN}":
            return Answer(403, "{}", "HTTP 403")
        return Answer(200, json.dumps({"draining": True, "idleSeconds": self.idle}), "HTTP 200")

    async def close(self) -> None:
        return None


async def test_the_call_sends_the_token_and_reads_the_idle_time() -> None:
    gate = GateDouble(idle=4.5)
    assert await mark_draining(gate, "ns", "old-head", 8000, TOKEN) == 4.5
    assert gate.calls == [("POST", "/vllmdp/drain", {"x-ray-authorization": f"Bearer {TOKEN}"})]
    assert await mark_draining(gate, "ns", "old-head", 8000, "wrong") is None
    # No gate there (an earlier release's head job): the drain ends as before.
    assert await mark_draining(GateDouble(status=404), "ns", "old-head", 8000, TOKEN) is None


async def test_the_pool_tells_only_a_draining_head_and_wakes_when_it_turns_quiet() -> None:
    engines, gate = EngineDouble(), GateDouble(idle=0.5)
    engines.ok["old"] = engines.ok["new"] = True
    woken: list[Any] = []
    pool = ProbePool(engines, woken.append, concurrency=2, launching_seconds=0.02,
                     serving_seconds=0.02, transport=gate)  # fmt: skip
    serving = Target("ns", "vdp", "new", 8000, "job-2", token=TOKEN)
    draining = Target("ns", "vdp", "old", 8000, "job-1", draining=True, token=TOKEN)
    task = pool.start()[0]
    try:
        pool.health(serving)
        for _ in range(200):
            if (r := pool.reading(draining)) is not None:
                break
            await asyncio.sleep(0.01)
        assert r is not None and r.idle == 0.5 and not r.quiet()
        assert {c[1] for c in gate.calls} == {"/vllmdp/drain"}
        woken.clear()
        gate.idle = 5.0
        for _ in range(200):
            if (r := pool.reading(draining)) is not None and r.quiet():
                break
            await asyncio.sleep(0.01)
        assert r is not None and r.quiet()
        for _ in range(100):
            if ("ns", "vdp") in woken:
                break
            await asyncio.sleep(0.01)
        assert ("ns", "vdp") in woken  # turning quiet is a change a decision waits for
        reading = pool.reading(serving)
        assert reading is not None and reading.idle is None  # the serving head is never told
    finally:
        task.cancel()
