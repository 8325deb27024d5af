"""The NetworkPolicy in front of the Ray pods, enforced for real (issue 19, item 1).

The bed's enforcer is kube-router's firewall controller (tests/testbed/netpolicy.py), acting
for node-1's pods, so the resource's two Ray pods run there (DP=2, a rank on the head and one on
a worker; the engine double). Clients are pods of the engine-double image (it has python3) in other
namespaces, each trying a TCP connect to the head pod: Ray's ports 6379 (GCS), 8265
(dashboard and job API) and 10001 (client) must not connect. The API port connects, by
default, from a pod of the resource's own namespace and from a namespace labelled
`vllmdp.io/api-access=true`, not from another (issue 39); `spec.service.allowFrom` replaces
that default. The operator, in its own pod, keeps reaching the
dashboard and /health: the resource serves, and an engine-only change stops the old Ray job
and confirms it. Turning the policy off opens the Ray ports again: the closed ports were the
policy's doing, not a port nobody listens on. The API port is open on the head pod only: a
listener on a worker's port of that number answers the head, and no client (issue 39). With
`spec.networkPolicy.egress` on, the head reaches its worker, DNS and the one listed pod, and
not a pod of another namespace that it reached before (issue 39).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from vllm_dp_operator import constants as c

from .bed import RunningCluster
from .vdp import API_PORT, DASHBOARD_PORT, Vdp, import_engine, own_namespace

pytestmark = pytest.mark.cluster

IMAGE = "vllm-dp-engine-double"
NAME = "netpol"
NS = "t-netpol"
CLIENTS = "t-netpol-clients"  # labelled team=clients (allowFrom's) and for API access
OTHERS = "t-netpol-others"  # not labelled
RAY_PORTS = (6379, DASHBOARD_PORT, 10001)
RAY_AGENT_PORT = 52365  # the dashboard agent, on every Ray pod
EGRESS_PORT = 9099  # a listener in the client pods, for the egress test
ENFORCED_NODE = "node-1"
# One TCP connect from inside a client pod: open, refused (kube-router REJECTs) or timeout.
_CONNECT = ("import socket,sys\ns=socket.socket();s.settimeout(3)\n"
            "try:\n s.connect((sys.argv[1],int(sys.argv[2])));print('open')\n"
            "except socket.timeout:\n print('timeout')\n"
            "except OSError as e:\n print('refused' if e.errno==111 else 'error %d'%e.errno)\n")
ALLOW = [{"namespaceSelector": {"matchLabels": {"team": "clients"}},
          "podSelector": {"matchLabels": {"role": "x"}}}]  # fmt: skip


def resource(extra_args: list[str], **service: Any) -> dict[str, Any]:
    return {"apiVersion": "vllmdp.io/v1alpha1", "kind": "VLLMDataParallel",
            "metadata": {"name": NAME, "namespace": NS},
            "spec": {"model": "cluster/double-model", "servedModelName": "double",
                     "image": f"{IMAGE}:dev", "dataParallel": {"size": 2, "ranksPerNode": 1},
                     "apiServerCount": 1, "shmSize": "64Mi", "engineArgs": extra_args,
                     # Where the bed enforces NetworkPolicy (one enforcer per network namespace).
                     "nodeSelector": {"kubernetes.io/hostname": ENFORCED_NODE},
                     "service": service,
                     "launch": {"timeoutSeconds": 300, "drainSeconds": 3}}}  # fmt: skip


def client_pod(name: str, ns: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "c", "image": f"{IMAGE}:dev",
                                     "imagePullPolicy": "Never",
                                     "command": ["python3", "-c",
                                                 "import time; time.sleep(86400)"]}]}}  # fmt: skip


@pytest.fixture(scope="module")
def vdp(operator: RunningCluster) -> Iterator[Vdp]:
    import_engine(operator, IMAGE)
    for ns in (CLIENTS, OTHERS):  # an earlier run's clients, before the nodes must be empty
        operator.kubectl("delete", "namespace", ns, "--ignore-not-found", "--wait=true",
                         timeout=180)  # fmt: skip
    own_namespace(operator, NS)
    for ns, labels in ((CLIENTS, {"team": "clients", c.LABEL_API_ACCESS: "true"}),
                       (OTHERS, {})):  # fmt: skip
        operator.kubectl("create", "namespace", ns)
        if labels:
            operator.kubectl("label", "namespace", ns, *(f"{k}={v}" for k, v in labels.items()))
        operator.wait_until("the default ServiceAccount", lambda ns=ns: operator.kubectl(
            "get", "sa", "default", "-n", ns, check=False).returncode == 0, 30)  # fmt: skip
    for name, ns, labels in (("inside", CLIENTS, {"role": "x"}), ("outside", CLIENTS, {}),
                             ("stranger", OTHERS, {"role": "x"}),
                             ("neighbour", NS, {})):  # fmt: skip
        operator.apply(client_pod(name, ns, labels))
    operator.apply(resource(["--max-num-seqs=4"]))
    yield Vdp(operator, NS, NAME)
    for ns in (NS, CLIENTS, OTHERS):
        operator.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def running(vdp: Vdp, pod: str) -> str:
    """Client `pod`'s namespace, once the pod runs."""
    ns = {"stranger": OTHERS, "neighbour": NS}.get(pod, CLIENTS)
    vdp.wait(f"client pod {pod} running", lambda: vdp.cluster.kubectl(
        "get", "pod", pod, "-n", ns, "-o", "jsonpath={.status.phase}",
        check=False).stdout == "Running", 120)  # fmt: skip
    return ns


