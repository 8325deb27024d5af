"""Smoke tests of the real-node test bed itself, with only the images it builds (pause, probe):
real kubelets with the GPU extended resource, containers on every node, pod-to-pod traffic
across nodes, a ClusterIP Service from the host and from a pod, cluster DNS (for pods, the host
and KubeRay), the API from a pod the in-cluster way, logs and exec through the kubelets, and
image import that skips a held image."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .bed import PROBE_IMAGE, REPO, RunningCluster

sys.path.insert(0, str(REPO / "tests" / "testbed"))
from addons import dns_query

pytestmark = pytest.mark.cluster

KUBE_SERVICE_IP = "10.201.0.1"


def probe_pod(name: str, node: str | None = None, gpus: int = 0,
              labels: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    """A pod running `probe serve` on :8080 (ready on /healthz), pinned to `node` if given."""
    env = [{"name": var, "valueFrom": {"fieldRef": {"fieldPath": path}}}
           for var, path in (("POD_NAME", "metadata.name"), ("NODE_NAME", "spec.nodeName"))]
    res: dict[str, Any] = {"requests": {"cpu": "10m", "memory": "16Mi"}}
    if gpus:
        res = {"requests": {**res["requests"], "nvidia.com/gpu": str(gpus)},
               "limits": {"nvidia.com/gpu": str(gpus)}}  # fmt: skip
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "probe", "image": PROBE_IMAGE, "imagePullPolicy": "Never",
                        "args": ["serve"], "env": env, "resources": res,
                        "ports": [{"containerPort": 8080}],
                        "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080},
                                           "periodSeconds": 1}}],
    }  # fmt: skip
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": labels or {}}, "spec": spec}  # fmt: skip


def ready_pod(cluster: RunningCluster, ns: str, name: str) -> dict[str, Any] | None:
    pod: dict[str, Any] = cluster.kubectl_json("get", "pod", name, "-n", ns)
    conds = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
    return pod if conds.get("Ready") == "True" else None


def http_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def web(cluster: RunningCluster) -> Iterator[dict[str, Any]]:
    """One probe pod per node behind the ClusterIP Service `web` (port 80) in its namespace."""
    ns = f"t-web-{os.urandom(3).hex()}"
    cluster.kubectl("create", "namespace", ns)
    cluster.wait_until("the default ServiceAccount", lambda: cluster.kubectl(
        "get", "sa", "default", "-n", ns, check=False).returncode == 0, 30)  # fmt: skip
    pods = {node: f"web-{node}" for node in cluster.node_names}
    cluster.apply([probe_pod(name, node, labels={"app": "web"}) for node, name in pods.items()],
                  "-n", ns)  # fmt: skip
    cluster.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
                   "spec": {"selector": {"app": "web"},
                            "ports": [{"port": 80, "targetPort": 8080}]}}, "-n", ns)  # fmt: skip
    found = {node: cluster.wait_until(f"pod {name} Ready", lambda n=name: ready_pod(cluster, ns, n),
                                      120, ns=ns)
             for node, name in pods.items()}  # fmt: skip
    svc = cluster.kubectl_json("get", "service", "web", "-n", ns)
    try:
        yield {"ns": ns, "pods": found, "cluster_ip": svc["spec"]["clusterIP"]}
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_nodes_are_real_kubelets_with_gpus(cluster: RunningCluster) -> None:
    nodes = {n["metadata"]["name"]: n for n in cluster.kubectl_json("get", "nodes")["items"]}
    assert sorted(nodes) == sorted(cluster.node_names) and len(nodes) >= 2
    for plan in cluster.nodes:
        node = nodes[plan["name"]]
        info = node["status"]["nodeInfo"]
        assert info["kubeletVersion"] == "v1.36.3"
        assert info["containerRuntimeVersion"].startswith("containerd://1.6")
        conds = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert conds["Ready"] == "True"
        addrs = {a["type"]: a["address"] for a in node["status"]["addresses"]}
        assert addrs["InternalIP"] == plan["ip"]
        assert node["status"]["capacity"]["nvidia.com/gpu"] == str(cluster.gpus_per_node)
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(cluster.gpus_per_node)
        assert node["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
        assert not node["spec"].get("taints"), "real nodes are untainted"


def test_a_container_runs_on_every_node(cluster: RunningCluster, web: dict[str, Any]) -> None:
    for plan in cluster.nodes:
        pod = web["pods"][plan["name"]]
        assert pod["spec"]["nodeName"] == plan["name"]
        ip = pod["status"]["podIP"]
        assert ipaddress.ip_address(ip) in ipaddress.ip_network(plan["pod_cidr"])
        # The host reaches the pod's own address through the node's bridge...
        assert http_json(f"http://{ip}:8080/")["pod"] == pod["metadata"]["name"]
        # ...and the process inside answers on its loopback (kubectl exec through the kubelet).
        out = cluster.exec(web["ns"], pod["metadata"]["name"], "/probe", "get",
                           "http://127.0.0.1:8080/").stdout  # fmt: skip
        assert json.loads(out)["node"] == plan["name"]
        logs = cluster.kubectl("logs", "-n", web["ns"], pod["metadata"]["name"]).stdout
        assert "probe serving on :8080" in logs


def test_pod_to_pod_across_nodes(cluster: RunningCluster, web: dict[str, Any]) -> None:
    first, second = cluster.node_names[:2]
    src = web["pods"][first]["metadata"]["name"]
    dst = web["pods"][second]
    out = cluster.exec(web["ns"], src, "/probe", "get",
                       f"http://{dst['status']['podIP']}:8080/").stdout  # fmt: skip
    answer = json.loads(out)
    assert answer["node"] == second
    # No NAT between pods: the server sees the client pod's own address.
    assert answer["client"].rsplit(":", 1)[0] == web["pods"][first]["status"]["podIP"]


def test_clusterip_service_from_host_and_from_a_pod(
    cluster: RunningCluster, web: dict[str, Any]
) -> None:
    ip = web["cluster_ip"]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network("10.201.0.0/16")
    seen: set[str] = set()

    def both_pods_answered() -> bool:
        seen.add(http_json(f"http://{ip}/")["pod"])
        return len(seen) == len(cluster.node_names)

    cluster.wait_until("both endpoints answering through the ClusterIP from the host",
                       both_pods_answered, 30, interval=0.05, ns=web["ns"])  # fmt: skip
    pod = web["pods"][cluster.node_names[0]]["metadata"]["name"]
    for url in ("http://web/", f"http://web.{web['ns']}.svc.cluster.local/", f"http://{ip}/"):
        answer = json.loads(cluster.exec(web["ns"], pod, "/probe", "get", url).stdout)
        assert answer["pod"].startswith("web-")


def test_cluster_dns_from_host_and_pod(cluster: RunningCluster, web: dict[str, Any]) -> None:
    assert dns_query(f"web.{web['ns']}.svc.cluster.local") == [web["cluster_ip"]]
    assert dns_query("kubernetes.default.svc.cluster.local") == [KUBE_SERVICE_IP]
    pod = web["pods"][cluster.node_names[-1]]["metadata"]["name"]
    out = cluster.exec(web["ns"], pod, "/probe", "resolve", "kubernetes.default").stdout
    assert out.split() == [KUBE_SERVICE_IP]


def test_api_from_a_pod_in_cluster(cluster: RunningCluster, web: dict[str, Any]) -> None:
    """Service-account token, CA and the `kubernetes` Service: what an operator pod uses."""
    ns, pod = web["ns"], web["pods"][cluster.node_names[0]]["metadata"]["name"]
    path = f"/api/v1/namespaces/{ns}/pods"
    denied = cluster.exec(ns, pod, "/probe", "kube", path, check=False)
    assert denied.returncode == 1 and "403" in denied.stderr, denied
    cluster.kubectl("create", "rolebinding", "view", "--clusterrole=view",
                    f"--serviceaccount={ns}:default", "-n", ns)  # fmt: skip

    def allowed() -> dict[str, Any] | None:
        proc = cluster.exec(ns, pod, "/probe", "kube", path, check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 else None

    listed = cluster.wait_until("RBAC to allow the pod's service account", allowed, 30, ns=ns)
    assert {p["metadata"]["name"] for p in listed["items"]} == {
        p["metadata"]["name"] for p in web["pods"].values()}  # fmt: skip


def test_gpu_extended_resource_schedules(cluster: RunningCluster, ns: str) -> None:
    gpus = cluster.gpus_per_node
    cluster.apply([probe_pod("fits", gpus=gpus), probe_pod("too-big", gpus=gpus + 1)], "-n", ns)
    pod = cluster.wait_until("a pod asking every GPU of a node to run",
                             lambda: ready_pod(cluster, ns, "fits"), 90, ns=ns)  # fmt: skip
    assert pod["spec"]["nodeName"] in cluster.node_names

    def unschedulable() -> str | None:
        p = cluster.kubectl_json("get", "pod", "too-big", "-n", ns)
        for c in p["status"].get("conditions", []):
            if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable":
                return str(c.get("message", ""))
        return None

    assert "nvidia.com/gpu" in cluster.wait_until("too-big Unschedulable", unschedulable, 30,
                                                  ns=ns)  # fmt: skip


def test_import_skips_an_image_every_node_holds(cluster: RunningCluster) -> None:
    out = cluster.import_images(cluster.node_bin_dir / "images" / "probe.tar")
    for name in cluster.node_names:
        assert f"{name}: {PROBE_IMAGE} already there" in out, out


def test_kuberay_resolves_cluster_names(cluster: RunningCluster, web: dict[str, Any]) -> None:
    """KubeRay polls `<cluster>-head-svc.<ns>.svc.cluster.local:8265` for RayJob status, so in
    its own mount namespace /etc/resolv.conf must lead to CoreDNS (the host's stays as it is)."""
    pid = json.loads((cluster.state_dir / "pids.json").read_text())["kuberay-operator"]["pid"]
    seen = Path(f"/proc/{pid}/root/etc/resolv.conf").read_text()
    assert f"nameserver {cluster.info['dns_ip']}" in seen
    assert f"nameserver {cluster.info['dns_ip']}" not in Path("/etc/resolv.conf").read_text()
    name = f"web.{web['ns']}.svc.cluster.local"
    out = subprocess.run(["nsenter", f"--target={pid}", "--mount", "--", "getent", "hosts", name],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out.split()[0] == web["cluster_ip"]


def test_oci_delta_import_into_one_node(cluster: RunningCluster, ns: str, tmp_path: Path) -> None:
    """An OCI layout tar (zstd layers, as images.py writes them) into one node; then a second
    image sharing a layer, as a delta without the blob that node already holds."""
    if shutil.which("zstd") is None:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail("zstd is needed to write zstd-compressed layers")
        pytest.skip("zstd is not installed")
    import oci

    first, second = cluster.node_names[:2]
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    shutil.copy2(cluster.node_bin_dir / "probe", base_dir / "probe")
    base = oci.build_layer(base_dir, tmp_path / "base.tar")
    base = oci.compress_layer(base, tmp_path / "base.zst")
    refs, tars = [], []
    for tag in ("one", "two"):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "marker").write_text(f"{tag} {os.urandom(8).hex()}\n")
        top = oci.compress_layer(oci.build_layer(tmp_path / tag, tmp_path / f"{tag}.tar"),
                                 tmp_path / f"{tag}.zst")  # fmt: skip
        refs.append(f"testbed.local/oci-{tag}:test")  # fixed: a rerun replaces, never piles up
        have = cluster.content_digests(first) if tag == "two" else set()
        tars.append(tmp_path / f"{tag}.oci.tar")
        oci.write_oci_archive(refs[-1], [base, top], oci.ImageConfig(entrypoint=["/probe"]),
                              tars[-1], omit=frozenset(have))  # fmt: skip
        if tag == "one":
            cluster.import_images(tars[-1], node=first)
    assert tars[1].stat().st_size < tars[0].stat().st_size / 2  # the probe layer was left out
    out = cluster.import_images(tars[1], node=first)
    assert f"{first}: imported" in out and second not in out
    assert f"{first}: {refs[1]} already there" in cluster.import_images(tars[1], node=first)
    pod = probe_pod("oci", first)
    pod["spec"]["containers"][0].update(image=refs[1], args=["serve"])
    cluster.apply(pod, "-n", ns)
    cluster.wait_until("a pod from the delta-imported image", lambda: ready_pod(cluster, ns, "oci"),
                       60, ns=ns)  # fmt: skip
    held = cluster.kubectl_json("get", "node", second)["status"].get("images", [])
    # An image that lost its tag to a newer import lists `names: null`.
    assert not any(refs[1] in name for img in held for name in img.get("names") or [])
