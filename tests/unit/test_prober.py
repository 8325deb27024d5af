"""The probe pool: probes run off the reconcile path, bounded, and wake only on a change."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from test_controller import CFG, Bed
from vllm_dp_operator.controller.kube import RAYJOB, VDP
from vllm_dp_operator.engines.engine_metrics import EngineLoad
from vllm_dp_operator.engines.probe import EngineReading, ProbeResult
from vllm_dp_operator.engines.prober import NOT_PROBED, ProbePool, Target


class EngineDouble:
    """Test double for the engines behind the transport: per service, answer, hang or fail."""

    def __init__(self) -> None:
        self.ok: dict[str, bool] = {}
        self.hung: set[str] = set()
        self.loads: dict[str, dict[int, EngineLoad]] = {}
        self.asked: list[str] = []
        #: /metrics reads, and the services whose /metrics cannot be read.
        self.reads: list[str] = []
        self.unreadable: set[str] = set()
        self.completes: dict[str, bool] = {}
        self.completions: list[tuple[str, str, bool]] = []
        self.checks: list[str] = []
        self.in_flight = 0
        self._release = asyncio.Event()

    async def check(self, namespace: str, service: str, port: int) -> ProbeResult:
        self.asked.append(service)
        self.in_flight += 1
        try:
            if service in self.hung:
                await self._release.wait()  # an engine that never answers
            return ProbeResult(self.ok.get(service, False), f"{service} answered")
        finally:
            self.in_flight -= 1

    async def engines(self, namespace: str, service: str, port: int, ranks: int = 0
                      ) -> EngineReading:  # fmt: skip
        self.reads.append(service)
        if service in self.unreadable:
            return EngineReading(None, f"{service} /metrics: HTTP 500")
        return EngineReading(self.loads.get(service, {}), f"{service} /metrics")

    async def complete(
        self, namespace: str, service: str, port: int, model: str, keyed: bool,
        check: str = "Completion",
    ) -> ProbeResult:  # fmt: skip
        self.completions.append((service, model, keyed))
        self.checks.append(check)
        ok = self.completes.get(service, False)
        return ProbeResult(ok, f"POST {service}/v1/completions {model}")


def target(name: str, job: str = "j1") -> Target:
    return Target("ns", name, f"{name}-head-svc", 8000, job)


async def until(check: Any, timeout: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not check():
        assert loop.time() - start < timeout, "not within the time"
        await asyncio.sleep(0.002)


def pool(engines: EngineDouble, woken: list[Any], concurrency: int = 4,
         period: float = 0.01, loads: dict[Any, Mapping[int, Any] | None] | None = None,
         metrics_seconds: float = 0.0) -> ProbePool:  # fmt: skip
    sink = loads if loads is not None else {}
    return ProbePool(engines, woken.append, concurrency=concurrency, launching_seconds=period,
                     serving_seconds=period, metrics_seconds=metrics_seconds,
                     on_loads=sink.__setitem__)  # fmt: skip


async def test_a_hung_engine_does_not_hold_a_reconcile_worker() -> None:
    """With one worker and an engine that never answers, every reconcile still completes:
    the reconcile reads the pool's latest answer and the hung probe waits in the pool."""
    bed = Bed(replace(CFG, workers=1))
    bed.probe.ok = True
    hung = asyncio.Event()

    async def never(namespace: str, service: str, port: int) -> ProbeResult:
        bed.probe.calls += 1
        await hung.wait()
        return ProbeResult(True, "too late")

    bed.probe.check = never  # type: ignore[method-assign]
    bed.ctl.start()
    try:
        await bed.owner_with_cluster()
        bed.cluster_ready()
        await bed.until("the head job", lambda: bed.names(RAYJOB))
        bed.api.set_status(RAYJOB, "default", "demo-j00001", {"jobStatus": "RUNNING"})
        await bed.until("a probe sent", lambda: bed.probe.calls == 1)
        await bed.settle()  # the one worker is free while the probe hangs
        for generation in (2, 3):  # and it keeps reconciling: two edits, each seen
            await bed.api.patch(VDP, "default", "demo", {"metadata": {"generation": generation},
                                                         "spec": {"model": f"m{generation}"}})
            bed.kopf_event("MODIFIED")
            await bed.until(f"generation {generation} observed",
                            lambda g=generation: bed.status().get("observedGeneration") == g)
        assert bed.status().get("phase") != "Serving"  # no probe has answered
    finally:
        hung.set()
        await bed.ctl.stop()


