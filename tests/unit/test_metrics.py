"""The operator's Prometheus metrics: names, a registry per controller, and counts that a
re-run reconcile or an operator restart reading status never repeat."""

from __future__ import annotations

from datetime import UTC, datetime

import aiohttp
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_controller import KEY, Bed, FlakyApi
from vllm_dp_operator import constants as c
from vllm_dp_operator.controller.kube import RAYCLUSTER, RAYJOB
from vllm_dp_operator.engines.engine_metrics import EngineLoad
from vllm_dp_operator.observability.metrics import NAMES, OperatorMetrics, result_of
from vllm_dp_operator.observability.metrics_http import serve_metrics
from vllm_dp_operator.reconcile.outcome import Event, Outcome


def value(m: OperatorMetrics, metric: str, **labels: str) -> float:
    got = m.registry.get_sample_value(metric, labels)
    return 0.0 if got is None else got


def exported_names(m: OperatorMetrics) -> set[str]:
    text = generate_latest(m.registry).decode()
    names = set()
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue  # prometheus_client's creation-time companion of counters and histograms
        kind = family.type
        names.add(f"{family.name}_total" if kind == "counter" else family.name)
    return names


def test_every_documented_metric_is_exported_and_nothing_else() -> None:
    lora = {"adapters": [{"name": "sql", "replicas": [0, 1]},
                         {"name": "bad", "replicas": [], "error": "404: no adapter"}]}
    m = OperatorMetrics(lambda: [(("a", "x"), {"phase": c.PHASE_SERVING, "launchAttempts": 3,
                                               "lora": lora}),
                                 (("b", "x"), {"phase": c.PHASE_SERVING}), (("b", "y"), {})])
    assert exported_names(m) == set(NAMES)
    assert value(m, "vllmdp_lora_adapter_replicas", namespace="a", name="x", adapter="sql") == 2
    assert value(m, "vllmdp_lora_adapter_failed", namespace="a", name="x", adapter="sql") == 0
    assert value(m, "vllmdp_lora_adapter_failed", namespace="a", name="x", adapter="bad") == 1
    assert value(m, "vllmdp_resources", phase=c.PHASE_SERVING) == 2
    assert value(m, "vllmdp_resources", phase="None") == 1  # not reconciled yet
    assert value(m, "vllmdp_resource_phase", namespace="a", name="x", phase="Serving") == 1
    assert value(m, "vllmdp_resource_launch_attempts", namespace="a", name="x") == 3
    assert value(m, "vllmdp_resources", phase=c.PHASE_BACKOFF) == 0  # present at 0
    assert m.registry.get_sample_value("vllmdp_reconcile_total", {"result": "error"}) == 0


def test_registries_are_private() -> None:
    a, b = OperatorMetrics(), OperatorMetrics()
    a.reconciled("error", 0.01)
    assert value(a, "vllmdp_reconcile_errors_total") == 1
    assert value(b, "vllmdp_reconcile_errors_total") == 0


def test_time_to_serving_is_observed_on_the_first_serving_only() -> None:
    m = OperatorMetrics()
    now = datetime(2026, 1, 1, 0, 2, 5, tzinfo=UTC)
    served = Outcome({"phase": c.PHASE_SERVING, "servedJob": "demo-j00001"})
    m.observe({}, served, "2026-01-01T00:00:00Z", now)
    m.observe({"servedJob": "demo-j00001"}, served, "2026-01-01T00:00:00Z", now)  # a re-run
    relaunch = Outcome({"phase": c.PHASE_SERVING, "servedJob": "demo-j00002"})
    m.observe({"servedJob": "demo-j00001"}, relaunch, "2026-01-01T00:00:00Z", now)
    assert value(m, "vllmdp_time_to_serving_seconds_count") == 1
    assert value(m, "vllmdp_time_to_serving_seconds_sum") == 125


def test_results() -> None:
    assert result_of(None) == "success"
    assert result_of(Outcome({}, [Event("Normal", "X", "y")])) == "success"
    assert result_of(Outcome({}, retry_after=2.0)) == "requeue"


