"""The Grafana dashboard's queries name metrics that exist: the operator's from its own
registry, vLLM's from the list docs/observability.md documents."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vllm_dp_operator.observability.metrics import OperatorMetrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "charts" / "vllm-dp-operator" / "dashboards" / "vllm-dp.json"
DOC = REPO / "docs" / "observability.md"
NAME = re.compile(r"\b(vllmdp_[a-z_]+|vllm:[a-z_]+)")
SUFFIXES = ("_bucket", "_count", "_sum")


def _queries(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            # "query" is also a variable's type ("prometheus"): only PromQL has parentheses.
            promql = key in ("expr", "definition") or (key == "query" and "(" in str(value))
            if promql and isinstance(value, str):
                yield value
            else:
                yield from _queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from _queries(item)


def _ours() -> set[str]:
    """Every series name the operator's registry exposes (with a resource, so none is empty)."""
    lora = {"adapters": [{"name": "sql", "replicas": [0]}]}
    m = OperatorMetrics(lambda: [(("ns", "demo"), {"phase": "Serving", "launchAttempts": 1,
                                                   "lora": lora})])
    m.reconciled("success", 0.01)
    m.time_to_serving.observe(60)
    text = generate_latest(m.registry).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def _vllm_documented() -> set[str]:
    """vLLM metric names in docs/observability.md's table of vLLM's metrics."""
    section = DOC.read_text().split("## vLLM's metrics", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`(vllm:[a-z_]+)`", section))


def _base(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def test_every_query_names_a_metric_that_exists() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = list(_queries(dashboard))
    assert len(queries) >= 15
    ours, vllm = _ours(), _vllm_documented()
    unknown = []
    for query in queries:
        for name in NAME.findall(query):
            known = name in ours if name.startswith("vllmdp_") else _base(name) in vllm
            if not known:
                unknown.append((name, query))
    assert not unknown, unknown


def test_the_dashboard_covers_each_view_the_issue_asks_for() -> None:
    text = json.dumps([q for q in _queries(json.loads(DASHBOARD.read_text()))])
    for name in ("vllmdp_resource_phase", "vllmdp_resource_launch_attempts",
                 "vllmdp_resource_consecutive_failures", "vllmdp_head_job_launches_total",
                 "vllmdp_head_job_failures_total", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket"):
        assert name in text, name
    # vLLM's per-engine series are shown per DP rank; its LoRA series has no engine label.
    per_rank = [q for q in _queries(json.loads(DASHBOARD.read_text()))
                if "vllm:" in q and "vllm:lora_requests_info" not in q]  # fmt: skip
    assert all("engine" in q for q in per_rank), "vLLM panels are per DP rank (label engine)"


def test_documented_vllm_metrics_include_the_ones_the_issue_names() -> None:
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds",
            "vllm:inter_token_latency_seconds", "vllm:request_success_total"} <= _vllm_documented()


def test_every_operator_metric_is_documented() -> None:
    doc = DOC.read_text()
    missing = [n for n in _ours() if not n.endswith("_created") and _base(n) not in doc
               and n not in doc]  # fmt: skip
    assert not missing, missing
