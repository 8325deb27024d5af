"""R2: the API server down for 10 s in the middle of a burst, and etcd stopped for 5 s.

The API server is killed (SIGKILL: a crash, and a down time that does not wait on a graceful
shutdown) and started again 10 s later; etcd is frozen with SIGSTOP for 5 s and then resumed, so
every request to it hangs meanwhile (tests/testbed/faults.py). Killing etcd instead left a pod
whose bind failed during the outage unscheduled by kube-scheduler for minutes, which is the
scheduler's retry policy, not the operator's; the operator's own watches over an etcd restart
are exercised by the API server's restart (its watch cache starts again from etcd). The
operator keeps its PID through all of it (no crash-loop), and its watches are not stuck: after
recovery a child deleted by hand comes back at once, though the safety resync is 10 minutes
away. Every other component of the bed (KubeRay, kwok, the controller-manager) rides the same
restart, so convergence here is the whole system's.
"""

from __future__ import annotations

import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import faults
import pytest
from fleet import QUIET, converged, explain, get, own_nodes, small
from operator_proc import OperatorProcess, install_crd

pytestmark = pytest.mark.reliability

BURST = 20


def _children(testbed: Any, ns: str) -> int:
    return len(get(testbed, ns, "rayclusters")) + len(get(testbed, ns, "services"))


def _still_running(op: OperatorProcess, pid: int) -> None:
    assert op.proc is not None and op.proc.poll() is None and op.proc.pid == pid, (
        f"the operator exited:\n{op.log_tail()}")
    assert "Controller task" not in op.log_tail(10**7), op.log_tail()
    # Its liveness probe (every reflector and worker alive) answers as before.
    with urllib.request.urlopen(f"http://127.0.0.1:{op.port}/healthz", timeout=5) as resp:
        assert resp.status == 200


def _service_comes_back(testbed: Any, ns: str, name: str, op: OperatorProcess) -> float:
    """Delete a resource's API Service by hand; seconds until the operator has made it again."""
    uid = testbed.kubectl_json("-n", ns, "get", "service", f"{name}-api")["metadata"]["uid"]
    t0 = time.monotonic()
    testbed.kubectl("-n", ns, "delete", "service", f"{name}-api", "--wait=true")
    try:
        testbed.wait_until(f"{name}-api to be made again", lambda: any(
            s["metadata"]["name"] == f"{name}-api" and s["metadata"]["uid"] != uid
            for s in get(testbed, ns, "services")), timeout=30, interval=0.1)  # fmt: skip
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{explain(testbed, ns, op)}") from exc
    return time.monotonic() - t0


def _bound_pods(testbed: Any, ns: str) -> int:
    return sum(1 for p in get(testbed, ns, "pods") if p["spec"].get("nodeName"))


def _fault_mid_burst(testbed: Any, ns: str, op: OperatorProcess, component: str,
                     down: float, first: int) -> tuple[float, int]:  # fmt: skip
    """Create BURST resources and take `component` away for `down` s while the operator works
    on them; return seconds from its return to convergence, and how many of the burst's head
    jobs existed when the fault began.

    The API server goes once every pod of the burst is bound, while head jobs and status are
    still being written: a bind cut off by the crash would leave its pod to kube-scheduler's
    retry of failed binds (minutes), which is not what this test is about. etcd is frozen as
    soon as the burst's children start to appear."""
    testbed.apply([small(ns, f"{component[:4]}{i:02d}") for i in range(first, first + BURST)])
    if component == "etcd":
        before = _children(testbed, ns)
        testbed.wait_until("the burst's first children", lambda: _children(testbed, ns) >=
                           before + 4, timeout=60, interval=0.05)  # fmt: skip
    else:
        testbed.wait_until("the burst's pods bound", lambda: _bound_pods(testbed, ns) >=
                           first + BURST, timeout=60, interval=0.05)  # fmt: skip
    jobs = len(get(testbed, ns, "rayjobs")) - first
    if component == "etcd":
        faults.pause(testbed.state_dir, component, down)
    else:
        faults.restart(testbed.state_dir, component, down, crash=True)
    back = time.monotonic()
    try:
        testbed.wait_until(f"convergence after {component} came back",
                           lambda: converged(testbed, ns, first + BURST), timeout=180,
                           interval=0.5)  # fmt: skip
    except AssertionError as exc:
        pending = [p["metadata"]["name"] for p in get(testbed, ns, "pods")
                   if p["status"].get("phase") != "Running"]  # fmt: skip
        raise AssertionError(f"{exc}\npods not running: {pending}\n{explain(testbed, ns, op)}\n"
                             f"{component} log:\n{testbed.log_tail(component)}") from exc
    return time.monotonic() - back, jobs


#: A leader that cannot renew for the renew deadline (10 s by default) stops writing and
#: exits, as controller-runtime's does, and its restart leads again: a 10 s outage would end
#: this process by design. Here the Lease outlasts the outage, so what is measured is the
#: controller riding it out with leader election on, not the restart.
LONG_LEASE = {"VLLMDP_LEASE_DURATION_SECONDS": "45", "VLLMDP_RENEW_DEADLINE_SECONDS": "30"}


@pytest.fixture
def operator(testbed: Any, testbed_namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    """The reliability tier's operator (quiet timers, the test's namespace), on a long Lease."""
    install_crd(testbed)
    op = OperatorProcess(testbed.env(), tmp_path / "operator.log", {**QUIET, **LONG_LEASE})
    op.namespace = testbed_namespace
    op.start()
    yield op
    op.stop()


def test_api_server_and_etcd_restarts_mid_burst_converge(
    testbed: Any, testbed_namespace: str, operator: OperatorProcess
) -> None:
    ns = testbed_namespace
    assert operator.proc is not None
    pid = operator.proc.pid
    with own_nodes(testbed, ns, gpus=2 * 2 * BURST):
        api, api_jobs = _fault_mid_burst(testbed, ns, operator, "kube-apiserver", 10, 0)
        _still_running(operator, pid)
        after_api = _service_comes_back(testbed, ns, "kube00", operator)
        etcd, etcd_jobs = _fault_mid_burst(testbed, ns, operator, "etcd", 5, BURST)
        _still_running(operator, pid)
        after_etcd = _service_comes_back(testbed, ns, "etcd20", operator)
        sys.stderr.write(f"\n[R2] API server down 10 s mid-burst of {BURST} ({api_jobs} head "
                         f"jobs made before): converged {api:.1f} s after it was back; etcd "
                         f"stopped 5 s mid-burst of {BURST} ({etcd_jobs} head jobs made before): "
                         f"{etcd:.1f} s; a deleted Service made again {after_api:.2f} s / "
                         f"{after_etcd:.2f} s after each (watches live)\n")  # fmt: skip
        testbed.kubectl("-n", ns, "delete", "vdp", "--all", "--wait=false")
