"""Head jobs through their life on the control-plane test bed: the launch deadline, a stop
confirmed before the next launch, and the API Service routing only to a head that answers."""

from __future__ import annotations

import base64
import calendar
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from operator_proc import OperatorProcess
from scenario import (
    api_endpoints,
    apply,
    double_in_pod_network,
    example,
    head_pod,
    items,
    launch_command,
    ray_api,
    run_operator,
    status,
    wait_head_job,
    wait_phase,
)

pytestmark = pytest.mark.controlplane


def double_up(pod_ip: str) -> bool:
    """Whether the Ray job API double answers at a pod IP yet."""
    try:
        return ray_api(pod_ip, "GET", "/_double/log") is not None
    except OSError:
        return False


@pytest.fixture(scope="module")
def operator(testbed: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    yield from run_operator(testbed, tmp_path_factory)


@pytest.fixture
def ns(testbed_namespace: str) -> str:
    """A fresh namespace per test (conftest's testbed_namespace), under a short name."""
    return testbed_namespace


def test_launch_deadline_stops_counts_and_relaunches_with_backoff(
    testbed: Any, operator: OperatorProcess, ns: str
) -> None:
    """A head job that never serves is stopped at the launch deadline and relaunched.

    The test bed's KubeRay (a host process) cannot resolve the head Service's cluster DNS
    name, so its HTTPMode submission never reaches a dashboard: the RayJob stays Running with
    no Ray job status, a real stuck launch. The deadline turns that into a failure that names
    the stage, a Warning event, a stop, and a relaunch after the backoff.
    """
    doc = example("fill.yaml")
    doc["spec"]["launch"] = {"timeoutSeconds": 8}
    doc = apply(testbed, ns, doc)
    name = doc["metadata"]["name"]
    wait_phase(testbed, ns, name, "Launching")
    job = f"{name}-j00001"
    event = testbed.wait_until("a LaunchTimedOut Warning event", lambda: next((
        e for e in items(testbed, ns, "events")
        if e.get("reason") == "LaunchTimedOut" and e.get("type") == "Warning"), None),
        timeout=60)
    assert job in event["message"] and "timeoutSeconds (8s)" in event["message"]
    assert "the Ray dashboard had not accepted it" in event["message"], event["message"]
    st = status(testbed, ns, name)
    assert st["consecutiveFailures"] >= 1 and st["lastFailedJob"] == job
    assert "the Ray dashboard had not accepted it" in st["lastFailureReason"]
    wait_head_job(testbed, ns, name, f"{name}-j00002", timeout=60)
    st = status(testbed, ns, name)
    assert st["launchAttempts"] >= 2
    reasons = {e.get("reason") for e in items(testbed, ns, "events")}
    assert {"HeadJobRelaunched", "HeadJobStopping"} <= reasons
    # Nothing answered for the old Ray job within the confirm time: said so, not hidden.
    assert "HeadJobStopUnconfirmed" in reasons or "HeadJobStopped" in reasons


def test_engine_change_stops_the_old_ray_job_and_confirms_before_the_next(
    testbed: Any, operator: OperatorProcess, ns: str
) -> None:
    """Drain, stop, confirm, then relaunch: never two launches on the same GPUs.

    Doubles for what the kwok pods cannot run: vLLM's /health and the Ray job API, both in the
    test bed's pod network. The test submits the Ray job as KubeRay's HTTPMode would (KubeRay
    itself cannot resolve the head Service here), from the RayJob's own spec.
    """
    doc = example("dp4-tp2.yaml")
    doc["metadata"]["name"] = "drainer"
    doc["spec"]["launch"] = {"drainSeconds": 4}
    doc = apply(testbed, ns, doc)
    st = wait_phase(testbed, ns, "drainer", "Launching")
    cluster = st["rayCluster"]
    (job,) = items(testbed, ns, "rayjobs")
    pod_ip = head_pod(testbed, ns, cluster)["status"]["podIP"]
    with double_in_pod_network(testbed, "ray_jobs_api.py", 8265), \
            double_in_pod_network(testbed, "health_server.py", 8000):  # fmt: skip
        testbed.wait_until("the Ray job API double to listen", lambda: double_up(pod_ip))
        ray_api(pod_ip, "POST", "/api/jobs/", {
            "entrypoint": job["spec"]["entrypoint"], "submission_id": job["spec"]["jobId"],
            "runtime_env": yaml.safe_load(job["spec"]["runtimeEnvYAML"])})  # fmt: skip
        wait_phase(testbed, ns, "drainer", "Serving", timeout=60)
        testbed.wait_until("the API Service to route to the head",
                           lambda: api_endpoints(testbed, ns, "drainer") == [pod_ip])

        doc["spec"]["engineArgs"] = ["--max-model-len", "4096"]
        testbed.apply(doc)

        def stop_sent() -> float | None:
            return next((e["time"] for e in ray_api(pod_ip, "GET", "/_double/log")
                         if e["method"] == "POST" and e["path"].endswith("/stop")), None)

        stopped_at = testbed.wait_until("the operator to stop the Ray job", stop_sent, timeout=30)
        # Through the real API server's service proxy, every call of the operator carried the
        # cluster's Ray token (the Secret the operator created and never read) in KubeRay's
        # header; the operator's own credential in Authorization ended at the API server.
        # Every cluster of the resource names one Secret (one key, one uid).
        (secret,) = {cl["spec"]["authOptions"]["secretName"]
                     for cl in items(testbed, ns, "rayclusters")}  # fmt: skip
        token = base64.b64decode(testbed.kubectl(
            "-n", ns, "get", "secret", secret, "-o",
            "jsonpath={.data.auth_token}").stdout).decode()  # fmt: skip
        calls = [e for e in ray_api(pod_ip, "GET", "/_double/log")
                 if e["path"].startswith("/api/jobs/drainer-") and (
                     e["method"] == "GET" or e["path"].endswith("/stop"))]  # fmt: skip
        assert calls and all(e["x_ray_authorization"] == f"Bearer {token}" for e in calls), calls
        assert all(e["authorization"] is None for e in calls), calls
        # While Ray drains the job, nothing new runs and no request is routed to the head.
        assert [j["metadata"]["name"] for j in items(testbed, ns, "rayjobs")] == [job["metadata"]
                                                                                  ["name"]]
        # Unrouted before the stop was sent (the slice's endpoint turned unready first).
        assert api_endpoints(testbed, ns, "drainer") == []
        assert [j["metadata"]["name"] for j in items(testbed, ns, "rayjobs")] == [job["metadata"]
                                                                                  ["name"]]
        wait_head_job(testbed, ns, "drainer", "drainer-j00002", timeout=30)
        new = next(j for j in items(testbed, ns, "rayjobs")
                   if j["metadata"]["name"] == "drainer-j00002")
        created = calendar.timegm(time.strptime(new["metadata"]["creationTimestamp"],
                                                "%Y-%m-%dT%H:%M:%SZ"))
        # Ray kills the job only after the drain grace; the operator waited for that.
        assert created >= stopped_at + 4 - 1.5, (created, stopped_at)
        assert ray_api(pod_ip, "GET", f"/api/jobs/{job['spec']['jobId']}")["status"] == "STOPPED"
        assert "--max-model-len" in launch_command(new)
        events = items(testbed, ns, "events")
        assert any(e.get("reason") == "HeadJobStopped" for e in events)
        assert not any(e.get("reason") == "HeadJobStopUnconfirmed" for e in events)
        testbed.wait_until("the old RayJob to go", lambda: all(
            j["metadata"]["name"] != job["metadata"]["name"]
            for j in items(testbed, ns, "rayjobs")), timeout=30)


def test_serving_once_health_answers_and_only_then_the_service_routes(
    testbed: Any, operator: OperatorProcess, ns: str
) -> None:
    """/health of the head pod through the API server's proxy, answered by a test double.

    The test bed routes pod IPs into a network namespace of its own; a /health double runs
    there. The API Service selects the head only once the operator labels it for a passing
    /health, and drops it only when /health has failed in a row over the unroute threshold
    (3 probes over 6 s in this tier).
    """
    doc = example("dp4-tp2.yaml")
    doc["metadata"]["name"] = "serving"
    apply(testbed, ns, doc)
    st = wait_phase(testbed, ns, "serving", "Launching")
    pod_ip = head_pod(testbed, ns, st["rayCluster"])["status"]["podIP"]
    assert api_endpoints(testbed, ns, "serving") == []  # Ray ready, vLLM not: no route
    with double_in_pod_network(testbed, "health_server.py", 8000):
        st = wait_phase(testbed, ns, "serving", "Serving", timeout=60)
        ready = next(c for c in st["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True" and "200" in ready["message"]
        assert "-head-svc:8000" in ready["message"]  # asked of the head pod itself
        # Events have their own writer, which may post just after the status patch.
        testbed.wait_until(
            "an EngineHealthy event",
            lambda: any(e.get("reason") == "EngineHealthy" for e in items(testbed, ns, "events")),
            timeout=15,
        )
        testbed.wait_until("the API Service to route to the head",
                           lambda: api_endpoints(testbed, ns, "serving") == [pod_ip])
    stopped = time.monotonic()
    st = wait_phase(testbed, ns, "serving", "Launching", timeout=60)
    assert "not routed" in st["message"]
    assert time.monotonic() - stopped >= 6  # not at the first failed probe
    testbed.wait_until("the API Service to stop routing",
                       lambda: api_endpoints(testbed, ns, "serving") == [])
