"""status.engines while Serving: per-rank load from the head's /metrics, totals for
`kubectl get`, a condition naming ranks that report nothing, and nothing once not Serving."""

from __future__ import annotations

from pathlib import Path

from vllm_dp_operator import constants as c
from vllm_dp_operator.reconcile.status import condition_status
from world import World, serving, spec

SAMPLE = (Path(__file__).parent / "data" / "vllm-0.33-dp2-metrics.txt").read_text()
DP2 = spec(dataParallel={"size": 2, "ranksPerNode": 1})


def _cond(w: World) -> dict[str, str]:
    return next(x for x in w.status["conditions"] if x["type"] == c.COND_ENGINES_REPORTING)


async def test_serving_reads_each_rank_and_totals() -> None:
    w = World(DP2)
    w.probe.metrics = SAMPLE
    await w.step()
    w.cluster_ready()
    await w.step()
    w.run("demo-j00001")
    w.probe.ok = True
    await w.step()
    assert w.status["phase"] == c.PHASE_SERVING
    assert w.status["engines"] == [
        {"rank": 0, "running": 3, "waiting": 0, "kvCacheUsage": 0.125},
        {"rank": 1, "running": 5, "waiting": 2, "kvCacheUsage": 0.375},
    ]
    assert (w.status["requestsRunning"], w.status["requestsWaiting"]) == (8, 2)
    assert _cond(w)["status"] == "True"
    assert w.probe.metric_calls == [f"{w.status['rayCluster']}-head-svc:8000"]


async def test_a_rank_that_stops_reporting_is_named() -> None:
    w = await serving(DP2)
    w.probe.metrics = "\n".join(x for x in SAMPLE.splitlines() if 'engine="1"' not in x) + "\n"
    await w.step(5)
    cond = _cond(w)
    assert cond["status"] == "False" and cond["reason"] == c.REASON_RANKS_MISSING
    assert "DP rank(s) 1 of 0-1" in cond["message"]
    assert [e["rank"] for e in w.status["engines"]] == [0]
    assert w.status["phase"] == c.PHASE_SERVING  # /health decides serving, not /metrics


async def test_unreadable_metrics_say_why_and_keep_serving() -> None:
    w = await serving(DP2)
    w.probe.metrics = None
    await w.step(5)
    cond = _cond(w)
    assert cond["reason"] == c.REASON_METRICS_UNAVAILABLE and "HTTP 500" in cond["message"]
    assert "engines" not in w.status and w.status["phase"] == c.PHASE_SERVING


async def test_leaving_serving_clears_the_view() -> None:
    w = await serving(DP2)
    w.probe.metrics = SAMPLE
    await w.step(5)
    assert w.status["requestsRunning"] == 8
    w.probe.ok = False
    for _ in range(3):  # failed probes in a row over the unroute threshold's time
        out = await w.step(45)
    assert w.status["phase"] == c.PHASE_LAUNCHING
    assert {k: out.status[k] for k in ("engines", "requestsRunning", "requestsWaiting")} == {
        "engines": None, "requestsRunning": None, "requestsWaiting": None}  # removed by patch
    assert condition_status(w.status["conditions"], c.COND_ENGINES_REPORTING) == "Unknown"
    assert _cond(w)["reason"] == c.REASON_NOT_SERVING
