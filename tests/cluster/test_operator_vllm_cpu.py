"""Real vLLM engines at DP=2 on two real nodes, launched by the helm-installed operator from
`examples/dev-cpu.yaml` as it is checked in (issue 10).

vLLM's CPU build in the `vllm-dp-engine-cpu` test image serves the tiny model at
/models/tiny; Ray nodes hold logical GPUs from the nodes' advertised `nvidia.com/gpu`, so the
operator renders the example through the same code as a GPU one, and vLLM's own Ray
data-parallel backend places one engine on each pod.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import yaml

from .bed import REPO, RunningCluster
from .vdp import API_PORT, Vdp, http, import_engine

pytestmark = pytest.mark.cluster

IMAGE = "vllm-dp-engine-cpu"
EXAMPLE = REPO / "examples" / "dev-cpu.yaml"
NS = "t-vllm-cpu"


def example(ns: str, max_model_len: int | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["namespace"] = ns
    if max_model_len is not None:
        args = doc["spec"]["engineArgs"]
        args[:] = [f"--max-model-len={max_model_len}" if a.startswith("--max-model-len")
                   else a for a in args]  # fmt: skip
    return doc


def note(msg: str) -> None:
    sys.stderr.write(f"[vllm-cpu] {msg}\n")


@pytest.fixture(scope="module")
def vdp(operator: RunningCluster) -> Iterator[Vdp]:
    note(import_engine(operator, IMAGE))
    operator.kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=true",
                     timeout=180)  # fmt: skip
    operator.kubectl("create", "namespace", NS)
    operator.wait_until("the default ServiceAccount", lambda: operator.kubectl(
        "get", "sa", "default", "-n", NS, check=False).returncode == 0, 30)  # fmt: skip
    doc = example(NS)
    v = Vdp(operator, NS, doc["metadata"]["name"])
    t0 = time.monotonic()
    operator.apply(doc)
    v.wait("the RayCluster ready", lambda: v.status().get("rayCluster") and (
        operator.kubectl_json("get", "raycluster", v.status()["rayCluster"], "-n", NS)
        .get("status", {}).get("state") == "ready"), 300)  # fmt: skip
    note(f"RayCluster ready {time.monotonic() - t0:.0f}s after apply")
    v.wait_phase("Serving", 600)
    note(f"Serving {time.monotonic() - t0:.0f}s after apply")
    try:
        yield v
    finally:
        operator.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def completion(url: str, via: Any) -> dict[str, Any]:
    out: dict[str, Any] = via(f"{url}/v1/completions",
                              {"model": "tiny", "prompt": "hello world", "max_tokens": 4})
    return out


def test_serving_on_two_nodes_and_answers(vdp: Vdp) -> None:
    pods = vdp.pods()
    assert pods["head"]["spec"]["nodeName"] != pods["worker"]["spec"]["nodeName"]
    ip = vdp.service_ip()
    host = f"http://{ip}:{API_PORT}"
    dns = f"http://{vdp.name}-api.{vdp.ns}.svc.cluster.local:{API_PORT}"
    for base, via in ((host, http), (dns, vdp.from_pod)):
        out = completion(base, via)
        assert out["object"] == "text_completion" and out["model"] == "tiny"
        assert out["usage"]["completion_tokens"] >= 1 and len(out["choices"]) == 1
        chat = via(f"{base}/v1/chat/completions", {"model": "tiny", "max_tokens": 4,
                   "messages": [{"role": "user", "content": "hello"}]})  # fmt: skip
        assert chat["object"] == "chat.completion"
        assert chat["choices"][0]["message"]["role"] == "assistant"


def finished_by_engine(metrics: str) -> dict[str, float]:
    """vllm:request_success_total summed per `engine` label."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = re.search(r'engine="(\d+)"', line)
            if engine:
                out[engine[1]] = out.get(engine[1], 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_both_engines_finish_requests(vdp: Vdp) -> None:
    base = f"http://{vdp.service_ip()}:{API_PORT}"
    for _ in range(20):
        completion(base, http)
    done = finished_by_engine(http(f"{base}/metrics"))
    assert done.get("0", 0) > 0 and done.get("1", 0) > 0, done
    assert sum(done.values()) >= 20, done


def test_engine_only_change_relaunches_on_same_pods(vdp: Vdp) -> None:
    st = vdp.status()
    old_job = st["headJob"]
    old_sid = vdp.rayjob(old_job)["status"]["jobId"]  # type: ignore[index]
    uids = {role: p["metadata"]["uid"] for role, p in vdp.pods().items()}
    t0 = time.monotonic()
    vdp.cluster.apply(example(vdp.ns, max_model_len=128))
    new = vdp.wait("a new head job", lambda: (s := vdp.status()).get("headJob") != old_job
                   and s.get("headJob"), 180)  # fmt: skip
    vdp.wait_phase("Serving", 600, job=new)
    note(f"relaunch after an engine-only change: Serving again in {time.monotonic() - t0:.0f}s")
    assert {role: p["metadata"]["uid"] for role, p in vdp.pods().items()} == uids
    assert vdp.dashboard_jobs()[old_sid]["status"] == "STOPPED"
    models = http(f"http://{vdp.service_ip()}:{API_PORT}/v1/models")
    assert models["data"][0]["max_model_len"] == 128


def test_worker_pod_killed_relaunches_with_backoff(vdp: Vdp) -> None:
    st = vdp.status()
    old_job, failures = st["headJob"], st.get("consecutiveFailures", 0)
    worker = vdp.pods()["worker"]["metadata"]
    t0 = time.monotonic()
    vdp.cluster.kubectl("delete", "pod", worker["name"], "-n", vdp.ns, "--wait=false")

    def failure_counted() -> dict[str, Any] | None:
        s = vdp.status()
        return s if s.get("lastFailedJob") == old_job and s.get(
            "consecutiveFailures", 0) > failures else None  # fmt: skip

    gone = vdp.wait("the worker pod deleted", lambda: vdp.cluster.kubectl(
        "get", "pod", worker["name"], "-n", vdp.ns, check=False).returncode != 0, 120)  # fmt: skip
    note(f"worker pod deleted (shareProcessNamespace, Ray's SIGTERM) in "
         f"{time.monotonic() - t0:.1f}s")  # fmt: skip
    assert gone
    failed = vdp.wait("the head job's failure in status", failure_counted, 300)
    note(f"worker killed: failure counted after {time.monotonic() - t0:.0f}s "
         f"({failed.get('lastFailureReason')})")  # fmt: skip
    events = vdp.cluster.kubectl("get", "events", "-n", vdp.ns, "--field-selector",
                                 f"involvedObject.name={vdp.name}").stdout  # fmt: skip
    assert "HeadJobFailed" in events, events
    new = vdp.wait("a relaunch", lambda: (s := vdp.status()).get("headJob") not in (
        None, old_job) and s["headJob"], 300)  # fmt: skip
    # With backoff: the relaunch was created no sooner than the chart's base delay (5 s here)
    # after the failure was seen.
    created = vdp.rayjob(new)["metadata"]["creationTimestamp"]  # type: ignore[index]
    waited = (datetime.fromisoformat(created.replace("Z", "+00:00"))
              - datetime.fromisoformat(failed["lastFailureTime"].replace("Z", "+00:00")))
    assert waited.total_seconds() >= 4, (created, failed["lastFailureTime"])
    vdp.wait_phase("Serving", 600, job=new)
    note(f"worker killed: Serving again {time.monotonic() - t0:.0f}s later")
    assert vdp.pods()["worker"]["metadata"]["uid"] != worker["uid"]
    out = completion(f"http://{vdp.service_ip()}:{API_PORT}", http)
    assert out["object"] == "text_completion"


def test_delete_removes_everything(vdp: Vdp) -> None:
    t0 = time.monotonic()
    vdp.cluster.kubectl("delete", "vdp", vdp.name, "-n", vdp.ns, "--wait=true", timeout=120)
    vdp.wait("every child gone", lambda: vdp.children() == [], 180)
    note(f"delete: every child gone in {time.monotonic() - t0:.0f}s")
