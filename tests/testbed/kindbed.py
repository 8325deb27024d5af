#!/usr/bin/env python3
"""The kind tier's cluster: two kind nodes on this tier's own Docker engine (kinddocker.py),
from the node image built here (kindnode.py), with what the e2e tests expect (root).

    python tests/testbed/kindbed.py build    # what `up` needs, built or reused; starts nothing
    python tests/testbed/kindbed.py up       # prints `export KUBECONFIG=...`
    python tests/testbed/kindbed.py down     # clusters, containers, network, daemon; leftovers
    python tests/testbed/kindbed.py status

`up`: the daemon; the node image (built when its inputs changed, `docker load`ed when the
daemon lacks it); `kind create cluster` (a control plane and a worker, both schedulable, on
the daemon's network); `nvidia.com/gpu` on each node's status as the real-node bed does it; the
operator, engine-double and CPU engine test images (images.py) and a KubeRay image `kind load
image-archive`d; KubeRay (KUBERAY_VERSION: its CRDs, RBAC and Deployment from its module,
rendered by `kubectl kustomize`, the image built here). The operator's chart is the tests'
to install (tests/e2e).

KIND_NODE_IMAGE=<ref> uses that node image instead (on a host with registry access, an
upstream `kindest/node`); the cluster then keeps kind's own CNI. Everything kind makes is
named CLUSTER; `down` removes every kind cluster on this daemon, then the daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import binaries
import images
import kindbins
import kinddocker
import kindload
import kindnode
import oci
import yaml
from common import BuildError, log, versions

CLUSTER = "vllmdp-e2e"
GPUS_PER_NODE = 2
TEST_IMAGES = ("vllm-dp-operator", "vllm-dp-engine-double", "vllm-dp-engine-cpu")
KUBERAY_NAMESPACE = "kuberay-system"
KUBERAY_IMAGE_REPO = "vllmdp.local/kuberay-operator"
KUBERAY_MODULE = binaries.KUBERAY_MODULE
UPSTREAM_KUBERAY_IMAGE = "quay.io/kuberay/operator"


@dataclass(frozen=True)
class Bed:
    """A running kind cluster: how to reach it."""

    kubeconfig: Path
    kubectl_bin: Path
    node_image: str

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:  # fmt: skip
        proc = subprocess.run([str(self.kubectl_bin), f"--kubeconfig={self.kubeconfig}", *args],
                              capture_output=True, text=True, input=input,
                              timeout=timeout)  # fmt: skip
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed (rc={proc.returncode}):\n"
                               f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")  # fmt: skip
        return proc

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)


def state_dir() -> Path:
    return kinddocker.paths().root.parent


def kubeconfig_path() -> Path:
    return state_dir() / "kubeconfig"


def kind_env() -> dict[str, str]:
    """kind's environment: the tier's daemon, and its network for the nodes."""
    return dict(kinddocker.env(), KIND_EXPERIMENTAL_PROVIDER="docker",
                KIND_EXPERIMENTAL_DOCKER_NETWORK=kinddocker.NETWORK)  # fmt: skip


def kind(*args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(kindbins.bin_dir() / "kind"), *args], capture_output=True,
                          text=True, env=kind_env(), timeout=timeout)  # fmt: skip
    if check and proc.returncode != 0:
        raise RuntimeError(f"kind {' '.join(args)} failed (rc={proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")  # fmt: skip
    return proc


# kubeadm's patches for the control plane's static pods (kubeadm's --patches files, one per
# component): no CPU requests. kubeadm asks 650m of the control-plane node's CPU for them, and
# the tests' Ray heads ask for a whole 2-CPU node (1 per pod and 1 per API server): with those
# requests only the worker could hold a head, and a worker pod scheduled there first would leave
# it Pending for good. On the real-node bed the control plane is host processes, asking nothing.
STATIC_PODS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "etcd")
PATCHES_IN_NODE = "/kind/vllmdp-patches"


def static_pod_patches() -> dict[str, str]:
    """File name -> kubeadm strategic-merge patch of that static pod."""
    def patch(c: str) -> str:
        return yaml.safe_dump({"spec": {"containers": [
            {"name": c, "resources": {"requests": {"cpu": "0"}}}]}})  # fmt: skip

    return {f"{c}+strategic.yaml": patch(c) for c in STATIC_PODS}


def cluster_config(ours: bool, patches_dir: Path) -> dict[str, Any]:
    """kind's config: a control plane and a worker. kubelet v1.35+ refuses cgroup v1 unless
    told (this host's hierarchy may be v1). The control plane's static pods ask for no CPU
    (`static_pod_patches`, mounted from `patches_dir`). Our node image carries our CNI, in the
    address plan of kindnode.py, and CoreDNS at the bed's own version."""
    patches = ["kind: KubeletConfiguration\nfailCgroupV1: false\n",
               f"kind: InitConfiguration\npatches:\n  directory: {PATCHES_IN_NODE}\n"]
    networking: dict[str, Any] = {"ipFamily": "ipv4"}
    if ours:
        networking.update(disableDefaultCNI=True, podSubnet=kindnode.POD_SUBNET,
                          serviceSubnet=kindnode.SERVICE_SUBNET)  # fmt: skip
        patches.append("kind: ClusterConfiguration\ndns:\n  imageTag: "
                       f"{versions()['COREDNS_VERSION']}\n")  # fmt: skip
    control_plane = {"role": "control-plane", "extraMounts": [
        {"hostPath": str(patches_dir), "containerPath": PATCHES_IN_NODE, "readOnly": True}]}
    return {"kind": "Cluster", "apiVersion": "kind.x-k8s.io/v1alpha4", "networking": networking,
            "nodes": [control_plane, {"role": "worker"}],
            "kubeadmConfigPatches": patches}  # fmt: skip


def _node_image() -> tuple[str, bool]:
    """The node image's ref, loaded into the daemon; and whether it is ours."""
    if upstream := os.environ.get("KIND_NODE_IMAGE"):
        return upstream, False
    archive = kindnode.build()
    kindload.load(archive, kindnode.node_ref())
    return kindnode.node_ref(), True


def _create(node_image: str, ours: bool) -> None:
    patches_dir = state_dir() / "kubeadm-patches"
    patches_dir.mkdir(parents=True, exist_ok=True)
    for name, text in static_pod_patches().items():
        (patches_dir / name).write_text(text)
    config = state_dir() / "kind-config.yaml"
    config.write_text(yaml.safe_dump(cluster_config(ours, patches_dir), sort_keys=False))
    t0 = time.monotonic()
    try:
        kind("create", "cluster", f"--name={CLUSTER}", f"--image={node_image}",
             f"--config={config}", f"--kubeconfig={kubeconfig_path()}", "--retain",
             "--wait=0s", timeout=900)  # fmt: skip
    except RuntimeError as e:
        raise RuntimeError(f"{e}\n{_node_logs()}") from e
    log(f"kind: cluster {CLUSTER} created in {time.monotonic() - t0:.1f}s")


def _node_logs() -> str:
    """What the nodes said, for a failed create: each node's journal tail."""
    out = []
    for node in kind("get", "nodes", f"--name={CLUSTER}", check=False).stdout.split():
        for unit in ("kubelet", "containerd", "vllmdp-preload", "vllmdp-cni"):
            proc = kinddocker.docker("exec", node, "journalctl", "--no-pager", "-n", "30", "-u",
                                     unit, check=False)  # fmt: skip
            out.append(f"--- {node} {unit}\n{proc.stdout[-3000:]}{proc.stderr[-500:]}")
    return "\n".join(out)


def _wait(what: str, check: Any, timeout: float, explain: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(2)
    raise RuntimeError(f"kind: timed out after {timeout:.0f}s waiting for {what}"
                       + (f"\n{explain()}" if explain else ""))  # fmt: skip


def _nodes_ready(bed: Bed) -> bool:
    items = bed.json("get", "nodes")["items"]
    return len(items) == 2 and all(
        any(c["type"] == "Ready" and c["status"] == "True" for c in n["status"]["conditions"])
        for n in items)  # fmt: skip


def coredns_plugins() -> set[str]:
    """The plugins in the bed's CoreDNS build (the ones nodecmd/coredns imports)."""
    main = (binaries.NODECMD / "coredns" / "main.go").read_text()
    return set(re.findall(r'"github\.com/coredns/coredns/plugin/(\w+)"', main))


def corefile_for(corefile: str, plugins: set[str]) -> str:
    """kubeadm's Corefile less each directive (and its block) the bed's CoreDNS has no plugin
    for: CoreDNS refuses to start on an unknown one, and the bed's build holds only what the
    real-node bed's Corefile uses (kubeadm's also names prometheus, loop, reload, ...)."""
    out, depth, skip_to = [], 0, None
    for line in corefile.splitlines():
        delta = line.count("{") - line.count("}")
        words = line.split()
        if skip_to is None and depth == 1 and words and words[0] != "}" \
                and words[0] not in plugins:  # fmt: skip
            skip_to = depth
        depth += delta
        if skip_to is None:
            out.append(line)
        elif depth <= skip_to:
            skip_to = None
    return "\n".join(out) + "\n"


def use_beds_coredns(bed: Bed) -> None:
    """Fit kubeadm's CoreDNS config to the bed's CoreDNS build (our node image only)."""
    cm = bed.json("-n", "kube-system", "get", "configmap", "coredns")
    fitted = corefile_for(cm["data"]["Corefile"], coredns_plugins())
    if fitted != cm["data"]["Corefile"]:
        patch = json.dumps({"data": {"Corefile": fitted}})
        bed.kubectl("-n", "kube-system", "patch", "configmap", "coredns", f"-p={patch}")
        bed.kubectl("-n", "kube-system", "rollout", "restart", "deployment/coredns")


def _coredns_logs(bed: Bed) -> str:
    proc = bed.kubectl("-n", "kube-system", "logs", "-l", "k8s-app=kube-dns", "--tail=20",
                       "--prefix", check=False)  # fmt: skip
    pods = bed.kubectl("-n", "kube-system", "get", "pods", "-l", "k8s-app=kube-dns", "-o", "wide",
                       check=False)  # fmt: skip
    return f"{pods.stdout}{proc.stdout[-4000:]}{proc.stderr[-1000:]}"


def advertise_gpus(bed: Bed, count: int = GPUS_PER_NODE) -> None:
    """As the real-node bed does: PATCH each node's status capacity; kubelet copies it into
    allocatable on its next status update."""
    patch = json.dumps([{"op": "add", "path": "/status/capacity/nvidia.com~1gpu",
                         "value": str(count)}])  # fmt: skip
    for node in bed.kubectl("get", "nodes", "-o", "name").stdout.split():
        bed.kubectl("patch", node, "--subresource=status", "--type=json", f"-p={patch}")

    def allocatable() -> bool:
        return all(n["status"].get("allocatable", {}).get("nvidia.com/gpu") == str(count)
                   for n in bed.json("get", "nodes")["items"])  # fmt: skip

    _wait("nvidia.com/gpu allocatable on every node", allocatable, 60)


def kuberay_image() -> tuple[Path, str]:
    """KubeRay's operator (the bed's build of KUBERAY_VERSION) as an image, as its own image
    runs it (/manager, a non-root user)."""
    ref = f"{KUBERAY_IMAGE_REPO}:{versions()['KUBERAY_VERSION']}"
    config = oci.ImageConfig(entrypoint=["/manager"], user="65532:65532")
    archive = kindnode.component_archive(binaries.bin_dir() / "ray-operator", "/manager",
                                         binaries.version_key(), ref, config)  # fmt: skip
    return archive, ref


def kuberay_manifests(bed: Bed, image: str) -> list[dict[str, Any]]:
    """KubeRay's default kustomization from its module (CRDs, RBAC, the Deployment), in its own
    namespace, running `image` (loaded on the nodes: never pulled), asking for no CPU (two
    2-CPU nodes hold the Ray pods)."""
    env = binaries.go_env()
    module = binaries.kuberay_module_dir(env) / "config" / "default"
    rendered = bed.kubectl("kustomize", str(module), timeout=120).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    for doc in docs:
        meta = doc.setdefault("metadata", {})
        if "namespace" in meta:
            meta["namespace"] = KUBERAY_NAMESPACE
        for subject in doc.get("subjects", []):
            subject["namespace"] = KUBERAY_NAMESPACE
        if doc["kind"] == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c["image"].startswith(UPSTREAM_KUBERAY_IMAGE):
                    c["image"], c["imagePullPolicy"] = image, "Never"
                    c["resources"]["requests"]["cpu"] = "0"
    return docs


def install_kuberay(bed: Bed, image: str) -> None:
    docs = kuberay_manifests(bed, image)
    bed.kubectl("create", "namespace", KUBERAY_NAMESPACE, check=False)
    bed.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
            input=yaml.safe_dump_all(docs), timeout=180)  # fmt: skip
    bed.kubectl("wait", "--for=condition=Established", "--timeout=120s", "crd/rayclusters.ray.io",
            "crd/rayjobs.ray.io")  # fmt: skip
    bed.kubectl("rollout", "status", "deployment/kuberay-operator", f"-n={KUBERAY_NAMESPACE}",
            "--timeout=300s", timeout=330)  # fmt: skip


# What a node keeps of one loaded archive, per byte of it: the blobs as they came, and their
# unpacked snapshots (the CPU engine's layers unpack to about 2.1 times their packed size), with
# a margin for the node's own writes while the tier runs.
NODE_BYTES_PER_ARCHIVE_BYTE = 3.5


def space_needed(archive_bytes: int, nodes: int) -> int:
    """Bytes the daemon's disk must have free before `nodes` nodes each load `archive_bytes`."""
    return int(archive_bytes * NODE_BYTES_PER_ARCHIVE_BYTE * nodes)


def check_space(archives: list[Path], data_dir: Path, nodes: int) -> None:
    """Refuse, naming the numbers, before a load that would fill the disk halfway through (ctr's
    "no space left on device" comes minutes later, from inside a node)."""
    need = space_needed(sum(a.stat().st_size for a in archives), nodes)
    free = shutil.disk_usage(data_dir).free
    if free < need:
        raise RuntimeError(f"kind: loading {len(archives)} image archives onto {nodes} nodes needs "
                           f"about {need / 2**30:.1f} GiB free under {data_dir}; it has "
                           f"{free / 2**30:.1f} GiB. Free some disk, then run the tier again.")


def load_archives(archives: list[Path]) -> None:
    """`kind load image-archive` each archive onto every node."""
    check_space(archives, kinddocker.paths().data, len(cluster_config(False, Path())["nodes"]))
    for archive in archives:
        t0 = time.monotonic()
        kind("load", "image-archive", str(archive), f"--name={CLUSTER}", timeout=1800)
        log(f"kind: loaded {archive.name} in {time.monotonic() - t0:.1f}s")


def build() -> tuple[dict[str, Path], tuple[Path, str]]:
    """Build (or reuse) everything `up` runs that needs no daemon: kind, kubeadm and etcd, the
    node image, the test images and KubeRay's image; return the test images' and KubeRay's
    archives (and KubeRay's ref)."""
    kindbins.build()
    binaries.build()
    if not os.environ.get("KIND_NODE_IMAGE"):
        kindnode.build()
    return images.build(list(TEST_IMAGES)), kuberay_image()


def up() -> Bed:
    """Bring the tier up (or find it up); return how to reach the cluster."""
    t0 = time.monotonic()
    archives, (ray_archive, ray_ref) = build()
    kinddocker.start()
    node_image, ours = _node_image()
    bed = Bed(kubeconfig_path(), binaries.bin_dir() / "kubectl", node_image)
    if CLUSTER not in kind("get", "clusters").stdout.split():
        _create(node_image, ours)
        created = True
    else:
        kubeconfig_path().write_text(kind("get", "kubeconfig", f"--name={CLUSTER}").stdout)
        created = False
    _wait("both nodes Ready", lambda: _nodes_ready(bed), 300, _node_logs)
    # Both nodes take pods: the Ray head and its worker need one each. The CPU example's head
    # asks for all 2 CPUs of a node, so CoreDNS, like the control plane, asks for none (as on
    # the real-node bed, where they are host processes): either node can hold the head.
    bed.kubectl("taint", "nodes", "--all", "node-role.kubernetes.io/control-plane-", check=False)
    bed.kubectl("-n", "kube-system", "set", "resources", "deployment/coredns", "--requests=cpu=0")
    if ours:
        use_beds_coredns(bed)
    try:
        bed.kubectl("-n", "kube-system", "rollout", "status", "deployment/coredns",
                    "--timeout=180s", timeout=200)  # fmt: skip
    except RuntimeError as e:
        raise RuntimeError(f"{e}\n{_coredns_logs(bed)}") from e
    advertise_gpus(bed)
    if created:
        load_archives([ray_archive, *archives.values()])
    install_kuberay(bed, ray_ref)
    log(f"kind: up in {time.monotonic() - t0:.1f}s; export KUBECONFIG={bed.kubeconfig}")
    return bed


def down() -> list[str]:
    """Delete every kind cluster on the daemon, then stop it; return what is left."""
    p = kinddocker.paths()
    if kinddocker.running(p):
        for name in kind("get", "clusters", check=False).stdout.split():
            kind("delete", "cluster", f"--name={name}", check=False, timeout=300)
    left = kinddocker.stop(p)
    kubeconfig_path().unlink(missing_ok=True)
    return left


def status() -> dict[str, Any]:
    p = kinddocker.paths()
    up_ = kinddocker.running(p)
    clusters = kind("get", "clusters", check=False).stdout.split() if up_ else []
    return {"dockerd": up_, "clusters": clusters,
            "leftovers": [] if up_ else kinddocker.leftovers(p)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=("build", "up", "down", "status"))
    a = ap.parse_args(argv)
    try:
        if a.cmd == "build":
            build()
        elif a.cmd == "up":
            bed = up()
            print(f"export KUBECONFIG={bed.kubeconfig}")
        elif a.cmd == "down":
            left = down()
            print(json.dumps({"leftovers": left}))
            return 1 if left else 0
        else:
            print(json.dumps(status(), indent=1))
    except (BuildError, RuntimeError) as e:
        print(f"kindbed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
