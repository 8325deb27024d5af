"""The operator as a real kopf process against a real API server, KubeRay and kwok GPU nodes."""

from __future__ import annotations

import copy
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_proc import OperatorProcess, install_crd
from vllm_dp_operator.plan import build_plan
from vllm_dp_operator.validation import validate

pytestmark = pytest.mark.controlplane

REPO = Path(__file__).resolve().parents[2]


def example(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / name).read_text())
    return doc


@pytest.fixture(scope="module")
def operator(testbed: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    install_crd(testbed)
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    proc = OperatorProcess(testbed.env(), log)
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture
def ns(testbed_namespace: str) -> str:
    """A fresh namespace per test (conftest's testbed_namespace), under a short name."""
    return testbed_namespace


def apply(testbed: Any, ns: str, doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    doc["metadata"]["namespace"] = ns
    testbed.apply(doc)
    return doc


def vdp(testbed: Any, ns: str, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = testbed.kubectl_json("-n", ns, "get", "vdp", name)
    return obj


def status(testbed: Any, ns: str, name: str) -> dict[str, Any]:
    st: dict[str, Any] = vdp(testbed, ns, name).get("status") or {}
    return st


def items(testbed: Any, ns: str, kind: str, selector: str = "") -> list[dict[str, Any]]:
    args = ["-n", ns, "get", kind] + (["-l", selector] if selector else [])
    found: list[dict[str, Any]] = testbed.kubectl_json(*args)["items"]
    return found


def ray_pods(testbed: Any, ns: str, cluster: str) -> list[dict[str, Any]]:
    return items(testbed, ns, "pods", f"ray.io/cluster={cluster}")


def wait_phase(testbed: Any, ns: str, name: str, phase: str, timeout: float = 90) -> dict[str, Any]:
    st: dict[str, Any] = testbed.wait_until(
        f"{name} phase {phase}",
        lambda: (s := status(testbed, ns, name)).get("phase") == phase and s,
        timeout=timeout,
    )
    return st


def wait_head_job(testbed: Any, ns: str, name: str, job: str, timeout: float = 90) -> None:
    testbed.wait_until(
        f"head job {job}",
        lambda: any(j["metadata"]["name"] == job for j in items(testbed, ns, "rayjobs")),
        timeout=timeout,
    )


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
    assert st["headJob"] == f"{name}-launch-1"
    (job,) = items(testbed, ns, "rayjobs")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster}
    (svc,) = items(testbed, ns, "services", "app.kubernetes.io/component=api")
    assert svc["spec"]["selector"] == {"ray.io/cluster": cluster, "ray.io/node-type": "head"}
    assert st["endpoint"] == f"http://{name}-api.{ns}.svc:8000/v1"
    conds = {c["type"]: c["status"] for c in st["conditions"]}
    assert conds["SpecValid"] == "True" and conds["ClusterReady"] == "True"
    table = testbed.kubectl("-n", ns, "get", "vdp", name).stdout.split("\n")
    assert table[0].split() == ["NAME", "DP", "TP", "PODS", "PHASE", "ENDPOINT", "AGE"]
    assert table[1].split()[1:5] == ["8", "1", "2", "Launching"]


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
            "--max-model-len" in j["spec"]["entrypoint"] and j["metadata"]["name"] != first_job
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


def test_failed_head_job_is_relaunched_with_backoff_and_warning(
    testbed: Any, operator: OperatorProcess, ns: str
) -> None:
    """A head job fails through the real Job and RayJob controllers, and is relaunched.

    The test bed runs no Ray dashboard, so after the submitter pod finishes KubeRay cannot
    read the Ray job's status and fails the RayJob once its 30 s grace period is over
    (JobDeploymentStatusTransitionGracePeriodExceeded): a real failure path, not a fake.
    """
    doc = apply(testbed, ns, example("fill.yaml"))
    name = doc["metadata"]["name"]
    wait_phase(testbed, ns, name, "Launching")
    job = f"{name}-launch-1"
    testbed.wait_until("the first head job to fail", lambda: any(
        j["metadata"]["name"] == job and j.get("status", {}).get("jobDeploymentStatus") == "Failed"
        for j in items(testbed, ns, "rayjobs")), timeout=120)
    event = testbed.wait_until("a Warning event for the failed head job", lambda: next((
        e for e in items(testbed, ns, "events")
        if e.get("reason") == "HeadJobFailed" and e.get("type") == "Warning"), None))
    assert job in event["message"] and "Failed" in event["message"]
    st = status(testbed, ns, name)
    assert st["consecutiveFailures"] >= 1 and st["lastFailedJob"] == job
    wait_head_job(testbed, ns, name, f"{name}-launch-2", timeout=60)
    st = status(testbed, ns, name)
    assert st["launchAttempts"] >= 2
    assert any(e.get("reason") == "HeadJobRelaunched" for e in items(testbed, ns, "events"))


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
    ("resources.cpu", {"dataParallel": {"size": 8, "ranksPerNode": 4}, "resources": {"cpu": "2"}}),
    ("env", {"env": [{"name": "VLLM_PORT", "value": "1"}]}),
    ("env", {"env": [{"name": "HF_TOKEN", "value": "hf_xxx"}]}),
    ("dataParallel.packStrategy", {"dataParallel": {"size": 4, "ranksPerNode": 2,
                                                    "packStrategy": "spread"}}),
    ("shmSize", {"shmSize": "lots"}),
    ("bogusField", {"bogusField": 1}),
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


def test_serving_once_health_answers_through_the_service(
    testbed: Any, operator: OperatorProcess, ns: str
) -> None:
    """/health through the API server's service proxy, answered by a test host.

    The test bed routes pod IPs into a network namespace of its own; a /health double runs
    there, so the operator's real probe path (Service, endpoints, service proxy) is exercised.
    """
    net = testbed.info.get("pod_network")
    if not net:
        pytest.fail("the test bed has no pod network (needs root and iproute2)", pytrace=False)
    doc = example("dp4-tp2.yaml")
    doc["metadata"]["name"] = "serving"
    apply(testbed, ns, doc)
    wait_phase(testbed, ns, "serving", "Launching")
    server = subprocess.Popen(["ip", "netns", "exec", net["netns"], sys.executable,
                               str(REPO / "tests" / "doubles" / "health_server.py"),
                               "--port", "8000"])  # fmt: skip
    try:
        st = wait_phase(testbed, ns, "serving", "Serving", timeout=60)
        ready = next(c for c in st["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True" and "200" in ready["message"]
        assert any(e.get("reason") == "EngineHealthy" for e in items(testbed, ns, "events"))
    finally:
        server.terminate()
        server.wait(timeout=10)
    st = wait_phase(testbed, ns, "serving", "Launching", timeout=60)
    assert "not answering" in st["message"]
