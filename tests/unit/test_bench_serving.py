"""The serving benchmark's pure pieces: its statistics, the operator's requests counted by
FlowSchema, and the engine fleet double's load model and exposition, read by the operator's
own parser."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from vllm_dp_operator.engines.engine_metrics import ExpositionError, parse_engine_loads
from vllm_dp_operator.engines.load_summary import level_of as operator_level

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "doubles"))

import benchlib  # noqa: E402
import engine_fleet  # noqa: E402


def test_percentile_median_and_spread() -> None:
    values = [float(v) for v in range(1, 101)]
    random.Random(0).shuffle(values)
    assert benchlib.pct(values, 0.99) == 99.0
    assert benchlib.pct(values, 0.5) == 50.0
    assert benchlib.pct([7.0], 0.99) == 7.0
    assert benchlib.median([3.0, 1.0, 2.0]) == 2.0
    assert benchlib.spread([3.0, 1.0, 2.0]) == (1.0, 3.0)


def test_requests_are_counted_per_flow_schema_of_the_operator_only() -> None:
    fs = benchlib.FLOW_SCHEMA
    text = "\n".join([
        f'apiserver_flowcontrol_dispatched_requests_total{{flow_schema="{fs}",'
        'priority_level="workload-high"} 5',
        f'apiserver_flowcontrol_dispatched_requests_total{{flow_schema="{fs}-status",'
        'priority_level="workload-high"} 2',
        f'apiserver_flowcontrol_dispatched_requests_total{{flow_schema="{fs}-leases",'
        'priority_level="workload-high"} 1e+03',
        'apiserver_flowcontrol_dispatched_requests_total{flow_schema="service-accounts",'
        'priority_level="workload-low"} 99',
        f'apiserver_flowcontrol_dispatched_requests_total{{flow_schema="{fs}-lease-reads",'
        'priority_level="workload-high"} 3',
        f'apiserver_flowcontrol_dispatched_requests_total{{flow_schema="{fs}-leasesx",'
        'priority_level="workload-high"} 7',
        'apiserver_request_total{code="200",component="apiserver",resource="services",'
        'scope="resource",subresource="proxy",verb="GET",version="v1"} 40',
        'apiserver_request_total{code="503",component="apiserver",resource="services",'
        'scope="resource",subresource="proxy",verb="GET",version="v1"} 2',
        'apiserver_request_total{code="200",component="apiserver",resource="services",'
        'scope="resource",subresource="",verb="GET",version="v1"} 99',
    ])  # fmt: skip
    assert benchlib.operator_requests_by_kind(text) == {
        "other": 5.0, "leases": 1000.0, "lease-reads": 3.0, "status": 2.0, "writes": 0.0}
    assert benchlib.operator_requests(text) == 1010.0
    assert benchlib.operator_requests(text, benchlib.LEASES) == 1003.0
    assert benchlib.proxy_requests(text) == 42.0


@pytest.mark.parametrize("regime", [engine_fleet.IDLE, engine_fleet.BUSY, engine_fleet.SATURATED])
def test_each_regime_reads_as_its_level_to_the_operator(regime: str) -> None:
    rng = random.Random(1)
    block = engine_fleet.render_block(8, 1000, rng)
    for _ in range(50):
        loads = engine_fleet.draw_loads(regime, 8, rng)
        parsed = parse_engine_loads(block + engine_fleet.render_gauges(loads))
        assert sorted(parsed) == list(range(8))
        assert [(p.running, p.waiting) for p in parsed.values()] == [
            (r.running, r.waiting) for r in loads]
        assert operator_level(parsed) == regime == engine_fleet.level_of(loads)


def test_the_exposition_is_the_size_of_vllms_for_8_ranks() -> None:
    text = engine_fleet.render_block(8, 1000, random.Random(2))
    assert 200 * 1024 < len(text) < 400 * 1024
    assert "vllm:time_to_first_token_seconds_bucket" in text
    assert parse_engine_loads(text) == {}  # the gauges come from render_gauges only


def test_the_flood_is_4_mib_of_made_up_ranks_the_operator_reads_no_further_than_the_cap(
) -> None:  # fmt: skip
    body = engine_fleet.hostile_exposition()
    assert len(body) >= 4 * 1024 * 1024
    text = body.decode()
    assert 'engine="16000"' in text and text.count("vllm:kv_cache_usage_perc{") > 16000
    with pytest.raises(ExpositionError, match="more than 80 series"):
        parse_engine_loads(text, ranks=8)


def test_a_hang_picks_the_engines_probed_next() -> None:
    fleet = engine_fleet.Fleet(8, regime_seconds=1800)
    for i, (prev, last) in enumerate([(0.0, 100.0), (90.0, 120.0), (95.0, 104.0), (0.0, 0.0)]):
        fleet.engine(f"10.244.0.{i}", 0.0).health_at = (prev, last)
    # Due at 130 (default 30 s period), 150, 113; never probed: not picked.
    assert engine_fleet.due_first(fleet.engines, 110.0, 30, 2) == ["10.244.0.2", "10.244.0.0"]
    assert engine_fleet.due_first(fleet.engines, 110.0, 10, 5) == ["10.244.0.2"]
    assert engine_fleet.due_first(fleet.engines, 140.0, 30, 5) == ["10.244.0.1"]


def test_an_engines_level_shifts_after_its_regime_time_and_is_counted() -> None:
    fleet = engine_fleet.Fleet(8, regime_seconds=10)
    eng = fleet.engine("10.244.0.7", 0.0)
    first = eng.until
    fleet.engine("10.244.0.7", first + 1000)
    assert eng.until > first + 1000
    assert len(fleet.shifts) >= 1 and all(t <= first + 1000 for t in fleet.shifts)
    assert fleet.engine("10.244.0.7", 0.0) is eng  # one engine per address


def test_the_audit_window_counts_each_request_once_by_user_verb_and_resource(
    tmp_path: Path,
) -> None:  # fmt: skip
    log = tmp_path / "audit.log"

    def line(user: str, verb: str, resource: str, stage: str = "ResponseComplete",
             sub: str = "") -> str:  # fmt: skip
        ref = {"resource": resource, **({"subresource": sub} if sub else {})}
        return json.dumps({"user": {"username": user}, "verb": verb, "stage": stage,
                           "objectRef": ref}) + "\n"  # fmt: skip

    op = "system:serviceaccount:vllmdp-bench-system:bench-op"
    log.write_text(line(op, "update", "leases"))  # before the window
    mark = benchlib.audit_mark(log)
    with log.open("a") as f:
        f.write(line(op, "update", "leases"))
        f.write(line("kuberay-operator", "update", "rayclusters", sub="status"))
        f.write(line(op, "watch", "customresourcedefinitions", stage="ResponseStarted"))
        f.write(line(op, "watch", "customresourcedefinitions"))  # the same watch, ending
        f.write(line(op, "list", "workloads"))
    assert benchlib.audited(mark, log) == {
        "vllmdp-bench-system:bench-op update leases": 1,
        "kuberay-operator update rayclusters/status": 1,
        "vllmdp-bench-system:bench-op watch customresourcedefinitions": 1,
        "vllmdp-bench-system:bench-op list workloads": 1,
    }
    log.write_text(line(op, "update", "leases"))  # rotated: shorter than the mark
    assert benchlib.audited(mark + 10_000, log) == {
        "audit log rotated": 1, "vllmdp-bench-system:bench-op update leases": 1}