def connect(vdp: Vdp, pod: str, ip: str, port: int) -> str:
    """What a TCP connect from client `pod` to ip:port does."""
    ns = running(vdp, pod)
    return vdp.cluster.exec(ns, pod, "python3", "-c", _CONNECT, ip, str(port)).stdout.strip()


def reach(vdp: Vdp, pod: str, ip: str, ports: tuple[int, ...]) -> dict[int, str]:
    return {p: connect(vdp, pod, ip, p) for p in ports}


def settled(vdp: Vdp, pod: str, ip: str, ports: tuple[int, ...], want_open: bool,
            timeout: float = 60) -> dict[int, str]:  # fmt: skip
    """The outcomes once every port is as wanted (the enforcer applies a change within
    seconds); past the deadline, fail with what it was and why."""
    def done() -> dict[int, str] | None:
        got = reach(vdp, pod, ip, ports)
        return got if all((v == "open") == want_open for v in got.values()) else None

    return vdp.wait(f"{pod} -> {ip} {ports} {'open' if want_open else 'closed'}", done,
                    timeout, interval=3)  # type: ignore[no-any-return]


def head_ip(vdp: Vdp) -> str:
    head = vdp.pods()["head"]
    assert head["spec"]["nodeName"] == ENFORCED_NODE
    return str(head["status"]["podIP"])


def test_ray_ports_closed_to_another_namespace_api_port_open_to_its_own_and_labelled(
    vdp: Vdp,
) -> None:
    st = vdp.wait_phase("Serving", 300)  # the operator's /health probe passed the policy
    policy = vdp.cluster.kubectl_json("get", "networkpolicy", f"{NAME}-ray", "-n", NS)
    assert policy["metadata"]["ownerReferences"][0]["name"] == NAME
    ip = head_ip(vdp)
    closed = settled(vdp, "outside", ip, RAY_PORTS, want_open=False)
    assert set(closed.values()) <= {"refused", "timeout"}, closed
    sys.stderr.write(f"[netpol] from {CLIENTS}/outside to the head {ip}: {closed}\n")
    # The API port: from the labelled namespace and the resource's own, not from another.
    assert connect(vdp, "outside", ip, API_PORT) == "open"
    assert connect(vdp, "neighbour", ip, API_PORT) == "open"
    assert "open" not in reach(vdp, "neighbour", ip, RAY_PORTS).values()  # not a Ray pod
    assert connect(vdp, "stranger", ip, API_PORT) in ("refused", "timeout")
    # Through KubeRay's head Service too: the ClusterIP leads to the same closed port.
    svc = vdp.cluster.kubectl_json("get", "svc", f"{st['rayCluster']}-head-svc", "-n", NS)
    assert connect(vdp, "outside", svc["spec"]["clusterIP"], DASHBOARD_PORT) != "open"


