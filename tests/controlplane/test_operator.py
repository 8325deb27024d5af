"""The operator as a real kopf process against a real API server, KubeRay and kwok GPU nodes."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from common import kubectl_table
from operator_proc import OperatorProcess
from scenario import (
    REPO,
    apply,
    example,
    items,
    launch_command,
    ray_pods,
    run_operator,
    status,
    wait_head_job,
    wait_phase,
)
from vllm_dp_operator.api.validation import validate
from vllm_dp_operator.plan import build_plan

pytestmark = pytest.mark.controlplane


@pytest.fixture(scope="module")
def operator(testbed: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    yield from run_operator(testbed, tmp_path_factory)


@pytest.fixture
def ns(testbed_namespace: str) -> str:
    """A fresh namespace per test (conftest's testbed_namespace), under a short name."""
    return testbed_namespace

def test_example_becomes_cluster_pods_head_job_and_service(
    testbed: Any, operator: OperatorProcess, ns: str
) -> None:
    doc = apply(testbed, ns, example("dp8-rpn4-tp1.yaml"))
    name = doc["metadata"]["name"]
    plan = build_plan(validate(name, doc["spec"]))
    # Provisioning can last less than this poll's period (the operator reacts to KubeRay's
    # events at once), so wait for the RayCluster to be named, in whatever phase.
    first = testbed.wait_until(f"{name} to name its RayCluster", lambda: (
        s := status(testbed, ns, name)).get("rayCluster") and s, timeout=60)
    assert first["phase"] in ("Provisioning", "Launching")
    cluster = first["rayCluster"]
    assert items(testbed, ns, "rayclusters")[0]["metadata"]["name"] == cluster

    st = wait_phase(testbed, ns, name, "Launching")
    pods = ray_pods(testbed, ns, cluster)
    assert len(pods) == plan.gpu_pods
    for pod in pods:
        assert pod["spec"].get("nodeName"), "every Ray pod is bound to a simulated GPU node"
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == plan.gpus_per_pod
    assert st["headJob"] == f"{name}-j00001"
    (job,) = items(testbed, ns, "rayjobs")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster}
    assert job["spec"]["submissionMode"] == "HTTPMode"
    # KubeRay took it: no submitter Job, and no ValidationFailed.
    testbed.wait_until("KubeRay to take the head job", lambda: (
        items(testbed, ns, "rayjobs")[0].get("status") or {}).get("jobDeploymentStatus"))
    assert items(testbed, ns, "rayjobs")[0]["status"]["jobDeploymentStatus"] != "ValidationFailed"
    assert items(testbed, ns, "jobs.batch") == []
    (svc,) = items(testbed, ns, "services", "app.kubernetes.io/component=api")
    # No selector: the operator's EndpointSlice is its only source of endpoints.
    assert "selector" not in svc["spec"]
    (eps,) = items(testbed, ns, "endpointslices", f"kubernetes.io/service-name={name}-api")
    assert eps["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"] == \
        "vllm-dp-operator.vllmdp.io"
    assert eps["metadata"]["ownerReferences"][0]["kind"] == "VLLMDataParallel"
    assert all(not e["conditions"]["ready"] for e in eps.get("endpoints") or [])  # Launching
    assert st["endpoint"] == f"http://{name}-api.{ns}.svc:8000/v1"
    conds = {c["type"]: c["status"] for c in st["conditions"]}
    assert conds["SpecValid"] == "True" and conds["ClusterReady"] == "True"
    [row] = kubectl_table(testbed.kubectl("-n", ns, "get", "vdp", name).stdout)
    assert list(row) == ["NAME", "DP", "TP", "PODS", "READY", "PHASE", "UPDATE", "LOAD",
                         "ENDPOINT", "AGE"]  # fmt: skip
    assert [row[k] for k in ("DP", "TP", "PODS", "READY", "PHASE", "UPDATE")] == [
        "8", "1", "2", "0/1", "Launching", ""]  # fmt: skip


def test_too_many_gpus_stays_pending_with_actionable_status(
    testbed: Any, operator: OperatorProcess, ns: str
) -> None:
    doc = example("dp8-rpn4-tp1.yaml")
    doc["metadata"]["name"] = "toobig"
    doc["spec"]["gpu"] = {"perPod": 16}
    apply(testbed, ns, doc)
    st = testbed.wait_until(
        "an explanation of the pending pods",
        lambda: "cannot be scheduled" in ((s := status(testbed, ns, "toobig")).get("message") or "")
        and s,
        timeout=90,
    )
    assert st["phase"] == "Provisioning"
    assert "nvidia.com/gpu" in st["message"] and "gpu.perPod" in st["message"]
    assert items(testbed, ns, "rayjobs") == []


