"""Serving that stays up (issue 17, scenarios A, B, C and E), measured from the client's side.

One serving deployment on the engine double at DP=2 (two Ray pods on two real nodes), shared
by the scenarios in file order. During each, a client in a pod (`traffic.Traffic`) POSTs
completions to the Service's ClusterIP at 10 a second, each on a new connection through
kube-proxy, and counts every non-2xx answer and connection error from its first 200 to its
stop. The faults are real: iptables DROP in the operator pods' own network namespaces, SIGKILL
of the operator processes from the host, the bed's kube-apiserver stopped, the head pod
deleted. What the scenarios assert (F, the head pod deleted, runs on real vLLM in
test_operator_vllm_cpu.py, with its LoRA adapters):

- A. the operators cannot reach the head pod for 60 s: 0 failed requests, phase `Serving`
  throughout, the EndpointSlice's endpoint ready throughout, and probe failures seen (so the
  partition did take effect);
- B. (i) every operator process SIGKILLed and the Deployment kept at 0 replicas for 60 s;
  (ii) the API server down for 30 s: 0 failed requests each, the same head job `Serving`
  afterwards;
- C. an engine change (`--max-model-len`) under `spec.update.strategy: Surge`: 0 failed
  requests from a new-connection client and from a kept-alive one (the old generation drains
  by its requests and its head job stops through Ray before its cluster goes), the slice never
  without a ready endpoint, on the old head until it moves to the new one, the old RayCluster
  gone afterwards; the time from apply to switch is reported;
- E. a Surge whose new engines never serve (a model path that does not exist): 0 failed
  requests, the old generation routed throughout, the new one deleted at its deadline, and
  status and a Warning Event that say why.

Each scenario's line (failed/total, rate, outage) is printed at the end of the module, for
docs/benchmarks.md.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from .bed import RunningCluster
from .podfaults import container_pid, dropped, sigkill
from .portsurge import NEW_PORT, surge_to_new_port
from .timeline import (
    READY_BY_ADDRESS,
    RouteWatch,
    ready_addresses,
)
from .traffic import Traffic
from .vdp import (
    API_PORT,
    OPERATOR_LABEL,
    OPERATOR_LEASE,
    OPERATOR_NS,
    Vdp,
    import_engine,
    operator_logs,
    own_namespace,
)
from .vdp import report as print_report

pytestmark = pytest.mark.cluster

IMAGE = "vllm-dp-engine-double"
NAME = "avail"
MODEL = "double"
#: The issue's floor is 5 a second; the client asks 10.
MIN_RATE = 5.0


def resource(ns: str, **over: Any) -> dict[str, Any]:
    """The shared deployment, with `over` on top of its spec (C's and E's changes)."""
    spec = {"model": "cluster/double-model", "servedModelName": MODEL, "image": f"{IMAGE}:dev",
            "dataParallel": {"size": 2, "ranksPerNode": 1}, "apiServerCount": 1,
            # No CPU asked: the double uses next to none, and a Surge's second generation
            # must fit beside the first on the bed's two nodes (each has the host's 2 cores).
            "resources": {"memory": "1Gi"}, "shmSize": "64Mi",
            "env": [{"name": "VLLMDP_DOUBLE_PLACE", "value": "1"}],
            "launch": {"timeoutSeconds": 300, "drainSeconds": 3},
            # Surge from the start: A, B and F change no spec, so it matters only to C and E.
            "update": {"strategy": "Surge", "drainSeconds": 10}}  # fmt: skip
    return {"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel",
            "metadata": {"name": NAME, "namespace": ns}, "spec": {**spec, **over}}


@pytest.fixture(scope="module")
def ns(operator: RunningCluster) -> Iterator[str]:
    name = "t-avail"
    own_namespace(operator, name)
    yield name
    operator.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def report(operator: RunningCluster,
           request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:  # fmt: skip
    """Each scenario's line, printed at the module's end (shown even without -s)."""
    lines: dict[str, str] = {}
    yield lines
    if revived := revive_bed(operator):
        lines["bed"] = f"started again at the module's end: {', '.join(revived)}"
    print_report(request, "availability", lines)


@pytest.fixture(scope="module")
def vdp(operator: RunningCluster, ns: str) -> Vdp:
    import_engine(operator, IMAGE)
    operator.apply(resource(ns))
    v = Vdp(operator, ns, NAME)
    v.wait_phase("Serving", 300)
    return v


def traffic(vdp: Vdp, scenario: str, keep_alive: bool = False) -> Traffic:
    """The scenario's client: a new connection per request, or (`keep_alive`) a pool of kept
    connections, which kube-proxy leaves on an endpoint the slice no longer routes to."""
    return Traffic(vdp.cluster, vdp.ns, f"http://{vdp.service_ip()}:{API_PORT}", MODEL,
                   f"{IMAGE}:dev", name=f"{'kept' if keep_alive else 'traffic'}-{scenario}",
                   keep_alive=keep_alive)  # fmt: skip


def revive_bed(cluster: RunningCluster) -> list[str]:
    """Start again what an API-server restart took down with it (tests/testbed/faults.py
    REVIVABLE: kube-scheduler can exit on a relist some seconds later), so the scenarios after
    it, and the modules after this one, find the bed whole."""
    import faults  # tests/testbed/faults.py, on sys.path once vdp is imported

    return list(faults.revive(cluster.state_dir))


def unready_seen(watch: RouteWatch, after: float = 0.0) -> list[tuple[float, str]]:
    """The slice states after `after` (epoch) in which no endpoint was ready."""
    return [(at, s) for at, s in watch.seen if at >= after and "true" not in s.split()]


def assert_no_failures(t: Traffic, vdp: Vdp, what: str) -> None:
    res = t.result
    why = (f"{what}: {t.summary()}\nfirst failures: {json.dumps(res['failures'][:15], indent=1)}"
           f"\n--- traffic client log\n{t.logs()}\n{vdp.diagnostics()}")  # fmt: skip
    assert res["failed"] == 0, why
    assert res["rate"] >= MIN_RATE, why


def operator_pods(cluster: RunningCluster) -> list[dict[str, Any]]:
    pods = cluster.kubectl_json("get", "pods", "-n", OPERATOR_NS, "-l", OPERATOR_LABEL)["items"]
    return [p for p in pods if p["status"].get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")]  # fmt: skip


def ready_operators(cluster: RunningCluster) -> int:
    return sum(any(c["type"] == "Ready" and c["status"] == "True"
                   for c in p["status"].get("conditions") or [])
               for p in operator_pods(cluster))  # fmt: skip


def lease_holder(cluster: RunningCluster) -> str:
    lease = cluster.kubectl_json("get", "lease", OPERATOR_LEASE, "-n", OPERATOR_NS)
    return str(lease["spec"].get("holderIdentity") or "")


def wait_operator_back(vdp: Vdp, replicas: int, since_holder: str = "") -> str:
    """Every operator pod Ready and a leader other than `since_holder`; the new holder."""
    vdp.wait(f"{replicas} Ready operator pods", lambda: ready_operators(vdp.cluster) >= replicas,
             300)  # fmt: skip
    return str(vdp.wait("a Lease holder", lambda: (h := lease_holder(vdp.cluster))
                        and h != since_holder and h, 120))  # fmt: skip


def ready_reason(st: dict[str, Any]) -> str:
    return next((c.get("reason", "") for c in st.get("conditions") or []
                 if c["type"] == "Ready"), "")  # fmt: skip


def test_a_operator_cut_off_from_the_head_pod(vdp: Vdp, report: dict[str, str]) -> None:
    st = vdp.wait_phase("Serving", 120)
    job = st["headJob"]
    head = vdp.pods()["head"]
    addresses = [head["status"]["podIP"]]
    cluster_name = head["metadata"]["labels"]["ray.io/cluster"]
    head_svc = vdp.cluster.kubectl_json("get", "svc", f"{cluster_name}-head-svc", "-n", vdp.ns)
    if head_svc["spec"].get("clusterIP") not in (None, "", "None"):
        addresses.append(head_svc["spec"]["clusterIP"])  # pods reach it before any DNAT
    pids = [container_pid(vdp.cluster, p, "operator") for p in operator_pods(vdp.cluster)]
    watch = vdp.watch()
    samples: list[tuple[float, str, int, str]] = []
    try:
        with traffic(vdp, "a") as t:
            t0 = time.monotonic()
            with dropped(pids, addresses):
                while time.monotonic() - t0 < 60:
                    s = vdp.status()
                    samples.append((round(time.monotonic() - t0, 1), s.get("phase", ""),
                                    s.get("probeFailures") or 0, ready_reason(s)))  # fmt: skip
                    time.sleep(2)
            # Reachable again: the next probe answers and the warning clears.
            vdp.wait("the probe failures cleared", lambda: not vdp.status().get("probeFailures"),
                     60)  # fmt: skip
    finally:
        watch.stop()
    report["A operator cut off from the head 60 s"] = t.summary()
    assert_no_failures(t, vdp, "A")
    phases = {phase for _, phase, _, _ in samples}
    assert phases == {"Serving"}, samples
    assert max(f for _, _, f, _ in samples) >= 1, f"no probe failed: the DROP took no effect\n" \
        f"{samples}\n{operator_logs(vdp.cluster)}"  # fmt: skip
    assert any(r == "ProbeFailing" for *_, r in samples), samples  # the condition warns
    assert not unready_seen(watch), watch.seen
    assert vdp.status()["headJob"] == job


def test_b1_operator_sigkilled_and_kept_down(vdp: Vdp, report: dict[str, str]) -> None:
    st = vdp.wait_phase("Serving", 120)
    job = st["headJob"]
    cluster = vdp.cluster
    [deploy] = cluster.kubectl("get", "deploy", "-n", OPERATOR_NS, "-l", OPERATOR_LABEL,
                               "-o", "name").stdout.split()  # fmt: skip
    replicas = int(cluster.kubectl_json("get", deploy, "-n", OPERATOR_NS)["spec"]["replicas"])
    holder = lease_holder(cluster)
    watch = vdp.watch()
    running: list[tuple[float, int]] = []
    try:
        with traffic(vdp, "b1") as t:
            pids = [container_pid(cluster, p, "operator") for p in operator_pods(cluster)]
            t0 = time.monotonic()
            try:
                for pid in pids:  # both replicas: a standby taking over is not "down"
                    sigkill(pid)
                # Kept down: no replica, so the kubelet's restart of a killed container
                # lives only until the scale-down reaches it.
                cluster.kubectl("scale", deploy, "-n", OPERATOR_NS, "--replicas=0")
                while time.monotonic() - t0 < 60:
                    running.append((round(time.monotonic() - t0, 1),
                                    ready_operators(cluster)))  # fmt: skip
                    time.sleep(2)
            finally:
                cluster.kubectl("scale", deploy, "-n", OPERATOR_NS, f"--replicas={replicas}")
            wait_operator_back(vdp, replicas, holder)
            # The new leader's first reconcile of everything, with traffic flowing.
            time.sleep(15)
    finally:
        watch.stop()
    report["B1 operator SIGKILLed, 0 replicas for 60 s"] = t.summary()
    assert_no_failures(t, vdp, "B(i)")
    late = [(at, n) for at, n in running if at > 10 and n]
    assert not late, f"an operator pod was Ready while it should be down: {running}"
    assert not unready_seen(watch), watch.seen
    st = vdp.status()
    assert (st["phase"], st["headJob"]) == ("Serving", job), st


def test_b2_api_server_down(vdp: Vdp, report: dict[str, str]) -> None:
    import faults  # tests/testbed/faults.py: stop and start a component of the bed

    st = vdp.wait_phase("Serving", 120)
    job = st["headJob"]
    cluster = vdp.cluster
    with traffic(vdp, "b2") as t:
        # SIGKILL: down from this instant (a SIGTERM'd one serves on for its shutdown delay).
        rec = faults.stop_component(cluster.state_dir, "kube-apiserver", crash=True)
        down = time.monotonic()
        try:
            time.sleep(30)
        finally:
            faults.start_component(cluster.state_dir, "kube-apiserver", rec)
            down = time.monotonic() - down
        wait_operator_back(vdp, 1)
        st = vdp.wait_phase("Serving", 120)
        time.sleep(15)  # the leader's reconcile after the outage, with traffic flowing
    revived = revive_bed(cluster)
    report["B2 API server down 30 s"] = (f"{t.summary()}; down {down:.1f}s (kill to ready)"
                                         + (f"; started again: {revived}" if revived else ""))
    assert_no_failures(t, vdp, "B(ii)")
    st = vdp.status()
    assert (st["phase"], st["headJob"]) == ("Serving", job), st
    [endpoint] = cluster.kubectl_json("get", "endpointslice", f"{NAME}-api", "-n",
                                      vdp.ns)["endpoints"]  # fmt: skip
    assert endpoint["conditions"]["ready"] is True, endpoint


def routed_after(watch: RouteWatch, after: float) -> float | None:
    """When an endpoint of the slice was first ready again after `after` (epoch)."""
    return next((at for at, s in watch.seen if at > after and "true" in s.split()), None)


def events(vdp: Vdp, reason: str) -> list[dict[str, Any]]:
    items = vdp.cluster.kubectl_json("get", "events", "-n", vdp.ns)["items"]
    return [e for e in items if e.get("reason") == reason]


def test_c_surge_switches_with_no_failed_request(vdp: Vdp, report: dict[str, str]) -> None:
    if revived := revive_bed(vdp.cluster):
        report["bed before C"] = f"started again: {', '.join(revived)}"
    st = vdp.wait_phase("Serving", 300)
    old, job = st["rayCluster"], st["headJob"]
    old_head = vdp.pods()["head"]
    old_ip, old_pod = old_head["status"]["podIP"], old_head["metadata"]["name"]
    watch = vdp.watch(READY_BY_ADDRESS)
    try:
        with traffic(vdp, "c") as t, traffic(vdp, "c", keep_alive=True) as kept:
            vdp.wait("the slice watch's first line", lambda: watch.seen, 30)
            applied = time.time()
            vdp.cluster.apply(resource(vdp.ns, engineArgs=["--max-model-len=4096"]))
            new = vdp.wait_update_started()
            assert new != old
            switched_at = vdp.wait("the slice routed to another head than the old", lambda: next(
                (at for at, s in watch.seen if at >= applied and ready_addresses(s) - {old_ip}),
                None), 600)  # fmt: skip
            vdp.wait("the old RayCluster gone after its drain",
                     lambda: vdp.live_clusters() == [new], 120)  # fmt: skip
            vdp.wait("status.update cleared", lambda: "update" not in vdp.status(), 60)
            time.sleep(5)  # the new generation alone, with traffic flowing
    finally:
        watch.stop()
    st = vdp.status()
    report["C Surge engine change"] = (f"{t.summary()}; kept-alive: {kept.summary()}; apply "
                                       f"to switch {switched_at - applied:.1f}s; {old} -> {new}")
    assert_no_failures(t, vdp, "C")
    # The old generation drained by its requests and stopped through Ray before it went: the
    # kept connections were on its head, then on the new one.
    assert_no_failures(kept, vdp, "C, kept-alive connections")
    new_pod = vdp.pods()["head"]["metadata"]["name"]
    assert kept.result["served_by"].get(old_pod) and kept.result["served_by"].get(new_pod), \
        (old_pod, new_pod, kept.result["served_by"])  # fmt: skip
    after = [(at, s) for at, s in watch.seen if at >= applied]
    assert all(ready_addresses(s) for _, s in after), f"the slice had no ready endpoint: {after}"
    before = [s for at, s in after if at < switched_at]
    assert all(ready_addresses(s) == {old_ip} for s in before), after
    assert (st["phase"], st["rayCluster"]) == ("Serving", new) and st["headJob"] != job, st
    new_ip = vdp.pods()["head"]["status"]["podIP"]
    assert ready_addresses(watch.seen[-1][1]) == {new_ip}, watch.seen[-3:]
    argv = " ".join(vdp.from_pod(f"http://{vdp.service_ip()}:{API_PORT}/double/argv")["argv"])
    assert "--max-model-len=4096" in argv or "--max-model-len 4096" in argv, argv
    for reason in ("UpdateStarted", "UpdateSwitched", "UpdateDone"):
        assert events(vdp, reason), reason


def test_e_surge_that_never_serves_leaves_the_old_serving(
        vdp: Vdp, report: dict[str, str]) -> None:  # fmt: skip
    st = vdp.wait_phase("Serving", 300)
    vdp.wait("no update in progress", lambda: "update" not in vdp.status(), 120)
    st = vdp.status()
    old, job = st["rayCluster"], st["headJob"]
    old_ip = vdp.pods()["head"]["status"]["podIP"]
    spec = vdp.get()["spec"]
    watch = vdp.watch(READY_BY_ADDRESS)
    try:
        with traffic(vdp, "e") as t:
            vdp.wait("the slice watch's first line", lambda: watch.seen, 30)
            applied = time.time()
            # A model path with nothing there: `vllm serve` exits at once, every launch.
            vdp.cluster.apply(resource(vdp.ns, engineArgs=spec.get("engineArgs") or [],
                                       model="/models/does-not-exist",
                                       launch={"timeoutSeconds": 60, "drainSeconds": 3}))
            new = vdp.wait_update_started()
            failed = vdp.wait("a Warning UpdateFailed", lambda: [
                e for e in events(vdp, "UpdateFailed") if e.get("type") == "Warning"], 240)
            vdp.wait("the failed generation removed", lambda: vdp.live_clusters() == [old], 120)
            time.sleep(10)  # no retry: the same spec starts nothing again
    finally:
        watch.stop()
    st = vdp.status()
    report["E Surge that never serves"] = (f"{t.summary()}; UpdateFailed "
                                           f"{time.time() - applied:.0f}s after the apply")
    assert_no_failures(t, vdp, "E")
    assert all(ready_addresses(s) == {old_ip} for at, s in watch.seen if at >= applied), \
        watch.seen  # fmt: skip
    assert (st["phase"], st["rayCluster"], st["headJob"]) == ("Serving", old, job), st
    assert "update" not in st and st.get("failedUpdate"), st
    cond = {c["type"]: c for c in st["conditions"]}["Updated"]
    assert (cond["status"], cond["reason"]) == ("False", "UpdateFailed"), cond
    message = failed[-1]["message"]
    assert new in message and "spec.launch.timeoutSeconds" in message, message
    assert "Last seen of it: " in message, message  # what the new generation last did
    assert new in cond["message"], cond
    assert vdp.live_clusters() == [old]
    assert len(events(vdp, "UpdateStarted")) >= 1


def test_c2_surge_to_a_new_port(vdp: Vdp, report: dict[str, str]) -> None:
    """Issue 38 item 2 on the engine double: a Surge that changes `spec.service.port` (after
    E, so from E's failed spec). A client on the old port loses nothing sent before the
    switch; a client of the new port that starts once kube-proxy has it (nothing can answer
    there before) loses nothing; the Service's and the slice's port move once, never back
    (portsurge.py, which real vLLM's D2 shares)."""
    vdp.wait_phase("Serving", 300)

    def client(url: str, name: str, wait_go: bool) -> Traffic:
        return Traffic(vdp.cluster, vdp.ns, url, MODEL, f"{IMAGE}:dev", name=name,
                       wait_go=wait_go)  # fmt: skip

    run = surge_to_new_port(vdp, resource(vdp.ns, engineArgs=["--max-model-len=2048"],
                                          service={"port": NEW_PORT}),
                            API_PORT, NEW_PORT, client, switch_s=300, drain_s=120,
                            label="c2")  # fmt: skip
    report.update(run.lines("C2 Surge to a new port"))
    run.check()