async def test_hung_engines_hold_pool_slots_and_the_others_are_still_answered() -> None:
    engines, woken = EngineDouble(), []
    engines.hung = {"h1-head-svc", "h2-head-svc"}
    engines.ok = {"a-head-svc": True, "b-head-svc": True}
    p = pool(engines, woken, concurrency=3)
    task = p.start()[0]
    try:
        for name in ("h1", "h2", "a", "b"):
            assert p.health(target(name)) is NOT_PROBED  # at once, no I/O
        await until(lambda: p.health(target("a")).ok and p.health(target("b")).ok)
        assert engines.in_flight <= 3 and p.health(target("h1")) is NOT_PROBED
        assert ("ns", "a") in woken and ("ns", "h1") not in woken
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_wakes_on_a_change_only_and_feeds_per_rank_load_without_a_wake() -> None:
    engines, woken = EngineDouble(), []
    loads: dict[Any, Mapping[int, Any] | None] = {}
    svc = "a-head-svc"
    engines.ok[svc] = True
    engines.loads[svc] = {0: EngineLoad(0, 1, 0, 0.1)}
    p = pool(engines, woken, loads=loads)
    task = p.start()[0]
    try:
        p.health(target("a"))
        await until(lambda: engines.asked.count(svc) >= 5)
        assert woken == [("ns", "a")]  # the first answer; the same answer again is no news
        engines.loads[svc] = {0: EngineLoad(0, 7, 0, 0.3)}  # busier, same level: no wake
        await until(lambda: loads[("ns", "a", 0)] == engines.loads[svc])
        assert woken == [("ns", "a")]
        engines.loads[svc] = {0: EngineLoad(0, 7, 3, 0.3)}  # requests wait: Saturated
        await until(lambda: len(woken) == 2)
        engines.ok[svc] = False  # each failure in a row is news (the unroute threshold)
        await until(lambda: p.health(target("a")).failures >= 3)
        health = p.health(target("a"))
        assert not health.ok and health.failing_since is not None
        assert len(woken) >= 2 + health.failures - 1
        p.release(("ns", "a"))
        assert loads[("ns", "a", 0)] is None and len(p) == 0
        asked = len(engines.asked)
        await asyncio.sleep(0.05)
        assert len(engines.asked) <= asked + 1  # at most the probe that was in flight
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_metrics_are_read_once_a_period_and_with_the_first_answer_after_a_failure() -> None:
    """/health every probe; /metrics (the costly read) only once 0.8 x metrics_seconds passed
    since the last read, with the first ok answer after a failure, and again at once after a
    read that failed."""
    engines, woken = EngineDouble(), []
    svc = "a-head-svc"
    engines.ok[svc] = True
    p = ProbePool(engines, woken.append, concurrency=2, launching_seconds=3600,
                  serving_seconds=3600, metrics_seconds=60)  # fmt: skip
    now = [1000.0]
    p._now = lambda: now[0]  # type: ignore[method-assign]  # the pool's clock, stepped here
    task = p.start()[0]

    async def probe_at(at: float) -> int:
        """Probe once at time `at`; the /metrics reads so far."""
        now[0], asked = at, len(engines.asked)
        if asked:
            p.nudge(("ns", "a"))
        else:
            p.health(target("a"))  # the first probe: at once on registration
        await until(lambda: len(engines.asked) == asked + 1 and engines.in_flight == 0)
        return len(engines.reads)

    try:
        assert await probe_at(1000) == 1  # the first answer is read
        assert await probe_at(1030) == 1  # 30 s later: /health only
        assert await probe_at(1049) == 2  # 49 s after the read: due (48 s)
        engines.ok[svc] = False
        assert await probe_at(1050) == 2  # a failed /health: no /metrics
        engines.ok[svc] = True
        assert await probe_at(1051) == 3  # back: read at once, not 48 s after the last
        engines.unreadable.add(svc)
        assert await probe_at(1100) == 4 and p.reading(target("a")).loads is None
        engines.unreadable.clear()
        assert await probe_at(1101) == 5  # a read that failed is tried again next probe
        assert await probe_at(1102) == 5
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_new_head_job_starts_unprobed_and_a_nudge_probes_at_once() -> None:
    engines, woken = EngineDouble(), []
    engines.ok["a-head-svc"] = True
    p = pool(engines, woken, period=3600)
    task = p.start()[0]
    try:
        p.health(target("a", "j1"))
        await until(lambda: p.health(target("a", "j1")).ok)
        # The next head job of the resource is not routable on its predecessor's answer.
        assert p.health(target("a", "j2")) is NOT_PROBED
        await until(lambda: p.health(target("a", "j2")).ok)
        asked = len(engines.asked)
        p.nudge(("ns", "a"))  # the launcher said vLLM answers: no wait for the next turn
        await until(lambda: len(engines.asked) == asked + 1, timeout=1.0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)