def test_engine_change_keeps_pods_and_shape_change_replaces_them(
    testbed: Any, operator: OperatorProcess, ns: str
) -> None:
    doc = apply(testbed, ns, example("dp4-tp2.yaml"))
    name = doc["metadata"]["name"]
    st = wait_phase(testbed, ns, name, "Launching")
    cluster = st["rayCluster"]
    uids = sorted(p["metadata"]["uid"] for p in ray_pods(testbed, ns, cluster))

    first_job = st["headJob"]
    doc["spec"]["engineArgs"] = ["--max-model-len", "4096"]
    testbed.apply(doc)

    def relaunched() -> bool:
        # Every head job left runs the new engine args, and the first one is gone.
        jobs = items(testbed, ns, "rayjobs")
        return bool(jobs) and all(
            "--max-model-len" in launch_command(j) and j["metadata"]["name"] != first_job
            for j in jobs
        )

    testbed.wait_until("a head job with the new engine args, the old one gone", relaunched)
    assert sorted(p["metadata"]["uid"] for p in ray_pods(testbed, ns, cluster)) == uids
    assert status(testbed, ns, name)["rayCluster"] == cluster

    doc["spec"]["dataParallel"]["size"] = 8
    testbed.apply(doc)
    new_plan = build_plan(validate(name, doc["spec"]))
    st = testbed.wait_until("a new cluster", lambda: (
        s := status(testbed, ns, name)).get("rayCluster") != cluster and s)
    new_cluster = st["rayCluster"]
    testbed.wait_until("old cluster and its pods gone", lambda: (
        [c["metadata"]["name"] for c in items(testbed, ns, "rayclusters")] == [new_cluster]
        and not ray_pods(testbed, ns, cluster)))
    wait_phase(testbed, ns, name, "Launching")
    pods = [p for p in items(testbed, ns, "pods", "app.kubernetes.io/component=engine")
            if not p["metadata"].get("deletionTimestamp")]
    assert len(pods) == new_plan.gpu_pods
    assert {p["metadata"]["labels"]["ray.io/cluster"] for p in pods} == {new_cluster}


def test_delete_removes_every_child(testbed: Any, operator: OperatorProcess, ns: str) -> None:
    doc = apply(testbed, ns, example("dp4-tp2.yaml"))
    name = doc["metadata"]["name"]
    wait_phase(testbed, ns, name, "Launching")
    testbed.kubectl("-n", ns, "delete", "vdp", name, "--wait=true", "--timeout=60s")
    selector = f"app.kubernetes.io/instance={name}"
    testbed.wait_until("children garbage-collected", lambda: all(
        not items(testbed, ns, kind, selector)
        for kind in ("rayclusters", "rayjobs", "services", "pods")), timeout=90)


