"""status.load while Serving: a summary of the head's /metrics that moves only on a change
worth a write, the per-rank numbers on the outcome (for the metrics), a condition naming ranks
that report nothing, and nothing once not Serving."""

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
    # Rank 1 has 2 requests waiting: saturated. The numbers themselves are not status.
    assert w.status["load"] == {"level": "Saturated", "ranksReporting": 2,
                                "since": w.status["load"]["since"]}  # fmt: skip
    assert "engines" not in w.status and "requestsRunning" not in w.status
    assert _cond(w)["status"] == "True"
    assert w.probe.metric_calls == [f"{w.status['rayCluster']}-head-svc:8000"]


async def test_a_rank_that_stops_reporting_is_named() -> None:
    w = await serving(DP2)
    w.probe.metrics = "\n".join(x for x in SAMPLE.splitlines() if 'engine="1"' not in x) + "\n"
    await w.step(5)
    cond = _cond(w)
    assert cond["status"] == "False" and cond["reason"] == c.REASON_RANKS_MISSING
    assert "DP rank(s) 1 of 0-1" in cond["message"]
    assert w.status["load"]["ranksReporting"] == 1
    assert w.status["phase"] == c.PHASE_SERVING  # /health decides serving, not /metrics


async def test_unreadable_metrics_say_why_and_keep_serving() -> None:
    w = await serving(DP2)
    w.probe.metrics = SAMPLE
    await w.step(5)
    before = w.status["load"]
    w.probe.metrics = None
    await w.step(5)
    cond = _cond(w)
    assert cond["reason"] == c.REASON_METRICS_UNAVAILABLE and "HTTP 500" in cond["message"]
    # The last summary stands (a failed read is not a change of load).
    assert w.status["load"] == before and w.status["phase"] == c.PHASE_SERVING


async def test_leaving_serving_clears_the_view() -> None:
    w = await serving(DP2)
    w.probe.metrics = SAMPLE
    await w.step(5)
    assert w.status["load"]["level"] == "Saturated"
    w.probe.ok = False
    for _ in range(3):  # failed probes in a row over the unroute threshold's time
        out = await w.step(45)
    assert w.status["phase"] == c.PHASE_LAUNCHING
    assert out.status["load"] is None  # removed by the merge patch
    assert condition_status(w.status["conditions"], c.COND_ENGINES_REPORTING) == "Unknown"
    assert _cond(w)["reason"] == c.REASON_NOT_SERVING


async def test_a_flickering_load_is_written_at_most_once_a_minute() -> None:
    """The load moves on every probe; status moves only when the level changes, and a new
    level waits until the last one has stood a minute."""
    w = await serving(DP2)
    busy = (
        'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_waiting{engine="0"} 0\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.1\nvllm:num_requests_running{engine="1"} 2\n'
        'vllm:num_requests_waiting{engine="1"} 0\nvllm:kv_cache_usage_perc{engine="1"} 0.2\n'
    )
    busier = busy.replace("} 2\n", "} 7\n", 1)
    w.probe.metrics = busy
    await w.step(5)
    first = w.status["load"]
    assert first["level"] == "Busy"
    writes = 0
    for text in (busier, busy, busier, busy):  # numbers move, the level does not
        w.probe.metrics = text
        out = await w.step(30)
        writes += out.status["load"] != first
    assert writes == 0 and w.status["load"] == first
    w.probe.metrics = SAMPLE  # saturated, well after the last change: written
    await w.step(30)
    second = w.status["load"]
    assert second["level"] == "Saturated" and second["since"] != first["since"]
    w.probe.metrics = busy  # back within the minute: the written level stands
    await w.step(30)
    assert w.status["load"] == second
    await w.step(31)  # the minute is over
    assert w.status["load"]["level"] == "Busy"
