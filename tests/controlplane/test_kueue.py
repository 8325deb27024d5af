"""Kueue admits the operator's RayClusters on the control-plane bed: real Kueue v0.17.0 with its
webhooks (tests/testbed/kueuebed.py), a ClusterQueue of 8 GPUs (one kwok node's), and the
operator's phases that say what the queue says.

Kueue runs only for this module (its fixture starts and stops it). Each test owns a namespace
labelled for Kueue's RayCluster webhooks, with a LocalQueue `gpu` in it. On the kwok bed a head
job stays in its first stage (KubeRay cannot reach a dashboard here), so "proceeds" means the
resource reaches Launching with its head job made.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from gcprobe import wait_gc_follows_rayclusters
from operator_proc import OperatorProcess
from scenario import apply, example, items, run_operator, status, wait_phase

pytestmark = pytest.mark.controlplane

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "testbed"))
import kueuebed  # noqa: E402

TESTBED_PY = REPO / "tests" / "testbed" / "testbed.py"


def _testbed(testbed: Any, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLLMDP_TESTBED_DIR": str(testbed.state_dir)}
    return subprocess.run([sys.executable, str(TESTBED_PY), *args], env=env, text=True,
                          capture_output=True, timeout=1800)  # fmt: skip


@pytest.fixture(scope="module")
def operator(testbed: Any, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[OperatorProcess]:  # fmt: skip
    """Started before Kueue is installed: every test here needs it to notice Kueue's
    Workloads with no restart."""
    KUEUE_BEFORE.append(testbed.kubectl("get", "crd", "workloads.kueue.x-k8s.io",
                                        check=False).returncode == 0)  # fmt: skip
    yield from run_operator(testbed, tmp_path_factory)


#: Whether Kueue's CRDs were on the bed when the module's operator started (`kueue-down`
#: keeps them, so a bed reused after an earlier run has them).
KUEUE_BEFORE: list[bool] = []


@pytest.fixture(scope="module")
def kueue(testbed: Any, operator: OperatorProcess) -> Iterator[None]:
    """Kueue with its webhooks and the bed's ClusterQueue, for this module only."""
    up = _testbed(testbed, "kueue-up")
    if up.returncode != 0:
        pytest.fail(f"Kueue did not start (rc={up.returncode}):\n{up.stdout[-3000:]}\n"
                    f"{up.stderr[-6000:]}\n{testbed.log_tail('kueue')}", pytrace=False)  # fmt: skip
    # Deleting a resource frees its quota only through the collector: an earlier module may
    # have left it behind (gcprobe.py).
    took = wait_gc_follows_rayclusters(testbed)
    sys.stderr.write(f"[kueue] the garbage collector follows RayClusters ({took:.1f}s)\n")
    try:
        yield
    finally:
        # Kueue removes its own finalizers from the namespaces' objects: let it, then stop it.
        selector = f"{kueuebed.NAMESPACE_LABEL}=true"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and testbed.kubectl(
                "get", "namespaces", "-l", selector, "-o", "name").stdout.strip():
            time.sleep(1)
        down = _testbed(testbed, "kueue-down")
        assert down.returncode == 0, down.stderr


@pytest.fixture
def ns(testbed: Any, testbed_namespace: str, kueue: None) -> str:
    """The test's namespace, seen by Kueue's webhooks, with the LocalQueue `gpu`."""
    testbed.kubectl("label", "namespace", testbed_namespace, f"{kueuebed.NAMESPACE_LABEL}=true")
    testbed.apply(kueuebed.local_queue(testbed_namespace))
    return testbed_namespace


def queued(name: str, priority: str | None = None, queue: str = "gpu") -> dict[str, Any]:
    """A DP=8 resource (two pods of 4 GPUs: the whole quota) in a LocalQueue."""
    doc = copy.deepcopy(example("dp8-rpn4-tp1.yaml"))
    doc["metadata"]["name"] = name
    doc["spec"]["scheduling"] = {"queueName": queue,
                                 **({"priorityClassName": priority} if priority else {})}
    return doc


def cluster_of(testbed: Any, ns: str, name: str) -> dict[str, Any]:
    cluster = status(testbed, ns, name).get("rayCluster")
    assert cluster, f"{name} has no rayCluster in its status yet"
    obj: dict[str, Any] = testbed.kubectl_json("-n", ns, "get", "raycluster", cluster)
    return obj