INVALID = [
    ("dataParallel.size", {"dataParallel": {"size": 1, "ranksPerNode": 1}}),
    ("dataParallel.ranksPerNode", {"dataParallel": {"size": 4, "ranksPerNode": 0}}),
    ("dataParallel.size", {"dataParallel": {"size": 6, "ranksPerNode": 4}}),
    ("gpu.perPod", {"dataParallel": {"size": 4, "ranksPerNode": 2}, "gpu": {"perPod": 1}}),
    ("dataParallel.ranksPerNode",
     {"dataParallel": {"size": 4, "ranksPerNode": 2, "packStrategy": "span"},
      "gpu": {"perPod": 4}, "tensorParallelSize": 8}),
    ("gpu.perPod", {"dataParallel": {"size": 2, "ranksPerNode": 1, "packStrategy": "span"},
                    "tensorParallelSize": 8}),
    ("tensorParallelSize",
     {"dataParallel": {"size": 2, "ranksPerNode": 1, "packStrategy": "span"},
      "gpu": {"perPod": 4}, "tensorParallelSize": 6}),
    ("engineArgs", {"engineArgs": ["--tensor-parallel-size=2"]}),
    ("engineArgs", {"engineArgs": ["--data-parallel-size", "4"]}),
    ("engineArgs", {"engineArgs": ["--port", "9000"]}),
    ("service.port", {"service": {"port": 8265}}),
    ("service.port", {"service": {"port": 8080}}),
    ("service.port", {"service": {"port": 52365}}),
    ("service.port", {"service": {"port": 12345}}),
    ("service.port", {"service": {"port": 40000}}),
    ("resources.cpu", {"dataParallel": {"size": 8, "ranksPerNode": 4}, "resources": {"cpu": "2"}}),
    ("env", {"env": [{"name": "VLLM_PORT", "value": "1"}]}),
    ("env", {"env": [{"name": "HF_TOKEN", "value": "hf_xxx"}]}),
    # Secrets as literals, abbreviations of owned flags, a model that is a flag.
    ("env", {"env": [{"name": "HUGGING_FACE_HUB_TOKEN", "value": "hf_xxx"}]}),
    ("env", {"env": [{"name": "VLLM_API_KEY", "value": "sk-xxx"}]}),
    ("engineArgs", {"engineArgs": ["--api-key", "sk-xxx"]}),
    ("engineArgs", {"engineArgs": ["--tensor-parallel-si=2"]}),
    ("engineArgs", {"engineArgs": ["--api-server-c=1"]}),
    ("engineArgs", {"engineArgs": ["--data-parallel-back", "mp"]}),
    ("engineArgs", {"engineArgs": ["-n2"]}),
    ("model", {"model": "--tensor-parallel-size=8"}),
    ("serviceAccountName", {"serviceAccountName": "Engines_SA"}),
    ("dataParallel.packStrategy", {"dataParallel": {"size": 4, "ranksPerNode": 2,
                                                    "packStrategy": "spread"}}),
    ("shmSize", {"shmSize": "lots"}),
    ("bogusField", {"bogusField": 1}),
    # Who may reach the API port (the NetworkPolicy's allowFrom), and its switch.
    ("service.allowFrom", {"service": {"allowFrom": [{}]}}),
    ("service.allowFrom", {"service": {"allowFrom": []}}),
    ("service.allowFrom", {"service": {"allowFrom": [
        {"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}]}}),
    ("service.allowFrom", {"service": {"allowFrom": [
        {"podSelector": {"matchExpressions": [{"key": "/x", "operator": "Exists"}]}}]}}),
    ("service.allowFrom", {"service": {"allowFrom": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}}),
    ("networkPolicy.enabled", {"networkPolicy": {"enabled": "no"}}),
    ("ray.auth", {"ray": {"auth": "disabled"}, "networkPolicy": {"enabled": False}}),
    # The opt-in egress policy: it needs the policies on, and each destination is one thing.
    ("networkPolicy.egress.enabled", {"networkPolicy": {"enabled": False,
                                                        "egress": {"enabled": True}}}),
    ("networkPolicy.egress.allowTo", {"networkPolicy": {"egress": {"allowTo": [{}]}}}),
    ("networkPolicy.egress.allowTo", {"networkPolicy": {"egress": {"allowTo": [
        {"cidr": "10.0.0.0/8", "podSelector": {}}]}}}),
    ("networkPolicy.egress.allowTo", {"networkPolicy": {"egress": {"allowTo": [
        {"podSelector": {"matchExpressions": [{"key": "a", "operator": "Exists",
                                              "values": ["b"]}]}}]}}}),
    ("networkPolicy.egress.allowTo[0].cidr", {"networkPolicy": {"egress": {"allowTo": [
        {"cidr": "10.0.0.256/8"}]}}}),
    ("update.servingCheck", {"update": {"servingCheck": "Ping"}}),
    ("update.maxSurge", {"update": {"maxSurge": "lots"}}),
    ("update.maxUnavailable", {"update": {"strategy": "RollingUpdate",
                                          "maxUnavailable": "0%", "maxSurge": 0}}),
]


@pytest.mark.parametrize(("field", "override"), INVALID, ids=[f"{i}-{f}" for i, (f, _) in
                                                               enumerate(INVALID)])
def test_api_server_rejects_invalid_resource_naming_the_field(
    testbed: Any, operator: OperatorProcess, field: str, override: dict[str, Any]
) -> None:
    spec = {"model": "m", "dataParallel": {"size": 4, "ranksPerNode": 2}, **override}
    doc = {"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel",
           "metadata": {"name": "bad", "namespace": "default"}, "spec": spec}
    proc = testbed.kubectl("create", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert proc.returncode != 0, f"accepted an invalid resource: {spec}"
    assert f"spec.{field}" in proc.stderr, proc.stderr


@pytest.mark.parametrize("update", [
    {"strategy": "RollingUpdate", "maxUnavailable": "25%", "maxSurge": "50%"},
    {"strategy": "RollingUpdate", "maxUnavailable": 0, "maxSurge": "1%"},
    {"servingCheck": "Embedding"},
])  # fmt: skip
def test_api_server_accepts_percentages_and_serving_checks(
    testbed: Any, operator: OperatorProcess, update: dict[str, Any]
) -> None:
    spec = {"model": "m", "dataParallel": {"size": 4, "ranksPerNode": 2}, "replicas": 4,
            "update": update}
    doc = {"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel",
           "metadata": {"name": "good", "namespace": "default"}, "spec": spec}
    proc = testbed.kubectl("create", "--dry-run=server", "-f", "-",
                           input=yaml.safe_dump(doc), check=False)
    assert proc.returncode == 0, proc.stderr


def test_api_server_accepts_an_egress_policy(testbed: Any, operator: OperatorProcess) -> None:
    spec = {"model": "m", "dataParallel": {"size": 4, "ranksPerNode": 2},
            "networkPolicy": {"egress": {"enabled": True, "allowTo": [
                {"cidr": "10.20.0.0/16", "ports": [443]}, {"cidr": "2001:db8::/64"},
                {"namespaceSelector": {"matchLabels": {"team": "models"}}}]}}}  # fmt: skip
    doc = {"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel",
           "metadata": {"name": "good", "namespace": "default"}, "spec": spec}
    proc = testbed.kubectl("create", "--dry-run=server", "-f", "-",
                           input=yaml.safe_dump(doc), check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.stem)
def test_api_server_accepts_every_example(testbed: Any, operator: OperatorProcess,
                                          path: Path) -> None:  # fmt: skip
    proc = testbed.kubectl("apply", "--dry-run=server", "-f", str(path), check=False)
    assert proc.returncode == 0, proc.stderr


def test_name_too_long_rejected(testbed: Any, operator: OperatorProcess) -> None:
    doc = example("dp4-tp2.yaml")
    doc["metadata"] = {"name": "n" * 41, "namespace": "default"}
    proc = testbed.kubectl("create", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert proc.returncode != 0 and "metadata.name" in proc.stderr, proc.stderr
    assert "at most 40 characters" in proc.stderr


@pytest.mark.parametrize("bad", ["qwen2.5-dp8", "7b-dp"])
def test_name_that_is_not_dns_1035_rejected(testbed: Any, operator: OperatorProcess,
                                            bad: str) -> None:  # fmt: skip
    doc = example("dp4-tp2.yaml")
    doc["metadata"] = {"name": bad, "namespace": "default"}
    proc = testbed.kubectl("create", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert proc.returncode != 0, f"accepted {bad}"
    assert "metadata.name" in proc.stderr and "DNS-1035 label" in proc.stderr, proc.stderr


def test_forty_character_name_gets_a_rayjob_kuberay_accepts(
    testbed: Any, operator: OperatorProcess, ns: str
) -> None:
    name = ("q7b-dp8-" * 5)[:39] + "x"  # the longest name the CRD admits
    assert len(name) == 40
    doc = example("dp4-tp2.yaml")
    doc["metadata"]["name"] = name
    apply(testbed, ns, doc)
    job = f"{name}-j00001"
    assert len(job) == 47
    wait_head_job(testbed, ns, name, job)
    st = testbed.wait_until("KubeRay to take the 47-character RayJob", lambda: (
        items(testbed, ns, "rayjobs")[0].get("status") or {}).get("jobDeploymentStatus"))
    assert st != "ValidationFailed", items(testbed, ns, "rayjobs")[0]["status"]
    assert not any(e.get("reason") == "ValidationFailed" for e in items(testbed, ns, "events"))


def test_sigkill_mid_reconcile_then_restart_converges_without_duplicates(
    testbed: Any, operator: OperatorProcess, ns: str
) -> None:
    names = []
    for i in range(3):
        doc = example("dp4-tp2.yaml")
        doc["metadata"]["name"] = f"crash{i}"
        apply(testbed, ns, doc)
        names.append(doc["metadata"]["name"])
    operator.kill(signal.SIGKILL)  # mid-reconcile: children half made for some resources
    operator.start()
    for name in names:
        wait_phase(testbed, ns, name, "Launching")
    for name in names:
        selector = f"app.kubernetes.io/instance={name}"
        assert len(items(testbed, ns, "rayclusters", selector)) == 1
        assert len(items(testbed, ns, "rayjobs", selector)) == 1
        assert len(items(testbed, ns, "services", selector)) == 1
