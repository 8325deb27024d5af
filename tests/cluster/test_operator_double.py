"""The operator, installed by helm, on real nodes with the engine-double image (issue 9).

Everything is real except vLLM: the operator pod (in-cluster config, its ServiceAccount, the
chart's RBAC, the `service-dns` probe), KubeRay, Ray head and worker pods on two kubelets, the
head job submitted over the Ray dashboard's HTTP API, the launcher gating on both Ray nodes and
running its preflight across the pods, cluster DNS, kube-proxy. `vllm` in the image is the
OpenAI test double (tests/e2e/openai_double.py over tests/doubles/vllm).

What proves what: the pods' nodes (real pods on two nodes), the launcher's stage lines in the
Ray job log (cross-node Ray), the ClusterIP from the host and a pod (Service), phase `Serving`
and the stopped old Ray job (the in-cluster operator and its probe).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .bed import RunningCluster
from .vdp import API_PORT, Vdp, import_engine

pytestmark = pytest.mark.cluster

IMAGE = "vllm-dp-engine-double"
NAME = "double"


def resource(ns: str, extra_args: list[str]) -> dict[str, Any]:
    return {"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel",
            "metadata": {"name": NAME, "namespace": ns},
            "spec": {"model": "cluster/double-model", "servedModelName": "double",
                     "image": f"{IMAGE}:dev", "dataParallel": {"size": 2, "ranksPerNode": 1},
                     # 1 CPU a pod, 2 on the head (one API server): the two cannot share a
                     # 2-CPU node, and DP=2 with one rank per pod asks two pods anyway.
                     "apiServerCount": 1, "resources": {"cpu": "1", "memory": "1Gi"},
                     "shmSize": "64Mi", "engineArgs": extra_args,
                     "launch": {"timeoutSeconds": 300, "drainSeconds": 3}}}  # fmt: skip


@pytest.fixture(scope="module")
def vdp(operator: RunningCluster, ns: str) -> Iterator[Vdp]:
    import_engine(operator, IMAGE)
    operator.apply(resource(ns, ["--max-num-seqs=4"]))
    yield Vdp(operator, ns, NAME)


@pytest.fixture(scope="module")
def ns(operator: RunningCluster) -> Iterator[str]:
    name = "t-double"
    operator.kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=true",
                     timeout=180)  # fmt: skip
    operator.kubectl("create", "namespace", name)
    operator.wait_until("the default ServiceAccount", lambda: operator.kubectl(
        "get", "sa", "default", "-n", name, check=False).returncode == 0, 30)  # fmt: skip
    yield name
    operator.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_serving_across_two_nodes(vdp: Vdp) -> None:
    st = vdp.wait_phase("Serving", 300)
    pods = vdp.pods()
    head, worker = pods["head"], pods["worker"]
    assert head["spec"]["nodeName"] != worker["spec"]["nodeName"], "DP=2 spans two nodes"
    assert {head["spec"]["nodeName"], worker["spec"]["nodeName"]} <= set(
        vdp.cluster.node_names)  # fmt: skip
    job = vdp.rayjob(st["headJob"])
    assert job and job["spec"]["submissionMode"] == "HTTPMode"
    # The launcher gated on both Ray nodes, ran its preflight, then exec'd the engine.
    logs = vdp.job_logs(job["status"]["jobId"])
    for stage in ("stage=waiting-for-cluster nodes=2", "stage=preflight nodes=2",
                  "stage=engine-starting", "stage=serving"):  # fmt: skip
        assert stage in logs, f"{stage!r} not in the head job's log:\n{logs[-3000:]}"


def test_service_answers_from_host_and_pod(vdp: Vdp) -> None:
    vdp.wait_phase("Serving", 120)
    ip = vdp.service_ip()
    from .vdp import http

    assert http(f"http://{ip}:{API_PORT}/health") in ("", {})
    out = http(f"http://{ip}:{API_PORT}/v1/completions", {"model": "double", "prompt": "hi"})
    assert out["object"] == "text_completion" and out["model"] == "double"
    dns = f"http://{NAME}-api.{vdp.ns}.svc.cluster.local:{API_PORT}"
    assert vdp.from_pod(f"{dns}/health") in ("", {})
    out = vdp.from_pod(f"{dns}/v1/completions", {"model": "double", "prompt": "hi"})
    assert out["object"] == "text_completion"


def test_engine_only_change_relaunches_on_same_pods(vdp: Vdp) -> None:
    st = vdp.wait_phase("Serving", 120)
    old_job = st["headJob"]
    old_sid = vdp.rayjob(old_job)["status"]["jobId"]  # type: ignore[index]
    uids = {role: p["metadata"]["uid"] for role, p in vdp.pods().items()}
    vdp.cluster.apply(resource(vdp.ns, ["--max-num-seqs=6"]))
    new = vdp.wait("a new head job", lambda: (s := vdp.status()).get("headJob") != old_job
                   and s.get("headJob"), 120)  # fmt: skip
    vdp.wait_phase("Serving", 180, job=new)
    assert {role: p["metadata"]["uid"] for role, p in vdp.pods().items()} == uids
    jobs = vdp.dashboard_jobs()
    assert jobs[old_sid]["status"] == "STOPPED", jobs[old_sid]
    ip = vdp.service_ip()
    from .vdp import http

    argv = http(f"http://{ip}:{API_PORT}/double/argv")
    assert "--max-num-seqs=6" in argv["argv"] and "--max-num-seqs=4" not in argv["argv"]


def test_delete_removes_every_child(vdp: Vdp) -> None:
    assert vdp.children()
    vdp.cluster.kubectl("delete", "vdp", NAME, "-n", vdp.ns, "--wait=true", timeout=120)
    vdp.wait("every child gone", lambda: vdp.children() == [], 120)
