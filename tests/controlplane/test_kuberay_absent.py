"""KubeRay absent: the operator says what is missing, everywhere, and recovers with no restart.

KubeRay's CRDs are deleted from the bed (its operator keeps running, so the finalizers on
RayJobs left by earlier tests are still handled and the deletion completes), then the operator
starts: its RayCluster and RayJob reflectors are answered 404. A new resource must show a
condition naming the missing kind within 30 s, the operator's readiness (Controller.ready(), in
its /debug/controller counters) and `vllmdp_watch_ready` must say the same, and the cause is
logged once, not at every retry. After the CRDs are reinstalled the same process converges the
resource. The fixture reinstalls KubeRay's CRDs whatever happens, for the tests that follow.
"""

from __future__ import annotations

import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gcprobe import wait_gc_follows_rayclusters
from operator_proc import OperatorProcess, install_crd
from prometheus_client.parser import text_string_to_metric_families
from scenario import apply, example, items, status, wait_phase

sys.path.append(str(Path(__file__).resolve().parents[1] / "testbed"))
from common import http_get
from promlib import free_port

pytestmark = pytest.mark.controlplane

MISSING = "rayclusters.ray.io/v1 is not served by the API server: is KubeRay installed"


def kuberay_crds(testbed: Any) -> list[Path]:
    return sorted((testbed.bin_dir / "kuberay-crds").glob("*.yaml"))


def crd_names(testbed: Any) -> list[str]:
    return [f"crd/{p.name.removeprefix('ray.io_').removesuffix('.yaml')}.ray.io"
            for p in kuberay_crds(testbed)]  # fmt: skip


def install_kuberay_crds(testbed: Any) -> None:
    testbed.kubectl("apply", "--server-side", "--force-conflicts",
                    *[f"-f={p}" for p in kuberay_crds(testbed)])  # fmt: skip
    testbed.kubectl("wait", "--for=condition=Established", "--timeout=60s", *crd_names(testbed))


def kuberay_ready(testbed: Any) -> bool:
    port = testbed.info["ports"]["kuberay-probe"]
    return bool(http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200)


@pytest.fixture
def kuberay_crds_deleted(testbed: Any) -> Iterator[None]:
    """KubeRay's CRDs deleted (with every RayCluster and RayJob); reinstalled at the end."""
    assert kuberay_ready(testbed), "KubeRay's operator must run before the test"
    try:
        testbed.kubectl("delete", "--wait=true", "--timeout=120s", *crd_names(testbed),
                        timeout=150)  # fmt: skip
        yield
    finally:
        install_kuberay_crds(testbed)
        testbed.wait_until("KubeRay's operator ready after its CRDs came back",
                           lambda: kuberay_ready(testbed), timeout=60)  # fmt: skip
        # The bed as the next test expects it: deleting a RayCluster collects its dependents.
        took = wait_gc_follows_rayclusters(testbed)
        sys.stderr.write(f"[kuberay-absent] the garbage collector follows RayClusters again "
                         f"{took:.1f}s after the CRDs came back\n")


@pytest.fixture
def operator(testbed: Any, testbed_namespace: str, tmp_path: Path,
             kuberay_crds_deleted: None) -> Iterator[OperatorProcess]:  # fmt: skip
    """An operator started while KubeRay's CRDs are missing, watching this test's namespace."""
    install_crd(testbed)
    port = free_port()
    proc = OperatorProcess(testbed.env(), tmp_path / "operator.log", extra_env={
        "VLLMDP_METRICS_PORT": str(port), "VLLMDP_METRICS_HOST": "127.0.0.1",
        # The gauges are read here without a token; the secure endpoint (the chart's default)
        # has its own test in test_observability.py.
        "VLLMDP_METRICS_AUTH": "none"})
    proc.namespace = testbed_namespace
    proc.metrics_port = port  # type: ignore[attr-defined]
    proc.start()
    yield proc
    proc.stop()


def readiness(op: OperatorProcess) -> dict[str, Any]:
    """Controller.ready() as the operator's /debug/controller answer reports it."""
    health = op.counters()
    return {"ready": health["ready"], "readiness": health["readiness"]}


def watch_ready(op: OperatorProcess) -> dict[str, float]:
    port = op.metrics_port  # type: ignore[attr-defined]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {s.labels["kind"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "vllmdp_watch_ready"}  # fmt: skip


def condition(testbed: Any, ns: str, name: str) -> dict[str, Any] | None:
    for cond in status(testbed, ns, name).get("conditions") or []:
        if cond["type"] == "ChildrenWatched":
            return dict(cond)
    return None


def test_kuberay_absent_is_said_on_the_resource_then_it_converges_with_no_restart(
    testbed: Any, operator: OperatorProcess, testbed_namespace: str
) -> None:
    ns = testbed_namespace
    pid = operator.proc.pid if operator.proc else None
    doc = apply(testbed, ns, example("dp4-tp2.yaml"))
    name = doc["metadata"]["name"]

    def told() -> dict[str, Any] | None:
        cond = condition(testbed, ns, name)
        return cond if cond and cond["status"] == "False" else None

    try:
        started = time.monotonic()
        cond = testbed.wait_until("the condition naming the missing kind", told, timeout=30)
        took = time.monotonic() - started
        assert cond["reason"] == "KindNotServed", cond
        assert MISSING in cond["message"] and "rayjobs.ray.io/v1" in cond["message"], cond

        def warnings() -> list[str]:
            return [e["reason"] for e in items(testbed, ns, "events")
                    if e["involvedObject"].get("name") == name and e["type"] == "Warning"]

        testbed.wait_until("the Warning", warnings, timeout=10)
        assert not items(testbed, ns, "services"), "nothing decided while a kind is missing"
        ready = testbed.wait_until("readiness to name the missing kind", lambda: (
            r := readiness(operator))["ready"] is False and MISSING in r["readiness"] and r,
            timeout=15)  # fmt: skip
        gauges = watch_ready(operator)
        assert gauges["rayclusters.ray.io/v1"] == 0 and gauges["rayjobs.ray.io/v1"] == 0
        assert gauges["pods/v1"] == 1 and gauges["services/v1"] == 1, gauges
        time.sleep(5)  # the reflectors retry every 4 s at most: some retries, not logged
        said = operator.log_tail(chars=10**7).count(MISSING)
        assert said == 1, f"the cause logged {said} times:\n{operator.log_tail()}"
        assert warnings() == ["KindNotServed"], "one Warning per cause, not per retry"
        print(f"condition after {took:.1f}s: {cond['message']}\nreadiness: {ready}\n"
              f"vllmdp_watch_ready: {gauges}")

        install_kuberay_crds(testbed)
        recovered = time.monotonic()
        st = wait_phase(testbed, ns, name, "Launching", timeout=180)
        print(f"Launching {time.monotonic() - recovered:.1f}s after the CRDs came back")
        back = condition(testbed, ns, name)
        assert back is not None and back["status"] == "True", back
        assert st["rayCluster"] and items(testbed, ns, "rayjobs")
        testbed.wait_until("readiness back", lambda: readiness(operator) == {
            "ready": True, "readiness": "synced; every watched kind is served"}, timeout=15)
        assert set(watch_ready(operator).values()) == {1.0}
        assert operator.proc is not None and operator.proc.poll() is None
        assert operator.proc.pid == pid, "no restart"
    except AssertionError as exc:
        raise AssertionError(f"{exc}\noperator log:\n{operator.log_tail()}") from exc