def test_a_workers_api_port_answers_no_one_outside_the_resource(vdp: Vdp) -> None:
    vdp.wait_phase("Serving", 300)
    pods = vdp.pods()
    worker, head = pods["worker"], pods["head"]
    assert worker["spec"]["nodeName"] == ENFORCED_NODE
    ip = worker["status"]["podIP"]
    # Something on the worker takes the API port's number (a Ray, NCCL or ZMQ listener may).
    vdp.cluster.exec(NS, worker["metadata"]["name"], "sh", "-c",
                     f"nohup python3 -m http.server {API_PORT} >/dev/null 2>&1 &")  # fmt: skip

    def from_head() -> str:
        return vdp.cluster.exec(NS, head["metadata"]["name"], "python3", "-c", _CONNECT, ip,
                                str(API_PORT)).stdout.strip()  # fmt: skip

    vdp.wait("the listener on the worker, seen from its own head", lambda: from_head() == "open",
             30)  # fmt: skip
    for client in ("outside", "stranger"):
        assert connect(vdp, client, ip, API_PORT) != "open", client
    assert connect(vdp, "outside", head_ip(vdp), API_PORT) == "open"
    api = vdp.cluster.kubectl_json("get", "networkpolicy", f"{NAME}-api-port", "-n", NS)
    assert api["spec"]["podSelector"]["matchLabels"]["ray.io/node-type"] == "head"


def test_operator_still_stops_and_confirms_through_the_dashboard(vdp: Vdp) -> None:
    st = vdp.wait_phase("Serving", 300)
    old_job = st["headJob"]
    old_sid = vdp.rayjob(old_job)["status"]["jobId"]  # type: ignore[index]
    vdp.cluster.apply(resource(["--max-num-seqs=6"]))
    new = vdp.wait("a new head job", lambda: (s := vdp.status()).get("headJob") != old_job
                   and s.get("headJob"), 120)  # fmt: skip
    vdp.wait_phase("Serving", 180, job=new)
    # The operator created the next job only once the dashboard said the old one ended
    # (from the host, the node's own traffic, which every NetworkPolicy admits).
    assert vdp.dashboard_jobs()[old_sid]["status"] == "STOPPED"
    reasons = vdp.cluster.kubectl("get", "events", "-n", NS, "-o",
                                  "jsonpath={.items[*].reason}").stdout.split()  # fmt: skip
    assert "HeadJobStopUnconfirmed" not in reasons


def test_allow_from_admits_only_the_selected_pods(vdp: Vdp) -> None:
    vdp.wait_phase("Serving", 300)
    vdp.cluster.apply(resource(["--max-num-seqs=6"], allowFrom=ALLOW))
    vdp.wait("the policy rendered from allowFrom", lambda: json.loads(vdp.cluster.kubectl(
        "get", "networkpolicy", f"{NAME}-api-port", "-n", NS, "-o", "json").stdout)["spec"][
        "ingress"][-1].get("from") == ALLOW, 60)  # fmt: skip
    ip = head_ip(vdp)
    # The labelled namespace's other pods and the resource's own namespace: not selected.
    settled(vdp, "outside", ip, (API_PORT,), want_open=False)
    settled(vdp, "neighbour", ip, (API_PORT,), want_open=False)
    settled(vdp, "stranger", ip, (API_PORT,), want_open=False)
    assert connect(vdp, "inside", ip, API_PORT) == "open"
    ray = reach(vdp, "inside", ip, RAY_PORTS)  # allowFrom opens the API port only
    assert "open" not in ray.values(), ray
    assert vdp.status()["phase"] == "Serving"  # the operator is no allowFrom source: admitted


def pod_ip(vdp: Vdp, ns: str, name: str) -> str:
    return str(vdp.cluster.kubectl_json("get", "pod", name, "-n", ns)["status"]["podIP"])