async def test_a_candidate_is_asked_one_completion_after_health_and_until_it_answers() -> None:
    """A Surge's new head: a completion only once /health answers, again while it fails,
    never again once it answered; its answer is news that wakes the resource. It does not
    wait for /metrics to be due (read once here, with the first answer)."""
    engines, woken = EngineDouble(), []
    svc = "a-head-svc"
    p = pool(engines, woken, metrics_seconds=3600)
    candidate = Target("ns", "a", svc, 8000, "j2", "llama", True)
    task = p.start()[0]
    try:
        assert p.completion(candidate) is None
        await until(lambda: engines.asked.count(svc) >= 3)
        assert engines.completions == []  # /health not answering: no completion asked
        engines.ok[svc] = True
        await until(lambda: len(engines.completions) >= 2)
        assert engines.reads == [svc]
        answer = p.completion(candidate)
        assert answer is not None and not answer.ok
        engines.completes[svc] = True
        await until(lambda: (p.completion(candidate) or answer).ok)
        asked = len(engines.completions)
        woke = len(woken)
        await until(lambda: engines.asked.count(svc) >= 10)
        assert len(engines.completions) == asked  # answered: never asked again
        assert engines.completions[-1] == (svc, "llama", True)
        assert woke >= 2  # the first health answer, then the completion's
        plain = target("b")
        engines.ok["b-head-svc"] = True
        await until(lambda: p.health(plain).ok and engines.asked.count("b-head-svc") >= 3)
        assert all(s != "b-head-svc" for s, _, _ in engines.completions)  # not a candidate
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_surge_probes_the_serving_head_and_the_new_one_side_by_side() -> None:
    """While a new generation starts, the serving one stays probed in its own slot (a hang
    there is still seen); the resource's load is the serving one's; the new one's slot goes
    when no update starts any more."""
    engines, woken, loads = EngineDouble(), [], {}
    p = pool(engines, woken, loads=loads)
    old, new = target("a"), Target("ns", "a", "a2-head-svc", 8000, "j2", "llama", False)
    engines.ok.update({"a-head-svc": True, "a2-head-svc": True})
    engines.loads["a-head-svc"] = {0: EngineLoad(0, running=3, waiting=0, kv_cache_usage=0.1)}
    engines.loads["a2-head-svc"] = {0: EngineLoad(0, running=0, waiting=0, kv_cache_usage=0.0)}
    task = p.start()[0]
    try:
        p.health(old)
        p.health(new)
        await until(lambda: p.health(old).ok and p.health(new).ok)
        assert len(p) == 2
        await until(lambda: engines.asked.count("a-head-svc") >= 5
                    and engines.asked.count("a2-head-svc") >= 5)  # fmt: skip
        assert loads[("ns", "a", 0)][0].running == 3  # never the new generation's
        engines.ok["a-head-svc"] = False  # the serving engine hangs on
        await until(lambda: p.health(old).failures >= 3)
        assert p.health(new).ok
        p.keep(("ns", "a"), {0: frozenset()})  # no update starting: the new generation's slot goes
        assert len(p) == 1 and p.health(old).failures >= 3
        asked = engines.asked.count("a2-head-svc")
        await until(lambda: engines.asked.count("a-head-svc") >= 15)
        assert engines.asked.count("a2-head-svc") <= asked + 1  # one in flight at most
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_series_of_ranks_beyond_the_dp_size_are_dropped_before_they_are_kept() -> None:
    # One engine's /metrics can name any engine="N" (issue 39, item 4): only the planned
    # ranks are kept, in the reading and in the per-rank gauges.
    engines, woken, loads = EngineDouble(), [], {}
    svc = "a-head-svc"
    engines.ok[svc] = True
    engines.loads[svc] = {r: EngineLoad(r, 1, 0, 0.1) for r in (0, 1, 2, 70_000)}
    p = pool(engines, woken, loads=loads)
    planned = Target("ns", "a", svc, 8000, "j1", ranks=2)
    task = p.start()[0]
    try:
        p.health(planned)
        await until(lambda: p.reading(planned) is not None)
        reading = p.reading(planned)
        assert reading is not None and reading.loads is not None
        assert sorted(reading.loads) == [0, 1]
        assert "2 series of ranks at or above the DP size 2 ignored" in reading.detail
        assert sorted(loads[("ns", "a", 0)]) == [0, 1]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
