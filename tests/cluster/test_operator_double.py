"""The operator, installed by helm, on real nodes with the engine-double image (issue 9).

Everything is real except vLLM: the operator pod (in-cluster config, its ServiceAccount, the
chart's RBAC, the `service-dns` probe), KubeRay, Ray head and worker pods on two kubelets, the
head job submitted over the Ray dashboard's HTTP API, the launcher gating on both Ray nodes and
running its preflight across the pods, cluster DNS, kube-proxy. `vllm` in the image is the
OpenAI test double (tests/e2e/openai_double.py over tests/doubles/vllm), run in its PLACE
mode: like vLLM's Ray backend it places one GPU placement group per DP rank and starts one
engine actor in each, and when an actor dies it exits 0, as vLLM does.

What proves what: the pods' nodes (real pods on two nodes), the launcher's stage lines in the
Ray job log and the engine actors' nodes (cross-node Ray), the ClusterIP from the host and a
pod (Service), phase `Serving` and the stopped old Ray job (the in-cluster operator and its
probe), an engine-only relaunch with `healthProbe.mode: off` (issue 17's G: routed on the
launcher's own report), the worker pod's deletion (a failure counted, a relaunch after the
backoff, `Serving` again).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from .bed import RunningCluster
from .vdp import (
    API_PORT,
    OPERATOR_SA_USER,
    Vdp,
    http,
    import_engine,
    operator_values,
    own_namespace,
)

pytestmark = pytest.mark.cluster
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "chart"))
import chartlib  # noqa: E402

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
                     # The double's PLACE mode: placement groups and engine actors on Ray.
                     "env": [{"name": "VLLMDP_DOUBLE_PLACE", "value": "1"}],
                     "launch": {"timeoutSeconds": 300, "drainSeconds": 3}}}  # fmt: skip


@pytest.fixture(scope="module")
def vdp(operator: RunningCluster, ns: str) -> Iterator[Vdp]:
    import_engine(operator, IMAGE)
    operator.apply(resource(ns, ["--max-num-seqs=4"]))
    yield Vdp(operator, ns, NAME)


@pytest.fixture(scope="module")
def ns(operator: RunningCluster) -> Iterator[str]:
    name = "t-double"
    own_namespace(operator, name)
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
    # kube-proxy routes by the operator's EndpointSlice: the Service has no selector, and the
    # head pod carries no routing label (the operator writes no pod).
    svc = vdp.cluster.kubectl_json("get", "service", f"{NAME}-api", "-n", vdp.ns)
    assert "selector" not in svc["spec"], svc["spec"]
    head = vdp.pods()["head"]
    assert "vllmdp.io/serving" not in head["metadata"].get("labels", {})
    eps = vdp.cluster.kubectl_json("get", "endpointslices", "-n", vdp.ns, "-l",
                                   f"kubernetes.io/service-name={NAME}-api")["items"]  # fmt: skip
    assert [e["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"] for e in eps] == [
        "vllm-dp-operator.vllmdp.io"]
    [endpoint] = eps[0]["endpoints"]
    assert endpoint["addresses"] == [head["status"]["podIP"]]
    assert endpoint["conditions"]["ready"] is True
    ip = vdp.service_ip()
    assert http(f"http://{ip}:{API_PORT}/health") in ("", {})
    out = http(f"http://{ip}:{API_PORT}/v1/completions", {"model": "double", "prompt": "hi"})
    assert out["object"] == "text_completion" and out["model"] == "double"
    dns = f"http://{NAME}-api.{vdp.ns}.svc.cluster.local:{API_PORT}"
    assert vdp.from_pod(f"{dns}/health") in ("", {})
    out = vdp.from_pod(f"{dns}/v1/completions", {"model": "double", "prompt": "hi"})
    assert out["object"] == "text_completion"


def test_engine_only_change_relaunches_on_same_pods_with_probes_off(vdp: Vdp) -> None:
    """Also issue 17's scenario G: with healthProbe.mode off the operator sends no probe, and
    the relaunch serves on the launcher's own report alone (the launcher is the real one;
    only vLLM is the double)."""
    st = vdp.wait_phase("Serving", 120)
    old_job = st["headJob"]
    old_sid = vdp.rayjob(old_job)["status"]["jobId"]  # type: ignore[index]
    uids = {role: p["metadata"]["uid"] for role, p in vdp.pods().items()}
    operator_values("healthProbe.mode=off")
    try:
        vdp.cluster.apply(resource(vdp.ns, ["--max-num-seqs=6"]))
        new = vdp.wait("a new head job", lambda: (s := vdp.status()).get("headJob") != old_job
                       and s.get("headJob"), 120)  # fmt: skip
        served = vdp.wait_phase("Serving", 180, job=new)
    finally:
        operator_values()  # the bed's own values again, probes on
    ready = next(c for c in served["conditions"] if c["type"] == "Ready")
    assert "the launcher reports" in ready["message"], ready
    assert {role: p["metadata"]["uid"] for role, p in vdp.pods().items()} == uids
    jobs = vdp.dashboard_jobs()
    assert jobs[old_sid]["status"] == "STOPPED", jobs[old_sid]
    ip = vdp.service_ip()
    argv = http(f"http://{ip}:{API_PORT}/double/argv")
    assert "--max-num-seqs=6" in argv["argv"] and "--max-num-seqs=4" not in argv["argv"]


def test_operator_service_account_cannot_write_pods(vdp: Vdp) -> None:
    # The chart's RBAC as the API server applies it, asked as the operator's ServiceAccount.
    sa = OPERATOR_SA_USER

    def can_i(verb: str, resource: str, *where: str) -> str:
        proc = vdp.cluster.kubectl("auth", "can-i", verb, resource, f"--as={sa}", *where,
                                   check=False)  # fmt: skip
        lines = proc.stdout.strip().splitlines()
        return lines[-1] if lines else proc.stderr

    for where in (("--all-namespaces",), ("-n", vdp.ns)):
        for verb in ("patch", "update", "create", "delete"):
            assert can_i(verb, "pods", *where) == "no", (verb, where)
        assert can_i("patch", "pods", "--subresource=status", *where) == "no", where
        for verb in ("get", "list", "watch", "create", "patch", "delete"):
            assert can_i(verb, "endpointslices.discovery.k8s.io", *where) == "yes", (verb, where)
        assert can_i("list", "pods", *where) == "yes", where


def test_the_fence_refuses_the_operators_service_account(vdp: Vdp) -> None:
    """Issue 39, on this bed with the chart's defaults: as the operator's ServiceAccount
    (`--as`), a privileged RayCluster in kube-system, an EndpointSlice for the API server's own
    Service, and a patch of that Service are refused by the chart's admission policy, naming it,
    though its RBAC allows each; the resource it made serves (the module's other tests)."""
    vdp.wait_phase("Serving", 300)
    owner = [{"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel", "name": NAME,
              "uid": vdp.cluster.kubectl_json("get", "vdp", NAME, "-n", vdp.ns)["metadata"][
                  "uid"], "controller": True}]  # fmt: skip
    cluster = chartlib.privileged_raycluster(f"{IMAGE}:dev")
    hijack = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
              "metadata": {"name": "hijack", "namespace": "default", "ownerReferences": owner,
                           "labels": {"kubernetes.io/service-name": "kubernetes",
                                      "app.kubernetes.io/managed-by": "vllm-dp-operator"}},
              "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"]}],
              "ports": [{"name": "https", "port": 443}]}  # fmt: skip
    asks = [(("create", "-f", "-"), cluster), (("create", "-f", "-"), hijack),
            (("-n", "default", "patch", "service", "kubernetes", "--type=merge", "-p",
              '{"metadata": {"labels": {"stolen": "yes"}}}'), None)]  # fmt: skip
    for args, doc in asks:
        proc = vdp.cluster.kubectl(*args, "--dry-run=server", f"--as={OPERATOR_SA_USER}",
                                   input=json.dumps(doc) if doc else None, check=False)
        assert proc.returncode != 0, f"accepted as the operator: {args} {proc.stdout}"
        # The policy's name, {release}-vllm-dp-operator-fence, not RBAC's "forbidden".
        assert "vdp-vllm-dp-operator-fence" in proc.stderr, (args, proc.stderr)