def test_egress_reaches_only_its_own_pods_dns_and_what_it_lists(vdp: Vdp) -> None:
    """Issue 39: with spec.networkPolicy.egress on, the head pod connects to its own worker,
    resolves names, and reaches the one listed destination; another namespace's pod, open to
    it before, is not; the resource still serves (the operator's calls are ingress)."""
    job = vdp.wait_phase("Serving", 300)["headJob"]
    pods = vdp.pods()
    head, worker_ip = pods["head"]["metadata"]["name"], pods["worker"]["status"]["podIP"]
    listen = f"nohup python3 -m http.server {EGRESS_PORT} >/dev/null 2>&1 &"
    for pod in ("inside", "stranger"):
        vdp.cluster.exec(running(vdp, pod), pod, "sh", "-c", listen)
    listed, other = pod_ip(vdp, CLIENTS, "inside"), pod_ip(vdp, OTHERS, "stranger")

    def from_head(ip: str, port: int) -> str:
        return vdp.cluster.exec(NS, head, "python3", "-c", _CONNECT, ip,
                                str(port)).stdout.strip()  # fmt: skip

    vdp.wait("the stranger's listener, open to the head before", lambda: from_head(
        other, EGRESS_PORT) == "open", 30)  # fmt: skip
    body = resource(["--max-num-seqs=6"], allowFrom=ALLOW)  # as the allowFrom test left it
    body["spec"]["networkPolicy"] = {"egress": {"enabled": True, "allowTo": [
        {"namespaceSelector": {"matchLabels": {"team": "clients"}},
         "podSelector": {"matchLabels": {"role": "x"}}, "ports": [EGRESS_PORT]}]}}  # fmt: skip
    vdp.cluster.apply(body)
    vdp.wait("the egress policy", lambda: vdp.cluster.kubectl(
        "get", "networkpolicy", f"{NAME}-egress", "-n", NS, check=False).returncode == 0, 60)
    vdp.wait("the stranger closed to the head", lambda: from_head(
        other, EGRESS_PORT) != "open", 60, interval=3)  # fmt: skip
    assert from_head(listed, EGRESS_PORT) == "open"
    assert from_head(worker_ip, RAY_AGENT_PORT) == "open"  # its own pods: every port
    resolved = vdp.cluster.exec(NS, head, "python3", "-c", "import socket;print(socket."
                                "gethostbyname('kubernetes.default.svc.cluster.local'))")
    assert resolved.stdout.strip(), resolved  # DNS, wherever the cluster serves it
    time.sleep(10)  # two probe periods with the policy on
    st = vdp.status()
    assert (st["phase"], st["headJob"]) == ("Serving", job), st  # no relaunch, still probed
    body["spec"].pop("networkPolicy")
    vdp.cluster.apply(body)  # off again: open again
    vdp.wait("the stranger open to the head again", lambda: from_head(
        other, EGRESS_PORT) == "open", 60, interval=3)  # fmt: skip


def test_turning_the_policy_off_opens_the_ray_ports(vdp: Vdp) -> None:
    vdp.wait_phase("Serving", 300)
    body = resource(["--max-num-seqs=6"])
    body["spec"]["networkPolicy"] = {"enabled": False}
    vdp.cluster.apply(body)
    vdp.wait("the policies deleted", lambda: vdp.cluster.kubectl(
        "get", "networkpolicy", f"{NAME}-ray", f"{NAME}-api-port", "-n", NS,
        "--ignore-not-found", "-o", "name").stdout.strip() == "", 60)  # fmt: skip
    settled(vdp, "outside", head_ip(vdp), RAY_PORTS, want_open=True)
    vdp.cluster.apply(resource(["--max-num-seqs=6"]))  # on again: closed again
    settled(vdp, "outside", head_ip(vdp), RAY_PORTS, want_open=False)


def test_delete_removes_the_policy_with_the_rest(vdp: Vdp) -> None:
    vdp.cluster.kubectl("delete", "vdp", NAME, "-n", NS, "--wait=true", timeout=120)
    vdp.wait("every child gone", lambda: not vdp.cluster.kubectl(
        "get", "rayclusters,rayjobs,services,networkpolicies", "-n", NS, "-o", "name",
        check=False).stdout.strip(), 180)  # fmt: skip