def explain(testbed: Any, ns: str, operator: OperatorProcess) -> str:
    """What a timeout needs: the resources, the Workloads, and the logs of both controllers."""
    vdps = [(v["metadata"]["name"], v.get("status", {}).get("phase"),
             v.get("status", {}).get("message")) for v in items(testbed, ns, "vdp")]  # fmt: skip
    wls = [(w["metadata"]["name"], [(c["type"], c["status"], c.get("message"))
                                    for c in w.get("status", {}).get("conditions", [])])
           for w in items(testbed, ns, "workloads.kueue.x-k8s.io")]  # fmt: skip
    return (f"resources: {vdps}\nworkloads: {wls}\n--- kueue log ---\n"
            f"{testbed.log_tail('kueue', 3000)}\n--- operator log ---\n{operator.log_tail()}")


def wait_phase_explained(testbed: Any, ns: str, name: str, phase: str, operator: OperatorProcess,
                         timeout: float = 90) -> dict[str, Any]:  # fmt: skip
    try:
        return wait_phase(testbed, ns, name, phase, timeout=timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{explain(testbed, ns, operator)}") from None


def operator_writes(testbed: Any, ns: str, resource: str, name: str) -> list[str]:
    """The operator's update and patch requests on one object, from the bed's audit log."""
    out = []
    for line in (testbed.state_dir / "logs" / "audit.log").read_text(errors="replace").splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        ref = ev.get("objectRef") or {}
        if (ev.get("userAgent") or "").startswith("vllm-dp-operator/") and ev.get("verb") in (
                "update", "patch") and ref.get("resource") == resource and ref.get(
                "namespace") == ns and ref.get("name") == name:  # fmt: skip
            out.append(f"{ev['requestReceivedTimestamp']} {ev['verb']} "
                       f"{ref.get('subresource') or ''}")
    return out


#: A kopf log line's time: `[2026-12-04 16:14:02,123] ...`.
_LOGGED = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")


def logged_at(log: str, needle: str) -> float | None:
    """When the first line holding `needle` was logged (seconds, the process's local clock)."""
    for line in log.splitlines():
        found = _LOGGED.match(line)
        if found and needle in line:
            return datetime.strptime(found[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def test_kueue_installed_after_the_operator_is_listed_once_its_crd_serves(
    testbed: Any, operator: OperatorProcess, kueue: None
) -> None:
    """Before Kueue, the Workloads' reflector waited on a watch of Kueue's CRD (no LIST a
    minute); the CRD's watch saw it serve, and the reflector listed at once."""
    if KUEUE_BEFORE[0]:
        pytest.skip("Kueue's CRDs were on this bed before its operator started (an earlier "
                    "run's; kueue-down keeps them): 'installed later' needs a fresh bed, as CI's")
    log = operator.log.read_text(errors="replace")
    serves = logged_at(log, "CrdPresence(workloads.kueue.x-k8s.io): serves v1beta2")
    listed = logged_at(log, "Reflector(workloads, all namespaces): listed again")
    assert serves is not None and listed is not None, operator.log_tail()
    assert 0 <= listed - serves < 5, (serves, listed, operator.log_tail())

    def counters() -> dict[str, dict[str, int]]:
        found: dict[str, dict[str, int]] = operator.counters()["reflectors"]
        assert found["workloads"]["lists"] >= 1, found
        return found

    # The log line may be written a moment before the counter is read.
    try:
        counts = testbed.wait_until("the Workloads' LIST in the controller's counters", counters,
                                    timeout=15, interval=1)  # fmt: skip
    except AssertionError as e:
        raise AssertionError(f"{e}\n{operator.log_tail()}") from None
    assert counts["customresourcedefinitions"]["lists"] >= 1, counts


def test_second_resource_queues_with_kueues_reason_and_is_admitted_when_the_first_goes(
    testbed: Any, operator: OperatorProcess, ns: str
) -> None:
    apply(testbed, ns, queued("first"))
    wait_phase_explained(testbed, ns, "first", "Launching", operator)
    first = cluster_of(testbed, ns, "first")
    assert first["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu"
    assert first["spec"].get("suspend") is False, "Kueue admitted and resumed it"

    apply(testbed, ns, queued("second"))
    st = wait_phase_explained(testbed, ns, "second", "Queued", operator)
    # Kueue's own words, once its Workload says why.
    st = testbed.wait_until("Kueue's reason in the message", lambda: (
        s := status(testbed, ns, "second"))["phase"] == "Queued"
        and "insufficient unused quota for nvidia.com/gpu" in (s.get("message") or "") and s,
        timeout=30)  # fmt: skip
    assert st["message"].startswith("Queued in LocalQueue gpu: couldn't assign flavors"), st
    ready = {c["type"]: c for c in st["conditions"]}["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "Queued", ready
    assert not items(testbed, ns, "rayjobs", "app.kubernetes.io/instance=second")
    row = testbed.kubectl("-n", ns, "get", "vdp", "second").stdout
    assert "Queued" in row, row

    testbed.kubectl("-n", ns, "delete", "vdp", "first", "--wait=false")
    took = quota_freed_and_second_resumed(testbed, ns, operator)
    wait_phase_explained(testbed, ns, "second", "Launching", operator)
    print("after the first was deleted: " + ", ".join(f"{k} {v:.1f}s" for k, v in took.items()))


#: The links from a deleted resource to the next one's admission, none of them the
#: operator's: the garbage collector deletes the RayCluster and then its Workload (whose
#: usage Kueue then releases), and Kueue admits and resumes the queued one. On a busy bed
#: the collector can lag a discovery resync (30 s); a timeout names the link that stalled.
QUOTA_FREED_S = 90


def quota_freed_and_second_resumed(testbed: Any, ns: str, operator: OperatorProcess
                                   ) -> dict[str, float]:  # fmt: skip
    """Follow the chain after `first` is deleted; the seconds at which each link was seen."""
    def first_cluster_gone() -> bool:
        return not items(testbed, ns, "rayclusters", "app.kubernetes.io/instance=first")

    def first_workload_gone() -> bool:
        return not [w for w in items(testbed, ns, "workloads.kueue.x-k8s.io")
                    if "first" in w["metadata"]["name"]]  # fmt: skip

    def second_resumed() -> bool:
        return cluster_of(testbed, ns, "second")["spec"].get("suspend") is False

    t0, took = time.monotonic(), {}
    for what, check in (("first's RayCluster gone", first_cluster_gone),
                        ("first's Workload gone", first_workload_gone),
                        ("second's RayCluster resumed by Kueue", second_resumed)):  # fmt: skip
        left = QUOTA_FREED_S - (time.monotonic() - t0)
        try:
            testbed.wait_until(what, check, timeout=max(left, 1), interval=0.2)
        except AssertionError as e:
            wls = [(w["metadata"]["name"], w["metadata"].get("deletionTimestamp"),
                    w["metadata"].get("finalizers"))
                   for w in items(testbed, ns, "workloads.kueue.x-k8s.io")]  # fmt: skip
            raise AssertionError(
                f"{e}\nlinks seen: {took}\nworkloads (name, deleting, finalizers): {wls}\n"
                f"--- kube-controller-manager log ---\n"
                f"{testbed.log_tail('kube-controller-manager', 3000)}\n"
                f"{explain(testbed, ns, operator)}") from None
        took[what] = time.monotonic() - t0
    return took


def test_a_replica_beyond_the_quota_queues_alone_and_scaling_down_frees_it(
    testbed: Any, operator: OperatorProcess, ns: str
) -> None:
    # Each replica's RayCluster is its own Workload: the quota holds one DP=8 group. The
    # earlier tests' namespaces are deleted without waiting: their Workloads must be gone
    # first, or they hold the quota this test measures.
    testbed.wait_until("no Workload of another namespace", lambda: not [
        w for w in testbed.kubectl_json("get", "workloads.kueue.x-k8s.io", "-A")["items"]
        if w["metadata"]["namespace"] != ns], timeout=120)
    apply(testbed, ns, queued("scaled"))
    wait_phase_explained(testbed, ns, "scaled", "Launching", operator)
    testbed.kubectl("-n", ns, "scale", "vdp", "scaled", "--replicas=2")

    def second_queued() -> dict[str, Any] | None:
        st = status(testbed, ns, "scaled")
        by_index = {e["index"]: e for e in st.get("replicaStatuses") or []}
        first, second = by_index.get(0) or {}, by_index.get(1) or {}
        ok = (second.get("phase") == "Queued" and first.get("phase") == "Launching"
              and "insufficient unused quota for nvidia.com/gpu" in (second.get("message") or ""))
        return st if ok else None

    try:
        st = testbed.wait_until("replica 1 Queued with Kueue's reason, replica 0 Launching",
                                second_queued, timeout=90)  # fmt: skip
    except AssertionError as e:
        raise AssertionError(f"{e}\n{explain(testbed, ns, operator)}") from None
    assert st["phase"] == "Launching", st  # the resource's own phase follows replica 0
    degraded = {c["type"]: c for c in st["conditions"]}["Degraded"]
    assert degraded["status"] == "True" and "replica 1" in degraded["message"], degraded
    assert len(items(testbed, ns, "workloads.kueue.x-k8s.io")) == 2

    testbed.kubectl("-n", ns, "scale", "vdp", "scaled", "--replicas=1")
    testbed.wait_until("replica 1's RayCluster and its Workload gone", lambda: len([
        c for c in items(testbed, ns, "rayclusters") if not c["metadata"].get("deletionTimestamp")
    ]) == 1 and len(items(testbed, ns, "workloads.kueue.x-k8s.io")) == 1, timeout=90)
    assert [e["index"] for e in status(testbed, ns, "scaled")["replicaStatuses"]] == [0]


def test_higher_priority_preempts_without_a_failure_or_a_suspend_write(
    testbed: Any, operator: OperatorProcess, ns: str
) -> None:
    apply(testbed, ns, queued("low", priority="low"))
    wait_phase_explained(testbed, ns, "low", "Launching", operator)
    low_cluster = status(testbed, ns, "low")["rayCluster"]
    started = time.monotonic()

    apply(testbed, ns, queued("high", priority="high"))
    st = wait_phase_explained(testbed, ns, "low", "Preempted", operator, timeout=60)
    assert "Preempted by Kueue" in st["message"] and "LocalQueue gpu" in st["message"], st
    wait_phase_explained(testbed, ns, "high", "Launching", operator)
    st = status(testbed, ns, "low")
    assert st["consecutiveFailures"] == 0 and not st.get("lastFailedJob"), st
    assert not [e for e in items(testbed, ns, "events")
                if e["reason"] in ("HeadJobFailed", "LaunchTimedOut")]  # fmt: skip
    assert not items(testbed, ns, "rayjobs", "app.kubernetes.io/instance=low"), \
        "no head job is relaunched into the suspended cluster"
    assert cluster_of(testbed, ns, "low")["spec"]["suspend"] is True

    time.sleep(max(0.0, 60 - (time.monotonic() - started)))
    writes = operator_writes(testbed, ns, "rayclusters", low_cluster)
    assert writes == [], f"the operator wrote the RayCluster Kueue owns: {writes}"
    assert status(testbed, ns, "low")["phase"] == "Preempted"

    # Readmission needs no user: the high one goes, the low one is back on its way to serving.
    testbed.kubectl("-n", ns, "delete", "vdp", "high", "--wait=false")
    wait_phase_explained(testbed, ns, "low", "Launching", operator, timeout=60)
    assert status(testbed, ns, "low")["consecutiveFailures"] == 0
    assert operator_writes(testbed, ns, "rayclusters", low_cluster) == []


def test_a_resource_without_a_queue_is_left_to_the_scheduler_as_before(
    testbed: Any, operator: OperatorProcess, ns: str
) -> None:
    doc = copy.deepcopy(example("dp8-rpn4-tp1.yaml"))
    doc["metadata"]["name"] = "plain"
    apply(testbed, ns, doc)
    wait_phase_explained(testbed, ns, "plain", "Launching", operator)
    cluster = cluster_of(testbed, ns, "plain")
    assert "kueue.x-k8s.io/queue-name" not in cluster["metadata"]["labels"]
    assert not items(testbed, ns, "workloads.kueue.x-k8s.io")


@pytest.mark.parametrize(("scheduling", "field", "said"), [
    ({"queueName": "Team_A"}, "spec.scheduling.queueName", "should match"),
    ({"queueName": "q" * 64}, "spec.scheduling.queueName", "63"),
    ({"schedulerName": "slurm", "queueName": "q"}, "spec.scheduling.schedulerName",
     "Unsupported value"),
    ({"priorityClassName": "high"}, "spec.scheduling.queueName", "is required"),
    ({"schedulerName": "scheduler-plugins", "queueName": "q"}, "spec.scheduling.queueName",
     "is not read"),
])  # fmt: skip
def test_bad_scheduling_is_refused_by_the_api_server_naming_the_field(
    testbed: Any, operator: OperatorProcess, ns: str, scheduling: dict[str, Any], field: str,
    said: str,
) -> None:
    doc = copy.deepcopy(example("dp8-rpn4-tp1.yaml"))
    doc["metadata"] |= {"name": "bad", "namespace": ns}
    doc["spec"]["scheduling"] = scheduling
    proc = testbed.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert proc.returncode != 0, proc.stdout
    assert field in proc.stderr and said in proc.stderr, proc.stderr