async def test_launch_and_failure_counted_once_across_reruns_and_a_restart() -> None:
    first = Bed()
    first.ctl.start()
    m = first.ctl.metrics
    try:
        first.add_owner()
        await first.until("the RayCluster", lambda: first.names(RAYCLUSTER), timeout=5)
        first.cluster_ready()
        await first.until("the head job", lambda: first.names(RAYJOB) == ["demo-j00001"],
                          timeout=5)
        await first.settle()
        assert value(m, "vllmdp_head_job_launches_total") == 1
        first.api.set_status(RAYJOB, "default", "demo-j00001",
                             {"jobStatus": "FAILED", "jobDeploymentStatus": "Failed"})
        await first.until("the failure", lambda: value(m, "vllmdp_head_job_failures_total"),
                          timeout=5)
        await first.settle()
        launches = value(m, "vllmdp_head_job_launches_total")
        failures = value(m, "vllmdp_head_job_failures_total")
        assert failures == 1 and launches >= 1
        for _ in range(3):  # re-runs read what the last one concluded: nothing new
            await first.ctl.process(KEY)
        assert value(m, "vllmdp_head_job_failures_total") == failures
        assert value(m, "vllmdp_head_job_launches_total") == launches
        ok = value(m, "vllmdp_reconcile_total", result="success")
        again = value(m, "vllmdp_reconcile_total", result="requeue")
        assert ok + again >= 3 and value(m, "vllmdp_reconcile_errors_total") == 0
        assert value(m, "vllmdp_reconcile_duration_seconds_count") >= ok + again
        assert sum(value(m, "vllmdp_resources", phase=p) for p in
                   (c.PHASE_LAUNCHING, c.PHASE_BACKOFF, c.PHASE_PROVISIONING)) == 1
    finally:
        await first.ctl.stop()

    second = Bed(api=first.api)  # a restart: only what the API holds survives
    second.ctl.start()
    try:
        second.kopf_event(None)
        await second.until("a reconcile", lambda: second.ctl.reconciles >= 1, timeout=5)
        await second.settle()
        m2 = second.ctl.metrics
        assert value(m2, "vllmdp_head_job_failures_total") == 0
        assert value(m2, "vllmdp_reconcile_total", result="success") + value(
            m2, "vllmdp_reconcile_total", result="requeue") >= 1
    finally:
        await second.ctl.stop()


async def test_a_failed_reconcile_counts_as_error() -> None:
    bed = Bed(api=FlakyApi())
    bed.ctl.start()
    try:
        bed.add_owner()
        await bed.until("children after a retry", lambda: bed.names(RAYCLUSTER), timeout=3)
        m = bed.ctl.metrics
        assert value(m, "vllmdp_reconcile_total", result="error") == 1
        assert value(m, "vllmdp_reconcile_errors_total") == 1
    finally:
        await bed.ctl.stop()


async def test_served_over_http_in_the_text_format() -> None:
    m = OperatorMetrics(lambda: [(("ns", "demo"), {"phase": c.PHASE_LAUNCHING})])
    m.reconciled("success", 0.002)
    runner = await serve_metrics(m.registry, "127.0.0.1", 0)
    try:
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession() as http, \
                http.get(f"http://127.0.0.1:{port}/metrics") as resp:
            text = await resp.text()
            assert resp.status == 200 and resp.content_type == "text/plain"
    finally:
        await runner.cleanup()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("vllmdp_reconcile_total", (("result", "success"),))] == 1
    assert samples[("vllmdp_resources", (("phase", "Launching"),))] == 1


def gone(m: OperatorMetrics, at: dict[str, str]) -> bool:
    sample = {**at, "rank": "0"}
    return m.registry.get_sample_value("vllmdp_engine_requests_running", sample) is None


def test_per_rank_load_is_a_metric_while_serving_and_goes_after() -> None:
    """Per-rank numbers live in the metrics (status only has a summary): set from the probe
    pool's reading, replaced by the next, gone when the pool stops probing the resource, when
    it is deleted, or is no longer listed. Each replica's ranks are its own series."""
    listed = [(("ns", "a"), {"phase": c.PHASE_SERVING})]
    m = OperatorMetrics(lambda: listed)
    loads = {0: EngineLoad(0, 3, 0, 0.125), 1: EngineLoad(1, 5, 2, 0.375)}
    m.set_engine_loads(("ns", "a", 0), loads)
    at = {"namespace": "ns", "name": "a", "replica": "0"}
    assert value(m, "vllmdp_engine_requests_running", **at, rank="1") == 5
    assert value(m, "vllmdp_engine_requests_waiting", **at, rank="1") == 2
    assert value(m, "vllmdp_engine_kv_cache_usage", **at, rank="0") == 0.125
    m.set_engine_loads(("ns", "a", 1), {0: EngineLoad(0, 9, 0, 0.0)})
    assert value(m, "vllmdp_engine_requests_running", **{**at, "replica": "1"}, rank="0") == 9
    assert value(m, "vllmdp_engine_requests_running", **at, rank="0") == 3
    m.set_engine_loads(("ns", "a", 0), {0: EngineLoad(0, 1, 0, 0.0)})
    assert value(m, "vllmdp_engine_requests_running", **at, rank="0") == 1
    listed.clear()  # the owner cache no longer lists it: its series go at once
    assert gone(m, at)
    listed.append((("ns", "a"), {"phase": c.PHASE_SERVING}))
    m.set_engine_loads(("ns", "a", 0), None)  # the pool released it: forgotten
    assert gone(m, at)
    m.set_engine_loads(("ns", "a", 0), loads)
    m.forget(("ns", "a"))
    assert gone(m, at) and gone(m, {**at, "replica": "1"})