def note(msg: str) -> None:
    sys.stderr.write(f"[double] {msg}\n")


def engines_alive(vdp: Vdp) -> list[str] | None:
    """The nodes (pod IPs) of the current launch's engine actors, from the double's record
    in the head pod (the last `engines-alive` event there)."""
    pod = vdp.pods()["head"]["metadata"]["name"]
    out = vdp.cluster.exec(vdp.ns, pod, "cat", "/tmp/vllm-double.jsonl", check=False).stdout
    alive = [r for line in out.splitlines() if (r := json.loads(line))["event"] ==
             "engines-alive"]  # fmt: skip
    return list(alive[-1]["nodes"]) if alive else None


def test_worker_pod_deleted_fails_and_relaunches_with_backoff(vdp: Vdp) -> None:
    st = vdp.wait_phase("Serving", 120)
    old_job, failures = st["headJob"], st.get("consecutiveFailures", 0)
    old_sid = vdp.rayjob(old_job)["status"]["jobId"]  # type: ignore[index]
    pods = vdp.pods()
    worker = pods["worker"]["metadata"]
    ips = {p["status"]["podIP"] for p in pods.values()}
    nodes = vdp.wait("both engine actors alive", lambda: engines_alive(vdp), 60)
    assert sorted(nodes) == sorted(ips), (nodes, ips)  # one engine actor on each pod
    t0 = time.monotonic()
    vdp.cluster.kubectl("delete", "pod", worker["name"], "-n", vdp.ns, "--wait=false")
    vdp.wait("the worker pod deleted", lambda: vdp.cluster.kubectl(
        "get", "pod", worker["name"], "-n", vdp.ns, check=False).returncode != 0, 120)  # fmt: skip
    note(f"worker pod deleted in {time.monotonic() - t0:.1f}s")

    def failure_counted() -> dict[str, Any] | None:
        s = vdp.status()
        return s if s.get("lastFailedJob") == old_job and s.get(
            "consecutiveFailures", 0) > failures else None  # fmt: skip

    failed = vdp.wait("the head job's failure in status", failure_counted, 180)
    note(f"failure counted {time.monotonic() - t0:.1f}s after the delete "
         f"({failed.get('lastFailureReason')})")  # fmt: skip
    assert "Ray job FAILED" in failed["lastFailureReason"], failed
    # The double saw its engine actor die and exited 0; the launcher made that a failure.
    log = vdp.job_logs(old_sid)
    assert "EngineDeadError" in log, log[-3000:]
    assert "stage=exited status=6 cause=engine-ended engine_status=0" in log, log[-3000:]
    events = vdp.cluster.kubectl_json("get", "events", "-n", vdp.ns, "--field-selector",
                                      f"involvedObject.name={vdp.name}")["items"]  # fmt: skip
    assert any(e["type"] == "Warning" and e["reason"] == "HeadJobFailed"
               and old_job in e["message"] for e in events), events  # fmt: skip
    new = vdp.wait("a relaunch", lambda: (s := vdp.status()).get("headJob") not in (
        None, old_job) and s["headJob"], 180)  # fmt: skip
    # With backoff: created no sooner than the chart's base delay (5 s here) after the failure.
    created = vdp.rayjob(new)["metadata"]["creationTimestamp"]  # type: ignore[index]
    failed_at = datetime.fromisoformat(failed["lastFailureTime"].replace("Z", "+00:00"))
    waited = datetime.fromisoformat(created.replace("Z", "+00:00")) - failed_at
    assert waited.total_seconds() >= 4, (created, failed["lastFailureTime"])
    note(f"relaunched {waited.total_seconds():.0f}s after the failure")
    vdp.wait_phase("Serving", 300, job=new)
    note(f"Serving again {time.monotonic() - t0:.0f}s after the delete")
    assert vdp.pods()["worker"]["metadata"]["uid"] != worker["uid"]
    out = http(f"http://{vdp.service_ip()}:{API_PORT}/v1/completions",
               {"model": "double", "prompt": "hi"})  # fmt: skip
    assert out["object"] == "text_completion"


def test_delete_removes_every_child(vdp: Vdp) -> None:
    assert vdp.children()
    vdp.cluster.kubectl("delete", "vdp", NAME, "-n", vdp.ns, "--wait=true", timeout=120)
    vdp.wait("every child gone", lambda: vdp.children() == [], 120)
