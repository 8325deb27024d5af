"""KEDA ScaledObjects in the chart (autoscaling.scaledObjects): none by default; one per entry,
each scaling its VLLMDataParallel through /scale on series the engine PodMonitor labels. Applied
to a real API server and scaling real engines in the autoscaling tier
(tests/cluster/test_operator_vllm_cpu.py, `make test-autoscaling`)."""

from __future__ import annotations

import re
from typing import Any

import chartlib
from vllm_dp_operator import constants as c
from vllm_dp_operator.api import crd

ENTRY = ("autoscaling.scaledObjects[0].name=dev-cpu",
         "autoscaling.scaledObjects[0].namespace=team-a")  # fmt: skip


def _scaled_objects(*values: str) -> list[dict[str, Any]]:
    return chartlib.by_kind(chartlib.render(set_values=values), "ScaledObject")


def test_none_by_default(helm_bin: str) -> None:
    assert _scaled_objects() == []


def test_an_entry_scales_its_resource_through_the_scale_subresource(helm_bin: str) -> None:
    (so,) = _scaled_objects(*ENTRY)
    assert so["metadata"] == {**so["metadata"], "name": "dev-cpu", "namespace": "team-a"}
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": f"{c.GROUP}/{c.VERSION}",
                                            "kind": c.KIND, "name": "dev-cpu"}  # fmt: skip
    # The CRD has the subresource KEDA's HPA scales through.
    scale = crd.build_crd()["spec"]["versions"][0]["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.replicas"
    spec = so["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 4)
    # Replicas leave one at a time, after the chosen stabilization window.
    down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] == 300
    assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 30}]
    waiting, kv = spec["triggers"]
    assert (waiting["type"], waiting["metricType"], waiting["metadata"]["threshold"]) == (
        "prometheus", "AverageValue", "4")  # fmt: skip
    assert "vllm:num_requests_waiting{" in waiting["metadata"]["query"]
    assert (kv["metricType"], kv["metadata"]["threshold"]) == ("Value", "0.85")
    assert "vllm:kv_cache_usage_perc{" in kv["metadata"]["query"]


def test_queries_select_the_labels_the_engine_pod_monitor_writes(helm_bin: str) -> None:
    objects = chartlib.render(set_values=(*ENTRY, "metrics.podMonitor.enabled=true"))
    (monitor,) = chartlib.by_kind(objects, "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    written = {r["targetLabel"] for r in endpoint["relabelings"]}
    (so,) = chartlib.by_kind(objects, "ScaledObject")
    for trigger in so["spec"]["triggers"]:
        query = trigger["metadata"]["query"]
        selected = dict(re.findall(r'(\w+)="([^"]*)"', query))
        assert selected == {"namespace": "team-a", "vllmdataparallel": "dev-cpu"}, query
        assert set(selected) <= written, (query, written)


def test_an_entry_overrides_the_defaults_zeros_included(helm_bin: str) -> None:
    (so,) = _scaled_objects(*ENTRY, "autoscaling.scaledObjects[0].minReplicas=0",
                            "autoscaling.scaledObjects[0].kvCacheUsage=0",
                            "autoscaling.scaledObjects[0].waitingPerReplica=2",
                            "autoscaling.defaults.maxReplicas=3")  # fmt: skip
    spec = so["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 3)
    assert [t["name"] for t in spec["triggers"]] == ["waiting"]  # 0: no KV-cache trigger
    assert spec["triggers"][0]["metadata"]["threshold"] == "2"


def test_an_entry_without_its_namespace_is_refused_by_name(helm_bin: str) -> None:
    proc = chartlib.helm("template", *chartlib.template_args(
        set_values=("autoscaling.scaledObjects[0].name=dev-cpu",)), check=False)  # fmt: skip
    assert proc.returncode != 0
    assert "autoscaling/scaledObjects/0" in proc.stderr and "namespace" in proc.stderr
