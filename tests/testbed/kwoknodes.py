"""The kwok mode: the shared control plane plus the kwok controller, simulated GPU and CPU nodes
(no kubelet: kwok fakes node heartbeats and pod lifecycles) and the pod network (podnet.py).

`up` starts, in order: the pod network namespace, etcd, kube-apiserver, controller-manager,
scheduler, kwok, the fake nodes, KubeRay and our CRDs. `down` stops the recorded PIDs in
reverse and removes the pod network. State: `.testbed/` or $VLLMDP_TESTBED_DIR.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import podnet
import yaml
from common import HERE, REPO, http_get, in_ci, log, wait_for
from controlplane import ADMISSION_ALWAYS, ControlPlane, Profile
from procs import Launcher, State, stop_all

KWOK_CONFIG = HERE / "kwok" / "config.yaml"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
GPU_RESOURCE = "nvidia.com/gpu"
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.0/16"
# kwok gives every simulated node this address (--node-ip); routed into the pod network too.
NODE_IP = "10.0.0.1"
# Components in start order; `down` stops them in reverse.
COMPONENTS = ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok",
              "kuberay-operator"]  # fmt: skip

# kube-controller-manager controllers (names as of v1.36; see `--help`). Node lifecycle, IPAM,
# CSR signing, volumes and cloud controllers are left out: there is no kubelet to watch.
KCM_CONTROLLERS = (
    "serviceaccount-token-controller", "serviceaccount-controller",
    "root-ca-certificate-publisher-controller", "namespace-controller",
    "garbage-collector-controller", "job-controller", "cronjob-controller",
    "ttl-after-finished-controller", "replicaset-controller", "deployment-controller",
    "statefulset-controller", "endpointslice-controller", "endpoints-controller",
    "disruption-controller", "pod-garbage-collector-controller",
    "clusterrole-aggregation-controller", "resourcequota-controller", "service-cidr-controller",
)  # fmt: skip

PROFILE = Profile(
    address="127.0.0.1",
    apiserver_port=None,
    service_cidr=SERVICE_CIDR,
    authorization="RBAC",
    endpoint_reconciler="none",
    admission_enable=ADMISSION_ALWAYS,
    # No node-lifecycle controller runs, so nothing would lift the not-ready taint that this
    # admission plugin puts on new nodes.
    admission_disable=("TaintNodesByCondition",),
    controllers=KCM_CONTROLLERS,
    kubelet_client=False,
)


def state_dir() -> Path:
    return Path(os.environ.get("VLLMDP_TESTBED_DIR") or REPO / ".testbed").resolve()


def node_manifests(
    gpu_nodes: int, gpus_per_node: int, cpu_nodes: int, gpu_product: str, instance_type: str
) -> list[dict[str, Any]]:
    def node(
        name: str, labels: dict[str, str], taints: list[dict[str, str]], res: dict[str, str]
    ) -> dict[str, Any]:
        all_labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                      "kubernetes.io/arch": "amd64", "type": "kwok",
                      "topology.kubernetes.io/region": "testbed",
                      "topology.kubernetes.io/zone": "testbed-a", **labels}  # fmt: skip
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": all_labels,
            },
            "spec": {"taints": taints} if taints else {},
            "status": {"capacity": res, "allocatable": res},
        }

    gpu_labels = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.count": str(gpus_per_node),
                  "nvidia.com/gpu.product": gpu_product, "nvidia.com/gpu.memory": "81559",
                  "node.kubernetes.io/instance-type": instance_type,
                  "vllmdp.io/testbed-node": "gpu"}  # fmt: skip
    gpu_taint = [{"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}]
    gpu_res = {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti",
               GPU_RESOURCE: str(gpus_per_node)}  # fmt: skip
    cpu_labels = {"node.kubernetes.io/instance-type": "m5.4xlarge", "vllmdp.io/testbed-node": "cpu"}
    cpu_res = {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "200Gi"}
    return [node(f"gpu-node-{i}", gpu_labels, gpu_taint, gpu_res) for i in range(gpu_nodes)] + [
        node(f"cpu-node-{i}", cpu_labels, [], cpu_res) for i in range(cpu_nodes)
    ]


def _live(root: Path) -> bool:
    return any(State(root).alive().values())


def start_pod_network(st: State) -> podnet.PodNetwork | None:
    """Route the pod and service CIDRs into a namespace of ours (see podnet.py)."""
    try:
        net = podnet.up(st.root, (POD_CIDR, SERVICE_CIDR, f"{NODE_IP}/32"), is_live=_live)
    except (podnet.PodNetworkError, OSError) as exc:
        if in_ci():
            raise
        log(f"pod network not set up ({exc}); pod IPs are unreachable, so run the operator "
            "with VLLMDP_HEALTH_PROBE=off")  # fmt: skip
        return None
    (st.root / "pod_network.json").write_text(json.dumps(net.to_json()) + "\n")
    log(f"pod network: {', '.join(net.cidrs)} routed into netns {net.netns}")
    return net


def stop_pod_network(st: State) -> None:
    """Remove what start_pod_network made, as recorded in the state dir."""
    record = st.root / "pod_network.json"
    if record.exists():
        podnet.down(podnet.PodNetwork.from_json(json.loads(record.read_text())))
        record.unlink()
        log("pod network removed")


def healthy(st: State) -> bool:
    info, alive = st.info(), st.alive()
    if not info or set(alive) != set(COMPONENTS) or not all(alive.values()):
        return False
    return http_get(f"{info['server']}/readyz", info["admin_token"])[0] == 200


def _start_nodes(cp: ControlPlane, launcher: Launcher, nodes: list[dict[str, Any]]) -> None:
    st, port = cp.st, cp.ports["kwok"]
    pid = launcher.launch(
        "kwok",
        [str(cp.bd / "kwok"), f"--kubeconfig={cp.kubeconfig_for('kwok')}",
         f"--config={KWOK_CONFIG}", "--manage-all-nodes=false",
         f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
         f"--cidr={POD_CIDR}", f"--node-ip={NODE_IP}", f"--server-address=127.0.0.1:{port}"],
        lambda: http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200, 60,
    )  # fmt: skip
    t0 = time.monotonic()
    existing = set(cp.kubectl("get", "nodes", "-o", "name").stdout.split())
    new = [n for n in nodes if f"node/{n['metadata']['name']}" not in existing]
    if new:
        cp.kubectl("create", "-f", "-", input=yaml.safe_dump_all(new))
    names = {n["metadata"]["name"] for n in nodes}

    def nodes_ready() -> bool:
        items = json.loads(cp.kubectl("get", "nodes", "-o", "json").stdout)["items"]
        ready = {n["metadata"]["name"] for n in items
                 if any(c["type"] == "Ready" and c["status"] == "True"
                        for c in n["status"].get("conditions", []))}  # fmt: skip
        return names <= ready

    wait_for("nodes Ready", nodes_ready, 60, pid, st.logs / "kwok.log")
    launcher.timings["nodes"] = time.monotonic() - t0
    log(f"{len(nodes)} fake node(s) Ready in {launcher.timings['nodes']:.1f}s")


def up(
    st: State,
    bd: Path,
    gpu_nodes: int,
    gpus_per_node: int,
    cpu_nodes: int,
    etcd_port: int | None,
    apiserver_port: int | None,
    keep_data: bool,
    gpu_product: str,
    instance_type: str,
) -> None:
    """Start the kwok bed (idempotent: a healthy one is left as it is)."""
    if healthy(st):
        log(f"already up and healthy ({st.root}); nothing to do")
        return
    if st.pids():
        log("found a partial or stale test bed; stopping what it recorded first")
        down(st)
    st.root.mkdir(parents=True, exist_ok=True)
    if not keep_data and (st.root / "etcd").exists():
        shutil.rmtree(st.root / "etcd")
    t_up = time.monotonic()
    # Before anything runs: traffic to pod and service IPs must stay on this machine.
    net = start_pod_network(st)
    launcher = Launcher(st)
    cp = ControlPlane(st, bd, PROFILE, launcher)
    cp.prepare({"kwok": ("kwok-controller", "system:masters")}, etcd_port, apiserver_port,
               ("kwok",), {"mode": "kwok", "gpu_nodes": gpu_nodes, "gpus_per_node": gpus_per_node,
                           "cpu_nodes": cpu_nodes,
                           "pod_network": net.to_json() if net else None})  # fmt: skip
    cp.start()
    nodes = node_manifests(gpu_nodes, gpus_per_node, cpu_nodes, gpu_product, instance_type)
    _start_nodes(cp, launcher, nodes)
    cp.start_kuberay()
    cp.install_our_crds()
    total = time.monotonic() - t_up
    st.update_info(timings={k: round(v, 2) for k, v in launcher.timings.items()},
                   up_seconds=round(total, 2))  # fmt: skip
    log("RSS MiB: " + ", ".join(f"{n}={v:.0f}" for n, v in st.rss().items()))
    log(f"up in {total:.1f}s. export KUBECONFIG={st.kubeconfig}")


def down(st: State) -> None:
    """Stop exactly what `up` recorded, then remove the pod network."""
    if not st.pids():
        log(f"nothing recorded in {st.root}; nothing to stop")
    stop_all(st, reversed(COMPONENTS))
    stop_pod_network(st)


def status(st: State) -> bool:
    pids = st.pids()
    if not pids:
        print(f"test bed in {st.root}: not running")
        return False
    alive, rss = st.alive(), st.rss()
    for name in COMPONENTS:
        rec = pids.get(name)
        if rec is None:
            print(f"  {name:26s} not started")
            continue
        extra = f", RSS {rss[name]:.0f} MiB" if alive.get(name) and name in rss else ""
        print(f"  {name:26s} {'alive' if alive.get(name) else 'DEAD'} (pid {rec['pid']}{extra})")
    ok = healthy(st)
    print(f"test bed in {st.root}: {'healthy' if ok else 'NOT healthy'}")
    return ok


def env_lines(st: State) -> list[str]:
    info = st.info()
    lines = [f"export VLLMDP_TESTBED_DIR={st.root}", f"export KUBECONFIG={st.kubeconfig}"]
    if info:
        lines.append(f"export PATH={info['bin_dir']}:$PATH")
        lines.append(f"export VLLMDP_TESTBED_SERVER={info['server']}")
    return lines
