"""Issue 37's replica scenarios, measured from the client's side: each one procedure, run on
the engine double (test_operator_replicas.py, in `make test`) and on real vLLM CPU engines
(test_operator_vllm_cpu.py, opt-in: `make test-replicas-vllm`, four nodes).

One resource, shared by the scenarios in this order: scaled to two replicas with
`kubectl scale`, one replica's head pod deleted under load, one replica's node drained under
load, a rolling engine change with `maxSurge: 0`, then scaled back to one under load. Two
clients count every failure of each scenario: one opens a new connection per request
(kube-proxy picks an endpoint afresh each time), one keeps its connections alive in a pool
(kube-proxy keeps an established connection on its endpoint after the endpoint leaves the
slice). What each asserts:

- scale to 2: both replicas Serving, the slice holds two ready endpoints, each head pod
  answers a completion directly, `status.ready` is `2/2`;
- a head pod deleted: the other replica's endpoint stays ready throughout, the lost one is
  unrouted, at most 2 failed requests per client (those in flight on the lost replica), none
  sent once kube-proxy had the unroute, and the replica serves again;
- a node drained (`kubectl drain`) that holds only replica 1's pods: the
  PodDisruptionBudget lets them go, the replica leaves the slice while its head drains, and
  it serves again from another node; 0 failed requests;
- a rolling engine change (`RollingUpdate`, `maxSurge: 0`, `maxUnavailable: 1`): one replica
  at a time is unrouted, drained and relaunched; never more than 2 RayClusters of the
  resource (polled every second); a ready endpoint at every moment; 0 failed requests; each
  head runs the change after;
- scale to 1: the leaving replica is unrouted first, drained and deleted; 0 failed requests.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .timeline import KUBE_PROXY_SYNC_S, READY_BY_ADDRESS, RouteWatch, ready_addresses
from .traffic import Traffic
from .vdp import Vdp


@dataclass
class Scene:
    """One resource, at `replicas: 1` to begin with, and how its scenarios talk to it."""

    vdp: Vdp
    #: The two counting clients of one scenario (named after it): a new connection per
    #: request, and kept-alive connections.
    clients: Callable[[str], tuple[Traffic, Traffic]]
    #: One completion asked of a head pod directly (by its IP): the answer's `object`.
    answer: Callable[[str], str]
    #: The resource as the rolling scenario applies it: its engine change, under
    #: `RollingUpdate` with `maxSurge: 0` and `maxUnavailable: 1`, at `replicas: 2`.
    changed: Callable[[], dict[str, Any]]
    #: Whether the head pod at this IP runs the rolling scenario's change.
    runs_changed: Callable[[str], bool]
    #: Each scenario's lines (failed/total, outages), printed at the module's end.
    report: dict[str, str]
    #: Seconds a replica may take to serve again: a relaunch, or a new pod's boot.
    boot: float = 300
    #: Whether each answer names the head pod that gave it (the double's `X-Served-By`; vLLM
    #: names none), so a client's tally says which replicas its connections were on.
    served_by: bool = True


def unready_seen(watch: RouteWatch) -> list[tuple[float, str]]:
    """The slice states in which no endpoint was ready."""
    return [(at, s) for at, s in watch.seen if "true" not in s.split("|")[-1].split()]


def ready_in_slice(vdp: Vdp) -> set[str]:
    eps = vdp.cluster.kubectl_json("get", "endpointslice", f"{vdp.name}-api", "-n", vdp.ns)
    return {e["addresses"][0] for e in eps["endpoints"] if e["conditions"]["ready"]}


def _check(scene: Scene, clients: tuple[Traffic, Traffic], allowed: int = 0) -> None:
    for t in clients:
        assert t.result["failed"] <= allowed, (f"{t.name}: {t.summary()}\n{t.logs()}\n"
                                               f"{scene.vdp.diagnostics()}")  # fmt: skip


def _report(scene: Scene, what: str, clients: tuple[Traffic, Traffic], extra: str = "") -> None:
    new, kept = clients
    scene.report[f"replicas: {what} (new connections)"] = new.summary() + extra
    scene.report[f"replicas: {what} (kept-alive)"] = kept.summary() + extra


def scale_to_two(scene: Scene) -> None:
    vdp = scene.vdp
    vdp.wait("one replica routed", lambda: vdp.ready_replicas(1), scene.boot)
    asked = time.time()
    vdp.cluster.kubectl("scale", "vdp", vdp.name, "-n", vdp.ns, "--replicas=2")
    st = vdp.wait("two replicas routed", lambda: vdp.ready_replicas(2), scene.boot)
    scene.report["replicas: scale 1 -> 2 (asked to the second routed)"] = (
        f"{time.time() - asked:.0f}s")
    assert st["phase"] == "Serving" and st["ready"] == "2/2", st
    heads = vdp.heads()
    assert sorted(heads) == ["0", "1"], sorted(heads)
    ips = {p["status"]["podIP"] for p in heads.values()}
    assert ready_in_slice(vdp) == ips
    answers = {ip: scene.answer(ip) for ip in ips}  # each replica answers on its own
    assert set(answers.values()) == {"text_completion"}, answers


def lost_head_pod(scene: Scene) -> None:
    vdp = scene.vdp
    vdp.wait("two replicas routed", lambda: vdp.ready_replicas(2), scene.boot)
    heads = vdp.heads()
    lost, lost_ip = heads["1"], heads["1"]["status"]["podIP"]
    kept_ip = heads["0"]["status"]["podIP"]
    watch = vdp.watch(READY_BY_ADDRESS)
    clients = scene.clients("lost")
    try:
        with clients[0], clients[1]:
            vdp.wait("the slice watch's first line", lambda: watch.seen, 30)
            deleted = time.time()
            vdp.cluster.kubectl("delete", "pod", lost["metadata"]["name"], "-n", vdp.ns,
                                "--wait=false")  # fmt: skip
            unrouted = vdp.wait("the lost replica unrouted", lambda: next((
                at for at, s in watch.seen if at >= deleted
                and lost_ip not in ready_addresses(s)), None), 60)  # fmt: skip
            vdp.wait("both replicas routed again", lambda: vdp.ready_replicas(2), scene.boot)
    finally:
        watch.stop()
    _report(scene, "a head pod deleted", clients,
            f"; unrouted {unrouted - deleted:.1f}s after the delete")  # fmt: skip
    assert not unready_seen(watch), watch.seen
    assert all(kept_ip in ready_addresses(s) for _, s in watch.seen), watch.seen
    # Only what was in flight on the lost replica: nothing sent once kube-proxy had the unroute.
    for t in clients:
        late = [f for f in t.result["failures"] if f["sent"] >= unrouted + KUBE_PROXY_SYNC_S]
        assert late == [], f"{t.name}: {t.summary()}\n{late[:10]}\n{t.logs()}"
    _check(scene, clients, allowed=2)


def drain_target(vdp: Vdp) -> tuple[str, list[dict[str, Any]]]:
    """A node that holds only replica 1's pods of the resource, each of which fits on another
    node (so the replica comes back elsewhere), the one under its head first; and its pods."""
    pods = vdp.cluster.kubectl_json("get", "pods", "-n", vdp.ns, "-l",
                                    "ray.io/node-type")["items"]  # fmt: skip
    by_node: dict[str, list[dict[str, Any]]] = {}
    for pod in pods:
        by_node.setdefault(pod["spec"].get("nodeName") or "", []).append(pod)
    # The scheduler's view (RunningCluster.node_load): what each node's CPU is promised to.
    load = vdp.cluster.node_load()
    free = {n: held["allocatable_m"] - sum(p["cpu_m"] for p in held["pods"])
            for n, held in load.items()}  # fmt: skip
    asks = {p["pod"]: p["cpu_m"] for held in load.values() for p in held["pods"]}

    def fits(node: str) -> bool:
        room = sorted((v for n, v in free.items() if n != node), reverse=True)
        for pod in by_node[node]:
            need = asks.get(f"{vdp.ns}/{pod['metadata']['name']}", 0)
            spot = next((i for i, v in enumerate(room) if v >= need), None)
            if spot is None:
                return False
            room[spot] -= need
        return True

    def head_first(node: str) -> bool:
        return not any(p["metadata"]["labels"].get("ray.io/node-type") == "head"
                       for p in by_node[node])  # fmt: skip

    mine = [n for n, ps in by_node.items() if n and all(
        p["metadata"]["labels"].get("vllmdp.io/replica", "0") == "1" for p in ps)]
    for node in sorted(mine, key=head_first):
        if fits(node):
            return node, by_node[node]
    layout = {n: [p["metadata"]["name"] for p in ps] for n, ps in by_node.items()}
    raise AssertionError(f"no node holds only replica 1's pods with room for them elsewhere: "
                         f"pods by node {layout}, free CPU (m) {free}")  # fmt: skip


def node_drain(scene: Scene) -> None:
    """`kubectl drain` of a node that holds only replica 1's pods while replica 0 serves: the
    PodDisruptionBudget lets them go, the replica leaves the slice while its head drains (the
    pod's preStop), and its pods come up on other nodes. No request fails."""
    vdp = scene.vdp
    vdp.wait("two replicas routed", lambda: vdp.ready_replicas(2), scene.boot)
    pdb = vdp.cluster.kubectl_json("get", "pdb", f"{vdp.name}-ray", "-n", vdp.ns)
    pods = vdp.cluster.kubectl_json("get", "pods", "-n", vdp.ns, "-l",
                                    "ray.io/node-type")["items"]  # fmt: skip
    # Every pod but one must stay: one eviction at a time, of one replica.
    assert pdb["spec"]["minAvailable"] == len(pods) - 1, (pdb["spec"], len(pods))
    node, evicted = drain_target(vdp)
    assert vdp.heads()["0"]["spec"]["nodeName"] != node
    watch = vdp.watch()
    clients = scene.clients("drain")
    try:
        with clients[0], clients[1]:
            started = time.time()
            drained = vdp.cluster.kubectl(
                "drain", node, f"--pod-selector=app.kubernetes.io/instance={vdp.name}",
                "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=120s",
                check=False, timeout=150)  # fmt: skip
            assert drained.returncode == 0, drained.stdout + drained.stderr
            gone = {p["metadata"]["uid"] for p in evicted}
            vdp.wait("both replicas routed again, replica 1 elsewhere", lambda: vdp.ready_replicas(
                2) and not any(p["metadata"]["uid"] in gone or p["spec"].get("nodeName") == node
                    for p in vdp.cluster.kubectl_json("get", "pods", "-n", vdp.ns, "-l",
                                                      "ray.io/node-type")["items"]),
                scene.boot)  # fmt: skip
    finally:
        watch.stop()
        vdp.cluster.kubectl("uncordon", node, check=False)
    _report(scene, "a node drained", clients,
            f"; {len(evicted)} pod(s) evicted, serving again {time.time() - started:.0f}s after")
    assert not unready_seen(watch), watch.seen
    _check(scene, clients)


@dataclass
class ClusterCount:
    """The resource's RayClusters, deleting ones included, counted every second."""

    vdp: Vdp
    counts: list[tuple[float, list[str]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _poll(self) -> None:
        kubectl = [str(self.vdp.cluster.bin_dir / "kubectl"),
                   f"--kubeconfig={self.vdp.cluster.kubeconfig}"]  # fmt: skip
        while not self._stop.wait(1.0):
            out = subprocess.run([*kubectl, "get", "rayclusters", "-n", self.vdp.ns, "-l",
                                  f"app.kubernetes.io/instance={self.vdp.name}", "-o", "name"],
                                 capture_output=True, text=True, timeout=20)  # fmt: skip
            if out.returncode == 0:
                self.counts.append((time.time(), out.stdout.split()))

    def most(self) -> int:
        return max((len(names) for _, names in self.counts), default=0)

    def __enter__(self) -> ClusterCount:
        threading.Thread(target=self._poll, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()


def rolling_change(scene: Scene) -> None:
    """An engine change under RollingUpdate with `maxSurge: 0, maxUnavailable: 1` on two
    replicas: no extra group of GPUs (never more than 2 RayClusters), a ready endpoint at every
    moment, and no failed request; both heads run the change after."""
    vdp = scene.vdp
    vdp.wait("two replicas routed", lambda: vdp.ready_replicas(2), scene.boot)
    served = {e["index"]: e.get("servedJob") for e in vdp.status()["replicaStatuses"]}

    def rolled() -> dict[str, Any] | None:
        st = vdp.ready_replicas(2)
        if not st or st.get("updatedReplicas") != 2 or st.get("rollout"):
            return None
        now = {e["index"]: e.get("servedJob") for e in st["replicaStatuses"]}
        return st if all(now.get(i) not in (None, job) for i, job in served.items()) else None

    watch = vdp.watch()
    clients = scene.clients("rolling")
    try:
        with ClusterCount(vdp) as count, clients[0], clients[1]:
            applied = time.time()
            vdp.cluster.apply(scene.changed())
            vdp.wait("both replicas relaunched and routed", rolled, 2 * scene.boot + 120)
            took = time.time() - applied
            time.sleep(3)  # both replicas serving the change, with traffic flowing
    finally:
        watch.stop()
    _report(scene, "rolling engine change, maxSurge 0", clients,
            f"; at most {count.most()} RayClusters, rolled in {took:.0f}s")
    assert 0 < count.most() <= 2, count.counts
    assert not unready_seen(watch), watch.seen
    _check(scene, clients)
    ips = [p["status"]["podIP"] for p in vdp.heads().values()]
    assert len(ips) == 2 and all(scene.runs_changed(ip) for ip in ips), ips


def scale_to_one(scene: Scene) -> None:
    vdp = scene.vdp
    vdp.wait("two replicas routed", lambda: vdp.ready_replicas(2), scene.boot)
    leaving = vdp.heads()["1"]["metadata"]["name"]  # the highest index leaves
    watch = vdp.watch()
    clients = scene.clients("down")
    try:
        with clients[0], clients[1]:
            vdp.cluster.kubectl("scale", "vdp", vdp.name, "-n", vdp.ns, "--replicas=1")
            vdp.wait("one replica left", lambda: vdp.ready_replicas(1)
                     and len(vdp.live_clusters()) == 1, 300)  # fmt: skip
    finally:
        watch.stop()
    _report(scene, "scale 2 -> 1", clients)
    assert not unready_seen(watch), watch.seen
    _check(scene, clients)
    if scene.served_by:
        # The kept connections were on both replicas, the leaving one's among them: its drain
        # and stop were what they went through.
        kept = clients[1]
        assert kept.result["served_by"].get(leaving), (leaving, kept.result["served_by"])


#: The scenarios in the order they share one resource.
SCENARIOS = (scale_to_two, lost_head_pod, node_drain, rolling_change, scale_to_one)
