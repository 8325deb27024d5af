"""Replicas on real nodes (issue 37), measured from the client's side.

One resource on the engine double (DP=2 in one Ray pod per replica), shared by the scenarios
in file order: scaled to two replicas with `kubectl scale`, one replica's head pod deleted
under load, one replica's node drained under load, then scaled back to one under load. Two
clients count every failure the whole time: one opens a new connection per request
(kube-proxy picks an endpoint afresh each time), one keeps its connections alive in a pool
(kube-proxy keeps an established connection on its endpoint after the endpoint leaves the
slice). What the scenarios assert:

- scale to 2: both replicas Serving, the slice holds two ready endpoints, each head pod
  answers a completion directly, `status.ready` is `2/2`;
- a head pod deleted: the other replica's endpoint stays ready throughout, the lost one is
  unrouted, at most 2 failed requests per client (those in flight on the lost replica), and
  the replica serves again;
- a node drained (`kubectl drain`) under one replica's head pod: the PodDisruptionBudget lets
  it go, the pod's preStop drains the head while the replica leaves the slice, 0 failed
  requests on either client;
- scale to 1: the leaving replica is unrouted first, drained and deleted; 0 failed requests
  on either client.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .bed import RunningCluster
from .timeline import READY_BY_ADDRESS, RouteWatch, ready_addresses
from .traffic import Traffic
from .vdp import API_PORT, Vdp, http, import_engine, own_namespace
from .vdp import report as print_report

pytestmark = pytest.mark.cluster

IMAGE = "vllm-dp-engine-double"
NAME = "reps"
MODEL = "double"


def resource(ns: str) -> dict[str, Any]:
    spec = {"model": "cluster/double-model", "servedModelName": MODEL, "image": f"{IMAGE}:dev",
            "dataParallel": {"size": 2, "ranksPerNode": 2}, "apiServerCount": 1,
            "resources": {"memory": "1Gi"}, "shmSize": "64Mi",
            "env": [{"name": "VLLMDP_DOUBLE_PLACE", "value": "1"}],
            "launch": {"timeoutSeconds": 300, "drainSeconds": 3},
            "update": {"strategy": "RollingUpdate", "drainSeconds": 10}}  # fmt: skip
    return {"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel",
            "metadata": {"name": NAME, "namespace": ns}, "spec": spec}


@pytest.fixture(scope="module")
def vdp(operator: RunningCluster) -> Iterator[Vdp]:
    ns = "t-replicas"
    own_namespace(operator, ns)
    import_engine(operator, IMAGE)
    operator.apply(resource(ns))
    v = Vdp(operator, ns, NAME)
    v.wait_phase("Serving", 300)
    yield v
    operator.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def unready_seen(watch: RouteWatch) -> list[tuple[float, str]]:
    """The slice states in which no endpoint was ready."""
    return [(at, s) for at, s in watch.seen if "true" not in s.split("|")[-1].split()]


def clients(vdp: Vdp, scenario: str) -> tuple[Traffic, Traffic]:
    url = f"http://{vdp.service_ip()}:{API_PORT}"
    return (Traffic(vdp.cluster, vdp.ns, url, MODEL, f"{IMAGE}:dev", name=f"new-{scenario}"),
            Traffic(vdp.cluster, vdp.ns, url, MODEL, f"{IMAGE}:dev", name=f"kept-{scenario}",
                    keep_alive=True))  # fmt: skip


def test_scale_to_two_serves_from_both_replicas(vdp: Vdp) -> None:
    vdp.cluster.kubectl("scale", "vdp", NAME, "-n", vdp.ns, "--replicas=2")
    st = vdp.wait("two replicas routed", lambda: vdp.ready_replicas(2), 300)
    assert st["phase"] == "Serving" and st["ready"] == "2/2"
    by_replica = vdp.heads()
    assert sorted(by_replica) == ["0", "1"]
    ips = {p["status"]["podIP"] for p in by_replica.values()}
    [eps] = [vdp.cluster.kubectl_json("get", "endpointslice", f"{NAME}-api", "-n", vdp.ns)]
    assert {e["addresses"][0] for e in eps["endpoints"] if e["conditions"]["ready"]} == ips
    for ip in ips:  # each replica answers on its own
        answer = http(f"http://{ip}:{API_PORT}/v1/completions",
                      {"model": MODEL, "prompt": "hi", "max_tokens": 1})  # fmt: skip
        assert answer["choices"], answer


def test_a_lost_head_pod_costs_only_its_replica(vdp: Vdp, report: dict[str, str]) -> None:
    vdp.wait("two replicas routed", lambda: vdp.ready_replicas(2), 300)
    lost = vdp.heads()["1"]
    kept_ip = vdp.heads()["0"]["status"]["podIP"]
    watch = vdp.watch(READY_BY_ADDRESS)
    new, kept = clients(vdp, "lost")
    try:
        with new, kept:
            vdp.wait("the slice watch's first line", lambda: watch.seen, 30)
            vdp.cluster.kubectl("delete", "pod", lost["metadata"]["name"], "-n", vdp.ns,
                                "--wait=false")  # fmt: skip
            vdp.wait("the lost replica unrouted", lambda: any(
                lost["status"]["podIP"] not in ready_addresses(s) for _, s in watch.seen), 60)
            vdp.wait("both replicas routed again", lambda: vdp.ready_replicas(2), 300)
    finally:
        watch.stop()
    report["replicas: a head pod deleted (new connections)"] = new.summary()
    report["replicas: a head pod deleted (kept-alive)"] = kept.summary()
    assert not unready_seen(watch), watch.seen
    assert all(kept_ip in ready_addresses(s) for _, s in watch.seen), watch.seen
    for t in (new, kept):
        assert t.result["failed"] <= 2, f"{t.summary()}\n{t.logs()}\n{vdp.diagnostics()}"


def test_a_node_drain_takes_one_replica_and_fails_no_request(
    vdp: Vdp, report: dict[str, str]
) -> None:  # fmt: skip
    """`kubectl drain` of the node under replica 1's head pod while replica 0 serves: the
    PodDisruptionBudget lets that pod go, its replica leaves the slice while the pod's preStop
    drains the head, and its new head pod comes up on another node. No request fails."""
    vdp.wait("two replicas routed", lambda: vdp.ready_replicas(2), 300)
    pdb = vdp.cluster.kubectl_json("get", "pdb", f"{NAME}-ray", "-n", vdp.ns)
    assert pdb["spec"]["minAvailable"] == 1, pdb["spec"]  # two pods, one may go
    by_replica = vdp.heads()
    node = by_replica["1"]["spec"]["nodeName"]
    assert by_replica["0"]["spec"]["nodeName"] != node, "the replicas' pods share a node"
    watch = vdp.watch()
    new, kept = clients(vdp, "drain")
    try:
        with new, kept:
            drained = vdp.cluster.kubectl(
                "drain", node, f"--pod-selector=app.kubernetes.io/instance={NAME}",
                "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=120s",
                check=False, timeout=150)  # fmt: skip
            assert drained.returncode == 0, drained.stdout + drained.stderr
            vdp.wait("both replicas routed again, replica 1 elsewhere", lambda: vdp.ready_replicas(
                2) and vdp.heads().get("1", {}).get("spec", {}).get("nodeName") not in (
                    None, node), 300)  # fmt: skip
    finally:
        watch.stop()
        vdp.cluster.kubectl("uncordon", node, check=False)
    report["replicas: a node drained (new connections)"] = new.summary()
    report["replicas: a node drained (kept-alive)"] = kept.summary()
    assert not unready_seen(watch), watch.seen
    for t in (new, kept):
        assert t.result["failed"] == 0, f"{t.summary()}\n{t.logs()}\n{vdp.diagnostics()}"


def test_scale_to_one_under_load_fails_no_request(vdp: Vdp, report: dict[str, str]) -> None:
    vdp.wait("two replicas routed", lambda: vdp.ready_replicas(2), 300)
    leaving = vdp.heads()["1"]["metadata"]["name"]  # the highest index leaves
    watch = vdp.watch()
    new, kept = clients(vdp, "down")
    try:
        with new, kept:
            vdp.cluster.kubectl("scale", "vdp", NAME, "-n", vdp.ns, "--replicas=1")
            vdp.wait("one replica left", lambda: vdp.ready_replicas(1)
                     and len(vdp.live_clusters()) == 1, 300)  # fmt: skip
    finally:
        watch.stop()
    report["replicas: scale 2 -> 1 (new connections)"] = new.summary()
    report["replicas: scale 2 -> 1 (kept-alive)"] = kept.summary()
    assert not unready_seen(watch), watch.seen
    for t in (new, kept):
        assert t.result["failed"] == 0, f"{t.summary()}\n{t.logs()}\n{vdp.diagnostics()}"
    # The kept connections were on both replicas, the leaving one's among them: its drain and
    # stop were what they went through.
    assert kept.result["served_by"].get(leaving), (leaving, kept.result["served_by"])


@pytest.fixture(scope="module")
def report(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """Each scenario's line, printed at the module's end (shown even without -s)."""
    lines: dict[str, str] = {}
    yield lines
    print_report(request, "availability", lines)
